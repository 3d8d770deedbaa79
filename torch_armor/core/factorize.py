"""Per-layer ARMOR optimization: ``factors = factorize(weight, act_sq_norm, config)``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from torch_armor.core.bcd import refine_core_cg, update_a, update_b
from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factors import ArmorFactors
from torch_armor.config.levers import AdamConfig, BcdConfig, Optimizer
from torch_armor.core.pattern import SparsityPattern, layer_prefix
from torch_armor.core.proxy import mask_from_scores, normalize_weight, nowag_scores, validate_layer
from torch_armor.core.refine import refine_output
from torch_armor.core.sparse_core import (DECREASE_SELECTIONS, block_grams, core_gradient, group_decrease, select_groups,
                                          sparse_core_step, sparse_core_steps)
from torch_armor.errors import ArmorNumericalError

__all__ = ["factorize", "reconstruct_normalized", "nowag_start", "factors_from_run", "RunLog", "weighted_sq"]

#: Clock behind ``time_budget_s`` and ``ArmorFactors.history_time_s`` (wall time). Benchmarks
#: on a shared machine may set it to ``time.process_time`` (CPU seconds of this process).
clock = time.perf_counter

def reconstruct_normalized(a: torch.Tensor, core: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``A · core · B`` with block-diagonal ``A``, ``B`` given as block stacks."""
    return block_diag_right(block_diag_left(a, core), b)


def weighted_sq(residual: torch.Tensor, act_sq_norm: torch.Tensor) -> torch.Tensor:
    """The proxy loss ``Σ R² h`` of a residual (normalized space)."""
    return (residual.square() * act_sq_norm).sum()


@dataclass
class _Problem:
    w_bar: torch.Tensor
    h: torch.Tensor
    pattern: SparsityPattern
    d_b: int
    nowag_loss: torch.Tensor

    @property
    def tiles(self) -> Tuple[int, int]:
        return self.w_bar.shape[0] // self.d_b, self.w_bar.shape[1] // self.d_b


class _Log:
    """Loss history at logged iterations, best-iterate tracking and the stopping rules."""

    def __init__(self, problem: _Problem, config: Optimizer) -> None:
        self.config = config
        self.start = clock()
        self.iters: List[int] = [0]
        self.losses: List[torch.Tensor] = [problem.nowag_loss]
        self.times: List[float] = [0.0]
        self.best_loss = problem.nowag_loss.clone()
        self.best_iter = torch.zeros((), dtype=torch.long, device=problem.w_bar.device)

    def elapsed(self) -> float:
        return clock() - self.start

    def out_of_time(self) -> bool:
        budget = self.config.time_budget_s
        return budget is not None and self.elapsed() >= budget

    def is_log_point(self, it: int) -> bool:
        return it % self.config.log_every == 0 or it == self.config.iterations

    def record(self, it: int, loss: torch.Tensor) -> None:
        self.iters.append(it)
        self.losses.append(loss)
        self.times.append(self.elapsed())

    def converged(self) -> bool:
        """Relative improvement between the last two logged points below ``tol`` (syncs)."""
        if self.config.tol <= 0 or len(self.losses) < 2:
            return False
        prev, last = float(self.losses[-2]), float(self.losses[-1])
        return prev > 0 and (prev - last) / prev < self.config.tol

    def keep_best(self, it: int, loss: torch.Tensor, state: dict, candidate: dict) -> None:
        """Keep ``candidate`` in ``state`` if ``loss`` beats the best so far, without a host sync."""
        better = loss < self.best_loss
        for key, value in candidate.items():
            state[key] = torch.where(better, value, state[key])
        self.best_iter = torch.where(better, torch.full_like(self.best_iter, it), self.best_iter)
        self.best_loss = torch.minimum(loss, self.best_loss)


def _choose_groups(opt: Optimizer, d_b: int, pattern: SparsityPattern, core, grad, a_gram, b_gram, generator,
                   num: Optional[int] = None):
    """``select_groups`` for ``opt.selection_rule``, computing every group's decrease if the rule needs it."""
    rule = opt.selection_rule
    decrease = (group_decrease(core, grad, a_gram, b_gram, pattern.n, pattern.m)
                if rule in DECREASE_SELECTIONS else None)
    return select_groups(grad, d_b, pattern.m, rule, generator, num=num, decrease=decrease)


