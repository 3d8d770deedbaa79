"""Every call form deprecated by the one-shape redesign still works for one release, warns with
:class:`~torch_armor.errors.ArmorDeprecationWarning` naming the new form, and gives exactly what
the new form gives. (The flat ``ArmorConfig`` keywords: tests/core/test_config_compat.py.)"""

from __future__ import annotations

import importlib

import pytest
import torch

from conftest import make_tiny_llama
from torch_armor import (ArmorConfig, BaselineConfig, BcdConfig, MagnitudeConfig, NoWagConfig, PruneOptions,
                         PruningSparsifier, SparseGPTConfig, WandaConfig, prune_model)
from torch_armor.errors import ArmorDeprecationWarning, RunMismatchError

CALIB = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(3))

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(model) -> dict:
    return {n: (p.dense_weight() if hasattr(p, "dense_weight") else p).detach().clone()
            for n, p in model.named_parameters()}


def _same(a, b) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_baseline_config_with_a_method_string():
    with pytest.warns(ArmorDeprecationWarning, match="BaselineConfig is deprecated"):
        old_config = BaselineConfig(block_size=32, damp=0.05)
    old, new = make_tiny_llama(), make_tiny_llama()
    with pytest.warns(ArmorDeprecationWarning, match=r"write prune_model\(model, calibration, SparseGPTConfig\("):
        a = prune_model(old, CALIB, "sparsegpt", old_config, sequential=False, progress=False)
    b = prune_model(new, CALIB, SparseGPTConfig(block_size=32, damp=0.05),
                    options=PruneOptions(sequential=False, progress=False))
    assert _same(old, new) and a.settings == b.settings and a.method == b.method == "sparsegpt"
    assert a.settings == {"pattern": "2:4", "block_size": 32, "damp": 0.05, "sequential": False}  # the old keys


@pytest.mark.parametrize("name, kind", [("wanda", WandaConfig), ("nowag", NoWagConfig), ("magnitude", MagnitudeConfig)])
def test_method_string_alone_and_pattern_keyword(name, kind):
    old, new = make_tiny_llama(), make_tiny_llama()
    with pytest.warns(ArmorDeprecationWarning, match=rf"{kind.__name__}\(pattern='4:8'\)"):
        prune_model(old, CALIB, name, pattern="4:8", progress=False)
    prune_model(new, CALIB, kind(pattern="4:8"), options=PruneOptions(progress=False))
    assert _same(old, new)


def test_armor_string_with_run_keywords(tmp_path):
    cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1), reconstruct=None)
    old, new = make_tiny_llama(), make_tiny_llama()
    with pytest.warns(ArmorDeprecationWarning, match=r"options=PruneOptions\(.*run_dir="):
        a = prune_model(old, CALIB, "armor", cfg, run_dir=tmp_path / "run", out=tmp_path / "old", progress=False,
                        layers="0")
    b = prune_model(new, CALIB, cfg, layers="0", options=PruneOptions(out=tmp_path / "new", progress=False))
    assert _same(old, new) and [r.name for r in a.layers] == [r.name for r in b.layers]
    assert (tmp_path / "run" / "manifest.json").is_file()  # the given run directory was used and kept
    with pytest.raises(ValueError, match="takes a ArmorConfig"):
        prune_model(make_tiny_llama(), CALIB, "armor", WandaConfig(), progress=False)


def test_pruning_sparsifier_with_a_method_name():
    with pytest.warns(ArmorDeprecationWarning, match=r"write PruningSparsifier\(SparseGPTConfig\(pattern='2:4', "
                                                     r"block_size=16, damp=0.05\)\)"):
        old = PruningSparsifier("sparsegpt", pattern="2:4", progress=False, block_size=16, damp=0.05)
    new = PruningSparsifier(SparseGPTConfig(block_size=16, damp=0.05), progress=False)
    assert old.baseline_config == new.baseline_config and old.method is new.method
    with pytest.raises(ValueError, match="ArmorSparsifier"):
        PruningSparsifier(ArmorConfig())


@pytest.mark.parametrize("module, name, home", [
    ("torch_armor.config", "ArmorConfig", "torch_armor.core.config"),
    ("torch_armor.config", "parse_pattern", "torch_armor.core.pattern"),
    ("torch_armor.recipes.prune", "prune_model", "torch_armor.engine.prune"),
    ("torch_armor.recipes.prune", "calibration_batches", "torch_armor.engine.batches"),
])
def test_moved_modules_still_import(module, name, home):
    alias = importlib.import_module(module)
    with pytest.warns(ArmorDeprecationWarning, match=home):
        got = getattr(alias, name)
    assert got is getattr(importlib.import_module(home), name)


def test_run_mismatch_error_moved_to_errors():
    from torch_armor.engine.runstore import RunMismatchError as old_place

    assert old_place is RunMismatchError and issubclass(RunMismatchError, ValueError)
