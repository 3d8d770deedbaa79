"""The wrapper pass ``src · blockdiag(blocks)ᵀ (+ bias)``: Triton kernel and reference against float64.

Without a GPU the Triton kernel runs under ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py): the same
kernel source, executed by Triton's interpreter on CPU tensors. Speed needs a GPU
(``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.kernels.block_diag import block_diag_rows, block_diag_rows_reference

triton_block_diag = pytest.importorskip("torch_armor.kernels.triton_block_diag", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
#: relative error allowed against float64: input and output rounding of the dtype (bf16: 2^-8 each)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def _expected(src: torch.Tensor, blocks: torch.Tensor, bias, row_multiple: int) -> torch.Tensor:
    """float64, from the dense block-diagonal matrix (independent of the batched-block code)."""
    out = src.double() @ torch.block_diag(*blocks.double()).T
    if bias is not None:
        out = out + bias.double()
    pad = (-src.shape[0]) % row_multiple
    return torch.cat([out, out.new_zeros(pad, out.shape[1])]) if pad else out


def _check(out, want, src_rows, dtype):
    assert out.shape == want.shape and out.is_contiguous()
    real = out[:src_rows].double()
    err = float((real - want[:src_rows]).norm() / want[:src_rows].norm().clamp_min(1e-30))
    assert err <= TOLERANCE[dtype], err
    assert bool(out[src_rows:].eq(0).all()), "padding rows must be exact zeros"


@st.composite
def problems(draw):
    block = draw(st.sampled_from([4, 8, 12, 16, 24, 32, 96]))
    n_blocks = draw(st.integers(1, 5))
    rows = draw(st.integers(1, 70))
    layout = draw(st.sampled_from(["rows", "transposed", "narrowed"]))
    return {
        "block": block, "n_blocks": n_blocks, "rows": rows, "layout": layout,
        "row_multiple": draw(st.sampled_from([1, 8, 16])),
        "blocks_dtype": draw(st.sampled_from(FLOATS)),
        "src_dtype": draw(st.sampled_from(FLOATS)),
        "out_dtype": draw(st.sampled_from(FLOATS)),
        "bias": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _inputs(p):
    gen = torch.Generator().manual_seed(p["seed"])
    width = p["n_blocks"] * p["block"]
    full = torch.randn(p["rows"] + 3, width + 5, generator=gen, dtype=torch.float64)
    if p["layout"] == "rows":
        src = full[: p["rows"], :width].contiguous()
    elif p["layout"] == "transposed":  # a GEMM output read transposed (CUTLASS's (d_out, T))
        src = full[: p["rows"], :width].t().contiguous().t()
    else:  # the first T rows of a padded GEMM output (row stride > width)
        src = full[: p["rows"], :width]
    blocks = torch.randn(p["n_blocks"], p["block"], p["block"], generator=gen, dtype=torch.float64) / p["block"] ** 0.5
    bias = torch.randn(width, generator=gen, dtype=torch.float64) if p["bias"] else None
    return src, blocks, bias


def _cast(src, blocks, bias, p):
    """The inputs in their test dtypes on the test device (layout kept), plus the float64 values they hold."""
    def to(t, dtype):
        return None if t is None else t.to(DEVICE, dtype)

    src_cast = to(src, p["src_dtype"])
    if p["layout"] == "transposed":
        src_cast = src_cast.t().contiguous().t()
    elif p["layout"] == "narrowed":
        padded = torch.zeros(src.shape[0], src.shape[1] + 5, dtype=p["src_dtype"], device=DEVICE)
        padded[:, : src.shape[1]] = src_cast
        src_cast = padded[:, : src.shape[1]]
    # the kernel rounds the input to the blocks' dtype before multiplying (as the GEMM's operand is)
    src_exact = src.to(p["src_dtype"]).to(p["blocks_dtype"]).double()
    blocks_cast, bias_cast = to(blocks, p["blocks_dtype"]), to(bias, p["blocks_dtype"])
    return src_cast, blocks_cast, bias_cast, src_exact, blocks_cast.double().cpu(), None if bias is None else bias_cast.double().cpu()


def _tolerance_dtype(p):
    """The coarsest dtype the values pass through."""
    order = [torch.float32, torch.float16, torch.bfloat16]
    return max((p["blocks_dtype"], p["out_dtype"]), key=order.index)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_triton_kernel_matches_float64(p):
    src, blocks, bias = _inputs(p)
    src_t, blocks_t, bias_t, src_x, blocks_x, bias_x = _cast(src, blocks, bias, p)
    out = triton_block_diag.block_diag_rows_triton(src_t, blocks_t, bias_t, p["row_multiple"], p["out_dtype"])
    assert out.dtype == p["out_dtype"] and out.device.type == DEVICE
    _check(out.cpu(), _expected(src_x, blocks_x, bias_x, p["row_multiple"]), p["rows"], _tolerance_dtype(p))


@settings(max_examples=40, deadline=None)
@given(problems())
def test_reference_matches_float64(p):
    src, blocks, bias = _inputs(p)
    src_t, blocks_t, bias_t, src_x, blocks_x, bias_x = _cast(src, blocks, bias, p)
    out = block_diag_rows_reference(src_t, blocks_t, bias_t, p["row_multiple"], p["out_dtype"])
    want = _expected(src_x, blocks_x, bias_x, p["row_multiple"])
    # the reference rounds once more (blocks' dtype before the bias and the cast to out_dtype)
    dtype = torch.bfloat16 if torch.bfloat16 in (p["blocks_dtype"], p["out_dtype"]) else _tolerance_dtype(p)
    _check(out.cpu(), want, p["rows"], dtype)


@pytest.mark.parametrize("tokens", [1, 7, 8, 13, 2048])
def test_triton_kernel_and_reference_agree_at_decode_and_prefill_sizes(tokens):
    """The sizes an LLM sends: one decode token up to a prefill, Llama-shaped width, bf16, d_b 16."""
    gen = torch.Generator().manual_seed(tokens)
    src = torch.randn(tokens, 512, generator=gen).to(DEVICE, torch.bfloat16)
    blocks = (torch.randn(32, 16, 16, generator=gen) / 4).to(DEVICE, torch.bfloat16)
    fused = triton_block_diag.block_diag_rows_triton(src, blocks, None, 8, torch.bfloat16)
    reference = block_diag_rows_reference(src, blocks, None, 8, torch.bfloat16)
    assert fused.shape == reference.shape == (tokens + (-tokens) % 8, 512)
    err = (fused.float() - reference.float()).norm() / reference.float().norm()
    assert float(err) <= 1e-2


def test_empty_input():
    blocks = torch.randn(2, 16, 16).to(DEVICE)
    out = triton_block_diag.block_diag_rows_triton(torch.empty(0, 32, device=DEVICE), blocks, None, 8, torch.float32)
    assert out.shape == (0, 32)


def test_custom_op_registration():
    """The op's fake implementation, schema and autograd registration as torch checks them."""
    src, blocks, bias = torch.randn(13, 48), torch.randn(3, 16, 16), torch.randn(48)
    torch.library.opcheck(block_diag_rows, (src, blocks, bias, 8, torch.float32))
    torch.library.opcheck(block_diag_rows, (src.t().contiguous().t(), blocks, None, 1, torch.bfloat16))
