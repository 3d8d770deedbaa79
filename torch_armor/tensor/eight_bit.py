"""8-bit 2:4 ARMOR cores: the core's kept values in int8 or fp8 e4m3, a scale per output channel;
``A``, ``B`` and the activations in the model's dtype; each token quantized on the fly.

``y = A · (s_x ⊙ (q_core · q_x) ⊙ s_w) · B`` (:mod:`torch_armor.kernels.quant8`): the B-pass output is
quantized per token, the 8-bit GEMM sums the products, both scales are applied where the A-pass reads
its result. One class per format and place (``storage_format`` ``"int8"`` or ``"fp8"``):

* :class:`Int8ArmorTensor` / :class:`Fp8ArmorTensor` — compact: ``values (d_out, d_in/2)`` 8-bit with
  their bit-packed 2:4 positions (``indices``) and ``core_scale (d_out,)`` float32. Any device; its
  linear multiplies the 8-bit values in float with the GPU's numbers. What a checkpoint stores.
* :class:`Int8CusparseltArmorTensor` / :class:`Fp8CusparseltArmorTensor` — the cuSPARSELt 8-bit 2:4
  buffer (``torch._cslt_compress`` of the int8 / e4m3 core) and ``core_scale``; the linear is the
  quantizing B-pass kernel, one 8-bit ``_cslt_sparse_mm``, the scaling A-pass kernel (int8 on sm80+,
  fp8 on sm89+).

:func:`quantize_core_8bit` builds one from a floating ARMOR weight (``quantize_(model,
ArmorCoreConfig(Int8DynamicActivationInt8WeightConfig()))`` calls it); the storage policy
(:func:`~torch_armor.tensor.policy.choose_eight_bit`) picks the class for the device on every move.

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import ArmorTensor
    >>> core = torch.tensor([[1.0, 0.0, -2.0, 0.0]] * 16).repeat(1, 4)
    >>> f = ArmorFactors(torch.eye(16)[None], core, torch.eye(16)[None], core != 0, "2:4")
    >>> w = quantize_core_8bit(ArmorTensor.from_factors(f), "int8")
    >>> w.storage_format, w.values.dtype, w.core_scale.shape
    ('int8', torch.int8, torch.Size([16]))
    >>> x = torch.randn(3, 16)
    >>> bool((torch.nn.functional.linear(x, w) - x @ core.T).abs().max() < 0.05 * (x @ core.T).abs().max())
    True
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from torch_armor.core.pattern import SparsityPattern, parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.kernels.quant8 import QDTYPES, quantize_rows, quantizing_b_pass, scaled_a_pass, scaled_core_mm_rows
from torch_armor.tensor import policy
from torch_armor.tensor.armor_tensor import ArmorTensor, PartSpecs, format_class, register_format
from torch_armor.tensor.linear_layout import armor_linear_rows
from torch_armor.tensor.packing import pack_nm, packed_nm_shapes, unpack_nm

__all__ = ["EIGHT_BIT", "EightBitArmorTensor", "Int8ArmorTensor", "Fp8ArmorTensor", "Int8CusparseltArmorTensor",
           "Fp8CusparseltArmorTensor", "quantize_core_8bit", "TOKEN_MULTIPLE_8BIT"]

EIGHT_BIT = tuple(sorted(QDTYPES))  # the storage formats of this module: "fp8", "int8"
#: cuSPARSELt's 8-bit kernels want the dense operand's token count a multiple of this
TOKEN_MULTIPLE_8BIT = 16


def _to(t: torch.Tensor, device: torch.device, dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device`` (cast to ``dtype`` when given), through the aten op, as ArmorTensor moves are."""
    dtype = dtype or t.dtype
    if t.device == device and t.dtype == dtype:
        return t
    return torch.ops.aten._to_copy.default(t, device=device, dtype=dtype, non_blocking=non_blocking)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """fp8 values as raw bytes (packing gathers and scatters them; CPU kernels lack float8 scatter)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


class EightBitArmorTensor(ArmorTensor):
    """An ARMOR weight whose 2:4 core is 8-bit (int8 or fp8 e4m3) with a float32 scale per output channel."""

    storage_format: ClassVar[str] = ""

    @property
    def qdtype(self) -> str:
        return self.storage_format

    def q_core(self) -> torch.Tensor:
        """The 8-bit core as a dense ``(d_out, d_in)`` tensor (zeros off the 2:4 support)."""
        raise NotImplementedError

    def core_dense(self) -> torch.Tensor:
        return (self.q_core().float() * self.core_scale[:, None]).to(self.dtype)

    def stored_parameters(self) -> int:
        d_out, d_in = self.shape
        return self.a_blocks.numel() + self.b_blocks.numel() + d_out * d_in // 2

    def with_storage(self, storage: str, backend: Optional[str] = None) -> ArmorTensor:
        if storage in ("auto", self.storage_format):
            return self.moved(self.device, self.dtype)
        raise ArmorInputError(
            f"{self.layer_name or 'this layer'}: its core is {self.storage_format}; storage={storage!r} would "
            "dequantize it. torch_armor.tensor.quant.dequantize_armor_core(weight) gives a floating core first"
        )

    def _parts_to(self, device, dtype, non_blocking):
        """``A`` and ``B`` cast to ``dtype``; the 8-bit values, positions and scales only moved."""
        def move(t, cast):
            return _to(t, torch.device(device), dtype if cast else None, non_blocking)

        parts = {n: move(getattr(self, n), n in ("a_blocks", "b_blocks")) for n in self.tensor_data_names}
        return type(self)(**parts, pattern=self.pattern, dtype=dtype)

    def moved(self, device, dtype: torch.dtype, non_blocking: bool = False) -> ArmorTensor:
        if not dtype.is_floating_point:
            raise ArmorInputError(f"an ARMOR weight's wrappers cannot be cast to {dtype}")
        device = torch.device(device)
        choice = policy.choose_eight_bit(policy.device_info(device), self.qdtype, tuple(self.shape))
        cls = format_class(self.qdtype, choice.backend)
        if cls is type(self):
            out = self._parts_to(device, dtype, non_blocking)
        else:
            a, b = (_to(t, device, dtype, non_blocking) for t in (self.a_blocks, self.b_blocks))
            out = cls.from_q_core(a, b, _to(self.q_core(), device), _to(self.core_scale, device), self.pattern, dtype)
        policy.warn_fallback(self.layer_name, tuple(self.shape), choice)
        out.layer_name = self.layer_name
        return out


class _Compact8(EightBitArmorTensor):
    tensor_data_names = ["a_blocks", "b_blocks", "values", "indices", "core_scale"]

    def __new__(cls, a_blocks, b_blocks, values, indices, core_scale, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, values, indices, core_scale, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.values, self.indices, self.core_scale = values, indices, core_scale

    @classmethod
    def core_specs(cls, d_out: int, d_in: int, pattern: SparsityPattern, dtype: torch.dtype) -> PartSpecs:
        values, indices = packed_nm_shapes(d_out, d_in, 2, 4)
        return {"values": (values, QDTYPES[cls.storage_format][0]), "indices": (indices, torch.uint8),
                "core_scale": ((d_out,), torch.float32)}

    @classmethod
    def from_q_core(cls, a, b, q_core, core_scale, pattern, dtype):
        values, indices = pack_nm(_as_bytes(q_core), 2, 4, mask=q_core.view(torch.uint8) != 0
                                  if q_core.dtype == torch.float8_e4m3fn else None)
        return cls(a, b, values.view(q_core.dtype), indices, core_scale, pattern, dtype)

    def q_core(self) -> torch.Tensor:
        return unpack_nm(_as_bytes(self.values), self.indices, 2, 4, self.shape[1]).view(self.values.dtype)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        q_core = self.q_core()
        dtype = x.dtype
        y = armor_linear_rows(x.reshape(-1, d_in), self.a_blocks.to(dtype), self.b_blocks.to(dtype),
                              lambda rows: scaled_core_mm_rows(rows, q_core, self.core_scale, self.qdtype, rows.dtype),
                              bias)
        return y.view(*x.shape[:-1], d_out)


class _Cusparselt8(EightBitArmorTensor):
    backend = "cusparselt"
    tensor_data_names = ["a_blocks", "b_blocks", "packed", "core_scale"]

    def __new__(cls, a_blocks, b_blocks, packed, core_scale, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, packed, core_scale, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.packed, self.core_scale = packed, core_scale

    @classmethod
    def from_q_core(cls, a, b, q_core, core_scale, pattern, dtype):
        packed = torch._cslt_compress(q_core.contiguous()).view(q_core.shape[0], -1)
        return cls(a, b, packed, core_scale, pattern, dtype)

    def q_core(self) -> torch.Tensor:
        """The 8-bit core, exactly: the sparse GEMM (int32 / fp32 out) against the identity, in 8 bits again."""
        d_in = self.shape[1]
        eye = torch.eye(d_in, dtype=self.packed.dtype, device=self.device)
        out_dtype = torch.int32 if self.packed.dtype == torch.int8 else torch.float32
        dense_t = torch._cslt_sparse_mm(self.packed, eye, bias=None, alpha=None, out_dtype=out_dtype,
                                        transpose_result=False, alg_id=0, split_k=1, split_k_mode=-1)
        return dense_t.to(self.packed.dtype)

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        x2d = x.reshape(-1, d_in)
        tokens = x2d.shape[0]
        q_rows, row_scale = quantizing_b_pass(x2d, self.b_blocks, TOKEN_MULTIPLE_8BIT, self.qdtype)
        # q_rows.t(): the column-major operand cuSPARSELt's 8-bit kernels take; the raw sums come back
        # (T', d_out) row-major in the wrappers' dtype, and the A-pass applies both scales
        sums = torch._cslt_sparse_mm(self.packed, q_rows.t(), bias=None, alpha=None, out_dtype=self.dtype,
                                     transpose_result=True, alg_id=0, split_k=1, split_k_mode=-1)
        y = scaled_a_pass(sums.narrow(0, 0, tokens), self.a_blocks, bias, row_scale.narrow(0, 0, tokens),
                          self.core_scale, x.dtype)
        return y.view(*x.shape[:-1], d_out)


@register_format
class Int8ArmorTensor(_Compact8):
    """int8 2:4 core, compact (any device; what a checkpoint stores)."""

    storage_format = "int8"


@register_format
class Fp8ArmorTensor(_Compact8):
    """fp8 e4m3 2:4 core, compact (any device; what a checkpoint stores)."""

    storage_format = "fp8"


@register_format
class Int8CusparseltArmorTensor(_Cusparselt8):
    """int8 2:4 core in cuSPARSELt's buffer (CUDA sm80+)."""

    storage_format = "int8"


