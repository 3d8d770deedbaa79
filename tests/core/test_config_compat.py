"""The flat form of ArmorConfig: the serialized dict is the one the flat config of 059405f wrote
(run directories, reports and sparsifier states stay readable), and the flat keywords and
attributes of earlier releases still work for one release, each with a warning naming the new form."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from torch_armor import AdamConfig, ArmorConfig, BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.core.config_compat import LEGACY_KEYWORDS
from torch_armor.core.levers import DEFAULT_RECONSTRUCT, DEFAULT_REFINE
from torch_armor.errors import ArmorDeprecationWarning

#: (flat keywords of the old ArmorConfig, the nested config they mean); the golden file holds
#: ``config_to_dict`` of the old config for each, written by the code of commit 059405f.
CASES = [
    ({}, ArmorConfig()),
    ({"block_size": 32}, ArmorConfig(block_size=32)),
    ({"block_size": "auto"}, ArmorConfig(block_size="auto")),
    ({"block_size": "budget"}, ArmorConfig(block_size="budget")),
    ({"optimizer": "adam"}, ArmorConfig(optimizer=AdamConfig())),
    ({"optimizer": "adam", "num_iters": 7, "lr": 1e-3}, ArmorConfig(optimizer=AdamConfig(iters=7, lr=1e-3))),
    ({"num_iters": 5, "cg_steps": 3, "group_updates": 2},
     ArmorConfig(optimizer=BcdConfig(iters=5, cg_steps=3, group_updates=2))),
    ({"refine": None}, ArmorConfig(refine=None)),
    ({"reconstruct_steps": 0}, ArmorConfig(reconstruct=None)),
    ({"reconstruct_steps": 3, "reconstruct_lr": 1e-2}, ArmorConfig(reconstruct=ReconstructConfig(steps=3, lr=1e-2))),
    ({"refine_rounds": 1, "refine_cg_steps": 5, "refine_damp": 0.1},
     ArmorConfig(refine=RefineConfig(rounds=1, cg_steps=5, damp=0.1))),
    ({"selection": "l1-greedy", "tol": 0.01, "time_budget_s": 2.0},
     ArmorConfig(optimizer=BcdConfig(selection="l1-greedy", tol=0.01, time_budget_s=2.0))),
    ({"dtype": torch.float64, "device": "cpu", "seed": 3, "log_every": 2, "max_overhead": 0.1},
     ArmorConfig(dtype=torch.float64, device="cpu", seed=3, max_overhead=0.1, optimizer=BcdConfig(log_every=2))),
    ({"block_size": "auto", "group_updates": 4}, ArmorConfig(block_size="auto", optimizer=BcdConfig(group_updates=4))),
    ({"block_sizes": {"*.mlp.*": 8}, "block_size": "budget"}, ArmorConfig(block_size="budget", block_sizes={"*.mlp.*": 8})),
    ({"pattern": "4:8", "block_size": 8}, ArmorConfig(block_size=8, pattern="4:8")),
    ({"pattern": "unstructured:0.5", "block_size": 6}, ArmorConfig(block_size=6, pattern="unstructured:0.5")),
    ({"ridge": 1e-4}, ArmorConfig(optimizer=BcdConfig(ridge=1e-4))),
    ({"optimizer": "adam", "selection": "mixed", "block_size": "auto"},
     ArmorConfig(block_size="auto", optimizer=AdamConfig(selection="mixed"))),
]
GOLDEN = json.loads((Path(__file__).parent / "data" / "flat_config_dicts_059405f.json").read_text())["dicts"]


def _flat(kwargs: dict) -> ArmorConfig:
    legacy = LEGACY_KEYWORDS.intersection(kwargs) or any(isinstance(kwargs.get(k), str) for k in ("optimizer", "refine"))
    if not legacy:
        return ArmorConfig(**kwargs)
    with pytest.warns(ArmorDeprecationWarning, match=r"is deprecated: write ArmorConfig\("):
        return ArmorConfig(**kwargs)


@pytest.mark.parametrize("index", range(len(CASES)))
def test_serialized_form_is_the_old_one(index):
    flat, nested = CASES[index]
    assert len(GOLDEN) == len(CASES)
    want = dict(GOLDEN[index])
    if "reconstruct_steps" not in flat:  # defaults changed since 059405f: reconstruction 8 -> 64 steps
        want["reconstruct_steps"] = DEFAULT_RECONSTRUCT.steps
    if "refine_rounds" not in flat:  # and refinement 3 -> 1 round
        want["refine_rounds"] = DEFAULT_REFINE.rounds
    if flat.get("optimizer") != "adam" and "num_iters" not in flat:  # and bcd's sweeps 30 -> 20
        want["num_iters"] = BcdConfig().iters
    for cfg in (_flat(flat), nested):
        got = json.loads(json.dumps(cfg.to_dict()))
        assert got == want and list(got) == list(want)  # same keys, values and order
    assert _flat(flat) == nested


def test_the_warning_names_the_new_form():
    with pytest.warns(ArmorDeprecationWarning) as caught:
        ArmorConfig(num_iters=7, optimizer="adam", lr=1e-3, reconstruct_steps=0)
    message = str(caught[0].message)
    assert "optimizer=AdamConfig(iters=7, lr=0.001)" in message and "reconstruct=None" in message
    assert caught[0].filename == __file__  # points at the caller


def test_replace_with_flat_keywords_keeps_the_other_settings():
    base = ArmorConfig(block_size=32, optimizer=BcdConfig(iters=5, tol=0.01))
    with pytest.warns(ArmorDeprecationWarning):
        moved = dataclasses.replace(base, num_iters=9)
    assert moved == ArmorConfig(block_size=32, optimizer=BcdConfig(iters=9, tol=0.01))
    with pytest.warns(ArmorDeprecationWarning):
        assert dataclasses.replace(base, reconstruct_steps=2).reconstruct == ReconstructConfig(steps=2)


def test_flat_attributes_read_with_a_warning():
    cfg = ArmorConfig(block_size=32, optimizer=AdamConfig(iters=7), refine=None)
    expected = {"num_iters": 7, "iterations": 7, "lr": 1e-4, "selection_rule": "l1-random", "group_updates_per_sweep": 16,
                "refine_rounds": 1, "reconstruct_steps": 64}  # a lever that is off reads ArmorConfig()'s
    for name, value in expected.items():
        with pytest.warns(ArmorDeprecationWarning, match=f"ArmorConfig.{name} is deprecated"):
            assert getattr(cfg, name) == value, name
    with pytest.raises(AttributeError):
        cfg.no_such_field


def test_flat_keywords_are_checked_and_errors_name_them():
    for kwargs, field in (({"num_iters": -1}, "num_iters"), ({"lr": 0.0}, "lr"), ({"cg_steps": -2}, "cg_steps"),
                          ({"reconstruct_steps": -1}, "reconstruct_steps"), ({"refine_damp": 2.0}, "refine_damp")):
        with pytest.raises(ValueError, match=field):
            ArmorConfig(**kwargs)  # an unused flat value (lr with bcd) is still checked, as before


def test_a_new_lever_field_at_its_default_leaves_the_serialized_form_alone():
    """Fields added to a lever later appear as "<lever>_<field>" only when they differ from their
    default, so earlier run directories keep resuming."""

    @dataclasses.dataclass(frozen=True)
    class Extended(ReconstructConfig):
        epochs: int = 1

    base = ArmorConfig(reconstruct=ReconstructConfig()).to_dict()
    assert ArmorConfig(reconstruct=Extended()).to_dict() == base
    assert ArmorConfig(reconstruct=Extended(epochs=3)).to_dict() == {**base, "reconstruct_epochs": 3}
