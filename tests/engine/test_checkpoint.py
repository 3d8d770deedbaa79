"""LazyCheckpoint: block-by-block materialization equals the eager model; hashing; clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor.engine.checkpoint import LazyCheckpoint

SHARD = "20KB"  # the tiny Llama (~100 KB fp32) then spans many shards


def _save(model, d: Path, shard: str | None = SHARD, dtype=None) -> Path:
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {} if shard is None else {"max_shard_size": shard}
    model.save_pretrained(d, **kwargs)
    return d


@pytest.fixture(params=["sharded", "single"])
def saved(request, tmp_path):
    shard = SHARD if request.param == "sharded" else None
    d = _save(make_tiny_llama(), tmp_path / "ckpt", shard)
    n_files = len(list(d.glob("*.safetensors")))
    assert (n_files > 2) if shard else (n_files == 1)
    return d


def _stream(ckpt: LazyCheckpoint):
    ckpt.materialize_non_decoder()
    prefix, layers = ckpt.decoder_layers()
    for i in range(len(layers)):
        ckpt.materialize(f"{prefix}.{i}")
    for p in ckpt.post_decoder_prefixes():
        ckpt.materialize(p)
    return ckpt.model


def _eager(d: Path, dtype=None):
    from transformers import AutoModelForCausalLM

    kwargs = {} if dtype is None else {"dtype": dtype}
    return AutoModelForCausalLM.from_pretrained(d, **kwargs).eval()


def _logits(model, seed: int = 1):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(ids).logits


def test_streamed_logits_equal_eager_fp32(saved):
    ckpt = LazyCheckpoint(saved)
    assert ckpt.decoder_layers()[0] == "model.layers"
    assert ckpt.post_decoder_prefixes() == ["model.norm", "lm_head"]
    lazy = _stream(ckpt)
    assert not any(t.is_meta for t in lazy.state_dict().values())
    ref = _eager(saved)
    assert all(torch.equal(a, b) for a, b in zip(ref.state_dict().values(), lazy.state_dict().values()))
    assert torch.equal(_logits(lazy), _logits(ref))


@pytest.mark.parametrize("stored", [torch.float32, torch.bfloat16])
def test_streamed_logits_equal_eager_bf16(tmp_path, stored):
    d = _save(make_tiny_llama(), tmp_path / "ckpt", dtype=stored)
    lazy = _stream(LazyCheckpoint(d, dtype=torch.bfloat16))
    assert {p.dtype for p in lazy.parameters()} == {torch.bfloat16}
    assert torch.equal(_logits(lazy), _logits(_eager(d, torch.bfloat16)))


def test_keeps_checkpoint_dtype_by_default(tmp_path):
    d = _save(make_tiny_llama(), tmp_path / "ckpt", dtype=torch.bfloat16)
    ckpt = LazyCheckpoint(d)
    assert ckpt.materialize("model.layers.0").self_attn.q_proj.weight.dtype == torch.bfloat16


def test_tied_embeddings(tmp_path):
    d = _save(make_tiny_llama(tie=True), tmp_path / "ckpt")
    ckpt = LazyCheckpoint(d)
    assert "lm_head.weight" not in ckpt.keys()
    lazy = _stream(ckpt)
    assert lazy.lm_head.weight is lazy.model.embed_tokens.weight
    assert torch.equal(_logits(lazy), _logits(_eager(d)))


def test_release_puts_tensors_back_on_meta(saved):
    ckpt = LazyCheckpoint(saved)
    block = ckpt.materialize("model.layers.1")
    assert not any(p.is_meta for p in block.parameters())
    assert all(p.is_meta for p in ckpt.model.model.layers[0].parameters())
    ckpt.release("model.layers.1")
    assert all(p.is_meta for p in block.parameters())
    again = ckpt.materialize("model.layers.1")  # and can come back
    ref = ckpt.read_tensors(["model.layers.1.mlp.up_proj.weight"])["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(again.mlp.up_proj.weight, ref)


def test_rotary_buffers_rebuilt(saved):
    ckpt = LazyCheckpoint(saved)
    ckpt.materialize_non_decoder()
    rot, ref = ckpt.model.model.rotary_emb, _eager(saved).model.rotary_emb
    assert torch.equal(rot.inv_freq, ref.inv_freq) and rot.attention_scaling == ref.attention_scaling
    assert not ckpt.model.model.embed_tokens.weight.is_meta
    assert ckpt.model.model.norm.weight.is_meta  # after the blocks: not loaded yet
    assert not rot.training


def test_read_tensors_and_keys(saved):
    ckpt = LazyCheckpoint(saved)
    assert set(ckpt.keys()) == set(make_tiny_llama().state_dict())
    out = ckpt.read_tensors(["model.norm.weight", "model.embed_tokens.weight"])
    assert list(out) == ["model.norm.weight", "model.embed_tokens.weight"]
    assert torch.equal(out["model.embed_tokens.weight"], make_tiny_llama().model.embed_tokens.weight)
    with pytest.raises(ValueError, match="nope"):
        ckpt.read_tensors(["nope"])


def test_content_hash(tmp_path):
    a = _save(make_tiny_llama(), tmp_path / "a")
    b = _save(make_tiny_llama(), tmp_path / "b")
    m = make_tiny_llama()
    with torch.no_grad():
        m.model.layers[1].mlp.down_proj.weight[3, 5] += 1.0
    c = _save(m, tmp_path / "c")
    h = LazyCheckpoint(a).content_hash()
    assert len(h) == 64 and h == LazyCheckpoint(a).content_hash()
    assert LazyCheckpoint(b).content_hash() == h
    assert LazyCheckpoint(c).content_hash() != h


def test_error_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LazyCheckpoint(tmp_path / "absent")


def test_error_no_config(saved):
    (saved / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json is missing"):
        LazyCheckpoint(saved)


def test_error_only_bin(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    make_tiny_llama().config.save_pretrained(d)
    torch.save(make_tiny_llama().state_dict(), d / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"only safetensors can be streamed") as e:
        LazyCheckpoint(d)
    assert str(d) in str(e.value) and "\n" not in str(e.value)


def test_error_index_names_missing_shard(tmp_path):
    d = _save(make_tiny_llama(), tmp_path / "ckpt")
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ValueError, match=f"{shard.name}.*missing"):
        LazyCheckpoint(d)


def test_error_index_key_not_in_shard(tmp_path):
    d = _save(make_tiny_llama(), tmp_path / "ckpt")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    key = "model.norm.weight"
    wm[key] = next(f for f in wm.values() if f != wm[key])
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"'{key}' is in {wm[key]}"):
        LazyCheckpoint(d)


def test_error_renamed_key(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    model = make_tiny_llama()
    model.config.save_pretrained(d)
    sd = {("transformer." + k if k.startswith("model.") else k): v for k, v in model.state_dict().items()}
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="'transformer.model.embed_tokens.weight'.*matches no parameter"):
        LazyCheckpoint(d)


def test_error_missing_tensor(tmp_path):
    from safetensors.torch import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    model = make_tiny_llama()
    model.config.save_pretrained(d)
    sd = {k: v for k, v in model.state_dict().items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match="'model.layers.1.mlp.up_proj.weight'"):
        LazyCheckpoint(d)


def test_materialized_tensors_do_not_view_the_files(tmp_path):
    d = _save(make_tiny_llama(), tmp_path / "ckpt", shard=None)
    ckpt = LazyCheckpoint(d)
    block = ckpt.materialize("model.layers.0")
    raw = ckpt.read_tensors(["model.layers.0.mlp.up_proj.weight"])["model.layers.0.mlp.up_proj.weight"]
    before = block.mlp.up_proj.weight.detach().clone()
    path = d / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # zero every tensor's bytes in place (a live mmap view would see this)
        start = 8 + int.from_bytes(f.read(8), "little")
        f.seek(start)
        f.write(b"\x00" * (size - start))
    assert not ckpt.read_tensors(["model.layers.0.mlp.up_proj.weight"])["model.layers.0.mlp.up_proj.weight"].any()
    assert torch.equal(block.mlp.up_proj.weight, before) and torch.equal(raw, before)


def _resaved(tmp_path: Path, edit) -> Path:
    """The tiny Llama written by save_pretrained, then its model.safetensors rewritten with ``edit(tensors)``."""
    from safetensors.torch import load_file, save_file

    d = _save(make_tiny_llama(), tmp_path / "ckpt", shard=None)
    tensors = load_file(d / "model.safetensors")
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_stale_rotary_inv_freq_keys_are_ignored_as_transformers_ignores_them(tmp_path, caplog):
    def add_inv_freq(tensors):  # what Llama checkpoints written by transformers < 4.31 hold in every block
        for i in range(2):
            tensors[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.rand(8)

    d = _resaved(tmp_path, add_inv_freq)
    with caplog.at_level("DEBUG", logger="torch_armor"):
        ckpt = LazyCheckpoint(d)
    assert [r.getMessage() for r in caplog.records if "inv_freq" in r.getMessage()] == [
        f"{d}: ignoring 2 checkpoint tensor(s) that LlamaForCausalLM does not use, as transformers does: "
        "['model.layers.0.self_attn.rotary_emb.inv_freq', 'model.layers.1.self_attn.rotary_emb.inv_freq']"]
    assert not [k for k in ckpt.keys() if "inv_freq" in k]
    assert torch.equal(_logits(_stream(ckpt)), _logits(_eager(d)))


def test_a_tensor_of_another_shape_than_config_json_gives_is_refused_naming_it(tmp_path):
    key = "model.layers.0.self_attn.q_proj.weight"

    def halve(tensors):
        tensors[key] = tensors[key][:, :32].contiguous()

    d = _resaved(tmp_path, halve)
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{key}' \(in .*model.safetensors\) is stored as "
                                         r"\(64, 32\), but .*config.json makes it \(64, 64\) in LlamaForCausalLM"):
        LazyCheckpoint(d)
