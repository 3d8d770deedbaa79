"""Exact block-coordinate updates of ARMOR factors (normalized space).

Each function takes the current factors and returns (or applies) an exact minimizer of the
proxy loss ``L = Σ_tiles ‖W_bar_ij − A_i S_ij B_j‖²_{D_j}`` over one block of variables,
with a proximal ridge ``λ‖X − X_old‖²`` (``λ`` at least 100 ulp of the dtype) so that every step provably never raises ``L``
(the proximal objective at the new point is ≤ its value at the old point, where the ridge
term is zero). ``λ`` is ``ridge`` times the mean diagonal of the system matrix.
"""

from __future__ import annotations

import torch

from torch_armor.core.blockdiag import block_diag_left, block_diag_right

__all__ = ["update_a", "update_b", "refine_core_cg"]


def _ridge(gram: torch.Tensor, ridge: float) -> torch.Tensor:
    # A floor of 100 ulp keeps Cholesky meaningful on rank-deficient systems. An all-zero block
    # (e.g. input channels never active in calibration) has no scale of its own: it gets scale 1,
    # so λ stays a normal number and the proximal step returns the old value (its optimum there).
    ridge = max(ridge, 100 * torch.finfo(gram.dtype).eps)
    d = gram.shape[-1]
    scale = gram.diagonal(dim1=-2, dim2=-1).mean(-1)
    scale = torch.where(scale > torch.finfo(gram.dtype).tiny / ridge, scale, torch.ones_like(scale))
    return (ridge * scale)[:, None, None] + torch.zeros(d, dtype=gram.dtype, device=gram.device)


def prox_solve(gram: torch.Tensor, rhs: torch.Tensor, old: torch.Tensor, ridge: float) -> torch.Tensor:
    """``(gram + λI)⁻¹ (rhs + λ·old)`` per block (gram symmetric PSD).

    Numerical guard: a block whose system Cholesky still rejects after raising ``λ`` a thousand-
    and a million-fold, or whose solution is not finite, keeps its old value (``X = old`` never
    raises the proximal objective, so the step stays monotone). All three ``λ`` are always tried
    (the ``d_b³`` factorizations cost a fraction ``d_b/d`` of the Gram products): no host sync.
    """
    lam = _ridge(gram, ridge)[..., :1]  # (n, 1, 1)
    eye = torch.eye(gram.shape[-1], dtype=gram.dtype, device=gram.device)
    out = old.clone()
    todo = torch.ones(gram.shape[0], dtype=torch.bool, device=gram.device)
    for boost in (1.0, 1e3, 1e6):
        chol, info = torch.linalg.cholesky_ex(gram + (boost * lam) * eye)
        ok = (info == 0) & todo
        safe = torch.where(ok[:, None, None], chol, eye)
        sol = torch.cholesky_solve(rhs + (boost * lam) * old, safe)
        ok = ok & torch.isfinite(sol).flatten(1).all(1)
        out = torch.where(ok[:, None, None], sol, out)
        todo = todo & ~ok
    return out


