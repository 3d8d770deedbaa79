"""The sparse-core step: in every ``d_b × d_b`` tile, re-solve one group of ``M`` core entries.

With ``A``, ``B`` block diagonal the proxy loss splits into independent tiles, so every tile
updates one group at once. For a tile ``(i, j)`` and a group at tile row ``i'`` and columns
``grp`` (``M`` consecutive), let ``a = A_i[:, i']``, ``Bg = B_j[grp, :]``, ``D = diag(h_j)``,
``K = Bg D Bgᵀ`` and ``u = Bg D Δᵀ a`` with ``Δ`` the tile residual *without* the group.
Setting the group to ``x`` (``M`` values, zero off its support) costs

    L(x) = ‖Δ‖²_D − gain(x),   gain(x) = 2 xᵀu − ‖a‖² xᵀ K x,

so for a support ``s`` (``N`` of the ``M`` columns) the best values are
``x_s = K_ss⁺ u_s / ‖a‖²`` (the paper's eq. for ``w*_m``). ``u`` comes from the gradient
``G = ∂L/∂core = −2 Aᵀ (R D) Bᵀ`` at the group: ``u = −G_grp / 2 + ‖a‖² K s_cur``.
A tile moves to the best support only if its gain beats the current values', so the step
never raises the loss.
"""

from __future__ import annotations

import itertools
from functools import lru_cache
from typing import Optional, Tuple

import torch

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.errors import ArmorInputError

__all__ = [
    "supports",
    "solve_psd",
    "psd_pinv",
    "group_decrease",
    "select_groups",
    "DECREASE_SELECTIONS",
    "sparse_core_step",
    "sparse_core_steps",
    "core_gradient",
    "block_grams",
    "selection_uniforms",
]


@lru_cache(maxsize=None)
def _supports_list(n: int, m: int) -> Tuple[Tuple[int, ...], ...]:
    return tuple(itertools.combinations(range(m), n))


def supports(n: int, m: int, device: Optional[torch.device] = None) -> torch.Tensor:
    """All ``C(m, n)`` supports of a group, as a ``(C, n)`` long tensor in lexicographic order
    (on CUDA made once per device, so the sweeps do no host-to-device copy; read-only)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return torch.tensor(_supports_list(n, m), dtype=torch.long, device=device)
    return _supports_on_cuda(n, m, device)


@lru_cache(maxsize=None)
def _supports_on_cuda(n: int, m: int, device: torch.device) -> torch.Tensor:
    with torch.inference_mode(False):  # a normal tensor even if first asked for under inference_mode
        return torch.tensor(_supports_list(n, m), dtype=torch.long, device=device)


def psd_pinv(k: torch.Tensor, rel_tol: float = 1e-6) -> torch.Tensor:
    """Pseudo-inverse of batched symmetric PSD ``N×N`` matrices; closed form for ``N ≤ 2``:
    ``adj(K)/det`` when regular, ``K / tr(K)²`` when ``det ≤ rel_tol·k11·k22`` (rank one)."""
    n = k.shape[-1]
    if n == 1:
        d = k[..., 0, 0]
        return torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.zeros_like(d))[..., None, None]
    if n > 2:
        return torch.linalg.pinv(k, hermitian=True)
    k11, k12, k22 = k[..., 0, 0], k[..., 0, 1], k[..., 1, 1]
    det = k11 * k22 - k12 * k12
    regular = det > rel_tol * k11 * k22
    trace_sq = (k11 + k22).square()
    # regular: adj(K)/det; rank one: K/tr(K)²; zero: 0
    scale = torch.where(regular, 1.0 / torch.where(regular, det, torch.ones_like(det)),
                        torch.where(trace_sq > 0, 1.0 / torch.where(trace_sq > 0, trace_sq, torch.ones_like(trace_sq)),
                                    torch.zeros_like(trace_sq)))
    off = torch.where(regular, -k12, k12)
    first = torch.stack([torch.where(regular, k22, k11), off], -1)
    second = torch.stack([off, torch.where(regular, k11, k22)], -1)
    return torch.stack([first, second], -2) * scale[..., None, None]


def solve_psd(k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Least-squares solution ``K⁺ u`` of batched symmetric PSD ``N×N`` systems."""
    return (psd_pinv(k) @ u[..., None])[..., 0]


