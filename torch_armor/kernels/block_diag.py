"""ARMOR's wrapper passes as one op: ``out = src · blockdiag(blocks)ᵀ (+ bias)``, row-major.

:func:`block_diag_rows` is the custom op ``torch_armor::block_diag_rows``. An ARMOR linear
``y = x · (A · core · B)ᵀ + bias`` on a GPU is three kernels around nothing else:

1. the B-pass ``block_diag_rows(x, b_blocks, None, token_multiple, core dtype)``: reads ``x``
   once (any dtype, any row stride), writes ``(T', d_in)`` row-major in the core's dtype with ``T``
   padded to the 2:4 GEMM's token multiple by zero rows — the GEMM's operand (as ``.t()``);
2. the 2:4 GEMM, writing ``(T', d_out)`` (cuSPARSELt's ``transpose_result``);
3. the A-pass ``block_diag_rows(z[:T], a_blocks, bias, 1, x's dtype)``: reads the GEMM's output,
   adds the bias, writes ``(T, d_out)`` row-major in the caller's dtype (the cast back fused).

On CUDA with Triton the op is the Triton kernel of :mod:`torch_armor.kernels.triton_block_diag`;
elsewhere its reference (batched matmuls, the same numbers up to rounding). It has a fake
implementation, so ``torch.compile`` traces it as one opaque node and CUDA graphs capture it.

Example::

    >>> import torch
    >>> blocks = torch.randn(3, 4, 4)
    >>> x = torch.randn(5, 12)
    >>> out = block_diag_rows(x, blocks, None, 8, torch.float32)
    >>> out.shape, torch.allclose(out[:5], x @ torch.block_diag(*blocks).T, atol=1e-5), bool(out[5:].eq(0).all())
    (torch.Size([8, 12]), True, True)
"""

from __future__ import annotations

import functools
import os
from typing import List, Optional

import torch
import torch.nn.functional as F

from torch_armor.core.blockdiag import block_diag_right

__all__ = ["FUSED_WRAPPERS", "block_diag_rows", "block_diag_rows_reference", "block_diag_rows_shared",
           "fused_wrappers_available", "triton_importable"]

#: Set to ``False`` (or ``TORCH_ARMOR_FUSED_WRAPPERS=0`` in the environment) to run ARMOR's wrappers as
#: batched matmuls on CUDA too: a way around a Triton problem, and the baseline the GPU check times.
FUSED_WRAPPERS = os.environ.get("TORCH_ARMOR_FUSED_WRAPPERS", "1") != "0"


@functools.cache
def triton_importable() -> bool:
    """Whether ``import triton`` works here (asked once)."""
    try:
        import triton  # noqa: F401  local: triton is optional (test/CI extra; CUDA wheels of torch ship it)
    except ImportError:
        return False
    return True


def fused_wrappers_available(device: torch.device) -> bool:
    """Whether ARMOR linears on ``device`` run their wrappers as :func:`block_diag_rows` kernels:
    CUDA with Triton installed, unless :data:`FUSED_WRAPPERS` is off (otherwise batched matmuls)."""
    return FUSED_WRAPPERS and device.type == "cuda" and triton_importable()


def block_diag_rows_reference(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                              row_multiple: int, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`block_diag_rows` in batched matmuls, computed in ``blocks.dtype`` (any device)."""
    out = block_diag_right(src.to(blocks.dtype), blocks.transpose(1, 2))
    if bias is not None:
        out = out + bias.to(out.dtype)
    pad = (-src.shape[0]) % row_multiple
    if pad:
        out = F.pad(out, (0, 0, 0, pad))
    return out.to(out_dtype).contiguous()


@torch.library.custom_op("torch_armor::block_diag_rows", mutates_args=())
def block_diag_rows(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor], row_multiple: int,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """``src (R, n·d_b) · blockdiag(blocks)ᵀ (+ bias)`` as a new row-major ``(R', n·d_b)`` tensor of
    ``out_dtype``, ``R' = R`` rounded up to ``row_multiple`` (rows ``R..R'-1`` are zeros)."""
    return block_diag_rows_reference(src, blocks, bias, row_multiple, out_dtype)


@block_diag_rows.register_fake
def _(src, blocks, bias, row_multiple, out_dtype):
    rows = src.shape[0]
    return src.new_empty((rows + (-rows) % row_multiple, blocks.shape[0] * blocks.shape[1]), dtype=out_dtype)


@block_diag_rows.register_kernel("cuda")
def _(src, blocks, bias, row_multiple, out_dtype):
    if not triton_importable():
        return block_diag_rows_reference(src, blocks, bias, row_multiple, out_dtype)
    from torch_armor.kernels.triton_block_diag import block_diag_rows_triton  # local: imports triton

    return block_diag_rows_triton(src, blocks, bias, row_multiple, out_dtype)


@torch.library.custom_op("torch_armor::block_diag_rows_shared", mutates_args=())
def block_diag_rows_shared(src: torch.Tensor, blocks: List[torch.Tensor], row_multiple: int,
                           out_dtype: torch.dtype) -> List[torch.Tensor]:
    """:func:`block_diag_rows` (no bias) of one ``src`` with each of several block stacks of one shape:
    the B-passes of linears that read the same input (q/k/v, gate/up) in one launch that reads ``src``
    once. :mod:`torch_armor.kernels.fusion` puts it in compiled graphs."""
    return [block_diag_rows_reference(src, b, None, row_multiple, out_dtype) for b in blocks]


@block_diag_rows_shared.register_fake
def _(src, blocks, row_multiple, out_dtype):
    rows = src.shape[0]
    return [src.new_empty((rows + (-rows) % row_multiple, b.shape[0] * b.shape[1]), dtype=out_dtype) for b in blocks]


@block_diag_rows_shared.register_kernel("cuda")
def _(src, blocks, row_multiple, out_dtype):
    if not triton_importable():
        return [block_diag_rows_reference(src, b, None, row_multiple, out_dtype) for b in blocks]
    from torch_armor.kernels.triton_block_diag import block_diag_rows_shared_triton  # local: imports triton

    return block_diag_rows_shared_triton(src, blocks, row_multiple, out_dtype)
