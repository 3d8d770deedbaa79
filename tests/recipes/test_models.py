"""Layer selection and load_model's dispatch (transformers mocked: no network, no weights)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st
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
    with pytest.raises(ValueError, match=r"got 0 \(int\) in a list; for decoder blocks pass a string such as "
                                         r"layers='0,1'"):
        select_layers(tiny_llama, [0, 1])
    with pytest.raises(ValueError, match=r"got None \(NoneType\) in a tuple$"):
        select_layers(tiny_llama, ("model.layers.0.mlp.up_proj", None))


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

    monkeypatch.setattr(models_module, "hub_reachable", lambda: True)  # as with network access
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


@given(model_gb=st.floats(0.001, 500), free_gb=st.floats(0.001, 2000), ranks=st.integers(1, 8))
def test_a_checkpoint_streams_exactly_when_the_run_would_not_fit(model_gb, free_gb, ranks):
    from torch_armor.recipes.models import RUN_ROOM, choose_streaming

    model, free = int(model_gb * 1e9), int(free_gb * 1e9)
    streamed, why = choose_streaming(model, free, None, world_size=ranks)
    assert streamed == (ranks > 1 or RUN_ROOM * model > free)
    assert why.startswith(f"{model / 1e9:.1f} GB in the run dtype")
    for asked in (True, False):  # the user's choice wins, whatever fits
        assert choose_streaming(model, free, asked, world_size=ranks) == (asked, why.split(",")[0] + ", asked for")
    assert choose_streaming(model, None, None)[0]  # free memory unknown: stream, the safe side


def test_checkpoint_parameters_reads_the_headers(tmp_path):
    from safetensors.torch import load_file

    from _tiny_dir import save_tiny_model
    from torch_armor.recipes.models import checkpoint_parameters

    model_dir = save_tiny_model(tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    assert checkpoint_parameters(model_dir) == sum(t.numel() for t in tensors.values()) > 0


def test_prune_loads_a_small_local_checkpoint_whole_and_says_why(tmp_path, capsys):
    """The CLI's default: a checkpoint whose run fits the free memory is loaded whole (so distillation can
    run); --stream streams it; the log says which and why."""
    from _tiny_dir import fast_prune_args, save_tiny_model
    from torch_armor.cli.parser import main

    model_dir = save_tiny_model(tmp_path)
    args = [a for a in fast_prune_args(tmp_path) if a != "--stream"]
    assert main(["prune", str(model_dir), "--out", str(tmp_path / "whole"), *args]) == 0
    err = capsys.readouterr().err
    assert f"loading {model_dir} whole (0.0 GB in the run dtype, 3x of it fits the " in err
    assert main(["prune", str(model_dir), "--out", str(tmp_path / "streamed"), *args, "--stream"]) == 0
    err = capsys.readouterr().err
    assert f"streaming {model_dir} block by block (0.0 GB in the run dtype, asked for)" in err
    assert "skipped when streamed" not in err  # a streamed prune distills too (these 2 windows are too few)
    assert (tmp_path / "streamed" / "model.safetensors.index.json").exists()  # streamed: a shard per block
    assert not (tmp_path / "whole" / "model.safetensors.index.json").exists()


def test_prune_help_states_the_run_room():
    from torch_armor.cli.parser import build_parser
    from torch_armor.recipes.models import RUN_ROOM

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    stream = next(a for a in sub.choices["prune"]._actions if a.dest == "stream")
    assert f"whole when {RUN_ROOM}x its size fits the free memory" in stream.help
