"""Triton kernels of the 8-bit ARMOR linear (:mod:`torch_armor.kernels.quant8`): the B-pass that
quantizes as it writes the GEMM's operand, and the A-pass that applies the scales as it reads the
GEMM's output.

* :func:`quantizing_b_pass_triton`: ``x · blockdiag(B)ᵀ`` rounded to the blocks' dtype, then quantized
  per row (int8 or fp8 e4m3): ``(q (T', d_in), scale (T',))``, ``T`` padded to ``row_multiple`` by zero
  rows. One program owns whole rows (the row's largest magnitude needs all of it): a first sweep over
  the blocks finds it, a second writes the 8-bit values.
* :func:`scaled_a_pass_triton`: ``(z ⊙ s_row ⊗ s_col) · blockdiag(A)ᵀ + bias``, row-major out.

Importing this module needs ``triton``; under ``TRITON_INTERPRET=1`` the kernels run on CPU tensors.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

__all__ = ["quantizing_b_pass_triton", "scaled_a_pass_triton"]


@triton.jit
def _block_rows(src_ptr, blocks_ptr, r, k, j, rows, src_row_stride, src_col_stride,
                BLOCK: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """One ``ROWS x d_b`` tile of ``src · blockdiag(blocks)ᵀ`` (block ``j``), in fp32."""
    k_ok = k < BLOCK
    cols = j * BLOCK + k
    x = tl.load(src_ptr + r[:, None] * src_row_stride + cols[None, :] * src_col_stride,
                mask=(r < rows)[:, None] & k_ok[None, :], other=0.0)
    x = x.to(blocks_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(blocks_ptr + j * BLOCK * BLOCK + k[:, None] * BLOCK + k[None, :],
                mask=k_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if USE_DOT:
        return tl.dot(x, tl.trans(w), input_precision=PRECISION)
    return tl.sum(x[:, None, :] * w[None, :, :], axis=2)


@triton.jit
def _round_to_e4m3(v):
    """``v`` (fp32, ``|v| <= 448``) rounded to the nearest float8 e4m3 value, ties to even, still fp32: the
    cast after it is exact (Triton's interpreter rounds casts that carry into the exponent wrongly)."""
    a = tl.abs(v)
    exponent = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # subnormals share the smallest normal's spacing, 2^-9
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    steps = a / ulp  # exact: ulp is a power of two
    low = tl.floor(steps)
    tie_to_even = (steps - low == 0.5) & ((low.to(tl.int32) & 1) == 0)
    rounded = tl.where(tie_to_even, low, tl.floor(steps + 0.5)) * ulp
    return tl.where((v < 0) & (rounded > 0), -rounded, rounded)  # never -0: zeros stay off the 2:4 support


@triton.jit
def _quantizing_b_pass_kernel(
    src_ptr, blocks_ptr, q_ptr, scale_ptr, rows, out_rows, src_row_stride, src_col_stride,
    N_BLOCKS: tl.constexpr, QMAX: tl.constexpr, IS_INT8: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_P2)
    width = N_BLOCKS * BLOCK
    amax = tl.zeros([ROWS], dtype=tl.float32)
    for j in range(0, N_BLOCKS):
        y = _block_rows(src_ptr, blocks_ptr, r, k, j, rows, src_row_stride, src_col_stride, BLOCK, USE_DOT, PRECISION)
        y = y.to(blocks_ptr.dtype.element_ty).to(tl.float32)  # the B-pass output as the unquantized path has it
        amax = tl.maximum(amax, tl.max(tl.abs(y), axis=1))
    scale = tl.maximum(amax / QMAX, 1e-12)
    for j in range(0, N_BLOCKS):
        y = _block_rows(src_ptr, blocks_ptr, r, k, j, rows, src_row_stride, src_col_stride, BLOCK, USE_DOT, PRECISION)
        v = y.to(blocks_ptr.dtype.element_ty).to(tl.float32) / scale[:, None]
        if IS_INT8:  # round to nearest, ties away from zero (quant8.quantize_rows)
            q = tl.minimum(tl.floor(tl.abs(v) + 0.5), QMAX)
            q = tl.where(v < 0, -q, q).to(tl.int8)
        else:
            q = _round_to_e4m3(tl.minimum(tl.maximum(v, -QMAX), QMAX)).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r[:, None] * width + (j * BLOCK + k)[None, :], q,
                 mask=(r < out_rows)[:, None] & (k < BLOCK)[None, :])
    tl.store(scale_ptr + r, scale, mask=r < out_rows)


