"""Baseline pruners: magnitude, Wanda and SparseGPT, as pure tensor functions.

Every function takes a linear weight ``W`` of shape ``(d_out, d_in)`` (plus calibration
statistics) and a sparsity pattern (``"N:M"`` or ``"unstructured:F"``, see
:func:`torch_armor.core.pattern.parse_pattern`) and returns ``(mask, pruned_weight)``:

* ``mask`` -- ``torch.bool`` of shape ``(d_out, d_in)``, ``True`` where a weight is **kept**;
* ``pruned_weight`` -- same shape and dtype as ``weight``, zero wherever ``mask`` is ``False``.

No modules, no hooks: the statistics (``act_sq_norm = Σ_tokens x_j²`` for Wanda, the full
``XᵀX`` for SparseGPT) are collected elsewhere and passed in.

Counting rule for unstructured patterns (shared with :mod:`torch_armor.core.proxy`): out of ``k``
candidate weights, ``round((1 − F) · k)`` are kept. Magnitude and Wanda apply it to each
output row (``k = d_in``); SparseGPT applies it to each lazy block of columns over all rows
at once (``k = d_out · block width``), as in the SparseGPT paper.
"""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch

from torch_armor.core.pattern import SparsityPattern, parse_pattern
from torch_armor.core.proxy import mask_from_scores
from torch_armor.errors import ArmorInputError

__all__ = ["magnitude_prune", "wanda_prune", "sparsegpt_prune"]

PatternLike = Union[str, SparsityPattern]


# --------------------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------------------


def _check_weight(weight: torch.Tensor, pat: SparsityPattern) -> None:
    if not isinstance(weight, torch.Tensor):
        raise ArmorInputError(f"weight must be a torch.Tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ArmorInputError(
            f"weight must be 2-D (d_out, d_in), got shape {tuple(weight.shape)}; "
            "pass a linear layer's weight (reshape conv kernels to 2-D first)"
        )
    if not weight.dtype.is_floating_point:
        raise ArmorInputError(
            f"weight dtype {weight.dtype} is not supported: pass a real floating-point weight "
            "(fp16/bf16/fp32/fp64); dequantize integer weights first"
        )
    if not torch.isfinite(weight).all():
        raise ArmorInputError("weight contains NaN or Inf; fix the checkpoint before pruning")
    d_in = weight.shape[1]
    if pat.structured and d_in % pat.m != 0:
        raise ArmorInputError(
            f"d_in={d_in} is not a multiple of M={pat.m} for pattern '{pat}': "
            "use a pattern whose M divides d_in, or skip this layer"
        )


def _check_act_sq_norm(act_sq_norm: torch.Tensor, d_in: int) -> None:
    if not isinstance(act_sq_norm, torch.Tensor):
        raise ArmorInputError(f"act_sq_norm must be a torch.Tensor, got {type(act_sq_norm).__name__}")
    if not act_sq_norm.dtype.is_floating_point:
        raise ArmorInputError(f"act_sq_norm dtype {act_sq_norm.dtype} must be floating point (fp32 recommended)")
    if act_sq_norm.shape != (d_in,):
        raise ArmorInputError(
            f"act_sq_norm has shape {tuple(act_sq_norm.shape)} but the weight has d_in={d_in}: "
            f"expected ({d_in},), the sum of squared inputs per input channel"
        )
    if not torch.isfinite(act_sq_norm).all():
        raise ArmorInputError(
            "act_sq_norm contains NaN or Inf: the calibration forward passes overflowed; "
            "accumulate the statistics in fp32 (or fp64)"
        )
    if (act_sq_norm < 0).any():
        raise ArmorInputError("act_sq_norm has negative entries: it must be a sum of squares (Σ x²)")
    if not (act_sq_norm > 0).any():
        raise ArmorInputError(
            "act_sq_norm is all zero: no calibration data reached this layer; "
            "run calibration forward passes before pruning"
        )


def _score_dtype(dtype: torch.dtype) -> torch.dtype:
    """Rank scores in at least fp32 (half precision creates spurious ties)."""
    return torch.promote_types(dtype, torch.float32)


def _n_keep(sparsity: float, count: int) -> int:
    """How many of ``count`` candidates an unstructured pattern with pruned fraction ``sparsity`` keeps."""
    return int(round((1.0 - sparsity) * count))


