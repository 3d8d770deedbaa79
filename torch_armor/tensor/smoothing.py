"""Move the 2:4 core's input outliers into ``B`` before 8-bit quantization, keeping the core 2:4.

An 8-bit ARMOR linear quantizes each token of the B-pass output ``z = B·x`` with one scale: a few
channels of ``z`` with large magnitudes (the outlier channels of LLM activations) set that scale and
leave the other channels a few levels each. A positive scale per core input channel ``s`` changes
nothing in exact arithmetic — ``A · (core · diag(s)) · (diag(s)⁻¹ · B)`` is the same weight — but
divides channel ``j`` of ``z`` by ``s_j`` and multiplies column ``j`` of the core by it.

* ``diag(s)⁻¹ · B`` scales rows of ``B``: still block-diagonal;
* ``core · diag(s)`` scales columns of the core: the same zeros, so still 2:4.

With ``s_j = max|z_j|^α / max_i |core_ij|^(1-α)`` (the SmoothQuant rule, applied to the operand of the
2:4 GEMM instead of a dense weight's input) the activations and the core share the range; the larger
``α``, the more of it moves into the core (``α = 0``: nothing moves, smoothing is off).

:func:`core_input_amax` runs calibration batches and records ``max|z_j|`` per ARMOR layer;
:func:`smooth_core_inputs` folds the scales in (call it before ``quantize_(model, ArmorCoreConfig(
Int8DynamicActivationInt8WeightConfig()))``; ``torch-armor quantize --format int8`` does both).

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import ArmorTensor
    >>> core = torch.tensor([[1.0, 0.0, -2.0, 0.0]] * 4)
    >>> w = ArmorTensor.from_factors(ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4"))
    >>> moved = fold_core_input_scale(w, torch.tensor([2.0, 1.0, 4.0, 1.0]))
    >>> moved.core_dense()[0].tolist(), torch.equal(moved.dense_weight(), w.dense_weight())
    ([2.0, 0.0, -8.0, 0.0], True)
"""

from __future__ import annotations

from typing import Dict, Iterable

import torch
from torch import nn

from torch_armor.errors import ArmorInputError
from torch_armor.kernels.block_diag import block_diag_rows_reference
from torch_armor.tensor.armor_tensor import ArmorTensor, from_parts
from torch_armor.tensor.eight_bit import EightBitArmorTensor

__all__ = ["DEFAULT_ALPHA", "core_input_amax", "smoothing_scale", "fold_core_input_scale", "smooth_core_inputs"]

#: alpha per 8-bit format, chosen on held-out calibration text for SmolLM2-135M (docs/gpu.md, "Int8 and fp8
#: 2:4 cores"): int8 0 / 0.35 / 0.5 / 0.65 / 0.8 gave 31.25 / 31.04 / 30.88 / 30.89 / 31.19 (bf16 30.71), fp8
#: 0 / 0.5 gave 31.20 / 31.27: e4m3's exponent already spans the outliers
DEFAULT_ALPHA = {"int8": 0.5, "fp8": 0.0}
_SCALE_RANGE = (1e-4, 1e4)  # no channel is scaled beyond this: a dead channel or column keeps its range


def _armor_linears(model: nn.Module) -> Dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)}


@torch.no_grad()
def core_input_amax(model: nn.Module, batches: Iterable[torch.Tensor]) -> Dict[str, torch.Tensor]:
    """``{module name: max |z_j| (d_in,) float32}``: the largest magnitude of each channel of every ARMOR
    layer's B-pass output ``z = B·x`` over the forward passes of ``model`` on ``batches`` (token ids)."""
    layers = _armor_linears(model)
    if not layers:
        raise ArmorInputError("the model has no ARMOR layers: core_input_amax needs a converted model")
    amax: Dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args):
            w = module.weight
            z = block_diag_rows_reference(args[0].reshape(-1, w.shape[1]), w.b_blocks.float(), None, 1, torch.float32)
            seen = z.abs().amax(dim=0)
            amax[name] = torch.maximum(amax[name], seen) if name in amax else seen
        return hook

    handles = [m.register_forward_pre_hook(record(name)) for name, m in layers.items()]
    try:
        for batch in batches:
            model(batch.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    missing = sorted(set(layers) - set(amax))
    if missing:
        raise ArmorInputError(f"{missing[0]} saw no calibration data ({len(missing)} ARMOR layers did not run): "
                              "give batches that run the whole model")
    return amax


def smoothing_scale(amax: torch.Tensor, weight: ArmorTensor, alpha: float) -> torch.Tensor:
    """``s (d_in,)`` with ``s_j = amax_j^α / max_i |core_ij|^(1-α)``, clamped to [1e-4, 1e4]; 1 where the
    channel never fired or the core's column is empty, and everywhere for ``α = 0`` (smoothing off)."""
    if not 0.0 <= alpha <= 1.0:
        raise ArmorInputError(f"alpha must be in [0, 1], got {alpha!r}")
    if alpha == 0:
        return torch.ones(weight.shape[1], dtype=torch.float32, device=weight.device)
    col_max = weight.core_dense().float().abs().amax(dim=0)
    amax = amax.float().to(col_max.device)
    live = (amax > 0) & (col_max > 0)
    scale = amax.clamp_min(1e-30).pow(alpha) / col_max.clamp_min(1e-30).pow(1.0 - alpha)
    return torch.where(live, scale.clamp(*_SCALE_RANGE), torch.ones_like(scale))


def fold_core_input_scale(weight: ArmorTensor, scale: torch.Tensor) -> ArmorTensor:
    """``weight`` with ``core · diag(scale)`` and ``diag(scale)⁻¹ · B``: the same linear map (up to rounding in
    ``weight.dtype``), the same 2:4 support, the same storage format and device."""
    if isinstance(weight, EightBitArmorTensor) or weight.storage_format == "quantized":
        raise ArmorInputError(f"{weight.layer_name or 'this layer'}: its core is already quantized "
                              f"({weight.storage_format}); smooth the floating-point model, then quantize it")
    d_in = weight.shape[1]
    if scale.shape != (d_in,) or not bool((scale > 0).all()) or not bool(scale.isfinite().all()):
        raise ArmorInputError(f"{weight.layer_name or 'this layer'}: the scale must be ({d_in},), positive and "
                              f"finite, got shape {tuple(scale.shape)}")
    scale = scale.float().to(weight.device)
    k, size, _ = weight.b_blocks.shape
    b_blocks = (weight.b_blocks.float() / scale.view(k, size, 1)).to(weight.b_blocks.dtype)
    core = (weight.core_dense().float() * scale[None, :]).to(weight.dtype)
    moved = from_parts("dense", weight.a_blocks, b_blocks, weight.pattern, weight.dtype, core=core)
    moved = moved.with_storage(weight.storage_format) if weight.storage_format != "dense" else moved
    moved.layer_name = weight.layer_name
    return moved


@torch.no_grad()
def smooth_core_inputs(model: nn.Module, batches: Iterable[torch.Tensor], alpha: float) -> Dict[str, torch.Tensor]:
    """Fold :func:`smoothing_scale` into every ARMOR layer of ``model`` (in place), from the B-pass outputs
    seen on ``batches``; returns ``{module name: scale}``. ``DEFAULT_ALPHA[format]`` is the measured choice
    for an 8-bit format; ``alpha=0`` changes nothing."""
    amax = core_input_amax(model, batches)
    scales = {}
    for name, module in _armor_linears(model).items():
        scales[name] = smoothing_scale(amax[name], module.weight, alpha)
        module.weight = nn.Parameter(fold_core_input_scale(module.weight, scales[name]), requires_grad=False)
    return scales
