"""A converted Hugging Face Llama under torch.compile (fullgraph, no graph breaks) and model.generate."""

from __future__ import annotations

import pytest
import torch

from torch_armor.tensor.armor_tensor import ArmorTensor

from conftest import make_converted_tiny_llama


@pytest.fixture(scope="module")
def converted_llama():
    """Tiny LlamaForCausalLM (hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab 128), converted."""
    model = make_converted_tiny_llama(iters=5)
    converted = [m for m in model.modules() if isinstance(getattr(m, "weight", None), ArmorTensor)]
    assert len(converted) == 14  # 7 linears x 2 layers; lm_head stays dense
    return model


def test_no_graph_breaks(converted_llama):
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        explained = torch._dynamo.explain(converted_llama)(ids)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1


def test_compiled_fullgraph_matches_eager(converted_llama):
    """One inductor compile of the whole model (the slow test of this file: ~30 s on 2 CPU cores)."""
    torch._dynamo.reset()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    compiled = torch.compile(converted_llama, fullgraph=True)
    with torch.no_grad():
        eager = converted_llama(ids).logits
        out = compiled(ids).logits
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-4)


def test_generate_matches_greedy_loop(converted_llama):
    """model.generate (KV cache) gives the same tokens as argmax over full re-computations."""
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        generated = converted_llama.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False, pad_token_id=0,
            eos_token_id=None,  # never stop early: compare all 6 new tokens
        )
        assert generated.shape == (2, 11)
        assert torch.equal(generated[:, :5], ids)
        seq = ids
        for _ in range(6):
            nxt = converted_llama(seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(generated, seq)
