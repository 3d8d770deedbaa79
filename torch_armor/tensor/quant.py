"""Stack torchao quantization configs on ARMOR weights: quantize the sparse core, keep ``A``, ``B`` as they are.

A converted linear computes ``y = A · core · B · x``. :class:`ArmorCoreConfig` wraps a torchao config
so that ``torchao.quantization.quantize_`` applies it to the **core** of every
:class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weight; ``A`` and ``B`` stay in the activation
dtype. Three configs are taken:

* ``Int8DynamicActivationInt8WeightConfig()`` and ``Float8DynamicActivationFloat8WeightConfig()``: an
  **8-bit 2:4 core** (:mod:`torch_armor.tensor.eight_bit`: int8 / fp8 e4m3 kept values, a scale per output
  channel, each token quantized on the fly), which on a GPU runs on cuSPARSELt's 8-bit 2:4 kernels
  (int8 sm80+, fp8 sm89+) — the two compressions add up;
* ``Int8WeightOnlyConfig()``: torchao's own ``Int8Tensor`` core (:class:`QuantizedArmorTensor`,
  ``storage_format == "quantized"``): int8 weights, a **dense** core (no 2:4 kernel), its matmul
  torchao's ``F.linear``.

Any other config is refused with one line naming these three. Plain ``quantize_(model,
Int8WeightOnlyConfig())`` on a converted model raises ``NotImplementedError`` telling you to wrap the
config in :class:`ArmorCoreConfig` (torchao's handler needs ops such as ``view`` that a factored weight
cannot offer). It may already have quantized dense linears it visited first; use
``ArmorCoreConfig(..., apply_to_dense=True)`` to quantize converted and dense linears in one call.

Measured error: relative Frobenius error of the logits of the int8-core model vs the fp32 converted
model (CPU, torch 2.13, torchao 0.18), on the tiny random Llama of the tests (hidden 64, 2 layers,
weights ~N(0, 0.3²), converted with ``block_size=16``; ``tests/tensor/test_quant.py``, ``-s`` prints
them): ``Int8WeightOnlyConfig()`` 3.5 % (torchao's own int8 on the dense model's decoder linears:
3.8 %), ``Int8DynamicActivationInt8WeightConfig()`` (the int8 2:4 core) 6.1 % (torchao on the dense
model: 6.0 %). The random model amplifies weight noise; on the real SmolLM2-135M see
``benchmarks/quantized_cores.py`` (docs/gpu.md).

Saving: :func:`torch_armor.format.serialization.save_pretrained` stores a quantized core's own
tensors (the int8 ``qdata`` packed N:M like a floating core, plus its scales) and the
inner config (``torchao.core.config.config_to_dict``); loading rebuilds the same torchao
tensor, so outputs are bit-identical.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torchao.quantization import quantize_, Int8WeightOnlyConfig
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import armor_linear_from_factors
    >>> model = nn.Sequential(nn.Linear(16, 8))
    >>> core = torch.tensor([[1.0, 0.0, -2.0, 0.0]] * 8).repeat(1, 4)
    >>> f = ArmorFactors(torch.eye(8)[None], core, torch.eye(8).repeat(2, 1, 1), core != 0, "2:4")
    >>> _ = armor_linear_from_factors(model[0], f)
    >>> x = torch.randn(3, 16)
    >>> ref = model(x)
    >>> quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False)))
    >>> w = model[0].weight
    >>> w.storage_format, type(w.core).__name__, w.a_blocks.dtype
    ('quantized', 'Int8Tensor', torch.float32)
    >>> bool((model(x) - ref).norm() < 1e-2 * ref.norm())
    True
"""

from __future__ import annotations

import dataclasses
import types
from functools import partial
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torchao.core.config import AOBaseConfig, config_from_dict, config_to_dict
from torchao.quantization import quantize_
from torchao.quantization.transform_module import register_quantize_module_handler
from torchao.utils import TorchAOBaseTensor

from torch_armor.core.pattern import SparsityPattern
from torch_armor.tensor.armor_tensor import QUANTIZED, ArmorTensor, PartSpecs, from_parts, register_format
from torch_armor.tensor.eight_bit import EightBitArmorTensor, quantize_core_8bit
from torch_armor.tensor.linear_layout import armor_linear_rows
from torch_armor.errors import ArmorInputError

