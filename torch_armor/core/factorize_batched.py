"""ARMOR on the E experts of one fused parameter at once: ``factorize_batched(weights, act_sq_norms, config)``.

The experts of a mixture-of-experts block share their shape and settings, so the default optimizer's
dense work — the closed-form ``A`` and ``B`` updates, CG on the core, the residual, the gradient and the
block Grams — runs on ``(E, ...)`` tensors (``torch.vmap`` of the serial steps of
:mod:`torch_armor.core.bcd`) instead of E Python loops. What stays per expert, in a loop: the NoWag-P
start and the final checks (cheap, the serial code itself), the group selection (each expert draws from
its own generator seeded with ``config.seed``, as the serial path does) and the sparse-core steps (in
place on each expert's slice of the stacked core and mask), and output-space refinement (``XᵀX``).
Per-expert best-iterate tracking runs on device with ``torch.where``; no host sync inside the loop.
``history_time_s`` of each expert is its equal share (1/E) of the batch's wall time.

The result equals E calls of :func:`~torch_armor.core.factorize.factorize` up to float rounding of the
batched reductions (``tests/core/test_factorize_batched.py``). One rule picks the serial loop instead
(:func:`serial_reason`): anything but :class:`~torch_armor.config.levers.BcdConfig` with ``tol=0`` and no
time budget, a pattern that is not N:M, a power-of-two pre-scaled expert, or an expert whose NoWag-P
loss is zero.

Example::

    >>> from torch_armor.config.armor import ArmorConfig
    >>> from torch_armor.config.levers import BcdConfig
    >>> w, h = torch.randn(3, 32, 32), torch.rand(3, 32) + 0.1
    >>> fs = factorize_batched(w, h, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=4)))
    >>> len(fs), fs[0].dense().shape, all(f.relative_loss <= 1.0 for f in fs)
    (3, torch.Size([32, 32]), True)
"""

from __future__ import annotations

import warnings
from functools import partial
from typing import List, Optional, Sequence

import torch

from torch_armor.core import factorize as serial_module
from torch_armor.core.bcd import refine_core_cg, update_a, update_b
from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factorize import (factors_from_run, nowag_start, RunLog, weighted_sq, factorize,
                                        reconstruct_normalized)
from torch_armor.core.factors import ArmorFactors
from torch_armor.config.levers import BcdConfig
from torch_armor.core.sparse_core import (DECREASE_SELECTIONS, block_grams, core_gradient, group_decrease, select_groups,
                                          selection_uniforms, sparse_core_steps)
from torch_armor.errors import ArmorInputError

__all__ = ["factorize_batched", "serial_reason", "MAX_BATCH_ELEMENTS"]

#: Weight elements (E·d_out·d_in) factorized in one batch; more experts run in chunks of that size, so
#: the optimizer's memory (about 14× the batch's weights, as for one layer) stays bounded for any E.
MAX_BATCH_ELEMENTS = 1 << 24


def serial_reason(config: ArmorConfig) -> Optional[str]:
    """Why ``config`` runs its experts one by one (``None``: batched). The one rule of the fallback;
    per-expert conditions (pre-scaling, a zero NoWag-P loss) are checked after the start is built."""
    opt = config.optimizer
    if not isinstance(opt, BcdConfig):
        return f"optimizer {opt.name!r} (only bcd is batched)"
    if opt.tol > 0:
        return "tol > 0 (experts would stop at different sweeps)"
    if opt.time_budget_s is not None:
        return "a time budget (experts would stop at different sweeps)"
    if opt.selection_rule == "random":
        return "selection 'random' (its integer draws are not batched)"
    return None


def _sweep_dense(w_bar, h, a, core, mask, b, *, ridge: float, cg_steps: int):
    """One expert's continuous part of a sweep (vmapped over experts): ``A``, ``B``, CG on the core,
    then the residual's loss, the core gradient and the block Grams the sparse-core steps need."""
    a = update_a(w_bar, h, a, core, b, ridge)
    b = update_b(w_bar, a, core, b, ridge)
    core = refine_core_cg(w_bar, h, a, core, mask, b, cg_steps, ridge)
    residual = w_bar - reconstruct_normalized(a, core, b)
    grad = core_gradient(residual, a, b, h)
    a_gram, b_gram = block_grams(a, b, h)
    return a, b, core, weighted_sq(residual, h), grad, a_gram, b_gram


def _sparse_steps(core, mask, grad, a_gram, b_gram, uniform, *, opt: BcdConfig, pattern, d_b: int, num: int):
    """One expert's group selection (its random draws given as ``uniform``) and its ``num`` exact
    sparse-core steps per tile (vmapped over experts); the new core, mask and the loss decrease."""
    rule = opt.selection_rule
    decrease = (group_decrease(core, grad, a_gram, b_gram, pattern.n, pattern.m)
                if rule in DECREASE_SELECTIONS else None)
    rows, groups = select_groups(grad, d_b, pattern.m, rule, None, num=num, decrease=decrease, uniform=uniform)
    core, mask = core.clone(), mask.clone()
    gain = sparse_core_steps(core, mask, a_gram, b_gram, grad, pattern.n, pattern.m, rows, groups)
    return core, mask, gain.sum()


