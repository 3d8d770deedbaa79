"""Every supported decoder architecture, end to end on a tiny random config: ``prune_model`` →
``model.save_pretrained`` → ``AutoModelForCausalLM.from_pretrained`` → bit-identical logits, ``generate``."""

from __future__ import annotations

import pytest
import torch

import torch_armor  # noqa: F401  (registers the ARMOR quantizer)
from torch_armor import ArmorConfig, ArmorTensor, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig

VOCAB = 96
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False)


def _config(arch: str):
    import transformers as tf

    if arch == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, **_COMMON)
    if arch == "mistral":
        return tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **_COMMON)
    if arch == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, **_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(num_key_value_heads=2, head_dim=16, **_COMMON)
    if arch == "gemma2":
        return tf.Gemma2Config(num_key_value_heads=2, head_dim=16, **_COMMON)
    if arch == "gemma3":
        return tf.Gemma3TextConfig(num_key_value_heads=2, head_dim=16, sliding_window=8, **_COMMON)
    if arch == "phi3":
        return tf.Phi3Config(num_key_value_heads=4, pad_token_id=0, **_COMMON)
    if arch == "gpt_neox":
        kw = {k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"}
        return tf.GPTNeoXConfig(tie_word_embeddings=False, **kw)
    raise AssertionError(arch)


ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "phi3", "gpt_neox"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prune_save_from_pretrained_generate(arch, tmp_path, one_thread):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    windows = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    report = prune_model(model, windows, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    converted = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)]
    assert len(converted) == len(report.layers) and len(converted) >= 2 * 4  # every decoder linear
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is type(model)
    for name in converted:
        w, ref = loaded.get_submodule(name).weight, model.get_submodule(name).weight
        assert isinstance(w, ArmorTensor) and torch.equal(w.core_dense(), ref.core_dense())
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    out = loaded.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    ref = model.generate(ids[:1, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9) and torch.equal(out, ref)


def test_conv1d_models_get_one_clear_message():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=50, n_positions=32)).eval()
    with pytest.raises(ValueError, match="Conv1D layers are not supported"):
        prune_model(model, torch.randint(0, 50, (2, 8)), ArmorConfig(optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
