"""Layer selection and load_model's dispatch (transformers mocked: no network, no weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.calibration.selection import select_layers
from torch_armor.recipes.models import load_model


def test_select_layers(tiny_llama):
    names = decoder_linear_names(tiny_llama)
    assert select_layers(tiny_llama) == names and len(names) == 14
    assert select_layers(tiny_llama, "1") == [n for n in names if ".layers.1." in n]
    assert select_layers(tiny_llama, "0-1") == names
    assert select_layers(tiny_llama, "0, 1") == names
    assert select_layers(tiny_llama, r"mlp\.(up|down)_proj") == [n for n in names if "up_proj" in n or "down_proj" in n]
    with pytest.raises(ValueError, match="selects none"):
        select_layers(tiny_llama, "5-6")
    with pytest.raises(ValueError, match="empty"):
        select_layers(tiny_llama, "1-0")
    with pytest.raises(ValueError, match="regular expression"):
        select_layers(tiny_llama, "(")


def test_load_model_dispatch(monkeypatch, tmp_path):
    """Local directories and hub ids go to transformers with gguf_file and dtype; errors are clear."""
    import transformers

    calls = []

    class FakeModel(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.lin = nn.Linear(2, 2).to(dtype)

    def fake_model(name, **kwargs):
        calls.append(("model", name, kwargs))
        return FakeModel(kwargs["dtype"])

    def fake_tokenizer(name, **kwargs):
        calls.append(("tokenizer", name, kwargs))
        return "tok"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(fake_model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(fake_tokenizer))
    model, tok = load_model(str(tmp_path), gguf_file="m.gguf", dtype="bf16")
    assert tok == "tok" and not model.training and model.lin.weight.dtype == torch.bfloat16
    assert calls == [("tokenizer", str(tmp_path), {"gguf_file": "m.gguf"}),
                     ("model", str(tmp_path), {"gguf_file": "m.gguf", "dtype": torch.bfloat16})]
    calls.clear()
    import torch_armor.recipes.models as models_module

    monkeypatch.setattr(models_module, "_hub_reachable", lambda: True)  # as with network access
    load_model("org/some-model")
    assert calls[1] == ("model", "org/some-model", {"dtype": torch.float32})

    def failing(name, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(failing))
    with pytest.raises(ValueError, match="hub id .*offline"):
        load_model("org/some-model")
    with pytest.raises(ValueError, match="no such model directory"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "weights.gguf").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(tmp_path / "weights.gguf"))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tmp_path), dtype="int3")