__all__ = [
    "QuantizedArmorTensor",
    "ArmorCoreConfig",
    "quantize_armor_core",
    "dequantize_armor_core",
    "is_armor_linear",
    "quant_config_to_dict",
    "quant_config_from_dict",
    "quantized_core_template",
]


_CONFIG_KEY = "torchao_config"
#: torchao configs whose quantization keeps the core 2:4: the 8-bit cores of torch_armor.tensor.eight_bit
#: (per-output-channel weight scales, per-token dynamic activation scales)
EIGHT_BIT_CONFIGS = {"Int8DynamicActivationInt8WeightConfig": "int8", "Float8DynamicActivationFloat8WeightConfig": "fp8"}


@register_format
class QuantizedArmorTensor(ArmorTensor):
    """An ARMOR weight whose core is a torchao quantized tensor (``storage_format == "quantized"``).

    ``A`` and ``B`` stay floating (the activation dtype); ``quant_config`` is the torchao config that
    built the core (saved, to rebuild it on load). Moves keep the core's own integer data and scales
    (``.to(dtype)`` casts ``A`` and ``B`` only); re-storing it as another format raises.
    """

    storage_format = QUANTIZED
    tensor_data_names = ["a_blocks", "b_blocks", "core"]
    optional_tensor_attribute_names = ["quant_config"]

    def __new__(cls, a_blocks, b_blocks, core, pattern, dtype, quant_config=None, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, core, pattern, dtype, quant_config=None, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.core, self.quant_config = core, quant_config

    @classmethod
    def core_specs(cls, d_out: int, d_in: int, pattern: SparsityPattern, dtype: torch.dtype) -> PartSpecs:
        """No plain core tensors: the torchao core is stored as its own class's (:func:`quantized_core_template`)."""
        return {}

    def core_dense(self) -> torch.Tensor:
        dequantize = getattr(self.core, "dequantize", None)
        if dequantize is None:
            raise NotImplementedError(
                f"the quantized core is a {type(self.core).__name__} without dequantize(); "
                "it can run F.linear but cannot be materialized"
            )
        return dequantize().to(self.dtype)

    def stored_parameters(self) -> int:
        names, _ = self.core.__tensor_flatten__()  # torchao keeps the int8 data dense, plus its scales
        return self.a_blocks.numel() + self.b_blocks.numel() + sum(getattr(self.core, n).numel() for n in names)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        dtype = x.dtype
        # the core matmul goes through torchao's dispatch (int8 weight-only / dynamic activation ...)
        y = armor_linear_rows(x.reshape(-1, d_in), self.a_blocks.to(dtype), self.b_blocks.to(dtype),
                              lambda h: F.linear(h, self.core), bias)
        return y.reshape(*x.shape[:-1], d_out)

    def with_storage(self, storage: str, backend: Optional[str] = None) -> ArmorTensor:
        if storage == QUANTIZED:
            return self
        raise ArmorInputError(
            f"this ArmorTensor's core is quantized ({type(self.core).__name__}); re-storing it as "
            f"{storage!r} would dequantize it. Call torch_armor.tensor.quant.dequantize_armor_core(weight) "
            "first to get a floating-point core, then with_storage()"
        )

    def __reduce_ex__(self, protocol):
        """Pickle the torchao config as its JSON dict, so ``torch.load(weights_only=True)`` reads it back."""
        rebuild, (func, cls, args, state) = super().__reduce_ex__(protocol)
        if isinstance(state, dict) and isinstance(state.get("quant_config"), AOBaseConfig):
            state = dict(state, quant_config={_CONFIG_KEY: config_to_dict(state["quant_config"])})
        return rebuild, (func, cls, args, state)

    def __setstate__(self, state):
        config = state.get("quant_config") if isinstance(state, dict) else None
        if isinstance(config, dict) and _CONFIG_KEY in config:
            state = dict(state, quant_config=config_from_dict(config[_CONFIG_KEY]))
        TorchAOBaseTensor.__setstate__(self, state)

    def moved(self, device, dtype: torch.dtype, non_blocking: bool = False) -> ArmorTensor:
        if not dtype.is_floating_point:
            raise ArmorInputError(
                f"ArmorTensor holds floating-point factors and cannot be cast to {dtype}; "
                "quantize the core with torch_armor's quantization helpers instead"
            )
        a, b = (t.to(device=device, dtype=dtype, non_blocking=non_blocking) for t in (self.a_blocks, self.b_blocks))
        out = QuantizedArmorTensor(a, b, self.core.to(device=device, non_blocking=non_blocking), self.pattern,
                                   dtype, quant_config=self.quant_config)
        out.layer_name = self.layer_name
        return out


torch.serialization.add_safe_globals([QuantizedArmorTensor])


@dataclasses.dataclass
class ArmorCoreConfig(AOBaseConfig):
    """Apply a torchao config to the sparse core of every ARMOR-converted linear.

    Args:
        inner: ``Int8DynamicActivationInt8WeightConfig()`` (int8 2:4 core),
            ``Float8DynamicActivationFloat8WeightConfig()`` (fp8 2:4 core) or ``Int8WeightOnlyConfig()``
            (torchao's dense int8 core); the module docstring says what each builds.
        apply_to_dense: also apply ``inner`` (torchao's usual handler) to linears whose
            weight is a plain tensor, e.g. ``lm_head``. Default: leave them untouched.

    Use with ``torchao.quantization.quantize_``; ``A`` and ``B`` keep their dtype.

    Example::

        >>> from torchao.quantization import Int8DynamicActivationInt8WeightConfig
        >>> ArmorCoreConfig(Int8DynamicActivationInt8WeightConfig()).inner.__class__.__name__
        'Int8DynamicActivationInt8WeightConfig'
        >>> ArmorCoreConfig("int8")
        Traceback (most recent call last):
        ...
        TypeError: ArmorCoreConfig(inner=...) needs a torchao config instance such as Int8WeightOnlyConfig(), got str
    """

    inner: AOBaseConfig
    apply_to_dense: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.inner, type) and issubclass(self.inner, AOBaseConfig):
            raise TypeError(
                f"ArmorCoreConfig(inner=...) needs a config instance, got the class {self.inner.__name__}; "
                f"write {self.inner.__name__}()"
            )
        if not isinstance(self.inner, AOBaseConfig):
            raise TypeError(
                "ArmorCoreConfig(inner=...) needs a torchao config instance such as Int8WeightOnlyConfig(), "
                f"got {type(self.inner).__name__}"
            )
        if isinstance(self.inner, ArmorCoreConfig):
            raise TypeError("ArmorCoreConfig cannot wrap another ArmorCoreConfig; pass the torchao config directly")
        if type(self.inner).__name__ == "FqnToConfig":
            raise TypeError(
                "ArmorCoreConfig wraps one per-weight config; to pick configs per layer use "
                "FqnToConfig({fqn: ArmorCoreConfig(cfg), ...}) instead"
            )


