"""Sparse-core group updates under the output-space loss ``L = tr((W − Ŵ) H (W − Ŵ)ᵀ)``.

``Ŵ = A·S·B`` with ``A``, ``B`` block diagonal, ``S`` the core on a 2:4 (``N:M``) mask, ``H = XᵀX``
(full). The mask and the kept values of ``S`` move; ``A``, ``B``, ``H`` stay fixed.

Changing one group — row ``r``, columns ``c`` (``M`` consecutive) — by ``δ`` changes the loss by

    ΔL(δ) = ⟨G_{r,c}, δ⟩ + P_rr · δᵀ Q_cc δ,   G = ∂L/∂S = −2 Aᵀ (W − ASB) H Bᵀ,
    P = AᵀA (block diagonal),  Q = B H Bᵀ (full),

the same quadratic as the diagonal proxy's (:mod:`torch_armor.core.sparse_core`) with ``Q``'s
``M × M`` diagonal block in place of ``B_j D_j B_jᵀ``'s: so each group's best support and values
are what :func:`~torch_armor.core.sparse_core.sparse_core_step` computes from ``G`` and the
diagonal blocks of ``Q``. What changes is the coupling: two groups ``(r, c)``, ``(r', c')``
interact through ``2 P_rr' · δᵀ Q_cc' δ'``. ``P`` is block diagonal, so groups in different
row blocks of ``A`` never interact; within a row block the full ``Q`` couples every column tile.

A step therefore picks, in every ``d_b × d_b`` tile, the group whose own update lowers the loss
most, solves each exactly (as if alone), and then per row block of ``A`` evaluates the *exact*
joint change of moving all its tiles' groups together (the cross terms included) against the
best single group's: it keeps whichever is lower (or nothing). Row blocks are independent, and
each choice is the exact change, so a step never raises the loss. ``G`` is updated by the
rank-one changes ``2 P[:, r] δᵀ Q[c, :]`` and recomputed from scratch after every sweep of steps,
when the loss is also recomputed; a sweep that did not lower it ends the run and the best
iterate is returned. The work runs in ``h``'s dtype (float64, or float32 as refinement does), the
loss is summed in float64.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.sparse_core import group_decrease, select_groups, sparse_core_step
from torch_armor.errors import ArmorInputError

__all__ = ["fullh_objective", "fullh_core_gradient", "fullh_core_step", "fullh_core_sweeps"]


def _approx(a: torch.Tensor, core: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return block_diag_right(block_diag_left(a, core), b)


def fullh_objective(weight: torch.Tensor, h: torch.Tensor, a: torch.Tensor, core: torch.Tensor,
                    b: torch.Tensor) -> torch.Tensor:
    """``tr((W − A S B) H (W − A S B)ᵀ)`` in ``h``'s dtype, summed in float64."""
    diff = weight.to(h.dtype) - _approx(a.to(h.dtype), core.to(h.dtype), b.to(h.dtype))
    return ((diff @ h) * diff).sum(dtype=torch.float64)


def fullh_core_gradient(weight: torch.Tensor, h: torch.Tensor, a: torch.Tensor, core: torch.Tensor,
                        b: torch.Tensor) -> torch.Tensor:
    """``∂L/∂S = −2 Aᵀ (W − A S B) H Bᵀ`` (``H`` symmetric)."""
    residual = weight - _approx(a, core, b)
    bh = block_diag_left(b, h)  # B H
    return -2.0 * block_diag_left(a.transpose(1, 2), residual @ bh.T)


