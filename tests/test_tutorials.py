"""Every tutorial runs end to end and returns what it promises."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest
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


def test_03_lora_on_armor():
    pytest.importorskip("peft", reason="pip install 'torch_armor[test]' (peft)")
    tutorial = load_tutorial("03_lora_on_armor.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = tutorial.main(["--steps", "6"])
    # nothing unasked: PEFT's read of transformers' deprecated is_gradient_checkpointing stays inside it
    assert [str(w.message) for w in caught if issubclass(w.category, FutureWarning)] == []
    assert results["converted_layers"] == 14
    assert results["lora_layers"] == 4  # q_proj and v_proj of 2 decoder layers
    # r=8 in 2 layers: q_proj 64→64 (A 8×64, B 64×8), v_proj 64→32 (2 key-value heads of 16: A 8×64, B 32×8)
    assert results["trainable_parameters"] == 2 * (8 * 64 + 64 * 8) + 2 * (8 * 64 + 32 * 8)
    losses = results["losses"]
    assert len(losses) == 6 and losses[-1] < 0.9 * losses[0]
    assert results["armor_unchanged"] is True
    assert results["reloaded_identical"] is True
    assert results["merge_refused"] is True
    assert "torch_armor.enable_finetuning(model)" in results["trainer_refusal"]
    finetune = results["finetune_losses"]
    assert len(finetune) == 6 and finetune[-1] < 0.9 * finetune[0]