def _where(better: torch.Tensor, new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    return torch.where(better.reshape((-1,) + (1,) * (new.dim() - 1)), new, old)


def factorize_batched(
    weights: torch.Tensor,
    act_sq_norms: torch.Tensor,
    config: Optional[ArmorConfig] = None,
    *,
    xtxs: Optional[Sequence[Optional[torch.Tensor]]] = None,
    names: Optional[Sequence[Optional[str]]] = None,
) -> List[ArmorFactors]:
    """Factorize E same-shape weights with one config; the factors of each, in order.

    Args:
        weights: ``(E, d_out, d_in)`` (a fused expert parameter) or a sequence of E 2-D weights.
        act_sq_norms: ``(E, d_in)`` ``Σ x²`` of each expert's tokens.
        config: one :class:`ArmorConfig` for every expert (resolved per expert with ``for_layer``).
        xtxs: per expert ``XᵀX`` or ``None`` (refinement, run per expert after the batched sweeps).
        names: per expert layer name for error messages.
    """
    config = config or ArmorConfig()
    n_exp = len(weights)
    if len(act_sq_norms) != n_exp:
        raise ArmorInputError(f"factorize_batched: {n_exp} weights but {len(act_sq_norms)} act_sq_norms; "
                              "give one statistics row per expert")
    xtxs = list(xtxs) if xtxs is not None else [None] * n_exp
    names = list(names) if names is not None else [None] * n_exp

    def serial() -> List[ArmorFactors]:
        return [factorize(weights[e], act_sq_norms[e], config, xtx=xtxs[e], name=names[e]) for e in range(n_exp)]

    if n_exp == 0:
        return []
    if serial_reason(config) is not None:
        return serial()
    chunk = max(1, MAX_BATCH_ELEMENTS // max(1, weights[0].numel()))
    if n_exp > chunk:
        return [f for lo in range(0, n_exp, chunk)
                for f in factorize_batched(weights[lo:lo + chunk], act_sq_norms[lo:lo + chunk], config,
                                           xtxs=xtxs[lo:lo + chunk], names=names[lo:lo + chunk])]
    starts = [nowag_start(weights[e], act_sq_norms[e], config, names[e]) for e in range(n_exp)]
    cfg, first = starts[0][0], starts[0][1]
    if (not first.pattern.structured or any(s[2][2] or s[2][3] for s in starts)
            or any(s[0] != cfg for s in starts) or bool((torch.stack([s[1].nowag_loss for s in starts]) <= 0).any())):
        return serial()
    opt: BcdConfig = cfg.optimizer
    problems = [s[1] for s in starts]
    w_bar = torch.stack([p.w_bar for p in problems])
    h = torch.stack([p.h for p in problems])
    a = torch.stack([s[3][0] for s in starts])
    b = torch.stack([s[3][1] for s in starts])
    core = torch.stack([s[3][2] for s in starts]).contiguous()
    mask = torch.stack([s[3][3] for s in starts]).contiguous()
    nowag = torch.stack([p.nowag_loss for p in problems])

    pattern, d_b = first.pattern, first.d_b
    generators = [torch.Generator(device=w_bar.device).manual_seed(cfg.seed) for _ in range(n_exp)]
    group_updates = opt.group_updates_per_sweep(d_b)
    tiles = first.tiles[0] * first.tiles[1]
    steps = partial(_sparse_steps, opt=opt, pattern=pattern, d_b=d_b, num=group_updates)
    sweep = torch.vmap(partial(_sweep_dense, ridge=opt.ridge, cg_steps=opt.cg_steps))
    best = {"a": a.clone(), "b": b.clone(), "core": core.clone(), "mask": mask.clone()}
    best_loss, best_iter = nowag.clone(), torch.zeros(n_exp, dtype=torch.long, device=w_bar.device)
    losses, iters, times = [nowag], [0], [0.0]
    start = serial_module.clock()  # the serial path's clock (benchmarks may set it)
    for it in range(1, opt.iterations + 1):
        a, b, core, loss, grad, a_gram, b_gram = sweep(w_bar, h, a, core, mask, b)
        core = core.contiguous()
        if group_updates > 0:
            uniform = [selection_uniforms(opt.selection_rule, tiles, group_updates, g, w_bar.device, grad.dtype)
                       for g in generators]
            uniform = torch.stack(uniform) if uniform[0] is not None else None
            with warnings.catch_warnings():  # take / index_copy_ run through vmap's per-expert fallback
                warnings.filterwarnings("ignore", message="There is a performance drop", category=UserWarning)
                core, mask, gain = torch.vmap(steps, in_dims=(0, 0, 0, 0, 0, None if uniform is None else 0))(
                    core, mask, grad.contiguous(), a_gram, b_gram, uniform)
            loss = loss - gain
        better = loss < best_loss
        for key, value in (("a", a), ("b", b), ("core", core), ("mask", mask)):
            best[key] = _where(better, value, best[key])
        best_iter = torch.where(better, torch.full_like(best_iter, it), best_iter)
        best_loss = torch.minimum(loss, best_loss)
        if it % opt.log_every == 0 or it == opt.iterations:
            losses.append(loss)
            iters.append(it)
            times.append((serial_module.clock() - start) / n_exp)  # each expert's share of the batch's time

    history = torch.stack(losses, 1)  # (E, logged points)
    best_losses, best_iters = best_loss.tolist(), best_iter.tolist()
    out = []
    for e, (_, problem, scales, _) in enumerate(starts):
        run = RunLog(list(history[e]), iters, times, best_losses[e], best_iters[e])
        factors = (best["a"][e], best["core"][e].clone(), best["b"][e], best["mask"][e].clone())
        out.append(factors_from_run(weights[e], act_sq_norms[e], cfg, problem, scales, factors, run, xtxs[e],
                                     names[e]))
    return out
