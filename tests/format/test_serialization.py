"""Tests for torch_armor.format.serialization: safetensors save/load, shards, integrity checks, pickle refusal."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch

from _helpers import random_pattern_factors
from safetensors.torch import save_file
from torch import nn

from torch_armor.errors import ArmorInputError
from torch_armor.format import serialization
from torch_armor.format.serialization import (
    ARMOR_CONFIG_NAME,
    WEIGHTS_NAME,
    assemble_checkpoint,
    flatten_armor_state,
    load_pretrained,
    save_pretrained,
    save_shard,
    unflatten_armor_state,
)
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors


def make_sequential() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 32))


def converted_sequential() -> nn.Sequential:
    model = make_sequential()
    armor_linear_from_factors(model[0], random_pattern_factors(128, 64, 16, seed=1), storage="compact")
    armor_linear_from_factors(model[2], random_pattern_factors(64, 128, 32, pattern="4:8", seed=2), storage="dense")
    # model[4] stays a plain nn.Linear
    return model.eval()


@pytest.fixture
def saved(tmp_path):
    model = converted_sequential()
    save_pretrained(model, tmp_path)
    return model, tmp_path


def test_sequential_roundtrip_bit_identical(saved):
    model, path = saved
    assert sorted(os.listdir(path)) == [ARMOR_CONFIG_NAME, WEIGHTS_NAME]
    loaded = load_pretrained(path, make_sequential())
    x = torch.randn(4, 9, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert isinstance(loaded[0].weight, ArmorTensor) and loaded[0].weight.storage_format == "compact"
    assert isinstance(loaded[2].weight, ArmorTensor) and loaded[2].weight.storage_format == "dense"
    assert loaded[2].weight.pattern == "4:8"
    assert type(loaded[4].weight) is nn.Parameter
    # a factory works too, and storage can be overridden
    other = load_pretrained(path, make_sequential, storage="dense")
    assert other[0].weight.storage_format == "dense"
    with torch.no_grad():
        assert torch.equal(other(x), model(x))
    other = load_pretrained(path, make_sequential, storage="auto", device="cpu")
    assert other[0].weight.storage_format == "compact" and other[2].weight.storage_format == "compact"
    with torch.no_grad():
        assert torch.equal(other(x), model(x))


def test_bf16_and_unstructured_roundtrip(tmp_path):
    model = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16))
    armor_linear_from_factors(model[0], random_pattern_factors(32, 32, 8, pattern="unstructured:0.5", seed=3))
    armor_linear_from_factors(model[1], random_pattern_factors(16, 32, 8, seed=4), storage="dense")
    model = model.bfloat16()
    save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / ARMOR_CONFIG_NAME).read_text())
    assert meta["layers"]["0.weight"]["storage"] == "dense"  # unstructured: dense core
    assert meta["layers"]["1.weight"]["storage"] == "compact"
    assert meta["layers"]["1.weight"]["dtype"] == "bfloat16"
    loaded = load_pretrained(tmp_path, nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 16)))  # fp32 skeleton
    assert loaded[1].weight.dtype == torch.bfloat16 and loaded[1].bias.dtype == torch.bfloat16
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_flatten_unflatten_inverse():
    model = converted_sequential()
    tensors, meta = flatten_armor_state(model)
    assert {"0.weight", "0.weight.b_blocks", "0.weight.values", "0.weight.indices"} <= set(tensors)  # A under the weight key
    assert tensors["0.weight"].shape == (128 // 16, 16, 16)
    assert "2.weight.values" in tensors and "2.weight.core" not in tensors  # always compact on disk
    assert "4.weight" in tensors and tensors["4.weight"].shape == (32, 64)
    assert tensors["0.weight.indices"].dtype == torch.uint8
    layer = meta["layers"]["0.weight"]
    assert layer["shape"] == [128, 64] and layer["block_size"] == 16 and layer["pattern"] == "2:4"
    assert layer["storage"] == "compact" and layer["runtime_storage"] == "compact" and layer["dtype"] == "float32"
    json.dumps(meta)  # JSON-able
    rebuilt = unflatten_armor_state(make_sequential(), tensors, meta)
    x = torch.randn(3, 64)
    with torch.no_grad():
        assert torch.equal(rebuilt(x), model(x))


def test_shared_tensors_saved_once(tmp_path):
    emb = nn.Embedding(16, 8)
    head = nn.Linear(8, 16, bias=False)
    head.weight = emb.weight  # tied
    model = nn.Sequential(emb, head)
    tensors, meta = flatten_armor_state(model)
    assert meta["aliases"] == {"1.weight": "0.weight"} and "1.weight" not in tensors
    save_pretrained(model, tmp_path)
    fresh = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
    loaded = load_pretrained(tmp_path, fresh)
    ids = torch.randint(0, 16, (2, 5))
    assert torch.equal(loaded(ids), model(ids))


def test_compact_core_bytes_smaller_than_dense(tmp_path):
    model = nn.Sequential(nn.Linear(256, 256, bias=False)).half()
    armor_linear_from_factors(model[0], random_pattern_factors(256, 256, 16, seed=5))
    save_pretrained(model, tmp_path / "armor")
    tensors, _ = flatten_armor_state(model)
    core_bytes = sum(tensors[f"0.weight.{k}"].numel() * tensors[f"0.weight.{k}"].element_size()
                     for k in ("values", "indices"))
    dense_core = 256 * 256 * 2
    assert core_bytes == dense_core // 2 + 256 * 256 // 8
    # the whole file vs a plain dense fp16 checkpoint of the same layer
    save_file({"0.weight": torch.zeros(256, 256, dtype=torch.half)}, str(tmp_path / "dense.safetensors"))
    armor_size = (tmp_path / "armor" / WEIGHTS_NAME).stat().st_size
    wrapper_bytes = 2 * 16 * 256 * 2  # a_blocks + b_blocks
    assert armor_size < (tmp_path / "dense.safetensors").stat().st_size
    assert armor_size < dense_core // 2 + 256 * 256 // 8 + wrapper_bytes + 4096  # + header


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "extra.pkl"])
def test_pickle_refused(saved, name):
    _, path = saved
    (path / name).write_bytes(b"\x80\x04K\x01.")
    with pytest.raises(ValueError, match="pickle"):
        load_pretrained(path, make_sequential())


def test_truncated_file(saved):
    _, path = saved
    data = (path / WEIGHTS_NAME).read_bytes()
    (path / WEIGHTS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_pretrained(path, make_sequential())


def test_truncated_file_with_matching_hash_still_caught(saved):
    _, path = saved
    data = (path / WEIGHTS_NAME).read_bytes()
    (path / WEIGHTS_NAME).write_bytes(data[:100])
    meta = json.loads((path / ARMOR_CONFIG_NAME).read_text())
    import hashlib

    meta["weights_sha256"] = hashlib.sha256(data[:100]).hexdigest()  # forge the hash too
    (path / ARMOR_CONFIG_NAME).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="cannot be read as safetensors"):
        load_pretrained(path, make_sequential())


def test_modified_weights_detected(saved):
    _, path = saved
    data = bytearray((path / WEIGHTS_NAME).read_bytes())
    data[-3] ^= 0xFF  # flip bits in tensor data
    (path / WEIGHTS_NAME).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_pretrained(path, make_sequential())


def test_tampered_json(saved):
    _, path = saved
    cfg = path / ARMOR_CONFIG_NAME
    original = cfg.read_text()
    meta = json.loads(original)
    meta["layers"]["0.weight"]["pattern"] = "1:4"
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="edited"):
        load_pretrained(path, make_sequential())
    cfg.write_text(original[: len(original) // 2])
    with pytest.raises(ValueError, match="not valid JSON"):
        load_pretrained(path, make_sequential())
    cfg.write_text(original)
    assert load_pretrained(path, make_sequential()) is not None


def test_metadata_validation_against_tensors():
    model = converted_sequential()
    tensors, meta = flatten_armor_state(model)
    bad = json.loads(json.dumps(meta))
    bad["layers"]["0.weight"]["block_size"] = 32
    with pytest.raises(ValueError, match="a_blocks should be"):
        unflatten_armor_state(make_sequential(), tensors, bad)
    bad = json.loads(json.dumps(meta))
    bad["tensors"]["4.bias"]["shape"] = [31]
    with pytest.raises(ValueError, match="4.bias"):
        unflatten_armor_state(make_sequential(), tensors, bad)
    bad = json.loads(json.dumps(meta))
    bad["layers"]["0.weight"]["dtype"] = "complex128"
    with pytest.raises(ValueError, match="unknown dtype"):
        unflatten_armor_state(make_sequential(), tensors, bad)


def test_architecture_mismatch(saved):
    _, path = saved
    with pytest.raises(ValueError, match="has no module '2'"):
        load_pretrained(path, nn.Sequential(nn.Linear(64, 128)))
    with pytest.raises(ValueError, match=r"do not match the model's architecture: missing \['5.weight'"):
        load_pretrained(path, nn.Sequential(*make_sequential(), nn.Linear(32, 8)))
    assert load_pretrained(path, nn.Sequential(*make_sequential(), nn.Linear(32, 8)), strict=False) is not None
    wrong = make_sequential()
    wrong[0] = nn.Linear(32, 128)
    before = wrong[4].weight
    with pytest.raises(ValueError, match="converted layer '0.weight'"):
        load_pretrained(path, wrong)
    assert wrong[4].weight is before  # checked before anything was loaded
    wrong = make_sequential()
    wrong[4] = nn.Linear(64, 16)
    with pytest.raises(ValueError, match=r"tensor '4.(weight|bias)' is"):
        load_pretrained(path, wrong)
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(path)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ValueError, match="armor_config.json"):
        load_pretrained(tmp_path, make_sequential())
    with pytest.raises(ValueError, match="not a directory"):
        load_pretrained(tmp_path / "missing", make_sequential())


def test_tiny_llama_roundtrip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    seed = 10
    for name, module in model.model.layers.named_modules():
        if isinstance(module, nn.Linear):
            seed += 1
            storage = "dense" if "mlp" in name else "compact"
            f = random_pattern_factors(module.out_features, module.in_features, 16, seed=seed)
            armor_linear_from_factors(module, f, storage=storage)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        ref = model(ids).logits
    save_pretrained(model, tmp_path)
    assert {"config.json", WEIGHTS_NAME, ARMOR_CONFIG_NAME} <= set(os.listdir(tmp_path))
    meta = json.loads((tmp_path / ARMOR_CONFIG_NAME).read_text())
    assert len(meta["layers"]) == 2 * 7
    for spec in (None, cfg):  # from config.json, then from a config object
        loaded = load_pretrained(tmp_path, spec)
        assert type(loaded) is type(model)
        w = loaded.model.layers[1].self_attn.q_proj.weight
        assert isinstance(w, ArmorTensor) and w.storage_format == "compact"
        assert loaded.model.layers[0].mlp.up_proj.weight.storage_format == "dense"
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, ref)


def test_tied_llama_roundtrip(tmp_path, tiny_llama_factory):
    pytest.importorskip("transformers")
    model = tiny_llama_factory(seed=1, tie=True)
    for i, module in enumerate(m for m in model.model.layers.modules() if isinstance(m, nn.Linear)):
        armor_linear_from_factors(module, random_pattern_factors(module.out_features, module.in_features, 16, seed=40 + i))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits
    save_pretrained(model, tmp_path)
    meta = json.loads((tmp_path / ARMOR_CONFIG_NAME).read_text())
    tensors = meta["tensors"]
    # a tied embedding is stored once
    assert not ("lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors)
    loaded = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)


# ---------------------------------------------------------------------------- shards


def read_tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def test_sharded_llama_matches_memory_and_single_file(tmp_path, tiny_llama_factory):
    pytest.importorskip("transformers")
    model = tiny_llama_factory(seed=2, tie=True)
    for i, (name, module) in enumerate((n, m) for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)):
        f = random_pattern_factors(module.out_features, module.in_features, 16, pattern="4:8" if "mlp" in name else "2:4", seed=60 + i)
        armor_linear_from_factors(module, f, storage="dense" if "up_proj" in name else "compact")
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        ref = model(ids).logits
    # what a block-streaming engine does: one shard per finished decoder block, then the rest
    parts = tmp_path / "parts"
    shards = []
    for i, block in enumerate(model.model.layers):
        shards.append(parts / f"block{i}.safetensors")
        meta = save_shard(shards[-1], block, prefix=f"model.layers.{i}.")
        assert f"model.layers.{i}.self_attn.q_proj.weight" in meta["layers"]
        assert all(k.startswith(f"model.layers.{i}.") for k in meta["tensors"])
    rest = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.startswith("model.layers.")}
    shards.append(parts / "rest.safetensors")
    meta = save_shard(shards[-1], rest)
    assert meta["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"} and meta["layers"] == {}
    ckpt = tmp_path / "sharded"
    model_class = f"{type(model).__module__}.{type(model).__qualname__}"
    assemble_checkpoint(ckpt, shards, hf_config=model.config, model_class=model_class)
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(os.listdir(ckpt)) == sorted([ARMOR_CONFIG_NAME, "config.json", "model.safetensors.index.json"] + names)
    assert os.listdir(parts) == []  # moved, not copied
    config = json.loads((ckpt / ARMOR_CONFIG_NAME).read_text())
    assert [f["file"] for f in config["weights_files"]] == names and "weights_sha256" not in config
    assert config["model_class"] == model_class and len(config["layers"]) == 2 * 7
    loaded = load_pretrained(ckpt)
    assert type(loaded) is type(model)
    assert loaded.model.layers[1].mlp.up_proj.weight.storage_format == "dense"
    assert loaded.model.layers[0].mlp.down_proj.weight.pattern == "4:8"
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref)
    # the same tensors and description as one save_pretrained file
    single = tmp_path / "single"
    save_pretrained(model, single)
    one = read_tensors(single / WEIGHTS_NAME)
    many = {}
    for name in names:
        many.update(read_tensors(ckpt / name))
    assert sorted(one) == sorted(many) and all(torch.equal(one[k], many[k]) for k in one)
    single_config = json.loads((single / ARMOR_CONFIG_NAME).read_text())
    for section in ("format", "format_version", "layers", "aliases", "tensors", "model_class"):
        assert config[section] == single_config[section]


def sharded_sequential(tmp_path):
    """converted_sequential saved as three shards (one per Linear) and assembled."""
    model = converted_sequential()
    shards = [tmp_path / "parts" / f"{i}.safetensors" for i in (0, 2, 4)]
    for i, shard in zip((0, 2, 4), shards):
        save_shard(shard, model[i], prefix=f"{i}.")
    assemble_checkpoint(tmp_path / "ckpt", shards)
    return model, tmp_path / "ckpt"


def test_sharded_sequential_roundtrip(tmp_path):
    model, path = sharded_sequential(tmp_path)
    loaded = load_pretrained(path, make_sequential())
    x = torch.randn(4, 64)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    assert loaded[2].weight.storage_format == "dense" and loaded[0].weight.storage_format == "compact"


def test_single_shard_is_a_save_pretrained_checkpoint(tmp_path):
    model = converted_sequential()
    save_shard(tmp_path / "whole.safetensors", model)
    assemble_checkpoint(tmp_path / "a", [tmp_path / "whole.safetensors"], model_class="x.Y")
    save_pretrained(model, tmp_path / "b")
    assert sorted(os.listdir(tmp_path / "a")) == [ARMOR_CONFIG_NAME, WEIGHTS_NAME]
    assert (tmp_path / "a" / WEIGHTS_NAME).read_bytes() == (tmp_path / "b" / WEIGHTS_NAME).read_bytes()
    config = json.loads((tmp_path / "a" / ARMOR_CONFIG_NAME).read_text())
    assert config["weights_file"] == WEIGHTS_NAME and "weights_files" not in config


def test_save_shard_deterministic(tmp_path):
    model = converted_sequential()
    a = save_shard(tmp_path / "a.safetensors", model, prefix="model.")
    b = save_shard(tmp_path / "b.safetensors", model, prefix="model.")
    assert a == b
    data = (tmp_path / "a.safetensors").read_bytes()
    assert data == (tmp_path / "b.safetensors").read_bytes()
    # safetensors' own save_file orders the header by a randomly seeded hash map, differently on
    # most calls even within one process: a few more saves make that regression very unlikely to pass
    for _ in range(4):
        save_shard(tmp_path / "c.safetensors", model, prefix="model.")
        assert (tmp_path / "c.safetensors").read_bytes() == data
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # no temp file left behind
    # readable by safetensors itself, the header describes the shard
    from safetensors import safe_open

    with safe_open(str(tmp_path / "a.safetensors"), framework="pt") as fh:
        header = fh.metadata()
        assert json.loads(header["armor_metadata"]) == a
        assert torch.equal(fh.get_tensor("model.4.bias"), model[4].bias.detach())


def test_missing_or_truncated_shard(tmp_path):
    _, path = sharded_sequential(tmp_path)
    second = path / "model-00002-of-00003.safetensors"
    data = second.read_bytes()
    second.unlink()
    with pytest.raises(ValueError, match=r"has no model-00002-of-00003\.safetensors .*incomplete"):
        load_pretrained(path, make_sequential())
    second.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model-00002-of-00003\.safetensors does not match the sha256.*truncated"):
        load_pretrained(path, make_sequential())
    second.write_bytes(data)
    assert load_pretrained(path, make_sequential()) is not None


def test_sharded_json_edits_detected(tmp_path):
    _, path = sharded_sequential(tmp_path)
    cfg = path / ARMOR_CONFIG_NAME
    original = cfg.read_text()
    meta = json.loads(original)
    meta["layers"]["2.weight"]["runtime_storage"] = "compact"
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"does not match model-00002-of-00003\.safetensors .*edited"):
        load_pretrained(path, make_sequential())
    meta = json.loads(original)
    meta["weights_files"][2]["file"] = "../elsewhere.safetensors"
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="not a plain .safetensors file name"):
        load_pretrained(path, make_sequential())
    meta = json.loads(original)
    meta["weights_files"].pop()  # a shard dropped from the list: its tensors are missing
    cfg.write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="disagree on the stored tensors"):
        load_pretrained(path, make_sequential())


@pytest.mark.parametrize("stage", ["move", "armor_config"])
def test_interrupted_assembly_does_not_load(tmp_path, monkeypatch, stage):
    model = converted_sequential()
    path = tmp_path / "ckpt"
    save_pretrained(model, path)  # a valid checkpoint already there is replaced, not kept half-valid
    shards = [tmp_path / f"{i}.safetensors" for i in (0, 2, 4)]
    for i, shard in zip((0, 2, 4), shards):
        save_shard(shard, model[i], prefix=f"{i}.")
    real_move, real_write = serialization._move, serialization.atomic_write
    moves = []

    def failing_move(src, dst):
        moves.append(dst)
        if len(moves) == 2:
            raise OSError("disk unplugged")
        real_move(src, dst)

    def failing_write(target, write):
        if target.name == ARMOR_CONFIG_NAME:
            raise OSError("disk unplugged")
        real_write(target, write)

    if stage == "move":
        monkeypatch.setattr(serialization, "_move", failing_move)
    else:
        monkeypatch.setattr(serialization, "atomic_write", failing_write)
    with pytest.raises(OSError, match="disk unplugged"):
        assemble_checkpoint(path, shards)
    assert WEIGHTS_NAME not in os.listdir(path)  # the old single file is gone too
    with pytest.raises(ValueError, match="has no armor_config.json"):
        load_pretrained(path, make_sequential())
    monkeypatch.undo()
    # re-running the assembly with each shard where it is now finishes the job
    dests = [path / f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assemble_checkpoint(path, [s if s.exists() else d for s, d in zip(shards, dests)])
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(load_pretrained(path, make_sequential())(x), model(x))


def test_assemble_rejects_bad_shards(tmp_path):
    model = converted_sequential()
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_shard(a, model[0], prefix="0.")
    save_shard(b, model[0], prefix="0.")
    with pytest.raises(ValueError, match="in both shard"):
        assemble_checkpoint(tmp_path / "out", [a, b])
    with pytest.raises(ValueError, match=r"shard .*missing\.safetensors does not exist"):
        assemble_checkpoint(tmp_path / "out", [a, tmp_path / "missing.safetensors"])
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ValueError, match="write it with save_shard"):
        assemble_checkpoint(tmp_path / "out", [a, tmp_path / "plain.safetensors"])
    with pytest.raises(ValueError, match="non-empty sequence"):
        assemble_checkpoint(tmp_path / "out", [])
    assert a.exists() and b.exists() and not (tmp_path / "out").exists()  # nothing moved
    with pytest.raises(ValueError, match="nn.Module or a"):
        save_shard(tmp_path / "c.safetensors", [torch.zeros(1)])


def test_legacy_single_file_checkpoint_loads(tmp_path):
    """A directory as written before shards existed (header hash only, weights_file/weights_sha256)."""
    model = converted_sequential()
    tensors, meta = flatten_armor_state(model)
    canonical = json.dumps(meta, sort_keys=True, separators=(",", ":"))
    header = {"format": "pt", "torch_armor_format": "1",
              "armor_metadata_sha256": hashlib.sha256(canonical.encode()).hexdigest()}
    save_file(tensors, str(tmp_path / WEIGHTS_NAME), metadata=header)
    config = dict(meta, weights_file=WEIGHTS_NAME, model_class="torch.nn.Sequential",
                  weights_sha256=hashlib.sha256((tmp_path / WEIGHTS_NAME).read_bytes()).hexdigest())
    (tmp_path / ARMOR_CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True))
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path, make_sequential())(x), model(x))


def test_an_earlier_layout_of_a_blocks_is_refused_in_one_line():
    """Files written before ``a_blocks`` moved under the weight's own key (never released) are refused."""
    model = converted_sequential()
    tensors, meta = flatten_armor_state(model)
    old = {("0.weight.a_blocks" if k == "0.weight" else "2.weight.a_blocks" if k == "2.weight" else k): v
           for k, v in tensors.items()}
    meta = dict(meta, tensors={("0.weight.a_blocks" if k == "0.weight" else "2.weight.a_blocks" if k == "2.weight" else k): v
                               for k, v in meta["tensors"].items()})
    with pytest.raises(ArmorInputError) as info:
        unflatten_armor_state(make_sequential(), old, meta)
    assert "\n" not in str(info.value) and "0.weight" in str(info.value)
