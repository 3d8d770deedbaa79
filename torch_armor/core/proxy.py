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

from torch_armor.config import SparsityPattern, parse_pattern

__all__ = [
    "validate_layer",
    "check_layer_shape",
    "normalize_weight",
    "nowag_scores",
    "nm_mask_from_scores",
    "unstructured_mask_from_scores",
    "mask_from_scores",
    "nowag_prune",
    "proxy_loss",
    "relative_proxy_loss",
    "valid_block_sizes",
    "auto_block_size",
]


def _where(name: Optional[str]) -> str:
    return f"layer {name!r}: " if name else ""


def valid_block_sizes(d_out: int, d_in: int, m: int = 1) -> list:
    """Block sizes that divide both dimensions and are multiples of ``m``."""
    g = math.gcd(d_out, d_in)
    return [b for b in range(1, g + 1) if g % b == 0 and b % m == 0]


def auto_block_size(d_out: int, d_in: int, max_overhead: float = 0.05, multiple_of: int = 4) -> int:
    """Largest ARMOR block size for a ``(d_out, d_in)`` layer within a wrapper-overhead budget.

    Picks the largest ``d_b`` that divides both ``d_out`` and ``d_in``, is a multiple of
    ``multiple_of`` (the ``M`` of an ``N:M`` pattern, so groups do not straddle tiles), and
    keeps the wrappers' extra parameters ``d_b·(d_in + d_out)`` within ``max_overhead`` of
    the layer's ``d_in·d_out``.

    Raises:
        ValueError: bad arguments, or no block size fits (then the message gives the smallest
            valid one and the overhead it would cost).

    Example::

        >>> auto_block_size(4096, 4096, 0.05, 4)     # 64 · 8192 / 4096² = 3.1 %
        64
        >>> auto_block_size(576, 1536, 0.05, 4)      # SmolLM2 down_proj: 16 · 2112 / 884736 = 3.8 %
        16
    """
    for label, value in (("d_out", d_out), ("d_in", d_in), ("multiple_of", multiple_of)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive integer, got {value!r}")
    if isinstance(max_overhead, bool) or not isinstance(max_overhead, (int, float)) or not max_overhead > 0:
        raise ValueError(f"max_overhead must be a positive fraction (0.05 = 5%), got {max_overhead!r}")
    g = math.gcd(d_out, d_in)
    divisors = sorted({d for i in range(1, math.isqrt(g) + 1) if g % i == 0 for d in (i, g // i)})
    valid = [b for b in divisors if b % multiple_of == 0]
    fitting = [b for b in valid if b * (d_in + d_out) / (d_in * d_out) <= max_overhead]
    if not fitting:
        if not valid:
            raise ValueError(
                f"no block size divides both dimensions of a ({d_out}, {d_in}) layer and is a multiple "
                f"of {multiple_of}; skip this layer or use another pattern"
            )
        smallest = valid[0]
        cost = smallest * (d_in + d_out) / (d_in * d_out)
        raise ValueError(
            f"no block size fits a ({d_out}, {d_in}) layer within {max_overhead:.1%} wrapper overhead: "
            f"the smallest valid one, {smallest}, costs {cost:.1%}; raise max_overhead (--max-overhead) or give an integer block size"
        )
    return fitting[-1]


def check_layer_shape(
    d_out: int,
    d_in: int,
    pattern: Union[str, SparsityPattern] = "2:4",
    block_size: Optional[int] = None,
    name: Optional[str] = None,
) -> None:
    """Check that ``pattern`` and ``block_size`` can serve a ``(d_out, d_in)`` weight."""
    where = _where(name)
    pat = parse_pattern(pattern)
    if pat.structured and d_in % pat.m != 0:
        raise ValueError(
            f"{where}d_in={d_in} is not a multiple of M={pat.m} for pattern '{pat}': "
            "use a pattern whose M divides d_in, or skip this layer"
        )
    if block_size is not None and (d_out % block_size or d_in % block_size):
        options = valid_block_sizes(d_out, d_in, pat.m if pat.structured else 1)
        raise ValueError(
            f"{where}block_size={block_size} does not divide the weight shape ({d_out}, {d_in}); "
            f"block sizes that fit this layer: {options}"
        )


def validate_layer(
    weight: torch.Tensor,
    act_sq_norm: torch.Tensor,
    pattern: Union[str, SparsityPattern] = "2:4",
    block_size: Optional[int] = None,
    name: Optional[str] = None,
) -> SparsityPattern:
    """Check one layer's inputs; raise ``ValueError`` saying what is wrong and what to do.

    Handled without error (documented): input channels with ``act_sq_norm == 0`` (never
    active in calibration) carry no loss, so NoWag-P prunes them first; all-zero columns or
    rows of ``W`` are normalized with a norm of 1 (they stay zero).
    """
    where = _where(name)
    pat = parse_pattern(pattern)
    if not isinstance(weight, torch.Tensor) or not isinstance(act_sq_norm, torch.Tensor):
        raise ValueError(f"{where}weight and act_sq_norm must be torch.Tensors")
    for label, t in (("weight", weight), ("act_sq_norm", act_sq_norm)):
        if t.is_meta:
            raise ValueError(f"{where}{label} is on the meta device (no values): load or materialize the "
                             "weights (e.g. LazyCheckpoint, or model.to_empty + load_state_dict) before pruning")
        if hasattr(type(t), "__tensor_flatten__"):  # a wrapper subclass: ArmorTensor, torchao tensors
            raise ValueError(f"{where}{label} is of type {type(t).__name__}, not a plain tensor: the layer is already "
                             "converted (pruned); prune the original dense weight, or skip this layer")
        if t.is_sparse or t.is_complex():
            raise ValueError(f"{where}{label} must be a dense real tensor, got layout {t.layout} dtype {t.dtype}")
    if weight.dim() != 2:
        raise ValueError(
            f"{where}weight must be 2-D (d_out, d_in), got shape {tuple(weight.shape)}; "
            "ARMOR factorizes linear layer weights only"
        )
    if not weight.dtype.is_floating_point:
        raise ValueError(
            f"{where}weight dtype {weight.dtype} is not supported: pass a real floating-point "
            "weight (fp32/fp16/bf16/fp64); dequantize integer weights first"
        )
    if not act_sq_norm.dtype.is_floating_point:
        raise ValueError(f"{where}act_sq_norm dtype {act_sq_norm.dtype} must be floating point")
    d_out, d_in = weight.shape
    if weight.numel() == 0:
        raise ValueError(f"{where}weight is empty (shape {tuple(weight.shape)}): nothing to prune; skip this layer")
    if act_sq_norm.shape != (d_in,):
        raise ValueError(
            f"{where}act_sq_norm has shape {tuple(act_sq_norm.shape)} but the weight has "
            f"d_in={d_in}: expected ({d_in},), the sum of squared inputs per input channel"
        )
    if not torch.isfinite(weight).all():
        raise ValueError(f"{where}weight contains NaN or Inf; fix the checkpoint before pruning")
    if not torch.isfinite(act_sq_norm).all():
        raise ValueError(
            f"{where}act_sq_norm contains NaN or Inf: the calibration forward passes overflowed; "
            "calibrate in fp32 or with fewer tokens"
        )
    if (act_sq_norm < 0).any():
        raise ValueError(f"{where}act_sq_norm has negative entries: it must be a sum of squares (Σ x²)")
    if not (act_sq_norm > 0).any():
        raise ValueError(
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
        raise ValueError(f"approx shape {tuple(approx.shape)} differs from weight shape {tuple(weight.shape)}")
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
