"""Output-space refinement of ARMOR factors: the mask fixed, ``A``, the kept core values and
``B`` re-fitted under ``L(Ŵ) = tr((W − Ŵ) H (W − Ŵ)ᵀ)``, ``H = XᵀX`` (full, not its diagonal).

ARMOR's proxy ``Σ_ij (W − Ŵ)²_ij h_j`` only sees ``h = diag(H)``; the output error
``‖(W − Ŵ) Xᵀ‖²`` also sees how input channels correlate, so a pruned weight can be compensated
by its correlated neighbours (as SparseGPT does). With the other factors fixed the loss is a
convex quadratic in each of:

- ``A``: separable per output block, closed form ``A_i = (W_i H C_iᵀ)(C_i H C_iᵀ)⁻¹``, ``C = S·B``;
- the kept core values: Hessian ``V ↦ M ⊙ (AᵀA V B H Bᵀ)`` — preconditioned CG;
- ``B``: Hessian ``V ↦ blockdiag(Eᵀ E V H)``, ``E = A·S`` — preconditioned CG.

Every step starts at the current point and lowers the loss (CG from the current point never
raises a convex quadratic), so a round is monotone; the best iterate is kept anyway.

Example::

    >>> import torch
    >>> from torch_armor.config.armor import ArmorConfig, BcdConfig
    >>> from torch_armor.core.factorize import factorize
    >>> g = torch.Generator().manual_seed(0)
    >>> w, x = torch.randn(32, 64, generator=g), torch.randn(256, 64, generator=g)
    >>> x = x @ (torch.eye(64) + 0.5 * torch.randn(64, 64, generator=g))   # correlated inputs
    >>> xtx = x.T @ x
    >>> f = factorize(w, xtx.diagonal().clone(), ArmorConfig(block_size=8, optimizer=BcdConfig(iters=5)))
    >>> r = refine_output(w, xtx, f, rounds=2)
    >>> bool(output_loss(w, r.dense(), xtx) < output_loss(w, f.dense(), xtx))
    True
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from torch_armor.core.bcd import prox_solve
from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.pattern import parse_pattern
from torch_armor.core.proxy import nowag_prune, relative_proxy_loss
from torch_armor.core.sparse_core_fullh import fullh_core_sweeps
from torch_armor.errors import ArmorInputError

__all__ = ["output_loss", "refine_output", "damped_xtx", "with_losses"]


def output_loss(weight: torch.Tensor, approx: torch.Tensor, xtx: torch.Tensor) -> torch.Tensor:
    """``tr((W − Ŵ) H (W − Ŵ)ᵀ)`` (= ``‖(W − Ŵ) Xᵀ‖²_F`` for ``H = XᵀX``), a float64 scalar."""
    diff = weight.to(xtx.dtype) - approx.to(xtx.dtype)
    return ((diff @ xtx) * diff).sum().double()


def damped_xtx(xtx: torch.Tensor, damp: float) -> torch.Tensor:
    """``H + damp · mean(diag H) · I`` (SparseGPT's dampening), symmetrized, float32 or wider."""
    h = xtx.float() if xtx.dtype not in (torch.float32, torch.float64) else xtx
    h = h.add(h.T).mul_(0.5)  # one new (d_in, d_in) tensor: H is the largest thing refinement holds
    if damp > 0:
        h.diagonal().add_(damp * h.diagonal().mean().clamp_min(torch.finfo(h.dtype).tiny))
    return h


def _dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y).sum()


