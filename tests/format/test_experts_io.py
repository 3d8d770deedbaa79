"""Saving and loading models with ARMOR experts: torch_armor's own format, and untrusted files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from _helpers import edit_checkpoint
from _tiny_moe import armor_moe, make_moe
from torch_armor import load_pretrained, save_pretrained
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.format.armor_format import flatten_armor_state, unflatten_armor_state

IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
FQN = "model.layers.0.mlp.experts.gate_up_proj"


def _assert_same(a, b):
    ta, ma = flatten_armor_state(a)
    tb, mb = flatten_armor_state(b)
    assert ma["layers"] == mb["layers"] and sorted(ta) == sorted(tb)
    for key in ta:
        assert ta[key].dtype == tb[key].dtype and torch.equal(ta[key], tb[key]), key
    with torch.no_grad():
        assert torch.equal(a(IDS).logits, b(IDS).logits)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_torch_armor_save_load_bit_identical(arch, tmp_path, one_thread):
    model, _ = armor_moe(arch)
    save_pretrained(model, tmp_path / "m")
    loaded = load_pretrained(tmp_path / "m")
    w = loaded.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert isinstance(w, ArmorTensor) and w.num_experts is not None and w.storage_format == "compact" and not w.requires_grad
    assert w.layer_name == FQN
    _assert_same(model, loaded)


def test_state_dict_round_trip_and_storage_override(one_thread):
    model, _ = armor_moe("qwen3_moe")
    tensors, meta = flatten_armor_state(model)
    assert meta["layers"][FQN]["experts"] == 4 and meta["layers"][FQN]["storage"] == "compact"
    assert tensors[FQN].shape == (4, 4, 8, 8) and tensors[FQN + ".indices"].dtype == torch.uint8
    fresh = make_moe("qwen3_moe", seed=1)
    fresh.set_experts_implementation("armor")
    _assert_same(model, unflatten_armor_state(fresh, tensors, meta))
    dense_cores = unflatten_armor_state(make_moe("qwen3_moe", seed=1), tensors, meta, storage="dense")
    w = dense_cores.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    assert w.storage_format == "dense" and torch.equal(
        w.dense_weight(), model.get_submodule("model.layers.0.mlp.experts").gate_up_proj.dense_weight())


def test_load_state_dict_copies_expert_parts(one_thread):
    model, _ = armor_moe("qwen3_moe")
    other, _ = armor_moe("qwen3_moe", seed=1)
    other.load_state_dict(model.state_dict())
    _assert_same(model, other)
    with pytest.raises(RuntimeError, match="dense 3-D experts tensor and ARMOR experts"):
        make_moe("qwen3_moe").load_state_dict(model.state_dict())


# ----------------------------------------------------------------------------- untrusted files


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    torch.set_num_threads(1)
    model, _ = armor_moe("qwen3_moe")
    d = tmp_path_factory.mktemp("moe") / "pruned"
    model.save_pretrained(d)
    return d


CONFIG_EDITS = {
    "experts count": lambda q: q["layers"][FQN].update(experts=3),
    "experts a string": lambda q: q["layers"][FQN].update(experts="4"),
    "experts dropped": lambda q: q["layers"][FQN].pop("experts"),
    "shape without experts": lambda q: q["layers"][FQN].update(shape=q["layers"][FQN]["shape"][1:]),
    "values shape": lambda q: q["layers"][FQN]["tensors"]["values"].update(shape=[3, 32, 16]),
    "quantized experts": lambda q: q["layers"][FQN].update(storage="quantized", runtime_storage="quantized"),
    "experts unlisted": lambda q: q["layers"].pop(FQN),
}


@pytest.mark.parametrize("edit", sorted(CONFIG_EDITS))
def test_edited_experts_entry_is_refused_naming_config_json(hf_dir, tmp_path, edit):
    d = Path(shutil.copytree(hf_dir, tmp_path / "m"))
    edit_checkpoint(d, quantization_config=CONFIG_EDITS[edit])
    with pytest.raises(ArmorInputError) as info:
        load_pretrained(d)
    text = str(info.value)
    assert "config.json" in text and "\n" not in text


def _truncate_experts(t):
    t[FQN + ".b_blocks"] = t[FQN + ".b_blocks"][:3].clone()


def _bad_positions(t):
    t[FQN + ".indices"] = t[FQN + ".indices"].clone()
    t[FQN + ".indices"][2, 5, 0] = 0  # expert 2: both kept positions of a group at 0


@pytest.mark.parametrize("edit, match", [(_truncate_experts, "config.json.*b_blocks"),
                                         (_bad_positions, "gate_up_proj.*strictly increasing")])
def test_edited_expert_tensors_are_refused(hf_dir, tmp_path, edit, match):
    d = Path(shutil.copytree(hf_dir, tmp_path / "m"))
    edit_checkpoint(d, tensors=edit)
    with pytest.raises(ArmorInputError, match=match):
        load_pretrained(d)


def test_saved_config_lists_every_expert_parameter(hf_dir):
    layers = json.loads((hf_dir / "config.json").read_text())["quantization_config"]["layers"]
    assert sorted(layers) == [f"model.layers.0.mlp.experts.{p}" for p in ("down_proj", "gate_up_proj")]
