"""Deprecated alias (one release): ``prune_model`` lives in :mod:`torch_armor.engine.prune`
(``from torch_armor import prune_model``); recipes hold only data and model recipes."""

from __future__ import annotations

from torch_armor.engine import batches, prune, sources
from torch_armor.errors import moved_names

__getattr__ = moved_names("torch_armor.recipes.prune", {"prune_model": prune, "calibration_batches": batches,
                                                        "is_streamable_checkpoint": sources})
