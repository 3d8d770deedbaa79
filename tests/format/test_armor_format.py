"""Tests for torch_armor.format.armor_format: a layer's stored parts are its storage class's own
``__tensor_flatten__`` tensors, and layer -> parts -> layer is the identity, bit for bit."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torchao.quantization import Int8WeightOnlyConfig

from _helpers import random_pattern_factors
from torch_armor.format.armor_format import build_layer, layer_keys, layer_parts, part_key, validate_layer
from torch_armor.tensor.armor_tensor import ArmorTensor, stack_experts
from torch_armor.tensor.eight_bit import quantize_core_8bit
from torch_armor.tensor.quant import quantize_armor_core

KEY = "model.layers.0.mlp.up_proj.weight"


def _weight(storage="compact", pattern="2:4", seed=0, dtype=torch.float32, d_out=32, d_in=64):
    f = random_pattern_factors(d_out, d_in, 16, pattern=pattern, seed=seed)
    return ArmorTensor.from_factors(f, storage=storage, dtype=dtype)


def _flatten_names(t):
    names, _ = t.__tensor_flatten__()
    return list(names)


@pytest.mark.parametrize("storage", ["dense", "compact"])
def test_an_n_m_core_is_stored_as_its_compact_class_flattens(storage):
    w = _weight(storage)
    inner, entry = layer_parts(KEY, w)
    assert list(inner) == _flatten_names(w.with_storage("compact")) == ["a_blocks", "b_blocks", "values", "indices"]
    assert list(entry["tensors"]) == list(inner) and entry["storage"] == "compact" and entry["runtime_storage"] == storage


def test_an_unstructured_core_is_stored_as_the_dense_class_flattens():
    w = _weight("dense", pattern="unstructured:0.5")
    inner, entry = layer_parts(KEY, w)
    assert list(inner) == _flatten_names(w) == ["a_blocks", "b_blocks", "core"] and entry["storage"] == "dense"
    assert all(inner[n] is getattr(w, n) for n in inner)


@pytest.mark.parametrize("qdtype", ["int8", "fp8"])
def test_an_eight_bit_core_is_stored_as_its_class_flattens(qdtype):
    w = quantize_core_8bit(_weight(), qdtype)
    inner, entry = layer_parts(KEY, w)
    assert list(inner) == _flatten_names(w) == ["a_blocks", "b_blocks", "values", "indices", "core_scale"]
    assert entry["storage"] == qdtype and all(inner[n] is getattr(w, n) for n in inner)


def test_a_torchao_core_is_flattened_through_its_own_class():
    w = quantize_armor_core(_weight("dense"), Int8WeightOnlyConfig(set_inductor_config=False))
    inner, entry = layer_parts(KEY, w)
    core_names = _flatten_names(w.core)
    kinds = entry["quantization"]["tensors"]
    assert list(kinds) == core_names and _flatten_names(w) == ["a_blocks", "b_blocks", "core"]
    expected = ["a_blocks", "b_blocks"]
    for n in core_names:
        expected += [f"core.{n}.values", f"core.{n}.indices"] if kinds[n] == "compact" else [f"core.{n}"]
    assert list(inner) == expected
    assert list(layer_keys(KEY, entry)) == [part_key(KEY, n) for n in expected]
    rebuilt = build_layer(KEY, entry, {part_key(KEY, n): t for n, t in inner.items()})
    for n in core_names:
        assert torch.equal(getattr(rebuilt.core, n), getattr(w.core, n)), n


@settings(max_examples=25, deadline=None)
@given(d_out=st.sampled_from([16, 32, 48]), d_in=st.sampled_from([16, 32, 64]),
       pattern=st.sampled_from(["2:4", "1:4", "4:8", "unstructured:0.5"]), storage=st.sampled_from(["dense", "compact"]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), experts=st.sampled_from([None, 1, 3]),
       seed=st.integers(0, 2**16))
def test_layer_parts_layer_round_trip_is_bit_identical(d_out, d_in, pattern, storage, dtype, experts, seed):
    if storage == "compact" and pattern.startswith("unstructured"):
        storage = "dense"
    if experts is None:
        w = _weight(storage, pattern, seed, dtype, d_out, d_in)
    else:
        w = stack_experts([_weight(storage, pattern, seed + e, dtype, d_out, d_in) for e in range(experts)])
    inner, entry = layer_parts(KEY, w)
    tensors = {part_key(KEY, n): t.clone() for n, t in inner.items()}
    assert sorted(tensors) == sorted(layer_keys(KEY, entry))
    validate_layer(KEY, entry, tensors)
    back = build_layer(KEY, entry, tensors)
    assert type(back).__name__ == type(w.with_storage(entry["storage"])).__name__ and back.shape == w.shape
    again, entry_again = layer_parts(KEY, back)
    assert entry_again == {**entry, "runtime_storage": entry["storage"]}  # built as stored; restore_storage re-stores
    assert list(again) == list(inner)
    for n in inner:
        assert again[n].dtype == inner[n].dtype and torch.equal(again[n], inner[n]), n
    assert torch.equal(back.dense_weight(torch.float64), w.dense_weight(torch.float64))
