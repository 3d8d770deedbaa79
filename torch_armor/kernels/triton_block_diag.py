"""The Triton kernel behind :func:`torch_armor.kernels.block_diag.block_diag_rows` on CUDA.

One pass over the rows of ``src``: each program reads a ``ROWS × d_b`` tile of every one of its
``GROUP`` diagonal blocks, multiplies it by that block's transpose (fp32 accumulation), adds the
bias where there is one and writes the tile, cast, into a row-major output that may have more
rows than ``src`` (those rows are written as zeros: the 2:4 GEMM's token padding costs no pass of
its own). ``src`` may have any strides (a row-major activation, a narrowed or transposed GEMM output).
One launch can serve up to :data:`MAX_MEMBERS` block stacks on the same input (the B-passes of q/k/v,
of gate/up): each tile of ``src`` is read once and multiplied by every stack.

Importing this module needs ``triton``. Under ``TRITON_INTERPRET=1`` (set before this module is
imported) the same kernel runs on CPU tensors, which is how ``tests/kernels`` checks it.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
import triton
import triton.language as tl

__all__ = ["MAX_MEMBERS", "block_diag_rows_triton", "block_diag_rows_shared_triton", "launch_config"]


@triton.jit
def _block_diag_rows_kernel(
    src_ptr, blocks0, blocks1, blocks2, blocks3, bias_ptr, out0, out1, out2, out3,
    rows, out_rows, n_blocks, src_row_stride, src_col_stride,
    MEMBERS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_P2: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
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
            # x is rounded to the blocks' dtype first (the core's dtype: what the GEMM reads), then
            # both go to fp32: fp16/bf16 values are exact in tf32, so PRECISION="tf32" is the
            # half-precision product on tensor cores, and the Triton interpreter (no bf16 matmul) agrees
            x = x.to(blocks0.dtype.element_ty).to(tl.float32)
            for m in tl.static_range(MEMBERS):  # linears that read the same input: x is read once
                if m == 0:
                    blocks_ptr, out_ptr = blocks0, out0
                elif m == 1:
                    blocks_ptr, out_ptr = blocks1, out1
                elif m == 2:
                    blocks_ptr, out_ptr = blocks2, out2
                else:
                    blocks_ptr, out_ptr = blocks3, out3
                w = tl.load(blocks_ptr + j * BLOCK * BLOCK + k[:, None] * BLOCK + k[None, :],
                            mask=k_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
                if USE_DOT:
                    acc = tl.dot(x, tl.trans(w), input_precision=PRECISION)
                else:  # blocks narrower than 16 (tests, tiny models): tl.dot needs 16
                    acc = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
                if HAS_BIAS:
                    b = tl.load(bias_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
                    acc += tl.where(r_in[:, None], b[None, :], 0.0)
                tl.store(out_ptr + r[:, None] * width + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                         mask=(r[:, None] < out_rows) & k_ok[None, :])


#: the most linears one launch serves (q/k/v: 3, gate/up: 2)
MAX_MEMBERS = 4


def launch_config(out_rows: int, block: int) -> dict:
    """Tile sizes: up to 64 rows a program, about 128 output columns (``GROUP`` blocks) a program."""
    block_p2 = triton.next_power_of_2(block)
    rows = 16 if out_rows <= 16 else 32 if out_rows <= 64 else 64
    return {"ROWS": rows, "BLOCK_P2": block_p2, "GROUP": max(1, 128 // block_p2)}


def block_diag_rows_triton(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                           row_multiple: int, out_dtype: torch.dtype) -> torch.Tensor:
    """``src (R, n·d_b) @ blockdiag(blocks)ᵀ (+ bias)``, ``R`` padded with zero rows to ``row_multiple``."""
    return _launch(src, [blocks], bias, row_multiple, out_dtype)[0]


def block_diag_rows_shared_triton(src: torch.Tensor, blocks: Sequence[torch.Tensor], row_multiple: int,
                                  out_dtype: torch.dtype) -> List[torch.Tensor]:
    """:func:`block_diag_rows_triton` for several block stacks on one input: one launch for up to
    :data:`MAX_MEMBERS` stacks of one shape, which reads ``src`` once."""
    outs: List[Optional[torch.Tensor]] = [None] * len(blocks)
    by_shape: dict = {}
    for i, b in enumerate(blocks):
        by_shape.setdefault(tuple(b.shape), []).append(i)
    for members in by_shape.values():
        for start in range(0, len(members), MAX_MEMBERS):
            chunk = members[start:start + MAX_MEMBERS]
            for i, out in zip(chunk, _launch(src, [blocks[i] for i in chunk], None, row_multiple, out_dtype)):
                outs[i] = out
    return outs


def _launch(src, blocks, bias, row_multiple, out_dtype) -> List[torch.Tensor]:
    rows = src.shape[0]
    n_blocks, block, _ = blocks[0].shape
    out_rows = rows + (-rows) % row_multiple
    outs = [torch.empty(out_rows, n_blocks * block, device=src.device, dtype=out_dtype) for _ in blocks]
    if out_rows == 0:
        return outs
    blocks = [b.contiguous() for b in blocks]
    padded_blocks = blocks + [blocks[0]] * (MAX_MEMBERS - len(blocks))
    padded_outs = outs + [outs[0]] * (MAX_MEMBERS - len(outs))
    cfg = launch_config(out_rows, block)
    grid = (triton.cdiv(out_rows, cfg["ROWS"]), triton.cdiv(n_blocks, cfg["GROUP"]))
    _block_diag_rows_kernel[grid](
        src, *padded_blocks, bias if bias is not None else blocks[0], *padded_outs,
        rows, out_rows, n_blocks, src.stride(0), src.stride(1),
        MEMBERS=len(blocks), BLOCK=block, HAS_BIAS=bias is not None,
        USE_DOT=cfg["ROWS"] >= 16 and cfg["BLOCK_P2"] >= 16,
        PRECISION="ieee" if blocks[0].dtype == torch.float32 else "tf32",
        **cfg,
    )
    return outs
