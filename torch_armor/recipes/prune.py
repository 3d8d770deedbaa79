"""Deprecated alias (one release): ``prune_model`` lives in :mod:`torch_armor.engine.prune`
(``from torch_armor import prune_model``); recipes hold only data and model recipes."""

from __future__ import annotations

from typing import Any

from torch_armor.engine import batches, prune, sources
from torch_armor.errors import deprecated

_HOMES = {"prune_model": prune, "calibration_batches": batches, "is_streamable_checkpoint": sources}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'torch_armor.recipes.prune' has no attribute {name!r}")
    deprecated(f"torch_armor.recipes.prune is deprecated: import {name} from {_HOMES[name].__name__}")
    return getattr(_HOMES[name], name)
