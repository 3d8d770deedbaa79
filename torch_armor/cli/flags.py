"""Which ``torch-armor prune`` flags apply to which method, and which flag a library parameter is.

A method flag sets a field of a config type (:data:`METHOD_FLAGS`, ``"Type.field[.field]"``); it
applies to every method whose config type is that type or derives from it (the method registry,
:data:`~torch_armor.engine.methods.METHODS`), so a new method gets the flags of its config's
fields. A flag the user gave that does not apply to ``--method`` is refused before anything is
loaded (:func:`flags_that_do_not_apply`). Library errors name API parameters (``out=``); the
command line prints them with its flags (:func:`with_flags`).

Example::

    >>> applies_to("--iters")
    ('armor',)
    >>> with_flags("out=runs/x is not empty; pass overwrite=True (PruneOptions(overwrite=True)) to write into it")
    '--out runs/x is not empty; pass --overwrite (PruneOptions(overwrite=True)) to write into it'
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Dict, List, Tuple

from torch_armor.config.serialized import CONFIG_TYPES
from torch_armor.config.methods import MethodConfig
from torch_armor.engine.methods import METHODS

__all__ = ["METHOD_FLAGS", "PARAMETER_FLAGS", "flag_field", "applies_to", "flags_that_do_not_apply", "with_flags"]

#: ``torch-armor prune`` flag -> the config field it sets, ``"Type.field[.field]"`` (``Type``: a
#: registered config type, or ``MethodConfig`` for every method; ``preset`` is ArmorConfig's
#: named set of fields, :meth:`~torch_armor.config.armor.ArmorConfig.preset`).
METHOD_FLAGS: Dict[str, str] = {
    "--pattern": "MethodConfig.pattern",
    "--preset": "ArmorConfig.preset",
    "--block-size": "ArmorConfig.block_size",
    "--max-overhead": "ArmorConfig.max_overhead",
    "--optimizer": "ArmorConfig.optimizer",
    "--iters": "ArmorConfig.optimizer.iters",
    "--time-budget": "ArmorConfig.optimizer.time_budget_s",
    "--refine": "ArmorConfig.refine",
    "--reconstruct-steps": "ArmorConfig.reconstruct.steps",
    "--distill-steps": "ArmorConfig.distill.steps",
    "--sparsegpt-block-size": "SparseGPTConfig.block_size",
    "--damp": "SparseGPTConfig.damp",
}

#: library parameter (``PruneOptions`` field, ``prune_model`` argument) -> the ``torch-armor``
#: flag that gives it: errors that name ``out=`` are printed with ``--out``.
PARAMETER_FLAGS: Dict[str, str] = {
    "out": "--out",
    "overwrite": "--overwrite",
    "strict": "--strict",
    "run_dir": "--run-dir",
    "layers": "--layers",
    "device": "--device",
    "dtype": "--dtype",
    "storage": "--storage",
    "batch_size": "--batch-size",
    "tasks": "--tasks",
    "include_path": "--include-path",
    "gguf_file": "--gguf-file",
}


def _owner(name: str) -> type:
    return MethodConfig if name == "MethodConfig" else CONFIG_TYPES[name]


def flag_field(flag: str) -> Tuple[type, Tuple[str, ...]]:
    """The config type a method flag belongs to and the field path it sets."""
    owner, *path = METHOD_FLAGS[flag].split(".")
    return _owner(owner), tuple(path)


def field_exists(kind: type, path: Tuple[str, ...]) -> bool:
    """Whether ``path`` names a field of ``kind`` (through nested config fields), or, alone, one
    of its class methods (``preset``)."""
    head, rest = path[0], path[1:]
    if not dataclasses.is_dataclass(kind):  # MethodConfig: a field every method config has
        return not rest and all(head in {f.name for f in dataclasses.fields(m.config_type)} for m in METHODS.values())
    fields = {f.name for f in dataclasses.fields(kind)}
    if head not in fields:
        return not rest and callable(getattr(kind, head, None))
    if not rest:
        return True
    hint = typing.get_type_hints(kind)[head]
    nested = [t for t in typing.get_args(hint) or (hint,) if t in CONFIG_TYPES.values()]
    return bool(nested) and any(field_exists(t, rest) for t in nested)


def applies_to(flag: str) -> Tuple[str, ...]:
    """The registered methods (by name) whose config type takes ``flag``."""
    owner, _ = flag_field(flag)
    return tuple(m.name for kind, m in METHODS.items() if issubclass(kind, owner))


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def flags_that_do_not_apply(args: argparse.Namespace, method: str) -> List[str]:
    """The method flags given in ``args`` (a value other than ``None``) that ``method`` does not
    take, each as one line: ``--iters does not apply to --method wanda (it applies to: armor)``."""
    lines = []
    for flag in METHOD_FLAGS:
        if getattr(args, _dest(flag), None) is not None and method not in applies_to(flag):
            lines.append(f"{flag} does not apply to --method {method} (it applies to: {', '.join(applies_to(flag))})")
    return lines


def method_fields(args: argparse.Namespace, kind: type) -> Dict[str, Tuple[str, Any]]:
    """``{field: (flag, value)}`` of the top-level fields of ``kind`` that the flags given set."""
    out = {}
    for flag in METHOD_FLAGS:
        owner, path = flag_field(flag)
        value = getattr(args, _dest(flag), None)
        if value is not None and issubclass(kind, owner) and len(path) == 1 and path[0] in \
                {f.name for f in dataclasses.fields(kind)}:
            out[path[0]] = (flag, value)
    return out


#: ``out=VALUE`` or ``overwrite=True`` as a parameter of its own (not inside ``PruneOptions(out=...)``)
_PARAMETER = re.compile(r"(?<![\w(.])(?<!, )(" + "|".join(map(re.escape, PARAMETER_FLAGS)) + r")=(True\b)?")


def with_flags(message: str) -> str:
    """A library message with its parameters spelled as flags: ``out=X`` as ``--out X``,
    ``overwrite=True`` as ``--overwrite``."""
    def flag(m: re.Match) -> str:
        bare = m.group(2) or m.end() == len(message) or message[m.end()].isspace()
        return PARAMETER_FLAGS[m.group(1)] + ("" if bare else " ")

    return _PARAMETER.sub(flag, message)
