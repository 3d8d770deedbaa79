"""ARMOR as a method of the engine: its hooks (:mod:`torch_armor.armor.method`), registered on import."""

from torch_armor.armor import method  # noqa: F401  (registers ARMOR with the engine's method registry)