@triton.jit
def _scaled_a_pass_kernel(
    src_ptr, blocks_ptr, bias_ptr, row_scale_ptr, col_scale_ptr, out_ptr, rows, n_blocks,
    src_row_stride, src_col_stride,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1)
    k = tl.arange(0, BLOCK_P2)
    k_ok = k < BLOCK
    r_in = r < rows
    cols = j * BLOCK + k
    z = tl.load(src_ptr + r[:, None] * src_row_stride + cols[None, :] * src_col_stride,
                mask=r_in[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    z = z * tl.load(row_scale_ptr + r, mask=r_in, other=0.0)[:, None] * tl.load(col_scale_ptr + cols, mask=k_ok, other=0.0)[None, :]
    z = z.to(blocks_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(blocks_ptr + j * BLOCK * BLOCK + k[:, None] * BLOCK + k[None, :],
                mask=k_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if USE_DOT:
        acc = tl.dot(z, tl.trans(w), input_precision=PRECISION)
    else:
        acc = tl.sum(z[:, None, :] * w[None, :, :], axis=2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + r[:, None] * (n_blocks * BLOCK) + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=r_in[:, None] & k_ok[None, :])


def _common(blocks: torch.Tensor, rows: int) -> dict:
    block_p2 = triton.next_power_of_2(blocks.shape[-1])
    rows_per_program = 16
    return {"BLOCK": blocks.shape[-1], "BLOCK_P2": block_p2, "ROWS": rows_per_program,
            "USE_DOT": block_p2 >= 16, "PRECISION": "ieee" if blocks.dtype == torch.float32 else "tf32"}


def quantizing_b_pass_triton(src: torch.Tensor, blocks: torch.Tensor, row_multiple: int, dtype: torch.dtype,
                             qmax: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows(x · blockdiag(blocks)ᵀ)`` to ``dtype`` (``torch.int8``, largest value ``qmax`` = 127,
    or ``torch.float8_e4m3fn``, 448) with ``T`` padded to ``row_multiple`` by zero rows."""
    rows = src.shape[0]
    n_blocks, block, _ = blocks.shape
    out_rows = rows + (-rows) % row_multiple
    q = torch.empty(out_rows, n_blocks * block, device=src.device, dtype=dtype)
    scale = torch.empty(out_rows, device=src.device, dtype=torch.float32)
    if out_rows:
        cfg = _common(blocks, out_rows)
        _quantizing_b_pass_kernel[(triton.cdiv(out_rows, cfg["ROWS"]),)](
            src, blocks.contiguous(), q, scale, rows, out_rows, src.stride(0), src.stride(1),
            N_BLOCKS=n_blocks, QMAX=qmax, IS_INT8=dtype == torch.int8, **cfg)
    return q, scale


def scaled_a_pass_triton(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                         row_scale: torch.Tensor, col_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``(src ⊙ row_scale[:, None] ⊙ col_scale[None, :]) · blockdiag(blocks)ᵀ (+ bias)``, ``(T, d_out)``."""
    rows = src.shape[0]
    n_blocks, block, _ = blocks.shape
    out = torch.empty(rows, n_blocks * block, device=src.device, dtype=out_dtype)
    if rows:
        cfg = _common(blocks, rows)
        _scaled_a_pass_kernel[(triton.cdiv(rows, cfg["ROWS"]), n_blocks)](
            src, blocks.contiguous(), bias if bias is not None else blocks, row_scale, col_scale, out, rows, n_blocks,
            src.stride(0), src.stride(1), HAS_BIAS=bias is not None, **cfg)
    return out
