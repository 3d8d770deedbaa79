"""The one serialized form of every config: nested JSON with a type and a version.

``config_to_dict(cfg)`` writes ``{"type": "ArmorConfig", "version": 1, <field>: <value>, …}``;
a field holding another config (ARMOR's ``optimizer``, ``refine``, ``reconstruct``, ``distill``)
is written the same way, nested, with its own ``"type"`` (the version is the top level's). Dtypes
are written as ``"torch.float32"``, tuples as lists. :func:`config_from_dict` reads it back to an
equal config; a dict of another form (no or another version, unknown type or field) is refused
with one line. Every config type is registered here (:func:`serializable`): :data:`CONFIG_TYPES`.

Example::

    >>> from torch_armor.config.methods import SparseGPTConfig
    >>> d = config_to_dict(SparseGPTConfig(damp=0.1))
    >>> d
    {'type': 'SparseGPTConfig', 'version': 1, 'pattern': '2:4', 'block_size': 128, 'damp': 0.1}
    >>> config_from_dict(d) == SparseGPTConfig(damp=0.1)
    True
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Dict, Mapping, Tuple, TypeVar

import torch

from torch_armor.errors import ArmorInputError

__all__ = ["CONFIG_FORMAT_VERSION", "CONFIG_TYPES", "serializable", "config_to_dict", "config_from_dict",
           "config_changes"]

#: The version of the serialized form; a dict with another one is refused.
CONFIG_FORMAT_VERSION = 1
#: Every serializable config type, by class name.
CONFIG_TYPES: Dict[str, type] = {}

T = TypeVar("T", bound=type)


def serializable(cls: T) -> T:
    """Register the frozen config dataclass ``cls`` (its name must be unique)."""
    if not dataclasses.is_dataclass(cls):
        raise ArmorInputError(f"{cls.__name__} is not a dataclass: a config type must be one")
    if CONFIG_TYPES.get(cls.__name__, cls) is not cls:
        raise ArmorInputError(f"two config types are named {cls.__name__}: rename one ({cls.__module__}."
                              f"{cls.__qualname__}, {CONFIG_TYPES[cls.__name__].__module__})")
    CONFIG_TYPES[cls.__name__] = cls
    return cls


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _fields_dict(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    raise ArmorInputError(f"config value {value!r} ({type(value).__name__}) has no serialized form")


def _fields_dict(config: Any) -> Dict[str, Any]:
    kind = type(config)
    if CONFIG_TYPES.get(kind.__name__) is not kind:
        raise ArmorInputError(f"expected a config (ArmorConfig, SparseGPTConfig, …), got {kind.__name__}")
    return {"type": kind.__name__, **{f.name: _plain(getattr(config, f.name))
                                      for f in dataclasses.fields(config) if f.init}}


def config_to_dict(config: Any) -> Dict[str, Any]:
    """The serialized form of ``config`` (JSON-ready): nested, with ``"type"`` and ``"version"``.

    Raises:
        ArmorInputError: ``config`` is not a registered config.
    """
    out = _fields_dict(config)
    return {"type": out.pop("type"), "version": CONFIG_FORMAT_VERSION, **out}


def _decode(hint: Any, value: Any, where: str) -> Any:
    if isinstance(value, Mapping):
        return _build(value, where)
    if hint is torch.dtype:
        dtype = getattr(torch, value.removeprefix("torch."), None) if isinstance(value, str) else None
        if not isinstance(dtype, torch.dtype):
            raise ArmorInputError(f"{where}: {value!r} is not a torch dtype")
        return dtype
    if isinstance(value, list):
        return tuple(_decode(None, v, where) for v in value)
    return value


def _build(data: Mapping[str, Any], where: str) -> Any:
    name = data.get("type")
    kind = CONFIG_TYPES.get(name) if isinstance(name, str) else None
    if kind is None:
        raise ArmorInputError(f"{where}: unknown config type {name!r}; known: {sorted(CONFIG_TYPES)}")
    fields = {f.name for f in dataclasses.fields(kind) if f.init}
    unknown = sorted(set(data) - fields - {"type", "version"})
    if unknown:
        raise ArmorInputError(f"{where}: {name} has no fields {unknown}")
    hints = typing.get_type_hints(kind)
    return kind(**{key: _decode(hints.get(key), value, f"{where}.{key}") for key, value in data.items()
                   if key in fields})


def config_from_dict(data: Any) -> Any:
    """The config that :func:`config_to_dict` serialized as ``data`` (an equal one).

    Raises:
        ArmorInputError: ``data`` is not of this form (no or another ``"version"``: written by
            another torch_armor), names an unknown type or field, or holds an invalid value.
    """
    if not isinstance(data, Mapping) or data.get("version") != CONFIG_FORMAT_VERSION:
        version = data.get("version") if isinstance(data, Mapping) else None
        raise ArmorInputError(f"not a torch_armor config of format version {CONFIG_FORMAT_VERSION} "
                              f"(version {version!r}); write the config again with this torch_armor")
    return _build(data, str(data.get("type")))


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> Dict[str, Tuple[Any, Any]]:
    """What differs between two serialized configs, by dotted field name (nested configs are
    compared field by field): ``{"optimizer.iters": (old, new)}``.

    Example::

        >>> config_changes({"type": "A", "opt": {"type": "B", "iters": 2}}, {"type": "A", "opt": {"type": "B", "iters": 5}})
        {'opt.iters': (2, 5)}
    """
    out: Dict[str, Tuple[Any, Any]] = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, Mapping) and isinstance(b, Mapping) and a.get("type") == b.get("type"):
            out.update(config_changes(a, b, f"{prefix}{key}."))
        elif a != b:
            out[f"{prefix}{key}"] = (a, b)
    return out
