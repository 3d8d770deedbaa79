"""Every config type serializes to the one nested form and reads back to an equal config.

The config types are taken from the registry (``CONFIG_TYPES``), and the registry is checked
against every frozen config dataclass the package defines, so a new config is covered without
editing this file; its values are drawn from its fields' types.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import typing
from typing import Any, Union

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import torch_armor
from torch_armor.config.serialized import CONFIG_FORMAT_VERSION, CONFIG_TYPES, config_from_dict, config_to_dict
from torch_armor.config.levers import DECAYS, RECONSTRUCT_TARGETS, SELECTIONS
from torch_armor.config.methods import MethodConfig
from torch_armor.errors import ArmorInputError

FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.filter_too_much,
                                                                                         HealthCheck.too_slow])

#: values for string fields, by field name (a new string field needs its choices here: the test says so)
STRINGS = {
    "pattern": ["2:4", "1:4", "4:8", "2:8", "unstructured:0.5", "unstructured:0.3"],
    "selection": list(SELECTIONS),
    "decay": list(DECAYS),
    "target": list(RECONSTRUCT_TARGETS),
}
#: the package modules whose dataclasses are configs (``*Config`` dataclasses of the front ends wrap
#: torchao's and transformers' config types and have their own formats)
CONFIG_PACKAGES = ("torch_armor.core",)


def _config_dataclasses() -> set:
    found = set()
    for package in CONFIG_PACKAGES:
        pkg = importlib.import_module(package)
        for info in pkgutil.walk_packages(pkg.__path__, package + "."):
            module = importlib.import_module(info.name)
            for obj in vars(module).values():
                if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == info.name
                        and (obj.__name__.endswith("Config") or issubclass(obj, MethodConfig))
                        and not obj.__name__.startswith("_")):
                    found.add(obj)
    return found


def test_every_config_dataclass_is_registered():
    assert _config_dataclasses() <= set(CONFIG_TYPES.values())  # (other tests may register their own too)
    assert set(CONFIG_TYPES) >= {"ArmorConfig", "BcdConfig", "AdamConfig", "RefineConfig", "ReconstructConfig",
                                 "DistillConfig", "MagnitudeConfig", "WandaConfig", "NoWagConfig", "SparseGPTConfig"}
    # every method of the registry has its config type registered
    from torch_armor.engine.methods import METHODS
    assert all(kind in CONFIG_TYPES.values() for kind in METHODS)


def test_a_method_registered_from_outside_serializes():
    from torch_armor.engine.methods import METHODS, register_method

    @dataclasses.dataclass(frozen=True)
    class OutsideConfig(MethodConfig):
        pattern: str = "2:4"
        scale: float = 0.5

    register_method(OutsideConfig, name="outside-test")(lambda weight, stats, config, name="": None)
    try:
        cfg = OutsideConfig(scale=0.25)
        assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    finally:
        METHODS.pop(OutsideConfig)
        CONFIG_TYPES.pop("OutsideConfig")


def _strategy(hint: Any, name: str, default: Any) -> st.SearchStrategy:
    """Values for a field of type ``hint`` (the default among them, often)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return st.one_of([_strategy(a, name, default) for a in args])
    if hint is type(None):
        return st.none()
    if isinstance(hint, type) and hint in CONFIG_TYPES.values():
        return configs(hint)
    if hint is bool:
        return st.booleans()
    if hint is int:
        return st.integers(0, 70)
    if hint is float:
        return st.one_of(st.floats(0.0, 0.99), st.floats(1e-7, 50.0), st.sampled_from([1e-6, 0.1, 1.0]))
    if hint is str:
        assert name in STRINGS, f"no test values for the string field {name!r}: add them to STRINGS"
        return st.sampled_from(STRINGS[name])
    if hint is torch.dtype:
        return st.sampled_from([torch.float32, torch.float64, torch.float16])
    if hint is torch.device:
        return st.sampled_from([torch.device("cpu"), torch.device("cuda", 1)])
    if origin is tuple and name == "block_sizes":
        return st.lists(st.tuples(st.sampled_from(["*.mlp.*", "*.q_proj", "layers.0.*"]),
                                  st.sampled_from([4, 8, 16, 32])), max_size=3).map(tuple)
    raise AssertionError(f"no test values for field {name!r} of type {hint!r}: extend _strategy")


