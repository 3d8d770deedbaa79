"""A pruned Hugging Face Llama with 2:4 cores, as a GPU would run it, on a CPU-only machine.

The model lives on the ``meta`` device with the storage policy told it is an sm90 GPU
(``_fake_cuda.meta_gpu``: a CPU-only torch cannot index fake CUDA tensors, and every HF model
indexes): its linears hold cuSPARSELt cores and take the CUDA path, so the strides reaching attention
and the compiled decode step's ops are those a GPU would see. Speed needs a GPU
(``benchmarks/gpu_check.py``)."""

from __future__ import annotations

import collections
import inspect

import pytest
import torch
from transformers import StaticCache
from transformers.integrations import sdpa_attention

from _fake_cuda import meta_gpu, traced_ops
from conftest import make_converted_tiny_llama

from torch_armor.kernels import block_diag as block_diag_kernels
from torch_armor.kernels.fusion import share_wrapper_inputs
from torch_armor.tensor.semi_structured import CusparseltArmorTensor

HOST_SYNCS = ("aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal", "aten.is_nonzero")


@pytest.fixture(scope="module")
def pruned_llama():
    """The tiny random Llama (hidden 64, 2 layers, 4 heads, 2 kv heads), every decoder linear ARMOR 2:4."""
    return make_converted_tiny_llama(iters=1)


@pytest.fixture
def on_meta_gpu(pruned_llama, monkeypatch, request):
    """The pruned model in bf16 on the meta GPU (a copy: the module fixture stays on CPU)."""
    import copy

    if getattr(request, "param", "fused") == "bmm":
        monkeypatch.setattr(block_diag_kernels, "triton_importable", lambda: False)
    else:
        pytest.importorskip("triton")
    with meta_gpu(monkeypatch):
        model = copy.deepcopy(pruned_llama).to("meta", torch.bfloat16)
        weights = [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), CusparseltArmorTensor)]
        assert len(weights) == 14  # 7 linears x 2 blocks, all 2:4 cuSPARSELt cores
        yield model


@pytest.mark.parametrize("on_meta_gpu", ["fused", "bmm"], indirect=True)
@pytest.mark.parametrize("tokens", [16, 1])
def test_attention_gets_row_major_q_k_v(on_meta_gpu, monkeypatch, tokens):
    """Issue #41 row 1: before, q/k/v reached ``scaled_dot_product_attention`` with last-dimension stride
    ``T`` (16 at 16 tokens), which rules out SDPA's flash, memory-efficient and cuDNN kernels; dense
    models give stride 1."""
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def record(q, k, v, *args, **kwargs):
        seen.append((q.stride(-1), k.stride(-1), v.stride(-1)))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(sdpa_attention.torch.nn.functional, "scaled_dot_product_attention", record)
    with torch.no_grad():
        on_meta_gpu(torch.zeros(2, tokens, dtype=torch.long, device="meta"))
    assert seen == [(1, 1, 1)] * 2, seen


def _cache_kwargs(model, cache):
    """The static cache under the keyword this transformers calls it (``cache`` in 5.x, earlier ``past_key_values``)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return {name: cache, "use_cache": True}


def _decode_step_ops(model, graph_pass=None):
    cache = StaticCache(config=model.config, max_cache_len=32)
    kwargs = _cache_kwargs(model, cache)
    with torch.no_grad():
        model(torch.zeros(1, 8, dtype=torch.long, device="meta"), cache_position=torch.arange(8, device="meta"), **kwargs)
        torch._dynamo.utils.counters.clear()
        return traced_ops(lambda tok, pos: model(tok, cache_position=pos, **kwargs).logits,
                          torch.zeros(1, 1, dtype=torch.long, device="meta"), torch.tensor([8], device="meta"),
                          graph_pass=graph_pass)


def test_compiled_decode_step_is_one_graph_without_host_syncs(on_meta_gpu):
    """Issue #41 row 4: a decode step with transformers' static cache, traced as ``torch.compile`` would for
    CUDA graphs (``mode="reduce-overhead"``): one graph, no graph break, nothing that syncs the host; every
    linear two wrapper kernels around one sparse GEMM, no padding op."""
    ops, logits = _decode_step_ops(on_meta_gpu)
    counts = collections.Counter(ops)
    print(f"\ncompiled decode step (tiny Llama, 2 blocks): {len(ops)} ops: {dict(counts)}")
    assert not torch._dynamo.utils.counters["graph_break"]
    assert not [op for op in ops if op.startswith(HOST_SYNCS)], ops
    assert counts["aten._cslt_sparse_mm.default"] == 14 and counts["torch_armor.block_diag_rows.default"] == 28
    assert "aten.constant_pad_nd.default" not in counts
    assert logits.shape == (1, 1, 128)


def test_q_k_v_and_gate_up_share_one_b_pass_when_compiled_with_the_pass(on_meta_gpu):
    """Issue #41, build item 2: linears that read the same input get one B-pass launch. With
    ``compile_options()``'s pass, each block's q/k/v B-passes are one ``block_diag_rows_shared`` and so are
    gate/up's: 2 per block instead of 5 separate launches."""
    ops, _ = _decode_step_ops(on_meta_gpu, graph_pass=share_wrapper_inputs)
    counts = collections.Counter(ops)
    print(f"\ndecode step with the shared-input pass: {dict(counts)}")
    assert counts["torch_armor.block_diag_rows_shared.default"] == 2 * 2
    # per block: the B-passes of o_proj and down_proj and the 7 A-passes stay single
    assert counts["torch_armor.block_diag_rows.default"] == 2 * (2 + 7)
    assert counts["aten._cslt_sparse_mm.default"] == 14