def _tile_outer(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``(P, Q, d)`` × ``(P, Q, d)`` → the ``(P·d, Q·d)`` matrix whose tile ``(i, j)`` is ``l rᵀ``."""
    p, q, d_b = left.shape
    return torch.einsum("pqr,pqc->prqc", left, right).reshape(p * d_b, q * d_b)


def _run_adam(problem: _Problem, opt: AdamConfig, seed: int, log: _Log, a, b, core, mask) -> dict:
    """The paper's recipe — joint Adam on ``A``, ``B``, ``W'`` and one sparse-core group per
    tile per iteration — with hand-written gradients: 6 block-diagonal passes per iteration.

    One iteration at the point ``(A, S = W' ⊙ M, B)``:

    1. ``AS = A·S``, ``R = W_bar − AS·B``, ``T = (R D)·Bᵀ``, ``G = Aᵀ·T`` (4 passes): the
       residual and the dense core gradient ``∂L/∂S = −2G``.
    2. Sparse-core step with that ``G``; the changed groups update ``AS``, ``R``, ``T`` and
       ``G`` by rank-one tile corrections, so they stay exact without another pass.
    3. ``∂L/∂A = −2 T Sᵀ`` and ``∂L/∂B = −2 (AS)ᵀ (R D)`` (2 passes), ``∂L/∂W' = −2 G ⊙ M``;
       one Adam step.

    The sparse step runs before the Adam step of the same iteration, a half-iteration shift
    of the paper's order (continuous, then sparse) that leaves the trajectory unchanged in
    distribution. The loss of the post-sparse point comes from ``R`` (no extra pass) and is
    the one recorded; no host synchronization happens inside the loop.
    """
    w_bar, h, pattern, d_b = problem.w_bar, problem.h, problem.pattern, problem.d_b
    p, q = problem.tiles
    d_out, d_in = w_bar.shape
    a = a.clone().requires_grad_(False)
    b = b.clone()
    w_prime = core.clone()
    params = [a, b, w_prime]
    for t in params:
        t.grad = torch.zeros_like(t)
    optimizer = torch.optim.Adam(params, lr=opt.lr)
    generator = torch.Generator(device=w_bar.device).manual_seed(seed)
    best = {"a": a.clone(), "b": b.clone(), "core": core.clone(), "mask": mask.clone()}
    structured = pattern.structured
    m = pattern.m
    p_idx = torch.arange(p, device=w_bar.device)[:, None].expand(p, q)
    q_idx = torch.arange(q, device=w_bar.device)[None, :].expand(p, q)

    steps_done = 0
    for it in range(1, opt.iterations + 1):
        s = (w_prime * mask).contiguous()
        a_s = block_diag_left(a, s)
        residual = w_bar - block_diag_right(a_s, b)
        weighted = residual * h
        t_mat = block_diag_right(weighted, b.transpose(1, 2))
        grad = block_diag_left(a.transpose(1, 2), t_mat).contiguous()  # ∂L/∂S = −2·grad
        if structured:
            neg = -2.0 * grad
            a_gram, b_gram = block_grams(a, b, h)
            rows, groups = _choose_groups(opt, d_b, pattern, s, neg, a_gram, b_gram, generator)
            _, delta = sparse_core_step(s, mask, a_gram, b_gram, neg, pattern.n, m, rows, groups,
                                        update_grad=True, return_delta=True)
            grad = -0.5 * neg
            cols = groups[..., None] * m + torch.arange(m, device=w_bar.device)
            a_col = a.transpose(1, 2)[p_idx, rows]  # (P, Q, d): column i' of A_i
            dbg = (delta[..., None] * b_gram[q_idx[..., None], cols]).sum(-2)  # δᵀ (B D Bᵀ)[grp, :]
            db = (delta[..., None] * b[q_idx[..., None], cols]).sum(-2)  # δᵀ B_j[grp, :]
            residual = residual - _tile_outer(a_col, db)
            weighted = residual * h
            t_mat = t_mat - _tile_outer(a_col, dbg)
            a_s_view = a_s.view(p, d_b, q, d_b // m, m)
            a_s_view[p_idx, :, q_idx, groups] += a_col[..., None] * delta[:, :, None, :]
            w_prime.copy_(torch.where(mask, s, w_prime))
        loss = weighted_sq(residual, h)
        log.keep_best(it - 1, loss, best, {"a": a, "b": b, "core": s, "mask": mask})
        if it > 1 and log.is_log_point(it - 1):
            log.record(it - 1, loss)
        if (it > 1 and log.converged()) or log.out_of_time():
            break
        a.grad.copy_(-2.0 * (t_mat.reshape(p, d_b, d_in) @ s.reshape(p, d_b, d_in).transpose(1, 2)))
        b.grad.copy_(-2.0 * (a_s.reshape(d_out, q, d_b).permute(1, 2, 0) @ weighted.reshape(d_out, q, d_b).transpose(0, 1)))
        w_prime.grad.copy_(-2.0 * grad * mask)
        optimizer.step()
        steps_done = it
    # Label the final point by the Adam steps taken; record it unless already recorded.
    if steps_done > log.iters[-1]:
        s = (w_prime * mask).contiguous()
        loss = weighted_sq(w_bar - reconstruct_normalized(a, s, b), h)
        log.keep_best(steps_done, loss, best, {"a": a, "b": b, "core": s, "mask": mask})
        log.record(steps_done, loss)
    return best


def _run_bcd(problem: _Problem, opt: BcdConfig, seed: int, log: _Log, a, b, core, mask) -> dict:
    """Exact block-coordinate sweeps; every sub-step is monotone, so the last iterate is the best.

    A sweep: ``A`` and ``B`` by their closed forms, ``cg_steps`` of preconditioned CG on the
    kept core values, then ``group_updates`` exact sparse-core steps per tile, chosen from the
    sweep's gradient (and, for ``"decrease-greedy"``/``"mixed"``, every group's exact decrease)
    and run in sequence by :func:`~torch_armor.core.sparse_core.sparse_core_steps`.
    """
    w_bar, h, pattern = problem.w_bar, problem.h, problem.pattern
    generator = torch.Generator(device=w_bar.device).manual_seed(seed)
    best = {"a": a.clone(), "b": b.clone(), "core": core.clone(), "mask": mask.clone()}
    group_updates = opt.group_updates_per_sweep(problem.d_b)
    for it in range(1, opt.iterations + 1):
        a = update_a(w_bar, h, a, core, b, opt.ridge)
        b = update_b(w_bar, a, core, b, opt.ridge)
        core = refine_core_cg(w_bar, h, a, core, mask, b, opt.cg_steps, opt.ridge).contiguous()
        residual = w_bar - reconstruct_normalized(a, core, b)
        loss = weighted_sq(residual, h)
        if pattern.structured and group_updates > 0:
            grad = core_gradient(residual, a, b, h).contiguous()
            a_gram, b_gram = block_grams(a, b, h)
            rows, groups = _choose_groups(opt, problem.d_b, pattern, core, grad, a_gram, b_gram, generator,
                                          num=group_updates)
            gain = sparse_core_steps(core, mask, a_gram, b_gram, grad, pattern.n, pattern.m, rows, groups)
            loss = loss - gain.sum()
        log.keep_best(it, loss, best, {"a": a, "b": b, "core": core, "mask": mask})
        if log.is_log_point(it) or log.out_of_time():
            log.record(it, loss)
            if log.converged() or log.out_of_time():
                break
    return best


def factorize(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    config: Optional[ArmorConfig] = None,
    *,
    xtx: Optional[torch.Tensor] = None,
    name: Optional[str] = None,
) -> ArmorFactors:
    """Factorize one linear weight as ``W_hat = A · (W' ⊙ M) · B`` (ARMOR).

    Starts from NoWag-P (``A = B = I``, ``W' = W_bar``, top-N of ``W_bar² h`` per group) and
    runs ``config.optimizer``: :class:`~torch_armor.config.levers.AdamConfig` (the paper's recipe: a
    joint Adam step on ``A``, ``B``, ``W'`` then the sparse-core step — one group per tile, all
    ``C(M, N)`` supports solved, best kept) or :class:`~torch_armor.config.levers.BcdConfig` (exact
    block-coordinate sweeps). The best iterate is
    returned, so the proxy loss is never above NoWag-P's. Unstructured patterns run only the
    continuous updates, on the NoWag-P mask.

    Cost: time per BCD sweep or Adam step grows as ``d_out·d_in·d_b``; peak memory
    above the inputs is a fixed multiple of the layer's size in ``config.dtype`` — about 14× for
    BCD and 18–20× for Adam (residual, gradients, Adam moments, the best iterate),
    measured by ``python benchmarks/scale.py memory`` on 4096×4096 and 4096×11008 layers.

    Args:
        weight: ``(d_out, d_in)`` float weight (fp16/bf16 are optimized in ``config.dtype``
            and the factors returned in the weight's dtype).
        act_sq_norm: ``(d_in,)`` ``Σ_tokens x_j²`` from calibration.
        config: :class:`ArmorConfig` (defaults if ``None``), resolved for this weight's shape
            with :meth:`ArmorConfig.for_layer` (``block_size="auto"`` allowed).
        xtx: ``(d_in, d_in)`` ``Σ_tokens x xᵀ``; with ``config.refine`` set (the default) the factors are
            then refined under the output-space loss (:func:`~torch_armor.core.refine.refine_output`).
        name: layer name used in error messages.

    Example::

        >>> w, h = torch.randn(64, 64), torch.rand(64) + 0.1
        >>> f = factorize(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=20)))
        >>> f.relative_loss <= 1.0, f.dense().shape
        (True, torch.Size([64, 64]))
    """
    config, problem, scales, start = nowag_start(weight, act_sq_norm, config, name)
    a, b, core, mask = start

    opt = config.optimizer
    log = _Log(problem, opt)
    if opt.iterations > 0 and float(problem.nowag_loss) > 0:
        run = _run_adam if isinstance(opt, AdamConfig) else _run_bcd
        best = run(problem, opt, config.seed, log, a, b, core, mask.clone())
        a, b, core, mask = best["a"], best["b"], best["core"], best["mask"]

    run = RunLog(log.losses, log.iters, log.times, float(log.best_loss), int(log.best_iter))
    return factors_from_run(weight, act_sq_norm, config, problem, scales, (a, core, b, mask), run, xtx, name)


@dataclass
class RunLog:
    """What an optimizer run of one layer logged: losses at ``iters`` (seconds ``times``), the best."""
    losses: List[torch.Tensor]
    iters: List[int]
    times: List[float]
    best_loss: float
    best_iter: int


def factors_from_run(weight, act_sq_norm, config: ArmorConfig, problem: _Problem, scales, factors, run: RunLog,
                      xtx, name) -> ArmorFactors:
    """The :class:`ArmorFactors` of an optimizer's best point ``factors = (A, core, B, mask)`` of
    ``problem`` (checked against ``run.best_loss``): normalization undone, refined under ``XᵀX`` if given."""
    row_norm, col_norm, w_exp, h_exp = scales
    a, core, b, mask = factors
    dtype, d_b = config.dtype, config.block_size
    device = problem.w_bar.device
    p, q = problem.tiles
    pattern = problem.pattern
    losses = torch.stack([torch.as_tensor(x, dtype=dtype, device=device) for x in run.losses]).double().cpu()
    nowag_loss = float(problem.nowag_loss)
    history = losses / nowag_loss if nowag_loss > 0 else torch.zeros_like(losses)
    _check_result(problem, a, core, b, mask, run.best_loss, name)
    out_dtype = weight.dtype
    factors = ArmorFactors(
        a_blocks=(row_norm.reshape(p, d_b, 1) * a).detach().to(out_dtype) * 2.0 ** w_exp,
        core=core.detach().to(out_dtype),
        b_blocks=(b * col_norm.reshape(q, 1, d_b)).detach().to(out_dtype),
        mask=mask.detach().clone(),
        pattern=str(pattern),
        history=history,
        history_iters=torch.tensor(run.iters, dtype=torch.long),
        history_time_s=torch.tensor(run.times, dtype=torch.float64),
        nowag_loss=nowag_loss * 2.0 ** h_exp,
        best_iter=run.best_iter,
    )
    if xtx is not None and config.refine is not None:
        refine = config.refine
        factors = refine_output(weight.detach().to(device), xtx.to(device), factors, rounds=refine.rounds,
                                cg_steps=refine.cg_steps, damp=refine.damp, act_sq_norm=act_sq_norm.to(device),
                                core_steps=refine.core_steps)
    for label in ("a_blocks", "core", "b_blocks"):
        if not bool(torch.isfinite(getattr(factors, label)).all()):
            raise ArmorNumericalError(
                f"{layer_prefix(name)}the {label} factors overflow {out_dtype} (weight scale 2^{w_exp}); "
                f"factorize in a wider dtype (ArmorConfig(dtype=torch.float64)) or rescale the weight")
    return factors


def nowag_start(weight, act_sq_norm, config: Optional[ArmorConfig], name):
    """Resolve ``config`` for the layer and build the NoWag-P starting point:
    ``(config, problem, (row_norm, col_norm, w_exp, h_exp), (A, B, core, mask))``."""
    pattern = validate_layer(weight, act_sq_norm, (config or ArmorConfig()).pattern, None, name)
    config = (config or ArmorConfig()).for_layer(*weight.shape, name=name)
    device = torch.device(config.device) if config.device is not None else weight.device
    dtype, d_b = config.dtype, config.block_size

    # Exact power-of-two pre-scaling (bit-identical results for ordinary inputs): weights near the
    # top of the dtype's range (1e19 in fp32) would overflow the column norms, statistics near it
    # the losses. The weight's scale goes back into the row norms, the statistics' into nowag_loss.
    w, w_exp = _pow2_scaled(weight, device, dtype)
    h, h_exp = _pow2_scaled(act_sq_norm, device, dtype)
    w_bar, row_norm, col_norm = normalize_weight(w)
    mask = mask_from_scores(nowag_scores(w_bar, h), pattern).contiguous()
    core = (w_bar * mask).contiguous()
    problem = _Problem(w_bar, h, pattern, d_b, weighted_sq(w_bar - core, h))
    p, q = problem.tiles
    eye = torch.eye(d_b, device=device, dtype=dtype)
    a, b = eye.repeat(p, 1, 1), eye.repeat(q, 1, 1)
    return config, problem, (row_norm, col_norm, w_exp, h_exp), (a, b, core, mask)


def _pow2_scaled(t: torch.Tensor, device, dtype) -> Tuple[torch.Tensor, int]:
    """``(t · 2^-k, k)`` in ``dtype`` on ``device`` with ``max|t · 2^-k|`` near 1 (exact scaling)."""
    work = t.detach().to(device=device, dtype=torch.promote_types(t.dtype, dtype))
    peak = float(work.abs().max()) if work.numel() else 0.0
    k = math.frexp(peak)[1] - 1 if peak > 0 and math.isfinite(peak) else 0
    # Ordinary magnitudes are left alone (k = 0: results bit-identical, Adam's eps unchanged);
    # only values whose squares could overflow or underflow the compute dtype are rescaled.
    exp_range = int(math.log2(torch.finfo(dtype).max))
    limit = int(math.log2(torch.finfo(work.dtype).max)) - 8
    k = 0 if abs(k) <= exp_range // 4 else max(-limit, min(limit, k))
    return (work * 2.0 ** -k if k else work).to(dtype), k


def _check_result(problem: _Problem, a, core, b, mask, best_loss: float, name: Optional[str]) -> None:
    """The returned factors must be finite, keep the pattern and reproduce the tracked best loss."""
    where = layer_prefix(name)
    for label, t in (("A", a), ("core", core), ("B", b)):
        if not bool(torch.isfinite(t).all()):
            raise ArmorNumericalError(f"{where}the optimizer produced non-finite {label} factors; retry with "
                                      "ArmorConfig(dtype=torch.float64) or optimizer=BcdConfig(), and report the layer")
    if bool((core.ne(0) & ~mask).any()):
        raise ArmorNumericalError(f"{where}the sparse core has non-zeros outside its mask; please report the layer")
    recomputed = float(weighted_sq(problem.w_bar - reconstruct_normalized(a, core, b), problem.h))
    nowag = float(problem.nowag_loss)
    tol = 1e-2 * nowag + 1e3 * torch.finfo(problem.w_bar.dtype).eps * float(problem.h.double().sum())
    if not math.isfinite(recomputed) or abs(recomputed - best_loss) > tol or recomputed > nowag + tol:
        raise ArmorNumericalError(
            f"{where}loss check failed: the optimizer tracked {best_loss:.6g} but the returned factors give "
            f"{recomputed:.6g} (NoWag-P {nowag:.6g}); retry with ArmorConfig(dtype=torch.float64)")
