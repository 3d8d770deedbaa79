"""Deprecated alias of :mod:`torch_armor.core.config` and :mod:`torch_armor.core.pattern` (one
release): ``from torch_armor import ArmorConfig`` or ``from torch_armor.core.config import …``."""

from __future__ import annotations

from torch_armor.core import config, pattern
from torch_armor.errors import moved_names

__getattr__ = moved_names("torch_armor.config", {"ArmorConfig": config, "SparsityPattern": pattern,
                                                 "parse_pattern": pattern})