def is_armor_linear(module: nn.Module, fqn: str = "") -> bool:
    """``quantize_`` filter: ``True`` for an ``nn.Linear`` whose weight is an :class:`ArmorTensor`.

    Its negation lets plain torchao configs skip converted layers:
    ``quantize_(model, Int8WeightOnlyConfig(), filter_fn=lambda m, n: isinstance(m, nn.Linear)
    and not is_armor_linear(m))``.

    Example::

        >>> is_armor_linear(nn.Linear(4, 4))
        False
    """
    return isinstance(module, nn.Linear) and isinstance(module.weight, ArmorTensor)


def _torchao_quantized(module: nn.Module, inner: AOBaseConfig) -> nn.Module:
    """``module`` after torchao's own handler for ``inner`` ran on it, through the public ``quantize_``
    (the module itself, changed in place, or the module the handler replaced it with)."""
    holder = nn.ModuleDict({"layer": module})  # a child, so that a replacement is seen too
    try:
        quantize_(holder, inner, filter_fn=lambda child, fqn: child is module)
    except KeyError:
        raise TypeError(
            f"{type(inner).__name__} has no quantize_ handler registered with torchao; "
            "ArmorCoreConfig needs a config that quantize_ accepts for nn.Linear"
        ) from None
    return holder["layer"]


