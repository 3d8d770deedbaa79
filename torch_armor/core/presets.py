"""Named ARMOR settings, a ladder from quick to thorough: :meth:`ArmorConfig.preset(name)
<torch_armor.core.config.ArmorConfig.preset>` and ``torch-armor prune --preset NAME``. Not measured as a whole yet.

Each preset is ``ArmorConfig()`` with the lever settings below replaced; ``"default"`` is
``ArmorConfig()`` itself. The reconstruction-steps curve behind them: docs/results.md (the presets
as a whole are not measured yet).

* ``"fast"``: 10 exact sweeps per layer, one refinement round, 32 reconstruction steps on single
  windows (a quarter of the cost of a 4-window step) — for a first look at a model.
* ``"default"``: the library's defaults.
* ``"max"``: 60 sweeps per layer, the default refinement, 128 reconstruction steps per block (eight
  epochs over the calibration batches), stopping early after two held-out checks without gain.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, Mapping

from torch_armor.core.levers import BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.errors import ArmorInputError

__all__ = ["PRESETS", "preset_changes"]

#: ``{name: {ArmorConfig field: value}}``, each a change of ``ArmorConfig()``.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "fast": MappingProxyType({
        "optimizer": BcdConfig(iters=10),
        "refine": RefineConfig(rounds=1),
        "reconstruct": ReconstructConfig(steps=32, micro_batch=1),
    }),
    "default": MappingProxyType({}),
    "max": MappingProxyType({
        "optimizer": BcdConfig(iters=60),
        "reconstruct": ReconstructConfig(steps=128, checks=8, patience=2),
        # end-to-end distillation and full-H sparse-core updates join here once they land
    }),
})


def preset_changes(name: str) -> Dict[str, Any]:
    """The field changes of preset ``name`` (a one-line error listing the presets otherwise)."""
    if name not in PRESETS:
        raise ArmorInputError(f"unknown ARMOR preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])
