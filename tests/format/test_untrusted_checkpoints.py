"""Crafted checkpoint directories through the real load paths: one clear error naming the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from _helpers import edit_checkpoint
from conftest import make_tiny_llama
from torch_armor import ArmorConfig, MagnitudeConfig, PruneOptions, load_pretrained, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.errors import ArmorInputError

CALIB = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A pruned tiny Llama written by transformers' model.save_pretrained (config.json quantization_config)."""
    torch.set_num_threads(1)
    model = make_tiny_llama()
    prune_model(model, CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    d = tmp_path_factory.mktemp("hf") / "pruned"
    model.save_pretrained(d)
    return d


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, fn) -> None:
    edit_checkpoint(d, quantization_config=fn)


def _edit_tensors(d: Path, fn) -> None:
    edit_checkpoint(d, tensors=fn)


def _first_layer(q: dict) -> str:
    return sorted(q["layers"])[0]


CONFIG_EDITS = {
    "block size not dividing": lambda q: q["layers"][_first_layer(q)].update(block_size=24),
    "block size another divisor": lambda q: q["layers"][_first_layer(q)].update(block_size=32),
    "block size a string": lambda q: q["layers"][_first_layer(q)].update(block_size="16"),
    "block size a bool": lambda q: q["layers"][_first_layer(q)].update(block_size=True),
    "pattern invalid": lambda q: q["layers"][_first_layer(q)].update(pattern="5:4"),
    "pattern another": lambda q: q["layers"][_first_layer(q)].update(pattern="1:4"),
    "dtype unknown": lambda q: q["layers"][_first_layer(q)].update(dtype="float128"),
    "dtype integer": lambda q: q["layers"][_first_layer(q)].update(dtype="int8"),
    "dtype another": lambda q: q["layers"][_first_layer(q)].update(dtype="float16"),
    "tensors missing": lambda q: q["layers"][_first_layer(q)].pop("tensors"),
    "shape swapped": lambda q: q["layers"][_first_layer(q)].update(shape=q["layers"][_first_layer(q)]["shape"][::-1] + [1]),
    "storage unknown": lambda q: q["layers"][_first_layer(q)].update(storage="sparse"),
    "layers a list": lambda q: q.update(layers=list(q["layers"])),
    "layers empty": lambda q: q.update(layers={}),
    "a layer unlisted": lambda q: q["layers"].pop(_first_layer(q)),
    "entry a string": lambda q: q["layers"].update({_first_layer(q): "x"}),
    "buffers a list": lambda q: q.update(buffers=[1]),
    # a non-ARMOR buffer (rotary inv_freq, recomputed on load) cast to another dtype: logits off
    "buffer dtype integer": lambda q: q["buffers"].update({"model.rotary_emb.inv_freq": "int8"}),
    "buffer dtype another": lambda q: q["buffers"].update({"model.rotary_emb.inv_freq": "float16"}),
    "buffer unknown": lambda q: q["buffers"].update({"model.layers.0.rotary_emb.inv_freq": "float32"}),
    "pattern another than the layers'": lambda q: q.update(pattern="4:8"),
}


@pytest.mark.parametrize("edit", sorted(CONFIG_EDITS))
def test_edited_quantization_config_is_refused_naming_config_json(hf_dir, tmp_path, edit):
    from transformers import AutoModelForCausalLM

    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, CONFIG_EDITS[edit])
    for load in (load_pretrained, AutoModelForCausalLM.from_pretrained):
        with pytest.raises(ArmorInputError) as info:
            load(d)
        text = str(info.value)
        assert "config.json" in text and "armor_config.json" not in text and "\n" not in text


@pytest.mark.parametrize("edit, field", [("buffer dtype integer", "'buffers' gives 'model.rotary_emb.inv_freq' the "
                                                                   "dtype 'int8'"),
                                         ("buffer unknown", "'buffers' names 'model.layers.0.rotary_emb.inv_freq'"),
                                         ("pattern another than the layers'", "'pattern' is '4:8'")])
def test_the_field_at_fault_is_named(hf_dir, tmp_path, edit, field):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_config(d, CONFIG_EDITS[edit])
    with pytest.raises(ArmorInputError, match="config.json \\(quantization_config\\).*" + re.escape(field)):
        load_pretrained(d)