def _quantize_dense_core(core: torch.Tensor, inner: AOBaseConfig) -> torch.Tensor:
    """Let torchao's handler for ``inner`` quantize ``core`` as if it were a linear's weight."""
    d_out, d_in = core.shape
    linear = nn.Linear(d_in, d_out, bias=False, device="meta")
    linear.weight = nn.Parameter(core, requires_grad=False)
    out = getattr(_torchao_quantized(linear, inner), "weight", None)
    if not isinstance(out, torch.Tensor) or type(out.data if isinstance(out, nn.Parameter) else out) is torch.Tensor:
        raise TypeError(
            f"{type(inner).__name__} did not turn the weight into a torchao quantized tensor (it left a "
            f"{type(out).__name__}); ArmorCoreConfig supports weight-swapping configs such as "
            "Int8WeightOnlyConfig() and Int8DynamicActivationInt8WeightConfig()"
        )
    out = out.detach()
    if tuple(out.shape) != (d_out, d_in):
        raise TypeError(f"{type(inner).__name__} produced a core of shape {tuple(out.shape)}, expected {(d_out, d_in)}")
    return out


def quantize_armor_core(weight: ArmorTensor, inner: AOBaseConfig) -> ArmorTensor:
    """Return ``weight`` with its core quantized by torchao's ``inner`` config (``A``, ``B`` unchanged).

    ``Int8DynamicActivationInt8WeightConfig()`` / ``Float8DynamicActivationFloat8WeightConfig()``: an
    8-bit 2:4 core (:func:`torch_armor.tensor.eight_bit.quantize_core_8bit`). ``Int8WeightOnlyConfig()``:
    the dense core (``weight.core_dense()``, exact) goes through torchao's registered handler and its
    ``Int8Tensor`` becomes the core, storage ``"quantized"`` (dense: no 2:4 kernel). Other configs raise.

    Raises:
        TypeError: ``weight`` is not an ArmorTensor, or ``inner`` is not a weight-swap config.
        ValueError: the core is already quantized.

    Example::

        >>> from torchao.quantization import Int8WeightOnlyConfig
        >>> from torch_armor.core.factors import ArmorFactors
        >>> core = torch.tensor([[0.5, 0.0, 0.0, -1.0]] * 4)
        >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
        >>> w = quantize_armor_core(ArmorTensor.from_factors(f), Int8WeightOnlyConfig(set_inductor_config=False))
        >>> w.storage_format, w.core.qdata.dtype, w.core.qdata[0].tolist()
        ('quantized', torch.int8, [64, 0, 0, -127])
    """
    if isinstance(weight, ArmorTensor) and weight.num_experts is not None:
        raise ArmorInputError(
            f"{weight.layer_name or 'ARMOR experts'}: quantizing the cores of fused experts is not supported yet "
            "(ArmorCoreConfig quantizes ARMOR linears only and leaves experts' cores in floating point)")
    if not isinstance(weight, ArmorTensor):
        raise TypeError(f"quantize_armor_core expects an ArmorTensor weight, got {type(weight).__name__}")
    if weight.storage_format == QUANTIZED or isinstance(weight, EightBitArmorTensor):
        raise ArmorInputError(
            "this ArmorTensor's core is already quantized; quantize the floating-point converted model "
            "once (or call dequantize_armor_core first)"
        )
    if isinstance(inner, ArmorCoreConfig):
        inner = inner.inner
    if not isinstance(inner, AOBaseConfig):
        raise TypeError(f"inner must be a torchao config instance such as Int8WeightOnlyConfig(), got {type(inner).__name__}")
    if type(inner).__name__ in EIGHT_BIT_CONFIGS:
        return quantize_core_8bit(weight, EIGHT_BIT_CONFIGS[type(inner).__name__])
    if type(inner).__name__ != "Int8WeightOnlyConfig":
        raise ArmorInputError(
            f"{weight.layer_name or 'an ARMOR layer'}: {type(inner).__name__} cannot quantize an ARMOR core; "
            "ArmorCoreConfig takes Int8DynamicActivationInt8WeightConfig() (int8 2:4 core), "
            "Float8DynamicActivationFloat8WeightConfig() (fp8 2:4 core) or Int8WeightOnlyConfig() (int8 weights, "
            "dense core)")
    core = weight.core_dense().detach().contiguous()
    qcore = _quantize_dense_core(core, inner)
    out = QuantizedArmorTensor(weight.a_blocks, weight.b_blocks, qcore, weight.pattern, weight.dtype,
                               quant_config=inner)
    out.layer_name = weight.layer_name
    return out


