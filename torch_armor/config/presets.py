"""Named ARMOR settings, a ladder from quick to thorough: :meth:`ArmorConfig.preset(name)
<torch_armor.config.armor.ArmorConfig.preset>` and ``torch-armor prune --preset NAME``.

Each preset is ``ArmorConfig()`` with the lever settings below replaced; ``"default"`` is
``ArmorConfig()`` itself. Measured perplexities and costs (default 34.84, max 28.26 on SmolLM2-135M): docs/results.md.

* ``"fast"``: 10 exact sweeps per layer, one refinement round, 32 reconstruction steps fitting
  each block to the dense model's hidden states (``target="model"``: without distillation, the
  better target), no distillation — for a first look at a model.
* ``"default"``: the library's defaults (20 sweeps, one refinement round, 64 reconstruction steps on
  single windows, 16 distillation steps at learning rate 1e-3; chosen on held-out calibration text
  for about 15 minutes on SmolLM2-135M on 2 cores).
* ``"max"``: 64 windows sampled from the dense model before pruning, each continuing a training
  window's first 64 tokens, calibrate it besides the calibration windows (the block pass and
  distillation; never held out); 20 sweeps, one refinement round and 16 full-``XᵀX`` sparse-core
  steps after it (the mask may change), 512 reconstruction steps per block on single windows
  (about four epochs over the calibration and sampled windows) and 96 distillation steps at
  learning rate 2e-3 (chosen on held-out calibration text: docs/results.md). Its calibration
  windows must be longer than 64 tokens, and its model a transformers causal LM (sampling uses
  its key/value cache).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Dict, Mapping

from torch_armor.config.levers import BcdConfig, DistillConfig, ReconstructConfig, RefineConfig
from torch_armor.errors import ArmorInputError

__all__ = ["PRESETS", "preset_changes"]

#: ``{name: {ArmorConfig field: value}}``, each a change of ``ArmorConfig()``.
PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType({
    "fast": MappingProxyType({
        "optimizer": BcdConfig(iters=10),
        "refine": RefineConfig(rounds=1),
        "reconstruct": ReconstructConfig(target="model"),
        "distill": None,
    }),
    "default": MappingProxyType({}),
    "max": MappingProxyType({
        "optimizer": BcdConfig(iters=20),
        "refine": RefineConfig(rounds=1, core_steps=16),
        "reconstruct": ReconstructConfig(steps=512),
        "distill": DistillConfig(steps=96, lr=2e-3, sampled_windows=64, sample_prompt_tokens=64,
                                 sampled_in_block_pass=True),
    }),
})


def preset_changes(name: str) -> Dict[str, Any]:
    """The field changes of preset ``name`` (a one-line error listing the presets otherwise)."""
    if name not in PRESETS:
        raise ArmorInputError(f"unknown ARMOR preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name])