@register_format
class Fp8CusparseltArmorTensor(_Cusparselt8):
    """fp8 e4m3 2:4 core in cuSPARSELt's buffer (CUDA sm89+)."""

    storage_format = "fp8"




def quantize_core_8bit(weight: ArmorTensor, qdtype: str) -> EightBitArmorTensor:
    """``weight`` with its 2:4 core quantized per output channel to ``qdtype`` (``"int8"`` or ``"fp8"``),
    in the class the storage policy picks for its device; ``A``, ``B`` and the dtype unchanged.

    Raises:
        ArmorInputError: the weight is not 2:4, or its core is already quantized.
    """
    if qdtype not in QDTYPES:
        raise ArmorInputError(f"8-bit format must be one of {EIGHT_BIT}, got {qdtype!r}")
    pattern = parse_pattern(weight.pattern)
    name = weight.layer_name or "an ARMOR layer"
    if (pattern.n, pattern.m) != (2, 4):
        raise ArmorInputError(f"{name}: an {qdtype} core must be 2:4 (the 8-bit sparse kernels' pattern), "
                              f"this one is {pattern}; quantize a 2:4 prune")
    if isinstance(weight, EightBitArmorTensor) or weight.storage_format == policy.QUANTIZED:
        raise ArmorInputError(f"{name}: its core is already quantized ({weight.storage_format}); quantize the "
                              "floating-point model once")
    core = weight.core_dense().float()
    q_core, core_scale = quantize_rows(core, qdtype)
    compact = format_class(qdtype).from_q_core(weight.a_blocks, weight.b_blocks, q_core, core_scale,
                                               str(pattern), weight.dtype)
    compact.layer_name = weight.layer_name
    return compact.moved(weight.device, weight.dtype)


torch.serialization.add_safe_globals([Int8ArmorTensor, Fp8ArmorTensor, Int8CusparseltArmorTensor,
                                      Fp8CusparseltArmorTensor])