def _mask_from_scores(scores: torch.Tensor, pat: SparsityPattern) -> torch.Tensor:
    """Keep the highest scores: top-N per group of M columns, or top fraction per row."""
    return mask_from_scores(scores, pat)


# --------------------------------------------------------------------------------------
# magnitude and Wanda
# --------------------------------------------------------------------------------------


def magnitude_prune(weight: torch.Tensor, pattern: PatternLike = "2:4") -> Tuple[torch.Tensor, torch.Tensor]:
    """Magnitude pruning: keep the largest ``|W_ij|``.

    ``N:M``: in every group of ``M`` consecutive input columns of each row, keep the ``N``
    largest magnitudes. ``unstructured:F``: keep the ``round((1 − F)·d_in)`` largest of each
    output row.

    Args:
        weight: ``(d_out, d_in)`` floating-point weight.
        pattern: ``"N:M"`` or ``"unstructured:F"`` (or a :class:`SparsityPattern`).

    Returns:
        ``(mask, pruned_weight)``: boolean keep-mask and ``weight * mask`` in ``weight``'s dtype.

    Example::

        >>> w = torch.tensor([[0.1, -3.0, 2.0, 0.5]])
        >>> mask, pruned = magnitude_prune(w, "2:4")
        >>> mask.tolist()
        [[False, True, True, False]]
        >>> pruned.tolist()
        [[0.0, -3.0, 2.0, 0.0]]
    """
    pat = parse_pattern(pattern)
    _check_weight(weight, pat)
    scores = weight.to(_score_dtype(weight.dtype)).abs()
    mask = _mask_from_scores(scores, pat)
    return mask, weight * mask