def _coupling(b: torch.Tensor, h: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``Q = B H Bᵀ`` (symmetrized) and its ``(n_B, d_b, d_b)`` diagonal blocks."""
    q = block_diag_right(block_diag_left(b, h), b.transpose(1, 2))
    q = 0.5 * (q + q.T)
    n_b, d_b, _ = b.shape
    idx = torch.arange(n_b, device=q.device)
    return q, q.view(n_b, d_b, n_b, d_b)[idx, :, idx, :]


def fullh_core_step(core: torch.Tensor, mask: torch.Tensor, grad: torch.Tensor, a_gram: torch.Tensor,
                    q: torch.Tensor, q_diag: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """One step, in place on ``core``, ``mask`` and ``grad`` (all contiguous); no host sync.

    Args:
        core, mask: ``(d_out, d_in)`` core (zeros off the mask, float32 or float64) and bool mask.
        grad: ``∂L/∂S`` at the current point; kept exact.
        a_gram: ``(P, d_b, d_b)`` blocks of ``AᵀA``.
        q, q_diag: ``B H Bᵀ`` and its diagonal blocks (:func:`_coupling`).

    Returns:
        ``(P,)`` change of the loss in each row block of ``A`` (``≤ 0``).
    """
    d_out, d_in = core.shape
    p, d_b, _ = a_gram.shape
    n_q = d_in // d_b
    decrease = group_decrease(core, grad, a_gram, q_diag, n, m)
    rows, groups = select_groups(grad, d_b, m, "decrease-greedy", decrease=decrease)  # (P, n_Q)
    tile_p = torch.arange(p, device=core.device)[:, None]
    tile_q = torch.arange(n_q, device=core.device)[None, :]
    cols = (tile_q * d_b + groups * m)[..., None] + torch.arange(m, device=core.device)  # (P, n_Q, M)
    flat = (tile_p * d_b + rows)[..., None] * d_in + cols
    old_core, old_mask = core.view(-1)[flat], mask.view(-1)[flat]
    group_grad = grad.view(-1)[flat]
    # every tile's group solved alone (written in place; undone below where not kept)
    _, delta = sparse_core_step(core, mask, a_gram, q_diag, grad, n, m, rows, groups, return_delta=True)
    # y = ΔS Q with ΔS the moves of every tile (sparse: one group per tile); P y = ΔS's gradient change / 2
    at = torch.stack([(tile_p * d_b + rows)[..., None].expand(p, n_q, m), cols]).reshape(2, -1)
    moves = torch.sparse_coo_tensor(at, delta.reshape(-1), (d_out, d_in), check_invariants=False)
    p_y = block_diag_left(a_gram, torch.sparse.mm(moves, q))
    linear = (group_grad * delta).sum(-1)  # (P, n_Q): ⟨G, δ_j⟩
    joint = linear.sum(-1) + (p_y.view(-1)[flat] * delta).sum((-2, -1))  # ⟨G, ΔS_i⟩ + ⟨ΔS_i, P_i ΔS_i Q⟩
    a_sq = a_gram.diagonal(dim1=-2, dim2=-1).gather(-1, rows)  # (P, n_Q): P_i[r_j, r_j]
    k = q_diag[tile_q.expand(p, n_q)[..., None], (groups * m)[..., None] + torch.arange(m, device=core.device)]
    k = k.gather(-1, cols[..., None, :].remainder(d_b).expand(p, n_q, m, m))  # (P, n_Q, M, M): Q[c_j, c_j]
    single = linear + a_sq * (delta * (k @ delta[..., None])[..., 0]).sum(-1)
    best_single, best_tile = single.min(-1)
    use_joint = joint < best_single.clamp_max(0)
    use_single = ~use_joint & (best_single < 0)
    keep = use_joint[:, None] | ((tile_q == best_tile[:, None]) & use_single[:, None])
    change = torch.where(use_joint, joint, best_single.clamp_max(0))
    core.view(-1)[flat] = torch.where(keep[..., None], old_core + delta, old_core)
    mask.view(-1)[flat] = torch.where(keep[..., None], mask.view(-1)[flat], old_mask)
    # the kept single move's gradient change: 2 P_i[:, r] (δᵀ Q[c, :])
    one = best_tile[:, None, None]
    r_one, c_one = rows.gather(1, best_tile[:, None])[:, 0], cols.gather(1, one.expand(p, 1, m))[:, 0]
    d_one = delta.gather(1, one.expand(p, 1, m))[:, 0] * use_single[:, None].to(core.dtype)  # (P, M)
    y_one = (d_one[..., None] * q.index_select(0, c_one.reshape(-1)).view(p, m, d_in)).sum(1)  # (P, d_in)
    p_one = a_gram.gather(-1, r_one[:, None, None].expand(p, d_b, 1))  # (P, d_b, 1): P_i[:, r]
    update = torch.where(use_joint[:, None, None], p_y.view(p, d_b, d_in), p_one * y_one[:, None, :])
    grad.view(p, d_b, d_in).add_(update, alpha=2.0)
    return change


def fullh_core_sweeps(weight: torch.Tensor, h: torch.Tensor, a: torch.Tensor, core: torch.Tensor,
                      mask: torch.Tensor, b: torch.Tensor, *, n: int, m: int, steps: int,
                      steps_per_sweep: int = 16) -> Tuple[torch.Tensor, torch.Tensor, List[float]]:
    """Up to ``steps`` exact full-``H`` sparse-core steps (:func:`fullh_core_step`), in sweeps of
    ``steps_per_sweep`` after which the gradient and the loss are recomputed exactly; a sweep
    that does not lower the loss ends the run.

    Args:
        weight: ``(d_out, d_in)``; h: ``(d_in, d_in)`` symmetric PSD (e.g. damped ``XᵀX``).
        a, b: ``(d_out/d_b, d_b, d_b)``, ``(d_in/d_b, d_b, d_b)`` diagonal blocks of ``A``, ``B``.
        core, mask: the core (zeros off the mask) and its ``N:M`` mask; not modified.

    Returns:
        ``(core, mask, losses)``: the best iterate (core in ``h``'s dtype, float32 at least) and the
        loss after each sweep, starting with the initial one (non-increasing up to the last, rejected,
        entry).
    """
    if steps < 0 or steps_per_sweep < 1:
        raise ArmorInputError(f"fullh_core_sweeps: steps must be >= 0 and steps_per_sweep >= 1, got {steps}, "
                              f"{steps_per_sweep}")
    d_out, d_in = core.shape
    d_b = a.shape[-1]
    if d_b % m or tuple(weight.shape) != (d_out, d_in) or tuple(h.shape) != (d_in, d_in):
        raise ArmorInputError(f"fullh_core_sweeps: weight {tuple(weight.shape)}, h {tuple(h.shape)}, core "
                              f"{(d_out, d_in)} and block size {d_b} (multiple of M={m}) do not fit")
    dtype = torch.float64 if h.dtype == torch.float64 else torch.float32
    w, h, a, b = (t.detach().to(dtype) for t in (weight, h, a, b))
    core = (core.detach().to(dtype) * mask).contiguous()
    mask = mask.detach().clone().contiguous()
    a_gram = a.transpose(1, 2) @ a
    q, q_diag = _coupling(b, h)
    losses = [float(fullh_objective(w, h, a, core, b))]
    best = (core.clone(), mask.clone())
    done = 0
    while done < steps:
        grad = fullh_core_gradient(w, h, a, core, b).contiguous()
        for _ in range(min(steps_per_sweep, steps - done)):
            fullh_core_step(core, mask, grad, a_gram, q, q_diag, n, m)
            done += 1
        losses.append(float(fullh_objective(w, h, a, core, b)))
        if not losses[-1] < min(losses[:-1]):
            break
        best = (core.clone(), mask.clone())
    return best[0], best[1], losses
