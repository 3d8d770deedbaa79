"""The math every pruner here shares: NoWag normalization, the proxy loss, NoWag-P masks.

Notation: ``W`` is ``(d_out, d_in)``; ``act_sq_norm`` ``h`` is ``Σ_tokens x_j²`` per input
channel. ``c_j`` is the L2 norm of column ``j`` of ``W``; ``r_i`` the L2 norm of row ``i`` of
``W diag(1/c)``; ``W_bar = diag(1/r) W diag(1/c)``. The proxy loss of an approximation
``W_hat`` is ``Σ_ij ((W − W_hat)_ij / (r_i c_j))² h_j``.
"""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from torch_armor.core.pattern import SparsityPattern, check_layer_shape, layer_prefix, parse_pattern
from torch_armor.errors import ArmorInputError

__all__ = [
    "validate_layer",
    "normalize_weight",
    "nowag_scores",
    "nm_mask_from_scores",
    "unstructured_mask_from_scores",
    "mask_from_scores",
    "nowag_prune",
    "proxy_loss",
    "relative_proxy_loss",
]


def validate_layer(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    pattern: Union[str, SparsityPattern] = "2:4",
    block_size: Optional[int] = None,
    name: Optional[str] = None,
) -> SparsityPattern:
    """Check one layer's inputs; raise :class:`~torch_armor.errors.ArmorInputError` saying what is wrong and what to do.

    Handled without error (documented): input channels with ``act_sq_norm == 0`` (never
    active in calibration) carry no loss, so NoWag-P prunes them first; all-zero columns or
    rows of ``W`` are normalized with a norm of 1 (they stay zero).
    """
    where = layer_prefix(name)
    pat = parse_pattern(pattern)
    if not isinstance(weight, torch.Tensor) or not isinstance(act_sq_norm, torch.Tensor):
        raise ArmorInputError(f"{where}weight and act_sq_norm must be torch.Tensors")
    for label, t in (("weight", weight), ("act_sq_norm", act_sq_norm)):
        if t.is_meta:
            raise ArmorInputError(f"{where}{label} is on the meta device (no values): load or materialize the "
                             "weights (e.g. LazyCheckpoint, or model.to_empty + load_state_dict) before pruning")
        if hasattr(type(t), "__tensor_flatten__"):  # a wrapper subclass: ArmorTensor, torchao tensors
            raise ArmorInputError(f"{where}{label} is of type {type(t).__name__}, not a plain tensor: the layer is already "
                             "converted (pruned); prune the original dense weight, or skip this layer")
        if t.is_sparse or t.is_complex():
            raise ArmorInputError(f"{where}{label} must be a dense real tensor, got layout {t.layout} dtype {t.dtype}")
    if weight.dim() != 2:
        raise ArmorInputError(
            f"{where}weight must be 2-D (d_out, d_in), got shape {tuple(weight.shape)}; "
            "ARMOR factorizes linear layer weights only"
        )
    if not weight.dtype.is_floating_point:
        raise ArmorInputError(
            f"{where}weight dtype {weight.dtype} is not supported: pass a real floating-point "
            "weight (fp32/fp16/bf16/fp64); dequantize integer weights first"
        )
    if not act_sq_norm.dtype.is_floating_point:
        raise ArmorInputError(f"{where}act_sq_norm dtype {act_sq_norm.dtype} must be floating point")
    d_out, d_in = weight.shape
    if weight.numel() == 0:
        raise ArmorInputError(f"{where}weight is empty (shape {tuple(weight.shape)}): nothing to prune; skip this layer")
    if act_sq_norm.shape != (d_in,):
        raise ArmorInputError(
            f"{where}act_sq_norm has shape {tuple(act_sq_norm.shape)} but the weight has "
            f"d_in={d_in}: expected ({d_in},), the sum of squared inputs per input channel"
        )
    if not torch.isfinite(weight).all():
        raise ArmorInputError(f"{where}weight contains NaN or Inf; fix the checkpoint before pruning")
    if not torch.isfinite(act_sq_norm).all():
        raise ArmorInputError(
            f"{where}act_sq_norm contains NaN or Inf: the calibration forward passes overflowed; "
            "calibrate in fp32 or with fewer tokens"
        )
    if (act_sq_norm < 0).any():
        raise ArmorInputError(f"{where}act_sq_norm has negative entries: it must be a sum of squares (Σ x²)")
    if not (act_sq_norm > 0).any():
        raise ArmorInputError(
            f"{where}act_sq_norm is all zero: no calibration data reached this layer; "
            "run calibration forward passes before pruning"
        )
    check_layer_shape(d_out, d_in, pat, block_size, name)
    return pat