@st.composite
def _draw_config(draw, kind: type) -> Any:
    hints = typing.get_type_hints(kind)
    kwargs = {}
    for f in dataclasses.fields(kind):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if f.name == "block_size" and kind.__name__ == "ArmorConfig":  # int or a name
            values = st.sampled_from([4, 8, 16, 32, "auto", "budget"])
        elif f.name == "device":  # None, a string or a torch.device
            values = st.one_of(st.none(), st.sampled_from(["cpu", "cuda:0", "meta"]), _strategy(torch.device, "", None))
        else:
            values = _strategy(hints[f.name], f.name, default)
        kwargs[f.name] = draw(st.one_of(st.just(default), values))
    try:
        return kind(**kwargs)
    except ArmorInputError:
        assume(False)


def configs(kind: type) -> st.SearchStrategy:
    return _draw_config(kind)


@pytest.mark.parametrize("name", sorted(CONFIG_TYPES))
@FAST
@given(data=st.data())
def test_round_trip(name, data):
    config = data.draw(configs(CONFIG_TYPES[name]))
    d = config_to_dict(config)
    assert d["type"] == name and d["version"] == CONFIG_FORMAT_VERSION
    assert config_from_dict(d) == config
    text = json.dumps(d, allow_nan=False)  # plain JSON
    assert config_from_dict(json.loads(text)) == config
    assert config_to_dict(config_from_dict(json.loads(text))) == d
    if isinstance(config, MethodConfig):
        assert config.to_dict() == d


def test_nested_form_and_own_fields_only():
    from torch_armor import ArmorConfig, MagnitudeConfig, SparseGPTConfig, WandaConfig
    from torch_armor.config.armor import BcdConfig
    assert WandaConfig().to_dict() == {"type": "WandaConfig", "version": 1, "pattern": "2:4"}
    assert MagnitudeConfig("4:8").to_dict() == {"type": "MagnitudeConfig", "version": 1, "pattern": "4:8"}
    assert SparseGPTConfig(damp=0.1).to_dict() == {"type": "SparseGPTConfig", "version": 1, "pattern": "2:4",
                                                   "block_size": 128, "damp": 0.1}
    d = ArmorConfig(optimizer=BcdConfig(iters=5), refine=None).to_dict()
    assert d["optimizer"] == {"type": "BcdConfig", **dataclasses.asdict(BcdConfig(iters=5))} and d["refine"] is None
    assert "version" not in d["optimizer"]  # the version is the document's


@pytest.mark.parametrize("data, match", [
    ({"block_size": 16, "num_iters": 20, "pattern": "2:4"}, "version None"),  # the flat form of before
    ({"pattern": "2:4", "block_size": 128, "damp": 0.01}, "version None"),
    ({"type": "WandaConfig", "version": 99, "pattern": "2:4"}, "version 99"),
    ({"type": "NoSuchConfig", "version": 1}, "unknown config type 'NoSuchConfig'"),
    ({"type": "WandaConfig", "version": 1, "pattern": "2:4", "damp": 0.01}, r"WandaConfig has no fields \['damp'\]"),
    ({"type": "ArmorConfig", "version": 1, "optimizer": {"type": "BcdConfig", "num_iters": 3}},
     r"ArmorConfig.optimizer: BcdConfig has no fields \['num_iters'\]"),
    ({"type": "ArmorConfig", "version": 1, "dtype": "torch.int8x"}, "ArmorConfig.dtype: 'torch.int8x' is not a torch dtype"),
    ({"type": "SparseGPTConfig", "version": 1, "damp": 2.0}, "SparseGPTConfig.damp"),
    ([1, 2], "version None"),
])
def test_other_forms_are_refused_with_one_line(data, match):
    with pytest.raises(ArmorInputError, match=match) as info:
        config_from_dict(data)
    assert "\n" not in str(info.value)


def test_only_configs_serialize():
    with pytest.raises(ArmorInputError, match="expected a config"):
        config_to_dict(torch_armor.PruneOptions())