@pytest.fixture(scope="module")
def int8_model_and_dir(tmp_path_factory):
    """A pruned tiny Llama whose cores are int8 (torchao through ArmorCoreConfig), written by model.save_pretrained."""
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from torch_armor import ArmorCoreConfig

    model = make_tiny_llama()
    prune_model(model, CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    quantize_(model, ArmorCoreConfig(Int8WeightOnlyConfig(set_inductor_config=False)))
    d = tmp_path_factory.mktemp("int8") / "pruned"
    model.save_pretrained(d)
    return model, d


@pytest.mark.parametrize("edit", ["duplicate", "out of order", "none"])
def test_int8_cores_get_the_index_checks_of_float_cores(int8_model_and_dir, tmp_path, edit):
    from transformers import AutoModelForCausalLM

    model, saved = int8_model_and_dir
    d = _copy(saved, tmp_path / "m")
    key = "model.layers.0.mlp.down_proj.weight.core.qdata.indices"

    def positions(t):  # the first byte holds the 2-bit positions of groups 0 and 1 (two each), lowest bits first
        t[key] = t[key].clone()
        t[key][0, 0] = 0 if edit == "duplicate" else (int(t[key][0, 0]) & 0xF0) | 0b0111  # [3, 1]: decreasing

    if edit != "none":
        _edit_tensors(d, positions)
        want = "[0, 0]" if edit == "duplicate" else "[3, 1]"
        for load in (load_pretrained, AutoModelForCausalLM.from_pretrained):
            with pytest.raises(ArmorInputError, match=rf"layer 'model.layers.0.mlp.down_proj.weight': compact "
                                                      rf"core.qdata.indices of row 0, group 0 are {re.escape(want)}, not "
                                                      r"2 strictly increasing"):
                load(d)
        return
    ids = torch.arange(12)[None]  # the unedited directory: a valid int8 checkpoint, loaded exactly
    with torch.no_grad():
        assert torch.equal(load_pretrained(d)(ids).logits, model(ids).logits)


def _nan_in(key_suffix):
    def fn(t):
        key = next(k for k in sorted(t) if k.endswith(key_suffix))
        t[key] = t[key].clone()
        t[key].view(-1)[3] = float("nan")
    return fn


def _duplicate_positions(t):
    key = next(k for k in sorted(t) if k.endswith(".indices"))
    t[key] = t[key].clone()
    t[key][0, 0] = 0  # both positions of the first two groups 0


VALUE_EDITS = {"NaN in a_blocks": _nan_in("q_proj.weight"), "NaN in b_blocks": _nan_in(".b_blocks"),
               "NaN in values": _nan_in(".values"), "duplicate compact positions": _duplicate_positions}


@pytest.mark.parametrize("edit", sorted(VALUE_EDITS))
def test_corrupt_values_are_refused(hf_dir, tmp_path, edit):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_tensors(d, VALUE_EDITS[edit])
    with pytest.raises(ValueError, match="layer 'model.layers"):
        load_pretrained(d)
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception, match="NaN or Inf|strictly increasing"):
        AutoModelForCausalLM.from_pretrained(d)


def test_torch_armor_format_with_non_finite_factors_is_refused(tmp_path):
    model = make_tiny_llama()
    prune_model(model, CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), options=PruneOptions(progress=False))
    w = model.model.layers[0].mlp.up_proj.weight
    w.a_blocks.view(-1)[0] = float("inf")
    from torch_armor import save_pretrained

    save_pretrained(model, tmp_path / "m")
    with pytest.raises(ValueError, match="up_proj.*NaN or Inf"):
        load_pretrained(tmp_path / "m")


@pytest.mark.parametrize("content", ["pickle", "truncated", "empty"])
def test_not_safetensors_where_safetensors_expected(hf_dir, tmp_path, content):
    d = _copy(hf_dir, tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"pickle": b"\x80\x04\x95" + b"\0" * 64, "truncated": data[: len(data) // 2], "empty": b""}[content])
    with pytest.raises(ArmorInputError, match="model.safetensors"):
        load_pretrained(d)


@pytest.mark.parametrize("device_map", ["meta", {"": "meta"}, {"": torch.device("meta")}])
def test_meta_device_map_is_refused(hf_dir, device_map):
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="meta"):
        AutoModelForCausalLM.from_pretrained(hf_dir, device_map=device_map)


def test_load_pretrained_on_meta_is_refused(hf_dir):
    with pytest.raises(ValueError, match="meta"):
        load_pretrained(hf_dir, device="meta")


# --------------------------------------------------------------------------- streamed / index
def _dense_dir(tmp_path: Path, shards: bool) -> Path:
    d = tmp_path / "dense"
    make_tiny_llama().save_pretrained(d, max_shard_size="60KB" if shards else "1GB")
    return d


@pytest.mark.parametrize("name", ["../other/model.safetensors", "/etc/passwd", "sub/x.safetensors", "..", 3])
def test_index_naming_files_outside_is_refused(tmp_path, name):
    d = _dense_dir(tmp_path, shards=True)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ArmorInputError, match="index.json"):
        prune_model(str(d), CALIB, MagnitudeConfig(), options=PruneOptions(out=tmp_path / "out", progress=False))
    assert not (tmp_path / "out").exists()


def test_sharded_hf_dir_with_unsafe_index_is_refused_on_load(hf_dir, tmp_path):
    model, _ = None, None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="100KB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = "../dense/" + index["weight_map"][key]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ArmorInputError, match="index.json"):
        load_pretrained(d)


@pytest.mark.parametrize("content", ["pickle", "truncated"])
def test_streamed_prune_of_a_damaged_shard(tmp_path, content):
    d = _dense_dir(tmp_path, shards=False)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(b"\x80\x04\x95" + b"\0" * 64 if content == "pickle" else data[:-100])
    with pytest.raises(ArmorInputError, match="model.safetensors"):
        prune_model(str(d), CALIB, MagnitudeConfig(), options=PruneOptions(out=tmp_path / "out", progress=False))


def test_missing_weights_are_refused_not_initialised(hf_dir, tmp_path):
    d = _copy(hf_dir, tmp_path / "m")
    _edit_tensors(d, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    with pytest.raises(ArmorInputError, match="post_attention_layernorm"):
        load_pretrained(d)