def _pcg(apply_h, rhs: torch.Tensor, precondition, steps: int) -> torch.Tensor:
    """``steps`` of preconditioned CG on ``H x = rhs`` from ``x = 0`` (``H`` SPD on the subspace);
    ``rhs`` is overwritten (it becomes the residual).

    Stops (every later step leaves ``x`` as it is) once the curvature or ``rᵀz`` is not positive;
    the test stays on the device, so no step waits for the host. The vectors are updated in place:
    besides ``x``, ``r`` and ``p`` only one of ``H p`` or ``z`` is alive at a time."""
    x = torch.zeros_like(rhs)
    r = rhs
    p = precondition(r)
    rz = _dot(r, p)
    going = torch.ones((), dtype=torch.bool, device=rhs.device)
    one = torch.ones((), dtype=rhs.dtype, device=rhs.device)
    for _ in range(steps):
        hp = apply_h(p)
        curv = _dot(p, hp)
        going = going & (curv > 0) & (rz > 0)
        alpha = torch.where(going, rz / torch.where(going, curv, one), 0.0)  # 0 once stopped
        x.addcmul_(p, alpha)
        r.addcmul_(hp, alpha, value=-1)
        del hp
        z = precondition(r)
        rz_new = _dot(r, z)
        p.mul_(torch.where(going, rz_new / torch.where(going, rz, one), one)).addcmul_(z, going.to(p.dtype))
        del z
        rz = torch.where(going, rz_new, rz)
    return x


def _sym_inv(gram: torch.Tensor) -> torch.Tensor:
    """Inverse of a stack of symmetric PSD blocks, ridged by 1e-6 of their mean diagonal."""
    d = gram.shape[-1]
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1).clamp_min(torch.finfo(gram.dtype).tiny)
    eye = torch.eye(d, dtype=gram.dtype, device=gram.device)
    return torch.linalg.inv(gram + 1e-6 * scale[:, None, None] * eye)


def _diag_blocks(m: torch.Tensor, d_b: int) -> torch.Tensor:
    """The ``(n/d_b, d_b, d_b)`` diagonal blocks of a square ``(n, n)`` matrix."""
    n = m.shape[0] // d_b
    idx = torch.arange(n, device=m.device)
    return m.view(n, d_b, n, d_b)[idx, :, idx, :]


def _update_a(w_h: torch.Tensor, h: torch.Tensor, a, core, b, ridge: float) -> torch.Tensor:
    p, d_b, _ = a.shape
    c = block_diag_right(core, b)  # S·B
    c_h = (c @ h).view(p, d_b, -1)
    c = c.view(p, d_b, -1)
    gram = c_h @ c.transpose(1, 2)  # C_i H C_iᵀ
    cross = w_h.view(p, d_b, -1) @ c.transpose(1, 2)  # W_i H C_iᵀ
    return prox_solve(gram, cross.transpose(1, 2), a.transpose(1, 2), ridge).transpose(1, 2)


