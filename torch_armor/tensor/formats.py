"""The two ARMOR core formats that run anywhere: dense, and compact N:M (for CPU and disk).

* :class:`DenseArmorTensor` holds the core as a dense ``(d_out, d_in)`` matrix with exact zeros.
  Its linear is :func:`~torch_armor.tensor.linear_layout.armor_linear_rows` around a dense ``mm``
  (on CPU bit-identical to what CPU runs always gave; on CUDA, where it is the fallback for cores
  no 2:4 kernel takes, with the fused wrapper kernels).
* :class:`CompactArmorTensor` holds the kept values ``(d_out, d_in·N/M)`` and the bit-packed
  positions (:func:`~torch_armor.tensor.packing.pack_nm`): about half the dense bytes. Each call
  unpacks the core (a scatter), so it saves memory, not time; the storage policy never picks it
  on a GPU.

Both compute in the input's dtype (the wrappers and the core are cast to it when they differ).

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
    >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
    >>> w = CompactArmorTensor.from_core(f.a_blocks, f.b_blocks, core, "2:4", torch.float32)
    >>> w.values.tolist()[0], w.indices.dtype, torch.equal(w.core_dense(), core)
    ([1.0, 2.0], torch.uint8, True)
"""

from __future__ import annotations

from typing import Optional

import torch

from torch_armor.core.pattern import SparsityPattern, parse_pattern
from torch_armor.tensor.armor_tensor import ArmorTensor, PartSpecs, register_format
from torch_armor.tensor.linear_layout import armor_linear_rows
from torch_armor.tensor.packing import pack_nm, packed_nm_shapes, unpack_nm

__all__ = ["DenseArmorTensor", "CompactArmorTensor"]


@register_format
class DenseArmorTensor(ArmorTensor):
    """An ARMOR weight whose core is a dense matrix with exact zeros (``storage="dense"``)."""

    storage_format = "dense"
    tensor_data_names = ["a_blocks", "b_blocks", "core"]

    def __new__(cls, a_blocks, b_blocks, core, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, core, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.core = core

    @classmethod
    def core_specs(cls, d_out: int, d_in: int, pattern: SparsityPattern, dtype: torch.dtype) -> PartSpecs:
        return {"core": ((d_out, d_in), dtype)}

    @classmethod
    def from_core(cls, a, b, core, pattern, dtype, mask=None):
        return cls(a, b, core, pattern, dtype)

    def core_dense(self) -> torch.Tensor:
        return self.core

    def stored_parameters(self) -> int:
        return self.a_blocks.numel() + self.b_blocks.numel() + int((self.core != 0).sum())

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        dtype = x.dtype
        core = self.core.to(dtype)
        y = armor_linear_rows(x.reshape(-1, d_in), self.a_blocks.to(dtype), self.b_blocks.to(dtype),
                              lambda h: torch.mm(h, core.t()), bias)
        return y.reshape(*x.shape[:-1], d_out)


@register_format
class CompactArmorTensor(ArmorTensor):
    """An ARMOR weight whose N:M core is stored compact: kept ``values`` + packed ``indices``."""

    storage_format = "compact"
    tensor_data_names = ["a_blocks", "b_blocks", "values", "indices"]

    def __new__(cls, a_blocks, b_blocks, values, indices, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, values, indices, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.values, self.indices = values, indices

    @classmethod
    def core_specs(cls, d_out: int, d_in: int, pattern: SparsityPattern, dtype: torch.dtype) -> PartSpecs:
        values, indices = packed_nm_shapes(d_out, d_in, pattern.n, pattern.m)
        return {"values": (values, dtype), "indices": (indices, torch.uint8)}

    @classmethod
    def from_core(cls, a, b, core, pattern, dtype, mask: Optional[torch.Tensor] = None):
        p = parse_pattern(pattern)
        values, indices = pack_nm(core, p.n, p.m, mask=mask)
        return cls(a, b, values, indices, pattern, dtype)

    def core_dense(self) -> torch.Tensor:
        n, m = self.nm
        return unpack_nm(self.values, self.indices, n, m, self.shape[1])

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        dtype = x.dtype
        core = self.core_dense().to(dtype)
        y = armor_linear_rows(x.reshape(-1, d_in), self.a_blocks.to(dtype), self.b_blocks.to(dtype),
                              lambda h: torch.mm(h, core.t()), bias)
        return y.reshape(*x.shape[:-1], d_out)


torch.serialization.add_safe_globals([DenseArmorTensor, CompactArmorTensor])
