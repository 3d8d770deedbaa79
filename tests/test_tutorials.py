"""Every tutorial runs end to end and returns what it promises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

TUTORIALS = Path(__file__).resolve().parents[1] / "tutorials"


def load_tutorial(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py").lstrip("0123456789_"), TUTORIALS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_01_prune_compile_quantize(tmp_path):
    torch._dynamo.reset()
    tutorial = load_tutorial("01_prune_compile_quantize.py")
    results = tutorial.main(["--output-dir", str(tmp_path)])
    assert results["converted_layers"] == 14
    assert results["rel_error_int8"] < 0.05
    assert results["graph_breaks"] == 0
    assert results["compiled_max_abs_diff"] < 1e-4
    assert results["loaded_bit_identical"] is True
    assert results["generated_shape"] == (2, 20)
    assert results["generated_equal"] is True
    saved = tmp_path / "tiny-llama-armor-int8"
    assert sorted(p.name for p in saved.iterdir()) == ["armor_config.json", "config.json", "model.safetensors"]
    assert results["saved_bytes"] == (saved / "model.safetensors").stat().st_size


def test_02_finetune_wrappers():
    tutorial = load_tutorial("02_finetune_wrappers.py")
    results = tutorial.main(["--steps", "12"])
    assert results["converted_layers"] == 14
    assert results["trainable_tensors"] == 3 * 14  # A, B, kept values of every converted linear
    assert results["grad_max_rel_diff"] < 1e-10  # float64: ARMOR autograd == dense-weight autograd
    losses = results["losses"]
    assert len(losses) == 12 and losses[-1] < 0.5 * losses[0]
    assert results["mask_unchanged"] is True
    assert results["loaded_bit_identical"] is True
    assert results["stored_parameters"] < results["dense_parameters"]