def normalize_weight(weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NoWag normalization: return ``(W_bar, r, c)`` with ``W = diag(r) · W_bar · diag(c)``."""
    col_norm = weight.norm(dim=0)
    col_norm = torch.where(col_norm > 0, col_norm, torch.ones_like(col_norm))
    scaled = weight / col_norm
    row_norm = scaled.norm(dim=1)
    row_norm = torch.where(row_norm > 0, row_norm, torch.ones_like(row_norm))
    return scaled / row_norm[:, None], row_norm, col_norm


def nowag_scores(w_bar: torch.Tensor, act_sq_norm: torch.Tensor) -> torch.Tensor:
    """NoWag-P importance ``W_bar_ij² · h_j``."""
    return w_bar.square() * act_sq_norm


def nm_mask_from_scores(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Keep the ``n`` highest scores in every group of ``m`` consecutive columns of each row."""
    d_out, d_in = scores.shape
    groups = scores.reshape(d_out, d_in // m, m)
    keep = groups.topk(n, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, keep, True)
    return mask.reshape(d_out, d_in)


def unstructured_mask_from_scores(scores: torch.Tensor, sparsity: float) -> torch.Tensor:
    """Keep the ``round((1 − sparsity)·d_in)`` highest scores of each row."""
    d_in = scores.shape[1]
    n_keep = int(round((1.0 - sparsity) * d_in))
    keep = scores.topk(n_keep, dim=1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, keep, True)


def mask_from_scores(scores: torch.Tensor, pattern: Union[str, SparsityPattern]) -> torch.Tensor:
    """The mask that keeps the highest ``scores`` under ``pattern``."""
    pat = parse_pattern(pattern)
    if pat.structured:
        return nm_mask_from_scores(scores, pat.n, pat.m)
    return unstructured_mask_from_scores(scores, pat.sparsity)


def nowag_prune(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    pattern: Union[str, SparsityPattern] = "2:4",
) -> Tuple[torch.Tensor, torch.Tensor]:
    """NoWag-P pruning: ``(mask, pruned_weight)`` keeping the top ``W_bar² · h`` per group.

    Unstructured patterns keep the top fraction of each output row.

    Example::

        >>> w, h = torch.randn(8, 16), torch.rand(16) + 0.1
        >>> mask, pruned = nowag_prune(w, h, "2:4")
        >>> int(mask.sum())
        64
    """
    validate_layer(weight, act_sq_norm, pattern)
    work = weight.to(torch.promote_types(weight.dtype, torch.float32))
    w_bar, _, _ = normalize_weight(work)
    mask = mask_from_scores(nowag_scores(w_bar, act_sq_norm.to(work.dtype)), pattern)
    return mask, weight * mask


#: float64 elements :func:`proxy_loss` works on at a time
LOSS_CHUNK = 1 << 22


def proxy_loss(weight: torch.Tensor, approx: torch.Tensor, act_sq_norm: torch.Tensor) -> torch.Tensor:
    """NoWag proxy loss ``Σ ((W − W_hat)_ij / (r_i c_j))² h_j`` (float64 scalar).

    ``r``, ``c`` come from ``weight``'s normalization, so this equals the loss in the
    normalized space ``Σ (W_bar − W_hat_bar)² h``.

    Example::

        >>> w, h = torch.randn(8, 16), torch.rand(16)
        >>> float(proxy_loss(w, w, h))
        0.0
    """
    if approx.shape != weight.shape:
        raise ArmorInputError(f"approx shape {tuple(approx.shape)} differs from weight shape {tuple(weight.shape)}")
    # float64 for the sum, a block of rows at a time: never a full-size float64 copy of the layer
    rows = max(1, LOSS_CHUNK // max(weight.shape[1], 1))
    col_sq = torch.zeros(weight.shape[1], dtype=torch.float64, device=weight.device)
    for w in weight.split(rows):
        col_sq += w.double().square().sum(0)
    col_norm = col_sq.sqrt()
    col_norm = torch.where(col_norm > 0, col_norm, torch.ones_like(col_norm))
    h = act_sq_norm.double()
    total = torch.zeros((), dtype=torch.float64, device=weight.device)
    for w, ap in zip(weight.split(rows), approx.split(rows)):
        w = w.double()
        row_norm = (w / col_norm).square_().sum(1).sqrt_()
        row_norm = torch.where(row_norm > 0, row_norm, torch.ones_like(row_norm))
        diff = (w - ap.double()).div_(row_norm[:, None]).div_(col_norm)
        total += (diff.square_() * h).sum()
    return total


def relative_proxy_loss(
    weight: torch.Tensor,
    approx: torch.Tensor,
    act_sq_norm: torch.Tensor,
    pattern: Union[str, SparsityPattern] = "2:4",
) -> float:
    """``proxy_loss(approx) / proxy_loss(NoWag-P)``: below 1 means better than NoWag-P.

    Returns 0.0 when NoWag-P is already exact (the weight already satisfies the pattern) and
    ``approx`` is exact too.
    """
    _, pruned = nowag_prune(weight, act_sq_norm, pattern)
    base = float(proxy_loss(weight, pruned, act_sq_norm))
    loss = float(proxy_loss(weight, approx, act_sq_norm))
    if base == 0.0:
        return 0.0 if loss == 0.0 else math.inf
    return loss / base
