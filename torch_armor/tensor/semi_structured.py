"""The CUDA 2:4 ARMOR core: the sparse kernel's own buffers, no activation copied around it.

Two classes, one per kernel (the storage policy picks; both are ``storage_format ==
"semi_structured"``):

* :class:`CusparseltArmorTensor` — ``packed``: the buffer of ``torch._cslt_compress`` (kept values
  and metadata together, ``d_out·d_in·9/16`` elements for fp16/bf16), viewed ``(d_out, -1)`` so
  that shape functions read ``d_out`` from it. The GEMM is ``torch._cslt_sparse_mm`` with every
  argument explicit. sm80+.
* :class:`CutlassArmorTensor` — ``packed`` ``(d_out, d_in/2)`` values and ``meta`` ``(d_out,
  d_in/16)`` int16 reordered metadata (PyTorch's CUTLASS layout, :func:`~torch_armor.tensor.packing.cutlass_pack`);
  the GEMM is ``torch._sparse_semi_structured_mm``. sm8x only (the policy's fallback where a
  build has no cuSPARSELt).

Both hold plain tensors, so ``copy_`` / ``load_state_dict``, ``torch.save`` with
``torch.load(weights_only=True)``, ``.to()`` and ``torch.compile`` see ordinary inner tensors.
The linear is :func:`~torch_armor.tensor.linear_layout.armor_linear_rows`: the B-pass writes the
``(T', d_in)`` rows (``T`` padded to 8 by zero rows) that the GEMM reads as its column-major
operand, the GEMM writes ``(T', d_out)`` rows (cuSPARSELt's ``transpose_result``), and the A-pass
adds the bias and writes ``(T, d_out)`` row-major in the input's dtype — with Triton, two wrapper
kernels and one sparse GEMM, no pad, cast or copy of its own. An input of another dtype is read
as the core's, never the core densified.

The first time a ``(device, backend, dtype, shape)`` is converted, a trial matmul on 8 random
columns is compared with the dense product; a kernel that raises or disagrees makes that shape
fall back to a dense core, with one warning that names the layer (not run under ``torch.compile``
or on fake tensors).
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from torch_armor.tensor.armor_tensor import ArmorTensor, register_format
from torch_armor.tensor.linear_layout import armor_linear_rows
from torch_armor.tensor.policy import KernelRefused

__all__ = ["SemiStructuredArmorTensor", "CusparseltArmorTensor", "CutlassArmorTensor", "TOKEN_MULTIPLE"]

#: the 2:4 kernels want the dense operand's token count a multiple of this (fp16/bf16); smaller
#: calls (a decode step) are padded
TOKEN_MULTIPLE = 8
_TRIALS: Dict[Tuple, Optional[str]] = {}  # (device, backend, dtype, shape) -> None (passed) or why not
_EYE_COLUMNS = 1024  # densify a cuSPARSELt core this many columns at a time


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]


def _refused(backend: str, core: torch.Tensor, why: str) -> str:
    return f"the {backend} 2:4 kernel refused a {tuple(core.shape)} {core.dtype} core: {why}"


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake  # local: torch internals, only on the CUDA path

    return is_fake(t) or t.device.type == "meta"


class SemiStructuredArmorTensor(ArmorTensor):
    """An ARMOR weight whose 2:4 core lives in a CUDA sparse kernel's format."""

    storage_format = "semi_structured"

    @classmethod
    def from_core(cls, a, b, core, pattern, dtype, mask=None):
        try:
            parts = cls._compress(core.contiguous())
        except (RuntimeError, NotImplementedError, ValueError) as exc:
            raise KernelRefused(_refused(cls.backend, core, f"its compression failed: {_first_line(exc)}")) from None
        w = cls(a_blocks=a, b_blocks=b, **parts, pattern=pattern, dtype=dtype)
        w._trial(core)
        return w

    @staticmethod
    def _compress(core: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The kernel's inner tensors of a contiguous dense 2:4 core, by name (all but ``a_blocks``, ``b_blocks``)."""
        raise NotImplementedError

    def _core_mm_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows · coreᵀ`` for row-major ``rows (T, d_in)``: ``(T, d_out)``."""
        raise NotImplementedError

    def _movable(self, device: torch.device, dtype: torch.dtype) -> bool:
        return dtype == self.dtype  # another GPU: copy the buffers; another dtype: re-compress

    def stored_parameters(self) -> int:
        return self.a_blocks.numel() + self.b_blocks.numel() + self.shape.numel() // 2

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        d_out, d_in = self.shape
        y = armor_linear_rows(x.reshape(-1, d_in), self.a_blocks, self.b_blocks, self._core_mm_rows, bias,
                              token_multiple=TOKEN_MULTIPLE)
        return y.view(*x.shape[:-1], d_out)

    def _trial(self, core: torch.Tensor) -> None:
        """Raise :class:`KernelRefused` if the kernel fails or disagrees with ``core`` on a small product."""
        if _is_fake(core) or torch.compiler.is_compiling():
            return
        key = (str(core.device), self.backend, core.dtype, tuple(core.shape))
        if key not in _TRIALS:
            gen = torch.Generator(core.device).manual_seed(0)
            x = torch.randn(TOKEN_MULTIPLE, core.shape[1], generator=gen, device=core.device, dtype=core.dtype)
            try:
                got, want = self._core_mm_rows(x).float(), (x.float() @ core.float().T)
                if core.is_cuda:
                    torch.cuda.synchronize(core.device)
                err = float((got - want).norm() / want.norm().clamp_min(1e-30))
                _TRIALS[key] = None if err <= 2e-2 else f"its trial matmul disagrees with the dense core ({err:.2g})"
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                _TRIALS[key] = f"its trial matmul failed: {_first_line(exc)}"
        if _TRIALS[key] is not None:
            raise KernelRefused(_refused(self.backend, core, _TRIALS[key]))


@register_format
class CusparseltArmorTensor(SemiStructuredArmorTensor):
    """2:4 core compressed for cuSPARSELt (``packed``: values and metadata in one buffer)."""

    backend = "cusparselt"
    tensor_data_names = ["a_blocks", "b_blocks", "packed"]

    def __new__(cls, a_blocks, b_blocks, packed, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, packed, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.packed = packed

    @staticmethod
    def _compress(core: torch.Tensor) -> Dict[str, torch.Tensor]:
        return {"packed": torch._cslt_compress(core).view(core.shape[0], -1)}

    def _core_mm_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # rows.t() is the column-major (d_in, T) operand torch's own 2:4 linear passes; transpose_result
        # writes core · rowsᵀ as its (T, d_out) transpose, row-major
        return torch._cslt_sparse_mm(self.packed, rows.t(), bias=None, alpha=None, out_dtype=None,
                                     transpose_result=True, alg_id=0, split_k=1, split_k_mode=-1)

    def core_dense(self) -> torch.Tensor:
        """The core, exactly: the sparse GEMM against the identity, ``_EYE_COLUMNS`` columns at a time."""
        d_in = self.shape[1]
        columns = []
        for start in range(0, d_in, _EYE_COLUMNS):
            cols = min(_EYE_COLUMNS, d_in - start)
            eye = torch.zeros(cols, d_in, dtype=self.dtype, device=self.device)
            eye.narrow(1, start, cols).fill_diagonal_(1)
            columns.append(self._core_mm_rows(eye).t())
        return torch.cat(columns, dim=1)


@register_format
class CutlassArmorTensor(SemiStructuredArmorTensor):
    """2:4 core in PyTorch's CUTLASS layout (``packed`` values, int16 ``meta``)."""

    backend = "cutlass"
    tensor_data_names = ["a_blocks", "b_blocks", "packed", "meta"]

    def __new__(cls, a_blocks, b_blocks, packed, meta, pattern, dtype, *, layer_name=None):
        return cls._wrapper(a_blocks, b_blocks, dtype)

    def __init__(self, a_blocks, b_blocks, packed, meta, pattern, dtype, *, layer_name=None):
        super().__init__(a_blocks, b_blocks, pattern, layer_name)
        self.packed, self.meta = packed, meta

    @staticmethod
    def _compress(core: torch.Tensor) -> Dict[str, torch.Tensor]:
        from torch.sparse._semi_structured_conversions import sparse_semi_structured_from_dense_cutlass  # local: CUTLASS packing only

        packed, meta = sparse_semi_structured_from_dense_cutlass(core)
        return {"packed": packed, "meta": meta}

    def _core_mm_rows(self, rows: torch.Tensor) -> torch.Tensor:
        # the column-major operand torch's own CUTLASS linear passes; the (d_out, T) result read transposed
        return torch._sparse_semi_structured_mm(self.packed, self.meta, rows.t()).t()

    def core_dense(self) -> torch.Tensor:
        from torch.sparse._semi_structured_conversions import sparse_semi_structured_to_dense_cutlass  # local: CUTLASS unpacking only

        return sparse_semi_structured_to_dense_cutlass(self.packed, self.meta)


torch.serialization.add_safe_globals([CusparseltArmorTensor, CutlassArmorTensor])