def _row_tiles(n: int, chunks: int):
    """``chunks`` (or fewer) consecutive slices covering ``range(n)``."""
    step = -(-n // chunks)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def _symmetrize_(m: torch.Tensor, chunks: int = 8) -> torch.Tensor:
    """``m ← (m + mᵀ) / 2`` in place, a pair of tiles at a time (no second ``(n, n)`` tensor)."""
    tiles = _row_tiles(m.shape[0], chunks)
    for k, rows in enumerate(tiles):
        for cols in tiles[k:]:
            avg = (m[rows, cols] + m[cols, rows].T).mul_(0.5)
            m[rows, cols] = avg
            m[cols, rows] = avg.T
    return m


def _b_h_bt(h: torch.Tensor, b: torch.Tensor, chunks: int = 8) -> torch.Tensor:
    """``B H Bᵀ`` for block-diagonal ``B``, a few block rows at a time (no ``B·H`` temporary)."""
    q_blocks, d_b, _ = b.shape
    out = torch.empty_like(h)
    for blocks in _row_tiles(q_blocks, chunks):
        rows = slice(blocks.start * d_b, blocks.stop * d_b)
        out[rows] = block_diag_right(block_diag_left(b[blocks], h[rows]), b.transpose(1, 2))
    return out


def _update_core(weight, h, a, core, mask, b, steps: int) -> torch.Tensor:
    d_b = a.shape[-1]
    a_gram = a.transpose(1, 2) @ a  # blocks of AᵀA
    q = _symmetrize_(_b_h_bt(h, b))  # B H Bᵀ: the one (d_in, d_in) tensor this step adds
    residual = weight - block_diag_right(block_diag_left(a, core), b)
    rhs = block_diag_left(a.transpose(1, 2), block_diag_right(residual @ h, b.transpose(1, 2))).mul_(mask)
    del residual  # Aᵀ R H Bᵀ ⊙ M above
    a_inv, q_inv = _sym_inv(a_gram), _sym_inv(_diag_blocks(q, d_b))

    def apply_h(v):
        return (block_diag_left(a_gram, v) @ q).mul_(mask)

    def precondition(r):
        return block_diag_right(block_diag_left(a_inv, r), q_inv).mul_(mask)

    return core + _pcg(apply_h, rhs, precondition, steps)


def _update_b(weight, h, a, core, b, steps: int, chunks: int = 8) -> torch.Tensor:
    q_blocks, d_b, _ = b.shape
    e = block_diag_left(a, core)  # A·S
    gram = e.T @ e  # EᵀE, the one (d_in, d_in) tensor this step adds
    h_blocks = _diag_blocks(h, d_b)
    g_inv, h_inv = _sym_inv(_diag_blocks(gram, d_b)), _sym_inv(h_blocks)
    h_cols = h.view(-1, q_blocks, d_b).permute(1, 0, 2)  # block j: H[:, C_j]

    def apply_h(v):
        # block j of EᵀE·blockdiag(V)·H is (EᵀE)[C_j, :]·blockdiag(V)·H[:, C_j]: 1/chunks of the block rows at a
        # time, so no (d_in, d_in) temporary
        out = []
        for blocks in _row_tiles(q_blocks, chunks):
            rows = block_diag_right(gram[blocks.start * d_b:blocks.stop * d_b], v)
            out.append(rows.view(-1, d_b, rows.shape[1]) @ h_cols[blocks])
        return torch.cat(out)

    def precondition(r):
        return g_inv @ r @ h_inv

    # blockdiag(Eᵀ R H): block j is E[:, C_j]ᵀ (R H)[:, C_j], from the (d_out, d_in) product R H
    residual_h = (weight - block_diag_right(e, b)) @ h
    d_out = e.shape[0]
    rhs = e.view(d_out, q_blocks, d_b).permute(1, 2, 0) @ residual_h.view(d_out, q_blocks, d_b).transpose(0, 1)
    del residual_h
    return b + _pcg(apply_h, rhs, precondition, steps)


def refine_output(weight: torch.Tensor, xtx: torch.Tensor, factors: ArmorFactors, *, rounds: int = 3,
                  cg_steps: int = 10, damp: float = 0.01, act_sq_norm: Optional[torch.Tensor] = None,
                  ridge: float = 1e-6, core_steps: int = 0) -> ArmorFactors:
    """Refine ARMOR factors under the output-space loss (the mask fixed unless ``core_steps``).

    Each round: exact ``A``, ``cg_steps`` of preconditioned CG on the kept core values, then on
    ``B``, minimizing ``tr((W − A S B) H_d (W − A S B)ᵀ)`` with ``H_d`` = ``xtx`` dampened by
    ``damp`` × its mean diagonal (:func:`damped_xtx`). The best iterate under that loss is kept,
    so the result is never worse than ``factors``.

    Args:
        weight: ``(d_out, d_in)`` the layer's weight.
        xtx: ``(d_in, d_in)`` ``Σ_tokens x xᵀ`` of the layer's inputs.
        factors: the factors to refine (e.g. from :func:`~torch_armor.core.factorize.factorize`).
        rounds: alternations of the three steps (0: return ``factors`` with only the loss set).
        cg_steps: CG steps per core / ``B`` update.
        damp: dampening of ``H``.
        act_sq_norm: ``diag(H)`` before dampening (default ``xtx.diagonal()``), for the diagonal
            proxy loss recorded in ``history`` and the NoWag-P reference.
        ridge: proximal ridge of the ``A`` solve (see :mod:`torch_armor.core.bcd`).
        core_steps: after the rounds, up to this many full-``H`` sparse-core steps
            (:func:`~torch_armor.core.sparse_core_fullh.fullh_core_sweeps`: the mask may change),
            then ``rounds`` more rounds on the new mask (0: off).

    Returns:
        New :class:`ArmorFactors`: same mask (unless ``core_steps``), refined ``a_blocks``/``core``/``b_blocks``,
        ``relative_output_loss`` = output loss ÷ NoWag-P's (both under the undamped ``xtx``), and the
        diagonal proxy loss of the refined factors appended to ``history`` (so
        ``relative_loss`` describes the returned factors).
    """
    if rounds < 0 or cg_steps < 0 or core_steps < 0:
        raise ArmorInputError(f"refine_output: rounds, cg_steps and core_steps must be >= 0, got {rounds}, {cg_steps}, "
                              f"{core_steps}")
    d_out, d_in = factors.shape
    if tuple(weight.shape) != (d_out, d_in) or tuple(xtx.shape) != (d_in, d_in):
        raise ArmorInputError(f"refine_output: weight {tuple(weight.shape)} and xtx {tuple(xtx.shape)} do not fit "
                         f"factors of shape {(d_out, d_in)}")
    start = time.perf_counter()
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    out_dtype, device = factors.core.dtype, weight.device
    h = damped_xtx(xtx.to(device=device, dtype=dtype), damp)
    w = weight.detach().to(dtype)
    a, core, b = (t.to(device=device, dtype=dtype) for t in (factors.a_blocks, factors.core, factors.b_blocks))
    mask = factors.mask.to(device)
    core = core * mask
    pattern = parse_pattern(factors.pattern)
    if core_steps and not pattern.structured:
        raise ArmorInputError(f"refine_output: core_steps needs an N:M pattern, got {factors.pattern!r}")

    def loss_of(a_, core_, b_) -> float:
        return float(output_loss(w, block_diag_right(block_diag_left(a_, core_), b_), h))

    best = (loss_of(a, core, b), a, core, b, mask)
    w_h = w @ h
    for phase in range(2 if core_steps else 1):
        if phase:  # the mask moves under the full-H loss, then the values and wrappers follow it
            _, a, core, b, mask = best
            core, mask, _ = fullh_core_sweeps(w, h, a, core, mask, b, n=pattern.n, m=pattern.m, steps=core_steps)
            best = (loss_of(a, core, b), a, core, b, mask)
        for _ in range(rounds):
            a = _update_a(w_h, h, a, core, b, ridge)
            core = _update_core(w, h, a, core, mask, b, cg_steps)
            b = _update_b(w, h, a, core, b, cg_steps)
            loss = loss_of(a, core, b)
            if not loss < best[0]:
                break
            best = (loss, a, core, b, mask)
    _, a, core, b, mask = best
    new = dataclasses.replace(factors, a_blocks=a.to(out_dtype).contiguous(), core=core.to(out_dtype).contiguous(),
                              b_blocks=b.to(out_dtype).contiguous(), mask=mask.to(factors.mask.device))
    return with_losses(new, weight, xtx, act_sq_norm, seconds=time.perf_counter() - start)


def with_losses(factors: ArmorFactors, weight: torch.Tensor, xtx: torch.Tensor,
                act_sq_norm: Optional[torch.Tensor] = None, seconds: float = 0.0) -> ArmorFactors:
    """``factors`` whose recorded losses describe them after a change made outside the optimizer
    (refinement, block reconstruction): ``relative_output_loss`` = ``tr(E H Eᵀ)`` ÷ NoWag-P's
    (undamped ``xtx``), and their relative proxy loss appended to ``history`` (``seconds``
    after its last entry), so ``relative_loss`` is theirs."""
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    device = weight.device
    w = weight.detach().to(dtype)
    raw = xtx.to(device=device, dtype=dtype)
    diag = raw.diagonal() if act_sq_norm is None else act_sq_norm.to(device, dtype)
    _, nowag = nowag_prune(w, diag, parse_pattern(factors.pattern))
    dense = factors.dense(dtype).to(device)
    proxy = relative_proxy_loss(w, dense, diag, factors.pattern)
    reference, final = float(output_loss(w, nowag, raw)), float(output_loss(w, dense, raw))
    return dataclasses.replace(
        factors,
        history=torch.cat([factors.history, torch.tensor([proxy], dtype=factors.history.dtype)]),
        history_iters=torch.cat([factors.history_iters, factors.history_iters[-1:]]),
        history_time_s=torch.cat([factors.history_time_s, factors.history_time_s[-1:] + seconds]),
        relative_output_loss=final / reference if reference > 0 else 0.0,
    )
