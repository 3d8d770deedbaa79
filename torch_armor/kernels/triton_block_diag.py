"""The Triton kernel behind :func:`torch_armor.kernels.block_diag.block_diag_rows` on CUDA.

One pass over the rows of ``src``: each program reads a ``ROWS × d_b`` tile of every one of its
``GROUP`` diagonal blocks, multiplies it by that block's transpose (fp32 accumulation), adds the
bias where there is one and writes the tile, cast, into a row-major output that may have more
rows than ``src`` (those rows are written as zeros: the 2:4 GEMM's token padding costs no pass of
its own). ``src`` may have any strides (a row-major activation, a narrowed or transposed GEMM output).

Importing this module needs ``triton``. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) the same kernel runs on CPU tensors, which is how ``tests/kernels`` checks it.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

__all__ = ["block_diag_rows_triton", "launch_config"]


@triton.jit
def _block_diag_rows_kernel(
    src_ptr, blocks_ptr, bias_ptr, out_ptr,
    rows, out_rows, n_blocks, src_row_stride, src_col_stride,
    BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_P2)
    k_ok = k < BLOCK
    r_in = r < rows
    width = n_blocks * BLOCK
    for g in tl.static_range(GROUP):
        j = tl.program_id(1) * GROUP + g
        if j < n_blocks:
            cols = j * BLOCK + k
            x = tl.load(src_ptr + r[:, None] * src_row_stride + cols[None, :] * src_col_stride,
                        mask=r_in[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(blocks_ptr + j * BLOCK * BLOCK + k[:, None] * BLOCK + k[None, :],
                        mask=k_ok[:, None] & k_ok[None, :], other=0.0)
            # x is rounded to the blocks' dtype first (the core's dtype: what the GEMM reads), then
            # both go to fp32: fp16/bf16 values are exact in tf32, so PRECISION="tf32" is the
            # half-precision product on tensor cores, and the Triton interpreter (no bf16 matmul) agrees
            x = x.to(w.dtype).to(tl.float32)
            w = w.to(tl.float32)
            if USE_DOT:
                acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)
            else:  # blocks narrower than 16 (tests, tiny models): tl.dot needs 16
                acc = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
            if HAS_BIAS:
                b = tl.load(bias_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
                acc += tl.where(r_in[:, None], b[None, :], 0.0)
            tl.store(out_ptr + r[:, None] * width + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                     mask=(r[:, None] < out_rows) & k_ok[None, :])


def launch_config(out_rows: int, block: int) -> dict:
    """Tile sizes: up to 64 rows a program, about 128 output columns (``GROUP`` blocks) a program."""
    block_p2 = triton.next_power_of_2(block)
    rows = 16 if out_rows <= 16 else 32 if out_rows <= 64 else 64
    return {"ROWS": rows, "BLOCK_P2": block_p2, "GROUP": max(1, 128 // block_p2)}


def block_diag_rows_triton(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                           row_multiple: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``src (R, n·d_b) @ blockdiag(blocks)ᵀ (+ bias)``, ``R`` padded with zero rows to ``row_multiple``."""
    rows = src.shape[0]
    n_blocks, block, _ = blocks.shape
    out_rows = rows + (-rows) % row_multiple
    out = torch.empty(out_rows, n_blocks * block, device=src.device, dtype=out_dtype)
    if out_rows == 0:
        return out
    blocks = blocks.contiguous()
    cfg = launch_config(out_rows, block)
    grid = (triton.cdiv(out_rows, cfg["ROWS"]), triton.cdiv(n_blocks, cfg["GROUP"]))
    _block_diag_rows_kernel[grid](
        src, blocks, bias if bias is not None else blocks, out,
        rows, out_rows, n_blocks, src.stride(0), src.stride(1),
        BLOCK=block, HAS_BIAS=bias is not None,
        USE_DOT=cfg["ROWS"] >= 16 and cfg["BLOCK_P2"] >= 16,
        PRECISION="ieee" if blocks.dtype == torch.float32 else "tf32",
        **cfg,
    )
    return out