def update_a(w_bar: torch.Tensor, act_sq_norm: torch.Tensor, a: torch.Tensor, core: torch.Tensor,
             b: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """Weighted least-squares ``A_i = (Σ_j W_bar_ij D_j C_ijᵀ)(Σ_j C_ij D_j C_ijᵀ)⁻¹``, ``C = S B``."""
    p, d_b, _ = a.shape
    c = block_diag_right(core, b).reshape(p, d_b, -1)
    weighted = c * act_sq_norm
    gram = weighted @ c.transpose(1, 2)  # (P, d, d)
    cross = (w_bar.reshape(p, d_b, -1) * act_sq_norm) @ c.transpose(1, 2)  # W_bar_i D C_iᵀ
    # A_i gram = cross  ⇔  gram A_iᵀ = crossᵀ (gram symmetric)
    return prox_solve(gram, cross.transpose(1, 2), a.transpose(1, 2), ridge).transpose(1, 2)


def update_b(w_bar: torch.Tensor, a: torch.Tensor, core: torch.Tensor, b: torch.Tensor,
             ridge: float = 1e-6) -> torch.Tensor:
    """Least-squares ``B_j = (E_jᵀE_j)⁻¹ E_jᵀ W_bar_j`` with ``E = A S``.

    The activation weights drop out: each column ``p`` of ``B_j`` only moves column ``p``
    of the residual, whose loss is that column's squared error times the scalar ``h_p``.
    """
    q, d_b, _ = b.shape
    d_out = w_bar.shape[0]
    e = block_diag_left(a, core).reshape(d_out, q, d_b).permute(1, 2, 0)  # (Q, d, d_out)
    gram = e @ e.transpose(1, 2)
    cross = e @ w_bar.reshape(d_out, q, d_b).permute(1, 0, 2)  # (Q, d, d)
    return prox_solve(gram, cross, b, ridge)


def _safe_inv(system: torch.Tensor) -> torch.Tensor:
    """Inverses of SPD blocks for the preconditioner; a block that cannot be inverted to finite
    values gets the identity (any SPD preconditioner keeps CG correct, only slower)."""
    inv, info = torch.linalg.inv_ex(system)
    ok = (info == 0) & torch.isfinite(inv).flatten(1).all(1)
    eye = torch.eye(system.shape[-1], dtype=system.dtype, device=system.device)
    return torch.where(ok[:, None, None], inv, eye)


def _tile_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-tile inner products of ``(P, d, Q, d)`` views: ``(P, Q)``."""
    return (x * y).sum((1, 3))


def refine_core_cg(w_bar: torch.Tensor, act_sq_norm: torch.Tensor, a: torch.Tensor, core: torch.Tensor,
                   mask: torch.Tensor, b: torch.Tensor, steps: int = 3, ridge: float = 1e-6) -> torch.Tensor:
    """A few preconditioned CG steps on the kept core values, every tile its own system.

    Tile ``(i, j)``'s Hessian on the support is ``(B_j D_j B_jᵀ) ⊗ (A_iᵀA_i)`` restricted to
    the mask; the preconditioner is the inverse of the unrestricted Kronecker product,
    compressed to the mask (symmetric positive definite). CG from the current values
    lowers each tile's loss monotonically. Returns the new core (zeros off the mask).
    """
    if steps <= 0:
        return core
    p, d_b, _ = a.shape
    q = b.shape[0]
    shape4 = (p, d_b, q, d_b)
    a_gram = a.transpose(1, 2) @ a
    b_gram = (b * act_sq_norm.reshape(q, 1, d_b)) @ b.transpose(1, 2)
    eye = torch.eye(d_b, dtype=a.dtype, device=a.device)
    a_inv = _safe_inv(a_gram + _ridge(a_gram, max(ridge, 1e-6))[..., :1] * eye)
    b_inv = _safe_inv(b_gram + _ridge(b_gram, max(ridge, 1e-6))[..., :1] * eye)
    maskf = mask.to(core.dtype).view(shape4)

    def sandwich(left: torch.Tensor, x: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
        return block_diag_right(block_diag_left(left, x.reshape(core.shape)), right).view(shape4) * maskf

    residual = w_bar - block_diag_right(block_diag_left(a, core), b)
    r = sandwich(a.transpose(1, 2), residual * act_sq_norm, b.transpose(1, 2))
    x = torch.zeros(shape4, dtype=core.dtype, device=core.device)
    z = sandwich(a_inv, r, b_inv)
    direction = z
    rz = _tile_dot(r, z)
    for _ in range(steps):
        h_dir = sandwich(a_gram, direction, b_gram)
        curv = _tile_dot(direction, h_dir)
        ok = curv > 0
        alpha = torch.where(ok, rz / torch.where(ok, curv, torch.ones_like(curv)), torch.zeros_like(curv))
        alpha4 = alpha[:, None, :, None]
        x = x + alpha4 * direction  # out of place: also runs under torch.vmap
        r = r - alpha4 * h_dir
        z = sandwich(a_inv, r, b_inv)
        rz_new = _tile_dot(r, z)
        ok = rz > 0
        beta = torch.where(ok, rz_new / torch.where(ok, rz, torch.ones_like(rz)), torch.zeros_like(rz))
        direction = z + beta[:, None, :, None] * direction
        rz = rz_new
    return core + x.reshape(core.shape)