def wanda_prune(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    pattern: PatternLike = "2:4",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Wanda pruning (Sun et al. 2023): keep the largest ``|W_ij| · ‖x_j‖₂``.

    The score of weight ``(i, j)`` is ``|W_ij| · sqrt(act_sq_norm_j)`` with
    ``act_sq_norm_j = Σ_tokens x_j²``. ``N:M``: top ``N`` per group of ``M`` consecutive
    input columns of each row. ``unstructured:F``: top ``round((1 − F)·d_in)`` per output row
    (Wanda's per-output comparison group).

    Args:
        weight: ``(d_out, d_in)`` floating-point weight.
        act_sq_norm: ``(d_in,)`` non-negative sum of squared inputs per input channel.
        pattern: ``"N:M"`` or ``"unstructured:F"``.

    Returns:
        ``(mask, pruned_weight)`` as in :func:`magnitude_prune`.

    Example::

        >>> w = torch.tensor([[1.0, 1.0, 2.0, 0.5]])
        >>> h = torch.tensor([100.0, 1.0, 1.0, 1.0])
        >>> mask, _ = wanda_prune(w, h, "2:4")
        >>> mask.tolist()
        [[True, False, True, False]]
    """
    pat = parse_pattern(pattern)
    _check_weight(weight, pat)
    _check_act_sq_norm(act_sq_norm, weight.shape[1])
    dt = _score_dtype(weight.dtype)
    scores = weight.to(dt).abs() * act_sq_norm.to(device=weight.device, dtype=dt).sqrt()
    mask = _mask_from_scores(scores, pat)
    return mask, weight * mask


# --------------------------------------------------------------------------------------
# SparseGPT
# --------------------------------------------------------------------------------------


def _check_sparsegpt_args(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    pat: SparsityPattern,
    block_size: int,
    damp: float,
    mask: Optional[torch.Tensor],
    compute_dtype: torch.dtype,
) -> None:
    _check_weight(weight, pat)
    d_out, d_in = weight.shape
    if not isinstance(xtx, torch.Tensor):
        raise ArmorInputError(f"xtx must be a torch.Tensor, got {type(xtx).__name__}")
    if not xtx.dtype.is_floating_point:
        raise ArmorInputError(f"xtx dtype {xtx.dtype} must be floating point; accumulate XᵀX in fp32 or fp64")
    if xtx.shape != (d_in, d_in):
        raise ArmorInputError(
            f"xtx has shape {tuple(xtx.shape)} but the weight has d_in={d_in}: expected "
            f"({d_in}, {d_in}), the Gram matrix XᵀX of this layer's inputs"
        )
    if not torch.isfinite(xtx).all():
        raise ArmorInputError(
            "xtx contains NaN or Inf: the calibration statistics overflowed; "
            "accumulate XᵀX in fp32 or fp64 (and divide by the token count if needed)"
        )
    if (torch.diagonal(xtx) < 0).any():
        raise ArmorInputError("xtx has negative diagonal entries: it must be a Gram matrix XᵀX (positive semi-definite)")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ArmorInputError(f"block_size must be a positive integer (SparseGPT uses 128), got {block_size!r}")
    if pat.structured and block_size % pat.m != 0:
        raise ArmorInputError(
            f"block_size={block_size} is not a multiple of M={pat.m} for pattern '{pat}': an N:M "
            f"group must not straddle two lazy blocks; use a multiple of {pat.m} such as 128"
        )
    if isinstance(damp, bool) or not isinstance(damp, (int, float)) or not (damp >= 0) or damp == float("inf"):
        raise ArmorInputError(f"damp must be a finite non-negative number (fraction of mean(diag(H)), e.g. 0.01), got {damp!r}")
    if compute_dtype not in (torch.float32, torch.float64):
        raise ArmorInputError(f"compute_dtype must be torch.float32 or torch.float64, got {compute_dtype}")
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise ArmorInputError("mask must be a torch.bool tensor (True = keep); convert with mask.bool()")
        if mask.shape != weight.shape:
            raise ArmorInputError(f"mask has shape {tuple(mask.shape)} but the weight has shape {tuple(weight.shape)}")


def _inverse_hessian_cholesky(hessian: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor ``U`` of ``H⁻¹`` (``H⁻¹ = Uᵀ U``).

    Row ``q`` of ``U`` is row ``q`` of ``(H[q:, q:])⁻¹`` divided by the square root of its
    diagonal entry: all the OBS sweep needs, already downdated for columns ``< q``.
    """
    lower, info = torch.linalg.cholesky_ex(hessian)
    if int(info) != 0:
        raise ArmorInputError(
            "the dampened Hessian XᵀX + damp·mean(diag)·I is not positive definite (Cholesky failed): "
            "raise damp (e.g. 0.01 → 0.1), use more calibration tokens, or accumulate xtx in fp64"
        )
    hinv = torch.cholesky_inverse(lower)
    upper, info = torch.linalg.cholesky_ex(hinv, upper=True)
    if int(info) != 0:
        raise ArmorInputError(
            "the inverse Hessian is numerically not positive definite: raise damp or pass compute_dtype=torch.float64"
        )
    return upper


def sparsegpt_prune(
    weight: torch.Tensor,
    xtx: torch.Tensor,
    pattern: PatternLike = "2:4",
    block_size: int = 128,
    damp: float = 0.01,
    *,
    mask: Optional[torch.Tensor] = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """SparseGPT (Frantar & Alistarh 2023): OBS pruning with weight reconstruction.

    Minimizes ``‖(W − Ŵ) Xᵀ‖²`` row by row, sweeping input columns left to right: each column
    is pruned by the mask, and the error it leaves is compensated on the columns to its right
    with the Optimal Brain Surgeon update, using the inverse Hessian of the columns not yet
    processed (read off the upper Cholesky factor of ``H⁻¹``). Updates to columns beyond the
    current lazy block of ``block_size`` columns are batched into one matrix product per block.

    Steps: ``H = xtx`` in ``compute_dtype``; dead inputs (``H_jj == 0``, never active during
    calibration) get ``H_jj = 1`` (rest of row/column 0) and ``W[:, j] = 0``, so they come
    out pruned or zero; then ``damp · mean(diag(H))`` is added to the diagonal (mean taken after
    the dead-input fix); ``U = cholesky(H⁻¹, upper=True)``; column sweep.

    Mask selection, with score ``w_ij² / U_jj²`` (``w`` the current, already-compensated
    weights; ``U_jj² = [(H[j:, j:])⁻¹]_00``, the OBS saliency denominator):

    * ``N:M`` -- when the sweep reaches the first column of a group of ``M`` columns, each row
      keeps its ``N`` highest-scoring of those ``M``.
    * ``unstructured:F`` -- when the sweep reaches the first column of a lazy block, the
      scores of the whole block (all rows × the block's columns) are ranked together and the
      ``round((1 − F)·k)`` highest are kept (``k`` entries in the block), as in the reference
      SparseGPT. Per-row counts therefore vary; the fraction per block is exact up to rounding,
      so the result depends on ``block_size``.
    * ``mask`` given -- it is used as is (not checked against ``pattern``): SparseGPT's weight
      reconstruction on a mask chosen by another method.

    Args:
        weight: ``(d_out, d_in)`` floating-point weight.
        xtx: ``(d_in, d_in)`` Gram matrix ``Σ_tokens x xᵀ`` of the layer inputs (accumulate in
            fp32/fp64; a constant scale, e.g. dividing by the token count, does not matter).
        pattern: ``"N:M"`` or ``"unstructured:F"``.
        block_size: lazy-batch width (a multiple of ``M`` for ``N:M`` patterns).
        damp: dampening as a fraction of ``mean(diag(H))``.
        mask: optional fixed boolean keep-mask ``(d_out, d_in)``.
        compute_dtype: ``torch.float32`` (default) or ``torch.float64``.

    Returns:
        ``(mask, pruned_weight)``: the keep-mask and the compensated weight (zeros where
        ``mask`` is ``False``), in ``weight``'s dtype and device.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> x = torch.randn(256, 16)
        >>> w = torch.randn(4, 16)
        >>> mask, w_hat = sparsegpt_prune(w, x.T @ x, "2:4", block_size=8)
        >>> int(mask.sum()), bool((w_hat[~mask] == 0).all())
        (32, True)
        >>> _, w_mag = magnitude_prune(w, "2:4")
        >>> bool(((w - w_hat) @ x.T).norm() < ((w - w_mag) @ x.T).norm())
        True
    """
    pat = parse_pattern(pattern)
    _check_sparsegpt_args(weight, xtx, pat, block_size, damp, mask, compute_dtype)
    d_out, d_in = weight.shape
    device = weight.device

    w = weight.detach().to(dtype=compute_dtype).clone()
    hessian = xtx.detach().to(device=device, dtype=compute_dtype).clone()
    diag_idx = torch.arange(d_in, device=device)
    dead = torch.diagonal(hessian) == 0
    # A dead input never fired: its row/column of XᵀX is zero (zeroed here in case it is not).
    hessian[dead, :] = 0.0
    hessian[:, dead] = 0.0
    hessian[diag_idx[dead], diag_idx[dead]] = 1.0
    w[:, dead] = 0.0
    hessian[diag_idx, diag_idx] += damp * torch.diagonal(hessian).mean()
    upper = _inverse_hessian_cholesky(hessian)

    keep = torch.ones(d_out, d_in, dtype=torch.bool, device=device) if mask is None else mask.to(device).clone()
    out = torch.zeros_like(w)

    for start in range(0, d_in, block_size):
        end = min(start + block_size, d_in)
        width = end - start
        w_blk = w[:, start:end].clone()
        u_blk = upper[start:end, start:end]
        u_diag = torch.diagonal(u_blk)
        err_blk = torch.zeros_like(w_blk)

        if mask is None and not pat.structured:
            scores = (w_blk.square() / u_diag.square()).flatten()
            n_keep = _n_keep(pat.sparsity, scores.numel())
            blk_keep = torch.zeros(scores.numel(), dtype=torch.bool, device=device)
            blk_keep[scores.topk(n_keep).indices] = True
            keep[:, start:end] = blk_keep.reshape(d_out, width)

        for i in range(width):
            if mask is None and pat.structured and i % pat.m == 0:
                grp = slice(i, i + pat.m)
                scores = w_blk[:, grp].square() / u_diag[grp].square()
                idx = scores.topk(pat.n, dim=1).indices
                keep[:, start + i : start + i + pat.m] = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
            col = w_blk[:, i]
            kept_col = torch.where(keep[:, start + i], col, torch.zeros_like(col))
            out[:, start + i] = kept_col
            err = (col - kept_col) / u_blk[i, i]
            # OBS update of the rest of this block (column i itself becomes kept_col).
            w_blk[:, i:] -= err[:, None] * u_blk[i, i:][None, :]
            err_blk[:, i] = err

        # Lazy batch update of every column to the right of this block.
        if end < d_in:
            w[:, end:] -= err_blk @ upper[start:end, end:]

    out = torch.where(keep, out, torch.zeros_like(out))
    return keep, out.to(dtype=weight.dtype)
