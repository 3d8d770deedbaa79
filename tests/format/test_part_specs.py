"""One definition of a stored layer's parts: each storage class's ``part_specs`` gives the shapes and
dtypes of what a built weight of that class stores, and both layer checks (``armor_format.validate_layer``
and ``file_checks.check_armor_layers``) hold the files to it."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torchao.quantization import Int8WeightOnlyConfig

from _helpers import random_pattern_factors
from torch_armor.core.pattern import parse_pattern
from torch_armor.errors import ArmorInputError
from torch_armor.format.armor_format import layer_parts, part_key, validate_layer
from torch_armor.format.file_checks import check_armor_layers, read_safetensors_header
from torch_armor.tensor.armor_tensor import ArmorTensor, format_class, stack_experts
from torch_armor.tensor.eight_bit import quantize_core_8bit
from torch_armor.tensor.quant import quantize_armor_core

KEY = "model.layers.0.mlp.up_proj.weight"
EXPERT_STORAGES = ("dense", "compact")


def _floating(storage, pattern, d_out, d_in, block_size, dtype, seed):
    f = random_pattern_factors(d_out, d_in, block_size, pattern=pattern, seed=seed)
    return ArmorTensor.from_factors(f, storage=storage, dtype=dtype)


def _built(storage, pattern="2:4", experts=None, d_out=32, d_in=64, block_size=16, dtype=torch.float32, seed=0):
    """A real weight whose saved storage is ``storage``: built by the storage classes, quantized by their own paths."""
    if storage in ("int8", "fp8"):
        return quantize_core_8bit(_floating("compact", "2:4", d_out, d_in, block_size, dtype, seed), storage)
    if storage == "quantized":
        w = _floating("dense", pattern, d_out, d_in, block_size, dtype, seed)
        return quantize_armor_core(w, Int8WeightOnlyConfig(set_inductor_config=False))
    if experts is None:
        return _floating(storage, pattern, d_out, d_in, block_size, dtype, seed)
    return stack_experts([_floating(storage, pattern, d_out, d_in, block_size, dtype, seed + e) for e in range(experts)])


def _specs_of(entry):
    return format_class(entry["storage"]).part_specs(entry["shape"], entry["block_size"], parse_pattern(entry["pattern"]),
                                                      getattr(torch, entry["dtype"]))


@settings(max_examples=40, deadline=None)
@given(storage=st.sampled_from(["dense", "compact", "int8", "fp8", "quantized"]),
       pattern=st.sampled_from(["2:4", "1:2", "1:4", "4:8", "3:16", "unstructured:0.5"]),
       experts=st.sampled_from([None, 1, 3]), d_out=st.sampled_from([16, 48]), d_in=st.sampled_from([16, 32, 96]),
       block_size=st.sampled_from([8, 16]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_part_specs_are_what_a_built_layer_stores(storage, pattern, experts, d_out, d_in, block_size, dtype, seed):
    if storage == "compact" and pattern.startswith("unstructured"):
        storage = "dense"
    if storage not in EXPERT_STORAGES:
        experts = None
    w = _built(storage, pattern, experts, d_out, d_in, block_size, dtype, seed)
    inner, entry = layer_parts(KEY, w)  # the format's own flatten path: the parts a file gets
    stored = [(name, (tuple(t.shape), t.dtype)) for name, t in inner.items()]
    specs = list(_specs_of(entry).items())
    if entry["storage"] == "quantized":  # the torchao core's own tensors follow the wrappers
        assert stored[:2] == specs and all(name.startswith("core.") for name, _ in stored[2:])
    else:
        assert stored == specs
        stored_form = w.with_storage(entry["storage"]) if entry["storage"] in EXPERT_STORAGES else w
        names, _ = stored_form.__tensor_flatten__()
        assert [name for name, _ in specs] == list(names)


def _stored_file(tmp_path, w):
    """``w`` written to a safetensors file as the format stores it: its entry, tensors and file header."""
    inner, entry = layer_parts(KEY, w)
    tensors = {part_key(KEY, name): t.contiguous() for name, t in inner.items()}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return entry, tensors, path


@pytest.mark.parametrize("storage, pattern, experts", [
    ("compact", "2:4", None), ("compact", "1:2", None), ("compact", "4:8", 3), ("dense", "unstructured:0.5", 2),
    ("int8", "2:4", None), ("fp8", "2:4", None), ("quantized", "2:4", None)])
def test_a_valid_layer_passes_both_checks(tmp_path, storage, pattern, experts):
    """1:2 included: its positions take one bit each, which a second copy of the table once got wrong."""
    entry, tensors, path = _stored_file(tmp_path, _built(storage, pattern, experts))
    validate_layer(KEY, entry, tensors)
    check_armor_layers({KEY: entry}, {}, {path: read_safetensors_header(path)}, "config.json")


def _wrong_shape(t):
    return torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)


@pytest.mark.parametrize("storage, experts", [("compact", None), ("compact", 2), ("dense", 2), ("int8", None),
                                              ("fp8", None), ("quantized", None)])
def test_a_part_of_the_wrong_shape_is_refused_by_both_checks_naming_it(tmp_path, storage, experts):
    pattern = "unstructured:0.5" if storage == "dense" else "2:4"
    w = _built(storage, pattern, experts)
    for name in _specs_of(layer_parts(KEY, w)[1]):
        entry, tensors, path = _stored_file(tmp_path, w)
        tensors[part_key(KEY, name)] = _wrong_shape(tensors[part_key(KEY, name)])
        with pytest.raises(ArmorInputError, match=rf"layer '{re.escape(KEY)}': {name} should be .* found "):
            validate_layer(KEY, entry, tensors)
        # the description edited with the file, so that the two agree and only the expected parts disagree
        entry["tensors"][name]["shape"] = list(tensors[part_key(KEY, name)].shape)
        save_file(tensors, path)
        with pytest.raises(ArmorInputError, match=rf"layer '{re.escape(KEY)}': inner tensor '{name}' should be "):
            check_armor_layers({KEY: entry}, {}, {path: read_safetensors_header(path)}, "config.json")