def core_gradient(
    residual: torch.Tensor, a: torch.Tensor, b: torch.Tensor, act_sq_norm: torch.Tensor
) -> torch.Tensor:
    """``∂L/∂core = −2 Aᵀ (R diag(h)) Bᵀ`` for ``R = W_bar − A core B`` (block-diagonal ``A``, ``B``)."""
    weighted = residual * act_sq_norm
    return -2.0 * block_diag_right(block_diag_left(a.transpose(1, 2), weighted), b.transpose(1, 2))


def _group_positions(rows: torch.Tensor, groups: torch.Tensor, block_size: int, d_in: int, m: int) -> torch.Tensor:
    """``(..., P, Q, M)`` flat indices into a contiguous ``(d_out, d_in)`` matrix of the ``M``
    entries of group ``groups`` in row ``rows`` of every tile."""
    p, q = rows.shape[-2:]
    tile_row = torch.arange(p, device=rows.device)[:, None] * block_size
    tile_col = torch.arange(q, device=rows.device)[None, :] * block_size
    start = (tile_row + rows) * d_in + tile_col + groups * m
    return start[..., None] + torch.arange(m, device=rows.device)


def group_decrease(
    core: torch.Tensor, grad: torch.Tensor, a_gram: torch.Tensor, b_gram: torch.Tensor, n: int, m: int
) -> torch.Tensor:
    """``(d_out, d_in // M)``: how much the proxy loss would drop if each group alone took its
    sparse-core step now (best support and values, or no change) — ``≥ 0``.

    Elementwise work of a few passes over the matrix per support (no tile matmuls): the same
    ``u``, ``K`` and ``‖a‖²`` as :func:`sparse_core_step`, for every group at once; the gain of a
    support at its best values is ``u_sᵀ K_ss⁺ u_s / ‖a‖²``.
    """
    d_out, d_in = core.shape
    q, d_b, _ = b_gram.shape
    n_grp = d_b // m
    a_sq = a_gram.diagonal(dim1=-2, dim2=-1).reshape(d_out)  # ‖A_i[:, r]‖² of every row
    # K of every column group: the diagonal M×M blocks of B_j D_j B_jᵀ
    k_grp = b_gram.view(q, n_grp, m, n_grp, m).diagonal(dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(q * n_grp, m, m)
    cur = core.reshape(d_out, q * n_grp, m)
    k_cur = (k_grp @ cur.permute(1, 2, 0)).permute(2, 0, 1)  # K s_cur of every group
    u = -0.5 * grad.reshape(d_out, q * n_grp, m) + a_sq[:, None, None] * k_cur
    cur_gain = 2.0 * (cur * u).sum(-1) - a_sq[:, None] * (cur * k_cur).sum(-1)
    sup = supports(n, m, core.device)
    n_sup = sup.shape[0]
    k_pinv = psd_pinv(k_grp[:, sup[:, :, None], sup[:, None, :]])  # (G, C, N, N)
    best = None
    if n == 2:  # u_sᵀ K_ss⁺ u_s written out on column views: no gathers, no tiny matmuls
        u_sq = u.square()
        for c, (i, j) in enumerate(_supports_list(n, m)):
            gain = (k_pinv[:, c, 0, 0] * u_sq[..., i] + k_pinv[:, c, 1, 1] * u_sq[..., j]
                    + 2.0 * k_pinv[:, c, 0, 1] * (u[..., i] * u[..., j]))
            best = gain if best is None else torch.maximum(best, gain)
    else:
        for c in range(n_sup):
            u_s = u.index_select(-1, sup[c])  # (R, G, N)
            gain = (u_s * (k_pinv[:, c] * u_s[..., None, :]).sum(-1)).sum(-1)
            best = gain if best is None else torch.maximum(best, gain)
    safe_a_sq = torch.where(a_sq > 0, a_sq, torch.ones_like(a_sq))
    best = torch.where((a_sq > 0)[:, None], best / safe_a_sq[:, None], torch.zeros_like(best))
    return (best - cur_gain).clamp_min(0)


#: selection rules that rank groups by :func:`group_decrease` (pass it to :func:`select_groups`)
DECREASE_SELECTIONS = ("decrease-greedy", "mixed")


def _per_tile(x: torch.Tensor, p: int, q: int, d_b: int, n_grp: int) -> torch.Tensor:
    """``(d_out, d_in/M)`` per-group values → ``(P·Q, d_b·d_b/M)``, one row per tile."""
    return x.reshape(p, d_b, q, n_grp).transpose(1, 2).reshape(p * q, d_b * n_grp)


def _largest(flat: torch.Tensor, count: int) -> torch.Tensor:
    """Indices of the ``count`` largest entries of each row, distinct, cycling if ``count``
    exceeds the row length."""
    top = flat.topk(min(count, flat.shape[1]), dim=-1).indices
    return top.repeat(1, -(-count // top.shape[1]))[:, :count]


def select_groups(
    grad: torch.Tensor,
    block_size: int,
    m: int,
    selection: str = "l1-random",
    generator: Optional[torch.Generator] = None,
    num: Optional[int] = None,
    decrease: Optional[torch.Tensor] = None,
    uniform: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Pick one group per tile; return its tile row and group index, each ``(P, Q)``.

    ``"l1-random"``/``"l2-random"`` draw with probability ∝ the L1/L2 norm of ``grad`` on the
    group (uniform in a tile whose gradient is all zero), ``"l1-greedy"`` takes the largest
    L1 norm, ``"random"`` draws uniformly. ``"decrease-greedy"`` takes the group with the
    largest ``decrease`` (see :func:`group_decrease`, required for it and for ``"mixed"``).
    With ``num``, ``num`` draws per tile, returned as ``(num, P, Q)``: independent for the
    random rules; the ``num`` largest for the greedy ones (distinct, repeating only if ``num``
    exceeds the groups of a tile); ``"mixed"`` = the ``num // 2`` largest decreases, then
    ``num − num // 2`` ``"l1-random"`` draws (with one draw, plain ``"l1-random"``).
    ``uniform``: the ``(P·Q, random draws)`` uniform numbers of the ``"l1"``/``"l2-random"`` draws,
    drawn beforehand from ``generator`` (:func:`selection_uniforms`), so that the rest runs under ``torch.vmap``.
    """
    d_out, d_in = grad.shape
    d_b, n_grp = block_size, block_size // m
    p, q = d_out // d_b, d_in // d_b
    draws = 1 if num is None else num
    if selection in DECREASE_SELECTIONS:
        if decrease is None:
            raise ArmorInputError(f"selection {selection!r} needs decrease= (see group_decrease)")
        n_greedy = draws if selection == "decrease-greedy" else draws // 2
        parts = []
        if n_greedy:
            parts.append(_largest(_per_tile(decrease, p, q, d_b, n_grp), n_greedy))
        if draws > n_greedy:
            r, g = select_groups(grad, block_size, m, "l1-random", generator, num=draws - n_greedy, uniform=uniform)
            parts.append((r * n_grp + g).reshape(draws - n_greedy, p * q).transpose(0, 1))
        flat_idx = torch.cat(parts, 1).reshape(p, q, draws).permute(2, 0, 1)
        if num is None:
            flat_idx = flat_idx[0]
        return flat_idx // n_grp, flat_idx % n_grp
    if selection == "random":
        flat_idx = torch.randint(0, d_b * n_grp, (p * q, draws), generator=generator, device=grad.device)
    else:
        grouped = grad.reshape(d_out, d_in // m, m)
        if selection in ("l1-random", "l1-greedy"):
            norms = grouped.abs().sum(-1)
        elif selection == "l2-random":
            norms = grouped.square().sum(-1).sqrt()
        else:
            raise ArmorInputError(f"unknown selection {selection!r}")
        flat = _per_tile(norms, p, q, d_b, n_grp)
        if selection == "l1-greedy":
            flat_idx = _largest(flat, draws)
        else:
            # Inverse-CDF sampling (an order of magnitude faster than torch.multinomial here);
            # a group with zero norm has an empty CDF interval and is never drawn.
            empty = flat.sum(-1, keepdim=True) <= 0
            flat = torch.where(empty, torch.ones_like(flat), flat)
            cdf = flat.cumsum(-1)
            if uniform is None:
                uniform = torch.rand(p * q, draws, generator=generator, device=grad.device, dtype=cdf.dtype)
            draw = uniform * cdf[:, -1:]
            flat_idx = torch.searchsorted(cdf, draw, right=True).clamp_max(d_b * n_grp - 1)
    flat_idx = flat_idx.reshape(p, q, draws).permute(2, 0, 1)
    if num is None:
        flat_idx = flat_idx[0]
    return flat_idx // n_grp, flat_idx % n_grp


def selection_uniforms(selection: str, tiles: int, num: Optional[int], generator: Optional[torch.Generator],
                       device, dtype) -> Optional[torch.Tensor]:
    """The uniform numbers :func:`select_groups` would draw from ``generator`` for ``selection``
    (``None`` for the rules that draw none; ``"random"`` draws integers and is not covered)."""
    draws = 1 if num is None else num
    if selection in DECREASE_SELECTIONS:
        draws -= draws if selection == "decrease-greedy" else draws // 2
    elif selection not in ("l1-random", "l2-random"):
        return None
    if draws == 0:
        return None
    return torch.rand(tiles, draws, generator=generator, device=device, dtype=dtype)


def block_grams(a: torch.Tensor, b: torch.Tensor, act_sq_norm: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-block Gram matrices ``(A_iᵀ A_i, B_j D_j B_jᵀ)`` that the sparse-core step needs."""
    q, d_b, _ = b.shape
    a_gram = a.transpose(1, 2) @ a
    b_gram = (b * act_sq_norm.reshape(q, 1, d_b)) @ b.transpose(1, 2)
    return a_gram, b_gram


def sparse_core_step(
    core: torch.Tensor,
    mask: torch.Tensor,
    a_gram: torch.Tensor,
    b_gram: torch.Tensor,
    grad: torch.Tensor,
    n: int,
    m: int,
    rows: torch.Tensor,
    groups: torch.Tensor,
    update_grad: bool = False,
    return_delta: bool = False,
):
    """Re-solve the chosen group of every tile over all ``C(M, N)`` supports, in place.

    Args:
        core: ``(d_out, d_in)`` contiguous core ``W' ⊙ M`` (zeros off ``mask``), updated in place.
        mask: ``(d_out, d_in)`` contiguous bool mask, updated in place.
        a_gram, b_gram: ``(P, d_b, d_b)`` ``A_iᵀA_i`` and ``(Q, d_b, d_b)`` ``B_j D_j B_jᵀ``
            (see :func:`block_grams`).
        grad: ``∂L/∂core`` at the current point (see :func:`core_gradient`).
        rows, groups: ``(P, Q)`` tile row and group index of each tile's chosen group.
        update_grad: also update ``grad`` in place so that it stays exact after the step
            (a rank-one change per tile: ``ΔG = 2 A_iᵀA_i ΔS B_j D_j B_jᵀ``).

    Returns:
        ``(P, Q)`` decrease of the proxy loss in each tile (≥ 0); with ``return_delta``, also
        the ``(P, Q, M)`` change of each chosen group's values.
    """
    if not (core.is_contiguous() and mask.is_contiguous() and grad.is_contiguous()):
        raise ArmorInputError("core, mask and grad must be contiguous: the step writes through views")
    p, d_b, _ = a_gram.shape
    q = b_gram.shape[0]
    p_idx = torch.arange(p, device=core.device)[:, None].expand(p, q)
    q_idx = torch.arange(q, device=core.device)[None, :].expand(p, q)

    a_sq = a_gram[p_idx, rows, rows]  # (P, Q): ‖A_i[:, i']‖²
    cols = groups[..., None] * m + torch.arange(m, device=core.device)  # (P, Q, M)
    b_rows = b_gram[q_idx[..., None], cols]  # (P, Q, M, d_b): rows grp of B_j D_j B_jᵀ
    gram = b_rows.gather(-1, cols[..., None, :].expand(p, q, m, m))  # K: (P, Q, M, M)

    # flat positions of the chosen groups in the (d_out, d_in) matrices: one gather / scatter
    # each, much cheaper than advanced indexing into the permuted tile view
    flat = _group_positions(rows, groups, d_b, core.shape[1], m)  # (P, Q, M)
    core_flat, mask_flat = core.view(-1), mask.view(-1)
    cur = core_flat[flat]  # (P, Q, M)
    cur_mask = mask_flat[flat]
    g = grad.view(-1)[flat]
    u = -0.5 * g + a_sq[..., None] * (gram @ cur[..., None])[..., 0]

    sup = supports(n, m, core.device)  # (C, N)
    k_ss = gram[..., sup[:, :, None], sup[:, None, :]]  # (P, Q, C, N, N)
    u_s = u[..., sup]  # (P, Q, C, N)
    safe_a_sq = torch.where(a_sq > 0, a_sq, torch.ones_like(a_sq))[..., None, None]
    vals = solve_psd(k_ss, u_s) / safe_a_sq
    vals = torch.where((a_sq > 0)[..., None, None], vals, torch.zeros_like(vals))
    cand = torch.zeros(*vals.shape[:-1], m, dtype=core.dtype, device=core.device)
    cand.scatter_(-1, sup.expand(*vals.shape[:-1], n), vals)  # (P, Q, C, M)

    def gain(x: torch.Tensor, kk: torch.Tensor, uu: torch.Tensor) -> torch.Tensor:
        kx = (kk @ x[..., None])[..., 0]
        return 2.0 * (x * uu).sum(-1) - a_sq[(...,) + (None,) * (x.dim() - 3)] * (x * kx).sum(-1)

    cand_gain = gain(cand, gram[:, :, None], u[:, :, None])  # (P, Q, C)
    cur_gain = gain(cur, gram, u)  # (P, Q)
    best_gain, best = cand_gain.max(-1)
    accept = best_gain > cur_gain
    best_vals = cand.gather(2, best[..., None, None].expand(p, q, 1, m))[:, :, 0]
    best_mask = torch.zeros(p, q, m, dtype=torch.bool, device=core.device)
    best_mask.scatter_(-1, sup[best], True)

    new_vals = torch.where(accept[..., None], best_vals, cur)
    core_flat[flat] = new_vals
    mask_flat[flat] = torch.where(accept[..., None], best_mask, cur_mask)
    delta = new_vals - cur  # (P, Q, M)
    if update_grad:
        left = 2.0 * a_gram[p_idx, :, rows]  # (P, Q, d_b): twice column i' of A_iᵀA_i
        right = (delta[..., None] * b_rows).sum(-2)  # (P, Q, d_b): δᵀ (B D Bᵀ)[grp, :]
        grad.view(p, d_b, q, d_b).add_(torch.einsum("pqr,pqc->prqc", left, right))
    decrease = torch.where(accept, best_gain - cur_gain, torch.zeros_like(cur_gain))
    return (decrease, delta) if return_delta else decrease


def sparse_core_steps(
    core: torch.Tensor,
    mask: torch.Tensor,
    a_gram: torch.Tensor,
    b_gram: torch.Tensor,
    grad: torch.Tensor,
    n: int,
    m: int,
    rows: torch.Tensor,
    groups: torch.Tensor,
) -> torch.Tensor:
    """``K`` exact sparse-core steps per tile in sequence, chosen in advance: ``rows`` and
    ``groups`` are ``(K, P, Q)`` (e.g. ``select_groups(..., num=K)`` on ``grad``).

    Each step uses the exact gradient at its group *after* the previous steps — ``grad`` (the
    gradient before the first step) plus the rank-one changes the earlier steps of its tile made,
    evaluated only on the later groups: ``2 (A_iᵀA_i)[r_k, r] · δᵀ (B_j D_j B_jᵀ)[G, G_k]``. So the
    result equals ``K`` calls of :func:`sparse_core_step` with ``update_grad=True``, but no step
    touches the whole gradient. Everything that does not depend on the order — the groups'
    ``K``, their supports' pseudo-inverses, ``‖a‖²``, the cross terms of ``A_iᵀA_i`` — is
    gathered once for all ``K`` steps, so a step is a few dozen small ``(P, Q, ·)`` operations.
    Extra memory: about twice the layer. ``grad`` is left unchanged (stale); ``core`` and
    ``mask`` are updated in place.

    Returns:
        ``(P, Q)`` total decrease of the proxy loss in each tile (≥ 0).
    """
    if not (core.is_contiguous() and mask.is_contiguous()):
        raise ArmorInputError("core and mask must be contiguous: the steps write through views")
    k_steps, p, q = rows.shape
    d_b = a_gram.shape[-1]
    d_in = core.shape[1]
    device, dtype = core.device, core.dtype
    # flat-index gathers (take / index_select) throughout: far cheaper than advanced indexing
    tile_p = torch.arange(p, device=device)[:, None].expand(p, q)
    tile_q = torch.arange(q, device=device)[None, :].expand(p, q)
    a_sq = a_gram.take(tile_p * d_b * d_b + rows * (d_b + 1))  # (K, P, Q): (A_iᵀA_i)[r, r]
    inv_a_sq = torch.where(a_sq > 0, 1.0 / torch.where(a_sq > 0, a_sq, torch.ones_like(a_sq)), torch.zeros_like(a_sq))
    cols = groups[..., None] * m + torch.arange(m, device=device)  # (K, P, Q, M)
    b_rows = b_gram.reshape(q * d_b, d_b).index_select(0, (tile_q[..., None] * d_b + cols).reshape(-1))
    b_rows = b_rows.view(k_steps, p, q, m, d_b)  # rows G_k of B_j D_j B_jᵀ
    gram = b_rows.gather(-1, cols[..., None, :].expand(k_steps, p, q, m, m))  # (K, P, Q, M, M)
    # (K, K, P, Q): 2 (A_iᵀA_i)[r_k, r_l]
    a_cross = 2.0 * a_gram.take((tile_p * d_b * d_b + rows * d_b)[:, None] + rows[None, :])
    flat = _group_positions(rows, groups, d_b, d_in, m)  # (K, P, Q, M)
    group_grad = grad.take(flat)  # corrected in place as the steps go

    sup = supports(n, m, device)  # (C, N)
    n_sup = sup.shape[0]
    pick = torch.zeros(m, n_sup * n, dtype=dtype, device=device)  # u @ pick = u on every support
    pick[sup.reshape(-1), torch.arange(n_sup * n, device=device)] = 1.0
    sup_mask = torch.zeros(n_sup, m, dtype=torch.bool, device=device).scatter_(-1, sup, True)
    ss_idx = (sup[:, :, None] * m + sup[:, None, :]).reshape(-1)  # K_ss entries inside K
    k_ss = gram.reshape(k_steps, p, q, m * m).index_select(-1, ss_idx).view(k_steps, p, q, n_sup, n, n)
    k_pinv = psd_pinv(k_ss)
    core_flat, mask_flat = core.view(-1), mask.view(-1)
    total = torch.zeros(p, q, dtype=dtype, device=device)  # summed out of place: also runs under torch.vmap
    for k in range(k_steps):
        pos = flat[k].reshape(-1)
        cur = core_flat.index_select(0, pos).view(p, q, m)
        a_k = a_sq[k][..., None]
        k_cur = (gram[k] @ cur[..., None])[..., 0]
        u = -0.5 * group_grad[k] + a_k * k_cur
        u_s = (u @ pick).view(p, q, n_sup, n)
        x_s = (k_pinv[k] @ u_s[..., None])[..., 0] * inv_a_sq[k][..., None, None]
        k_x = (k_ss[k] @ x_s[..., None])[..., 0]
        cand_gain = (x_s * (2.0 * u_s - a_k[..., None] * k_x)).sum(-1)  # (P, Q, C)
        cur_gain = (cur * (2.0 * u - a_k * k_cur)).sum(-1)
        best_gain, best = cand_gain.max(-1)
        accept = best_gain > cur_gain
        best_vals = x_s.gather(2, best[..., None, None].expand(p, q, 1, n))[:, :, 0]
        new = torch.zeros_like(cur).scatter_(-1, sup.index_select(0, best.view(-1)).view(p, q, n), best_vals)
        new = torch.where(accept[..., None], new, cur)
        core_flat.index_copy_(0, pos, new.view(-1))
        new_mask = torch.where(accept[..., None], sup_mask.index_select(0, best.view(-1)).view(p, q, m),
                               mask_flat.index_select(0, pos).view(p, q, m))
        mask_flat.index_copy_(0, pos, new_mask.view(-1))
        total = total + torch.where(accept, best_gain - cur_gain, torch.zeros_like(cur_gain))
        if k + 1 < k_steps:
            right = ((new - cur)[..., None] * b_rows[k]).sum(-2)  # (P, Q, d_b): δᵀ (B_j D_j B_jᵀ)[G_k, :]
            later = right.expand(k_steps - k - 1, p, q, d_b).gather(-1, cols[k + 1:])
            group_grad[k + 1:] += a_cross[k + 1:, k, ..., None] * later
    return total
