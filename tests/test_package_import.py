"""What importing torch_armor does to the process: the same registrations with transformers and
torchao whatever is imported first and whatever ``sys.argv`` says, and nothing else changed (the
loggers and warning filters of the user's process are as they were)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch_armor

ROOT = Path(__file__).resolve().parents[1]

REGISTERED = {
    "config": "torch_armor.format.hf.ArmorQuantizationConfig",
    "quantizer": "torch_armor.format.hf.ArmorHfQuantizer",
    "torchao": ["torch_armor.tensor.quant.ArmorCoreConfig"],
    # the method registry, in registration order: (name, config type, hooks); the engine imports no method
    "methods": [["magnitude", "torch_armor.config.methods.MagnitudeConfig", "torch_armor.engine.methods.Method"],
                ["wanda", "torch_armor.config.methods.WandaConfig", "torch_armor.engine.methods.Method"],
                ["sparsegpt", "torch_armor.config.methods.SparseGPTConfig", "torch_armor.engine.methods.Method"],
                ["nowag", "torch_armor.config.methods.NoWagConfig", "torch_armor.engine.methods.Method"],
                ["armor", "torch_armor.config.armor.ArmorConfig", "torch_armor.armor.method.ArmorMethod"]],
    "default": "torch_armor.config.armor.ArmorConfig",
}

# Imports the modules in order under the given argv, and prints the registrations seen after each.
_SNAPSHOTS = textwrap.dedent("""
    import importlib, json, sys
    sys.argv, modules = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    if sys.argv[0].endswith("torch-armor"):
        sys.orig_argv = [sys.executable, "-m", "torch_armor"]  # what `python -m torch_armor` leaves there

    def registrations():
        from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER  # no public view of it
        from transformers.quantizers.auto import AUTO_QUANTIZATION_CONFIG_MAPPING, AUTO_QUANTIZER_MAPPING

        def name(cls):
            return None if cls is None else f"{cls.__module__}.{cls.__qualname__}"

        from torch_armor.engine.methods import METHODS, default_config

        return {"config": name(AUTO_QUANTIZATION_CONFIG_MAPPING.get("armor")),
                "quantizer": name(AUTO_QUANTIZER_MAPPING.get("armor")),
                "torchao": sorted(name(c) for c in _QUANTIZE_CONFIG_HANDLER if c.__module__.startswith("torch_armor")),
                "methods": [[m.name, name(m.config_type), name(type(m))] for m in METHODS.values()],
                "default": name(type(default_config()))}

    seen = []
    for module in modules:
        importlib.import_module(module)
        seen.append(registrations())
    print(json.dumps(seen))
""")


def _registrations_after_each(argv, modules):
    proc = subprocess.run([sys.executable, "-c", _SNAPSHOTS, json.dumps(argv), json.dumps(modules)],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.parametrize("argv, modules", [
    # the case: the console script's name, prune_model imported from its module
    (["torch-armor", "prune"], ["torch_armor.engine.prune", "torch_armor"]),
    (["/venv/bin/torch-armor", "--help"], ["torch_armor.cli.parser", "torch_armor.format.hf"]),
    (["-c"], ["torch_armor.core.pattern", "torch_armor.format.serialization"]),
    # the registry's own module first, then a method's: every method is registered by then all the same
    (["script.py"], ["torch_armor.engine.methods", "torch_armor.armor.method", "torch_armor.baselines"]),
    (["torch-armor"], ["torch_armor.engine.blocks", "torch_armor.calibrated_sparsifier"]),
])
def test_every_import_registers_the_same(argv, modules):
    assert _registrations_after_each(argv, modules) == [REGISTERED] * len(modules)


def test_at_most_15_public_names_each_importing_from_the_package():
    """One front door per job: at most 15 names, each one importable from torch_armor and defined by the
    module the package names for it; the names that left the top level are gone, not aliased."""
    assert len(torch_armor.__all__) <= 15
    assert len(set(torch_armor.__all__)) == len(torch_armor.__all__)
    namespace: dict = {}
    exec("from torch_armor import *", namespace)
    assert set(torch_armor.__all__) <= set(namespace)
    for name in torch_armor.__all__:
        value = getattr(torch_armor, name)
        assert value is namespace[name]
        assert getattr(value, "__name__", name) == name  # the object itself, under its own name
    removed = ["PruningSparsifier", "attach_quantizer", "factorize", "model_size", "BcdConfig", "AdamConfig",
               "RefineConfig", "ReconstructConfig", "DistillConfig", "ArmorFactors", "config_for_method",
               "register_method", "RunMismatchError"]
    assert [n for n in removed if hasattr(torch_armor, n)] == []
    import torch_armor.format.hf as hf
    import torch_armor.sparsifier as sparsifier

    assert not hasattr(sparsifier, "PruningSparsifier") and not hasattr(hf, "from_pretrained")


PUBLIC_MODULES = sorted({"torch_armor", "torch_armor.cli.parser", "torch_armor.format.hf",
                         *(getattr(torch_armor, name).__module__ for name in torch_armor.__all__)})


@pytest.mark.slow
@pytest.mark.parametrize("argv0", ["torch-armor", "script.py"])
@pytest.mark.parametrize("first", PUBLIC_MODULES)
def test_every_public_module_imported_first_registers_the_same(first, argv0):
    rest = [m for m in reversed(PUBLIC_MODULES) if m != first]
    assert _registrations_after_each([argv0], [first, *rest]) == [REGISTERED] * len(PUBLIC_MODULES)


_STATE = textwrap.dedent("""
    import json, logging, warnings
    import torch, torchao.quantization, transformers.quantizers.auto  # the user's own imports come first

    def state():
        loggers = {"": logging.getLogger()}
        loggers.update((n, lg) for n, lg in logging.root.manager.loggerDict.items() if isinstance(lg, logging.Logger))
        return {"loggers": {n: [lg.level, lg.disabled, lg.propagate, [repr(f) for f in lg.filters],
                                [repr(h) for h in lg.handlers]] for n, lg in sorted(loggers.items())},
                "warnings": [repr(f) for f in warnings.filters]}

    before = state()
    import torch_armor
    after = state()
    after["loggers"] = {n: v for n, v in after["loggers"].items() if n in before["loggers"]}  # new modules' own loggers
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger("torchao").addHandler(handler)
    logging.getLogger("torchao").warning("Failed to load torchao/_C_x.so")  # what the import filter would drop
    print(json.dumps({"same": before == after, "before": before, "after": after, "heard": heard}))
""")


def test_import_leaves_loggers_and_warning_filters_as_they_were():
    proc = subprocess.run([sys.executable, "-c", _STATE], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    changed = {n: (v, result["after"]["loggers"].get(n)) for n, v in result["before"]["loggers"].items()
               if v != result["after"]["loggers"].get(n)}
    assert result["same"], (changed, result["before"]["warnings"] == result["after"]["warnings"])
    assert result["heard"] == ["Failed to load torchao/_C_x.so"]
