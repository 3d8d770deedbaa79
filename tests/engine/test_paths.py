"""Inputs are never outputs: prune refuses, before touching a file, an out that is or holds the input."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, MagnitudeConfig, PruneOptions, WandaConfig, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.engine.paths import check_prune_paths


def _tree_hash(root: Path) -> dict:
    """Every file under ``root`` (name -> sha256) and every directory, to see that nothing changed."""
    out = {}
    for p in sorted(root.rglob("*")):
        out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "model"
    make_tiny_llama().save_pretrained(d)
    return d


CALIB = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def _aliases(model_dir: Path, tmp_path: Path) -> list:
    """Ways to name the input directory or a directory holding it: itself, a symlink, ``..`` forms, the parent."""
    link = tmp_path / "link"
    link.symlink_to(model_dir)
    return [model_dir, str(model_dir) + "/", link, model_dir / "." , model_dir / ".." / "model", model_dir.parent]


@pytest.mark.parametrize("overwrite_style", ["out", "run_dir", "hidden_dir"])
def test_prune_model_refuses_out_over_its_input_before_any_work(model_dir, tmp_path, overwrite_style):
    before = _tree_hash(tmp_path)
    for alias in _aliases(model_dir, tmp_path):
        kwargs = {"out": tmp_path / "elsewhere", overwrite_style: alias}
        with pytest.raises(ValueError, match="input checkpoint"):
            prune_model(str(model_dir), CALIB, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)),
                        options=PruneOptions(progress=False, **kwargs))
    before.pop("link", None)
    after = _tree_hash(tmp_path)
    after.pop("link", None)
    assert after == before


def test_in_memory_model_keeps_its_source_directory(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    before = _tree_hash(model_dir)
    with pytest.raises(ValueError, match="input checkpoint"):
        prune_model(model, CALIB, WandaConfig(), options=PruneOptions(out=model_dir, progress=False))
    assert _tree_hash(model_dir) == before
    assert type(model.model.layers[0].mlp.up_proj.weight) is torch.nn.Parameter  # not pruned either


@pytest.mark.parametrize("extra", [[], ["--overwrite"]])
def test_cli_refuses_out_equal_to_model(model_dir, tmp_path, extra):
    from torch_armor.cli.parser import main

    before = _tree_hash(tmp_path)
    for alias in _aliases(model_dir, tmp_path):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            code = main(["prune", str(model_dir), "--out", str(alias), "--calib", "x.txt", *extra])
        assert code == 2
        lines = err.getvalue().strip().splitlines()
        assert len(lines) == 1 and "input checkpoint" in lines[0] and "--out" in lines[0]
    before.pop("link", None)
    after = _tree_hash(tmp_path)
    after.pop("link", None)
    assert after == before


def test_existing_file_as_out_is_refused_up_front(model_dir, tmp_path):
    target = tmp_path / "file"
    target.write_bytes(b"keep me")
    model = make_tiny_llama()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="not a directory"):
        prune_model(model, CALIB, MagnitudeConfig(), options=PruneOptions(out=target, progress=False))
    assert target.read_bytes() == b"keep me"
    assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items())  # refused before pruning


def test_out_inside_the_input_is_allowed(model_dir):
    check_prune_paths([model_dir], out=model_dir / "pruned")
    check_prune_paths([model_dir], out=os.path.join(model_dir, "sub", "..", "pruned"))


@pytest.mark.parametrize("field", ["out", "run_dir", "hidden_dir"])
def test_an_empty_path_is_refused_not_taken_as_the_working_directory(field, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"PruneOptions.{field} is an empty path .*give a directory"):
        PruneOptions(**{field: ""})
    assert list(tmp_path.iterdir()) == []
