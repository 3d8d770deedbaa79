"""Presets: one table, ``default`` is ``ArmorConfig()``, every preset a valid config, one-line errors."""

from __future__ import annotations

import dataclasses

import pytest

from torch_armor import ArmorConfig
from torch_armor.config.armor import ReconstructConfig
from torch_armor.config.presets import PRESETS
from torch_armor.errors import ArmorInputError


def test_default_is_the_default_and_presets_differ():
    assert ArmorConfig.preset("default") == ArmorConfig()
    configs = {name: ArmorConfig.preset(name) for name in PRESETS}
    assert len(set(map(repr, configs.values()))) == len(PRESETS)
    for name, changes in PRESETS.items():
        for key, value in changes.items():
            assert getattr(configs[name], key) == value, (name, key)


def test_overrides_apply_on_top():
    cfg = ArmorConfig.preset("max", seed=3, reconstruct=None)
    assert cfg == dataclasses.replace(ArmorConfig.preset("max"), seed=3, reconstruct=None)


def test_unknown_preset_lists_the_names():
    with pytest.raises(ArmorInputError) as err:
        ArmorConfig.preset("slow")
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in PRESETS)


@pytest.mark.parametrize("bad", [dict(steps=0), dict(micro_batch=0), dict(warmup=1.0), dict(decay="step"),
                                 dict(held_out=0), dict(checks=0), dict(patience=0), dict(split_stages=1),
                                 dict(lr=float("nan"))])
def test_reconstruct_config_rejects_in_one_line(bad):
    with pytest.raises(ArmorInputError) as err:
        ReconstructConfig(**bad)
    assert "\n" not in str(err.value) and "ReconstructConfig." in str(err.value)
