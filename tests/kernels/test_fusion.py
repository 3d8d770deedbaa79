"""Linears that read the same input share one B-pass: the multi-stack kernel and the graph pass."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.kernels import fusion
from torch_armor.kernels.block_diag import block_diag_rows_reference

triton_block_diag = pytest.importorskip("torch_armor.kernels.triton_block_diag", reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
single = torch.ops.torch_armor.block_diag_rows


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.sampled_from([8, 16, 32]), st.integers(1, 40), st.sampled_from([1, 8]),
       st.sampled_from([torch.float32, torch.bfloat16]), st.booleans(), st.integers(0, 2**16))
def test_shared_kernel_equals_one_launch_per_stack(members, block, rows, row_multiple, dtype, mixed, seed):
    """Every member's output is what the single-stack kernel gives for it (same rounding), for up to 6
    stacks (more than one launch holds) of one shape or of two (q/k/v blocks of other sizes)."""
    gen = torch.Generator().manual_seed(seed)
    width = 2 * 32
    src = torch.randn(rows, width, generator=gen).to(DEVICE, dtype)
    sizes = [block if not (mixed and i % 2) else 32 for i in range(members)]
    blocks = [torch.randn(width // d, d, d, generator=gen).to(DEVICE, dtype) for d in sizes]
    shared = triton_block_diag.block_diag_rows_shared_triton(src, blocks, row_multiple, dtype)
    assert len(shared) == members
    for out, b in zip(shared, blocks):
        alone = triton_block_diag.block_diag_rows_triton(src, b, None, row_multiple, dtype)
        assert torch.equal(out, alone)
        want = block_diag_rows_reference(src.double(), b.double(), None, row_multiple, torch.float64)
        assert float((out.double() - want).norm() / want.norm()) <= (1e-5 if dtype == torch.float32 else 2e-2)


class _Recording(fusion.ShareWrapperInputs):
    merged = 0

    def __call__(self, graph):
        type(self).merged += fusion.share_wrapper_inputs(graph)


def test_the_pass_under_inductor_merges_and_keeps_every_output(monkeypatch):
    """A real inductor compile (CPU) with the pass: the three bias-free passes of one input become one
    shared op, a pass with a bias and a pass of another input stay single; every output as in eager."""
    gen = torch.Generator().manual_seed(0)
    x, other = torch.randn(13, 64, generator=gen), torch.randn(5, 64, generator=gen)
    bq, bk, bv, bo = (torch.randn(4, 16, 16, generator=gen) for _ in range(4))
    bias = torch.randn(64, generator=gen)

    def block(x, other, bq, bk, bv, bo, bias):
        flat = x.reshape(-1, 64)
        q, k, v = (single(flat.view(-1, 64), b, None, 8, torch.float32) for b in (bq, bk, bv))
        return q + k * v, single(x, bo, bias, 1, torch.float32), single(other, bq, None, 8, torch.float32)

    options = fusion.compile_options()
    options.update(post_grad_custom_post_pass=_Recording(), fx_graph_cache=False)  # a cache hit runs no pass
    torch._dynamo.reset()
    compiled = torch.compile(block, fullgraph=True, options=options)
    args = (x, other, bq, bk, bv, bo, bias)
    for got, want in zip(compiled(*args), block(*args)):
        torch.testing.assert_close(got, want)
    assert _Recording.merged == 1
