"""Deprecated alias of :mod:`torch_armor.core.config` and :mod:`torch_armor.core.pattern` (one
release): ``from torch_armor import ArmorConfig`` or ``from torch_armor.core.config import …``."""

from __future__ import annotations

from typing import Any

from torch_armor.core import config, pattern
from torch_armor.errors import deprecated

_HOMES = {"ArmorConfig": config, "SparsityPattern": pattern, "parse_pattern": pattern}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'torch_armor.config' has no attribute {name!r}")
    deprecated(f"torch_armor.config is deprecated: import {name} from {_HOMES[name].__name__}")
    return getattr(_HOMES[name], name)
