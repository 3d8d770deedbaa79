"""8-bit cores: per-row quantization, the 8-bit GEMM's numbers, and the Triton B-pass (quantizing) and
A-pass (scaling) kernels, against float64 and against each other."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.kernels.block_diag import block_diag_rows_reference
from torch_armor.kernels.quant8 import QDTYPES, dequantize_rows, quantize_rows, scaled_core_mm_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(seed: int, rows: int, cols: int, spread: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    return x * torch.logspace(0, spread, cols, dtype=torch.float64)[torch.randperm(cols, generator=gen)]


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 9), st.integers(1, 70), st.floats(0, 3), st.sampled_from(sorted(QDTYPES)))
def test_quantize_rows_error_bound(seed, rows, cols, spread, qdtype):
    """Each value comes back within half a step (int8) or half an e4m3 ulp (fp8) of where it was; the
    largest magnitude of a row maps to the format's largest value."""
    x = _rows(seed, rows, cols, spread)
    x[0] = 0.0  # an all-zero row stays zero
    q, scale = quantize_rows(x, qdtype)
    dtype, qmax = QDTYPES[qdtype]
    assert q.dtype == dtype and scale.dtype == torch.float32 and scale.shape == (rows,)
    back = dequantize_rows(q, scale, torch.float64)
    x32 = x.float().double()
    s = scale.double()[:, None]
    if qdtype == "int8":
        bound = s * (0.5 + 1e-6)
    else:  # 3 mantissa bits: half an ulp is 2^-4 of the value; subnormals are spaced 2^-9 (times the scale)
        bound = x32.abs() * 2.0 ** -4 + s * 2.0 ** -10 + 1e-30
    assert bool(((back - x32).abs() <= bound * (1 + 1e-6)).all())
    assert bool((q[0].float() == 0).all())
    assert torch.allclose(q[1:].float().abs().amax(dim=1), torch.full((rows - 1,), qmax), rtol=0, atol=0)


@pytest.mark.parametrize("qdtype", sorted(QDTYPES))
def test_scaled_core_mm_rows_is_the_product_of_the_dequantized_operands(qdtype):
    gen = torch.Generator().manual_seed(1)
    rows, core = torch.randn(11, 64, generator=gen), torch.randn(32, 64, generator=gen)
    core = core * (torch.rand(32, 64, generator=gen) < 0.5)
    q_core, core_scale = quantize_rows(core, qdtype)
    got = scaled_core_mm_rows(rows, q_core, core_scale, qdtype, torch.float64)
    q_rows, row_scale = quantize_rows(rows, qdtype)
    want = (q_rows.double() * row_scale.double()[:, None]) @ (q_core.double() * core_scale.double()[:, None]).T
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-9)  # float32 scaling of the sums
    exact = rows.double() @ core.double().T  # and close to the unquantized product
    assert float((got - exact).norm() / exact.norm()) < (0.02 if qdtype == "int8" else 0.1)


triton_quant8 = pytest.importorskip("torch_armor.kernels.triton_quant8", reason="needs triton")


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**16), st.integers(1, 40), st.sampled_from([8, 16, 32]), st.integers(1, 4),
       st.sampled_from([1, 8, 16]), st.sampled_from(sorted(QDTYPES)))
def test_quantizing_b_pass_equals_quantizing_the_b_pass_output(seed, rows, block, n_blocks, row_multiple, qdtype):
    """In float32 the kernel's 8-bit values and scales are exactly those of :func:`quantize_rows` applied to
    the reference B-pass (zero rows for the padding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n_blocks * block, generator=gen).to(DEVICE)
    blocks = (torch.randn(n_blocks, block, block, generator=gen) / block ** 0.5).to(DEVICE)
    q, scale = triton_quant8.quantizing_b_pass_triton(x, blocks, row_multiple, *QDTYPES[qdtype])
    want_q, want_scale = quantize_rows(block_diag_rows_reference(x, blocks, None, row_multiple, torch.float32), qdtype)
    assert q.dtype == QDTYPES[qdtype][0] and q.shape == want_q.shape
    assert torch.equal(q.cpu().float(), want_q.cpu().float())
    torch.testing.assert_close(scale.cpu(), want_scale.cpu(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("qdtype", sorted(QDTYPES))
def test_quantizing_b_pass_in_bf16(qdtype):
    """In bf16 the B-pass output is rounded to bf16 before quantizing, as the unquantized path has it: the
    kernel's values are those of the float64 B-pass rounded to bf16, within one 8-bit step."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(29, 128, generator=gen).to(DEVICE, torch.bfloat16)
    blocks = (torch.randn(8, 16, 16, generator=gen) / 4).to(DEVICE, torch.bfloat16)
    q, scale = triton_quant8.quantizing_b_pass_triton(x, blocks, 8, *QDTYPES[qdtype])
    y = (x.double().cpu() @ torch.block_diag(*blocks.double().cpu()).T).bfloat16().double()
    back = dequantize_rows(q.cpu()[:29], scale.cpu()[:29], torch.float64)
    step = scale.cpu()[:29].double()[:, None] * (1.0 if qdtype == "int8" else 32.0)
    assert bool(((back - y).abs() <= step * 1.01 + y.abs() * 2.0 ** -3).all())


def test_scaled_a_pass_matches_float64():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(21, 64, generator=gen)
    row_scale, col_scale = torch.rand(21, generator=gen) + 0.1, torch.rand(64, generator=gen) + 0.1
    blocks, bias = torch.randn(4, 16, 16, generator=gen), torch.randn(64, generator=gen)
    out = triton_quant8.scaled_a_pass_triton(z.to(DEVICE), blocks.to(DEVICE), bias.to(DEVICE), row_scale.to(DEVICE),
                                             col_scale.to(DEVICE), torch.float32)
    want = (z.double() * row_scale.double()[:, None] * col_scale.double()[None, :]) @ torch.block_diag(*blocks.double()).T
    want = want + bias.double()
    assert out.shape == (21, 64) and float((out.cpu().double() - want).norm() / want.norm()) < 1e-6


def test_fp8_ties_round_to_even_as_torch_does():
    """Values exactly halfway between two e4m3 values (the scale is 1: the row's largest value is 448)."""
    ties = [448.0, 8.5, 9.5, 17.0, 19.0, -8.5, -9.5, 0.5 * 2.0 ** -9, 3 * 2.0 ** -10, 104.0, 120.0, 0.0, 1.0625,
            1.1875, -240.0, 2.25]
    x = torch.tensor([ties]).to(DEVICE)
    q, scale = triton_quant8.quantizing_b_pass_triton(x, torch.eye(16)[None].to(DEVICE), 1, *QDTYPES["fp8"])
    assert float(scale) == 1.0
    assert q.cpu().float().tolist() == torch.tensor([ties]).to(torch.float8_e4m3fn).float().tolist()