def dequantize_armor_core(weight: ArmorTensor, storage: str = "auto") -> ArmorTensor:
    """Return ``weight`` with a floating-point core again (the dequantized values), as ``storage``.

    Lossy relative to the original fp core (it keeps the quantization error), exact relative to
    the quantized weight's values. A weight whose core is not quantized is returned re-stored.

    Example::

        >>> from torchao.quantization import Int8WeightOnlyConfig
        >>> from torch_armor.core.factors import ArmorFactors
        >>> core = torch.tensor([[0.5, 0.0, 0.0, -1.0]] * 4)
        >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
        >>> w = quantize_armor_core(ArmorTensor.from_factors(f), Int8WeightOnlyConfig(set_inductor_config=False))
        >>> dequantize_armor_core(w, "dense").storage_format
        'dense'
    """
    if not isinstance(weight, ArmorTensor):
        raise TypeError(f"dequantize_armor_core expects an ArmorTensor weight, got {type(weight).__name__}")
    if isinstance(weight, EightBitArmorTensor):
        dense = from_parts("dense", weight.a_blocks, weight.b_blocks, weight.pattern, weight.dtype,
                           core=weight.core_dense())
        dense.layer_name = weight.layer_name
        return dense.with_storage(storage) if storage != "dense" else dense
    if weight.storage_format != QUANTIZED:
        return weight.with_storage(storage)
    dense = from_parts("dense", weight.a_blocks, weight.b_blocks, weight.pattern, weight.dtype,
                       core=weight.core_dense())
    dense.layer_name = weight.layer_name
    return dense.with_storage(storage) if storage != "dense" else dense


def _armor_extra_repr(module: nn.Module, original_extra_repr: Any) -> str:
    w = module.weight
    return f"{original_extra_repr()}, weight={w!r}, core={type(w.core).__name__}"


@register_quantize_module_handler(ArmorCoreConfig)
def _armor_core_transform(module: nn.Module, config: ArmorCoreConfig, *, parameter_name: str = "weight") -> nn.Module:
    """torchao handler: quantize the core of an ArmorTensor weight in place (others: see ``apply_to_dense``)."""
    weight = getattr(module, parameter_name, None)
    if not isinstance(weight, ArmorTensor):
        if not config.apply_to_dense:
            return module
        return _torchao_quantized(module, config.inner)
    if weight.storage_format == QUANTIZED or isinstance(weight, EightBitArmorTensor):  # quantize_ twice: leave it
        return module
    new = quantize_armor_core(weight, config.inner)
    setattr(module, parameter_name, nn.Parameter(new, requires_grad=False))
    module.extra_repr = types.MethodType(partial(_armor_extra_repr, original_extra_repr=module.extra_repr), module)
    return module


# --------------------------------------------------------------------------- serialization helpers


def quant_config_to_dict(config: AOBaseConfig) -> Dict[str, Any]:
    """JSON-able description of a torchao config (``torchao.core.config.config_to_dict``).

    Example::

        >>> from torchao.quantization import Int8WeightOnlyConfig
        >>> quant_config_to_dict(Int8WeightOnlyConfig())["_type"]
        'Int8WeightOnlyConfig'
    """
    return config_to_dict(config)


def quant_config_from_dict(data: Dict[str, Any]) -> AOBaseConfig:
    """Inverse of :func:`quant_config_to_dict`; only torchao's own config classes are accepted.

    Example::

        >>> from torchao.quantization import Int8WeightOnlyConfig
        >>> type(quant_config_from_dict(quant_config_to_dict(Int8WeightOnlyConfig()))).__name__
        'Int8WeightOnlyConfig'
    """
    try:
        return config_from_dict(data)
    except (ValueError, TypeError, KeyError) as err:
        raise ArmorInputError(
            f"cannot rebuild the torchao quantization config {data!r} ({err}); the checkpoint was written "
            "with a different torchao version or edited"
        ) from None


def quantized_core_template(
    inner: AOBaseConfig, shape: tuple, dtype: torch.dtype, device: Optional[torch.device] = None
) -> torch.Tensor:
    """A quantized core of the right class/attributes for ``inner`` (values meaningless: built from zeros).

    Used when loading: its ``__tensor_flatten__`` tells which inner tensors to read, and
    ``__tensor_unflatten__`` rebuilds the saved core from them.
    """
    core = torch.zeros(*shape, dtype=dtype, device=device)
    return _quantize_dense_core(core, inner)
