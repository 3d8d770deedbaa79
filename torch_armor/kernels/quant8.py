"""8-bit (int8, fp8 e4m3) 2:4 cores: the numbers a cuSPARSELt 8-bit GEMM computes, in plain torch.

An ARMOR linear with an 8-bit core runs ``y = A · s_x ⊙ (q_core · q_x) ⊙ s_w · B``:

* the core is quantized once, per output channel (:func:`quantize_rows` of the core: ``q_core`` and
  ``s_w (d_out,)``), only the kept 2:4 values counting;
* the B-pass output is quantized per token, dynamically (:func:`quantize_rows` of ``x · Bᵀ``:
  ``q_x`` and ``s_x (T,)``) — on a GPU in the B-pass kernel itself, as it writes the GEMM's operand;
* the GEMM multiplies the 8-bit values exactly, accumulating in int32 (int8) or fp32 (fp8), and the
  scales are applied to its output, where the A-pass reads it (:func:`scaled_core_mm_rows`).

Symmetric quantization, the largest magnitude of a row mapped to 127 (int8, rounded to nearest, ties
away from zero) or 448 (fp8 e4m3, the format's own round-to-nearest-even). This module is the reference every 8-bit path (a CPU
format, the GPU kernels) is checked against.

Example::

    >>> import torch
    >>> q, scale = quantize_rows(torch.tensor([[0.5, -1.0, 0.25, 0.0]]), "int8")
    >>> q.tolist(), [round(float(s) * 127, 6) for s in scale]
    ([[64, -127, 32, 0]], [1.0])
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from torch_armor.kernels.block_diag import block_diag_rows_reference, triton_importable

__all__ = ["QDTYPES", "quantize_rows", "dequantize_rows", "scaled_core_mm_rows", "quantizing_b_pass",
           "quantizing_b_pass_reference", "scaled_a_pass", "scaled_a_pass_reference"]

#: the 8-bit formats: (torch dtype, largest magnitude a row is scaled to)
QDTYPES = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
_TINY = 1e-12  # an all-zero row gets this scale (its values quantize to 0 either way)


def _qdtype(name: str):
    if name not in QDTYPES:
        raise ValueError(f"8-bit format must be one of {sorted(QDTYPES)}, got {name!r}")
    return QDTYPES[name]


def quantize_rows(x: torch.Tensor, qdtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric quantization of ``x (R, K)``: ``(q (R, K) 8-bit, scale (R,) float32)`` with
    ``x ≈ q · scale[:, None]``."""
    dtype, qmax = _qdtype(qdtype)
    x = x.float()
    scale = (x.abs().amax(dim=1) / qmax).clamp_min(_TINY)
    scaled = x / scale[:, None]
    if dtype == torch.int8:
        return (scaled.sign() * (scaled.abs() + 0.5).floor()).clamp(-qmax, qmax).to(torch.int8), scale
    bits = scaled.clamp(-qmax, qmax).to(dtype).view(torch.uint8)
    return torch.where(bits == 0x80, 0, bits).view(dtype), scale  # -0 is 0: zeros stay off the 2:4 support


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q · scale[:, None]`` in ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


def scaled_core_mm_rows(rows: torch.Tensor, q_core: torch.Tensor, core_scale: torch.Tensor, qdtype: str,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """``rows (T, d_in) · coreᵀ`` as the 8-bit GEMM computes it: ``rows`` quantized per token, the 8-bit
    products summed as the GPU sums them (int8: exactly, as its int32 — in float32 where no sum can reach
    2^24, else float64; fp8: in float32), then ``s_x[:, None] · s_w[None, :]``; ``(T, d_out)``."""
    q_rows, row_scale = quantize_rows(rows, qdtype)
    d_in = rows.shape[1]
    exact_in_float32 = qdtype == "fp8" or d_in * 127 * 127 < 2 ** 24
    acc_dtype = torch.float32 if exact_in_float32 else torch.float64
    acc = q_rows.to(acc_dtype) @ q_core.to(acc_dtype).t()
    return (acc * row_scale.to(acc_dtype)[:, None] * core_scale.to(acc_dtype)[None, :]).to(out_dtype)


# ----------------------------------------------------------------------- the 8-bit linear's two passes


def quantizing_b_pass_reference(src: torch.Tensor, blocks: torch.Tensor, row_multiple: int,
                                qdtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantizing_b_pass` in plain torch: the B-pass (:func:`block_diag_rows_reference`) quantized per row."""
    return quantize_rows(block_diag_rows_reference(src, blocks, None, row_multiple, blocks.dtype), qdtype)


def scaled_a_pass_reference(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor],
                            row_scale: torch.Tensor, col_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """:func:`scaled_a_pass` in plain torch."""
    scaled = src.float() * row_scale.float()[:, None] * col_scale.float()[None, :]
    return block_diag_rows_reference(scaled, blocks, bias, 1, out_dtype)


@torch.library.custom_op("torch_armor::quantizing_b_pass", mutates_args=())
def quantizing_b_pass(src: torch.Tensor, blocks: torch.Tensor, row_multiple: int,
                      qdtype: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit linear's B-pass: ``x · blockdiag(B)ᵀ`` quantized per token (``qdtype`` ``"int8"`` or
    ``"fp8"``), rows padded with zeros to ``row_multiple``: ``(q (T', d_in), scale (T',) float32)``."""
    return quantizing_b_pass_reference(src, blocks, row_multiple, qdtype)


@quantizing_b_pass.register_fake
def _(src, blocks, row_multiple, qdtype):
    rows = src.shape[0] + (-src.shape[0]) % row_multiple
    return (src.new_empty((rows, blocks.shape[0] * blocks.shape[1]), dtype=QDTYPES[qdtype][0]),
            src.new_empty((rows,), dtype=torch.float32))


@quantizing_b_pass.register_kernel("cuda")
def _(src, blocks, row_multiple, qdtype):
    if not triton_importable():
        return quantizing_b_pass_reference(src, blocks, row_multiple, qdtype)
    from torch_armor.kernels.triton_quant8 import quantizing_b_pass_triton  # local: imports triton

    return quantizing_b_pass_triton(src, blocks, row_multiple, *QDTYPES[qdtype])


@torch.library.custom_op("torch_armor::scaled_a_pass", mutates_args=())
def scaled_a_pass(src: torch.Tensor, blocks: torch.Tensor, bias: Optional[torch.Tensor], row_scale: torch.Tensor,
                  col_scale: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The 8-bit linear's A-pass: ``(z ⊙ row_scale ⊗ col_scale) · blockdiag(A)ᵀ (+ bias)``, row-major."""
    return scaled_a_pass_reference(src, blocks, bias, row_scale, col_scale, out_dtype)


@scaled_a_pass.register_fake
def _(src, blocks, bias, row_scale, col_scale, out_dtype):
    return src.new_empty((src.shape[0], blocks.shape[0] * blocks.shape[1]), dtype=out_dtype)


@scaled_a_pass.register_kernel("cuda")
def _(src, blocks, bias, row_scale, col_scale, out_dtype):
    if not triton_importable():
        return scaled_a_pass_reference(src, blocks, bias, row_scale, col_scale, out_dtype)
    from torch_armor.kernels.triton_quant8 import scaled_a_pass_triton  # local: imports triton

    return scaled_a_pass_triton(src, blocks, bias, row_scale, col_scale, out_dtype)
