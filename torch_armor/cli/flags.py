"""Which config field each ``torch-armor prune`` flag sets and which methods it applies to, the
config the flags build, and which flag a library parameter is.

A method flag sets a field of a config type (:data:`METHOD_FLAGS`, ``"Type.field[.field]"``, a
dotted path into nested configs); it applies to every method whose config type is that type or
derives from it (the method registry, :data:`~torch_armor.engine.methods.METHODS`), so a new method
gets the flags of its config's fields. The few flags whose value is not the field's value are
declared beside the table (:data:`FLAG_VALUES`, :data:`OFF_VALUES`), and one function builds every
method's config from the flags given (:func:`config_from_flags`). A flag the user gave that does
not apply to ``--method`` is refused before anything is loaded (:func:`flags_that_do_not_apply`). Library errors name API parameters (``out=``); the
command line prints them with its flags (:func:`with_flags`).

Example::

    >>> applies_to("--iters")
    ('armor',)
    >>> args = argparse.Namespace(pattern="4:8", preset="fast", iters=3, reconstruct_steps=0, seed=0)
    >>> config = config_from_flags(args, method_named("armor").config_type)
    >>> config.pattern, config.optimizer.iters, config.reconstruct
    ('4:8', 3, None)
    >>> with_flags("out=runs/x is not empty; pass overwrite=True (PruneOptions(overwrite=True)) to write into it")
    '--out runs/x is not empty; pass --overwrite (PruneOptions(overwrite=True)) to write into it'
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from typing import Any, Callable, Dict, List, Tuple

from torch_armor.config.levers import OPTIMIZERS
from torch_armor.config.methods import MethodConfig
from torch_armor.config.serialized import CONFIG_TYPES
from torch_armor.engine.methods import METHODS, method_named  # noqa: F401  (method_named: doctest)
from torch_armor.errors import ArmorInputError

__all__ = ["METHOD_FLAGS", "SHARED_FLAGS", "FLAG_VALUES", "OFF_VALUES", "PARAMETER_FLAGS", "flag_field", "applies_to",
           "flags_that_do_not_apply", "config_from_flags", "with_flags"]

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

#: Flags of the whole command that also set a field of the configs that have it (never refused):
#: ``--seed`` seeds the calibration windows too.
SHARED_FLAGS: Dict[str, str] = {"--seed": "ArmorConfig.seed"}

#: The flags whose value is not the field's value: ``(flag's value, the field's value so far, the
#: field's default) -> the field's value``.
FLAG_VALUES: Dict[str, Callable[[Any, Any, Any], Any]] = {
    # an optimizer by name: the one so far if it is of that kind (keeping the preset's settings), else its defaults
    "--optimizer": lambda name, now, default: now if isinstance(now, OPTIMIZERS[name]) else OPTIMIZERS[name](),
    # on: the refinement so far, or the default one; "none": off
    "--refine": lambda value, now, default: (now or default) if value == "output" else None,
}

#: Flags that set a field of a nested config, and the value that turns that config off (``None``);
#: another value turns it on (from the field's default) with the field set.
OFF_VALUES: Dict[str, Any] = {"--reconstruct-steps": 0, "--distill-steps": 0}

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
    """The config type a method flag (or a shared flag) belongs to and the field path it sets."""
    owner, *path = {**METHOD_FLAGS, **SHARED_FLAGS}[flag].split(".")
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


def _default(kind: type, name: str) -> Any:
    """The default of field ``name`` of dataclass ``kind``."""
    f = next(f for f in dataclasses.fields(kind) if f.name == name)
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _with(config: Any, path: Tuple[str, ...], value: Any) -> Any:
    """``config`` with the field at ``path`` (nested configs) set to ``value``."""
    head, rest = path[0], path[1:]
    return dataclasses.replace(config, **{head: _with(getattr(config, head), rest, value) if rest else value})


def config_from_flags(args: argparse.Namespace, kind: type) -> Any:
    """The config of type ``kind`` that the flags given in ``args`` (a value other than ``None``) make:
    its base (a flag naming a constructor of ``kind``, ``--preset``: what it builds; else ``kind()``)
    with the field of every flag that applies to ``kind`` set, in the table's order
    (:data:`FLAG_VALUES` and :data:`OFF_VALUES` map the values that are not the field's). An error
    about a top-level field names its flag."""
    given = []
    for flag in {**METHOD_FLAGS, **SHARED_FLAGS}:
        owner, path = flag_field(flag)
        value = getattr(args, _dest(flag), None)
        if value is not None and issubclass(kind, owner):
            given.append((flag, path, value))
    constructors = [(flag, path[0], value) for flag, path, value in given
                    if path[0] not in {f.name for f in dataclasses.fields(kind)}]
    base = getattr(kind, constructors[0][1])(constructors[0][2]) if constructors else kind()
    fields: Dict[str, Any] = {}
    flags: Dict[str, Tuple[str, Any]] = {}  # top-level field -> (the flag that set it, its value)
    try:
        for flag, path, value in given:
            head = path[0]
            if not any(head == f.name for f in dataclasses.fields(kind)):
                continue
            now, default = fields.get(head, getattr(base, head)), _default(kind, head)
            if flag in OFF_VALUES and value == OFF_VALUES[flag]:
                fields[head] = None
            elif len(path) > 1:
                fields[head] = _with(default if now is None else now, path[1:], value)
            else:
                fields[head] = FLAG_VALUES[flag](value, now, default) if flag in FLAG_VALUES else value
            flags[head] = (flag, value)
        return dataclasses.replace(base, **fields)
    except ArmorInputError as err:
        field = next((f for f in flags if str(err).startswith(f"{kind.__name__}.{f}")), None)
        if field is None:
            raise
        flag, value = flags[field]
        raise ArmorInputError(f"{flag} {value}: {err}") from None


#: ``out=VALUE`` or ``overwrite=True`` as a parameter of its own (not inside ``PruneOptions(out=...)``)
_PARAMETER = re.compile(r"(?<![\w(.])(?<!, )(" + "|".join(map(re.escape, PARAMETER_FLAGS)) + r")=(True\b)?")


def with_flags(message: str) -> str:
    """A library message with its parameters spelled as flags: ``out=X`` as ``--out X``,
    ``overwrite=True`` as ``--overwrite``."""
    def flag(m: re.Match) -> str:
        bare = m.group(2) or m.end() == len(message) or message[m.end()].isspace()
        return PARAMETER_FLAGS[m.group(1)] + ("" if bare else " ")

    return _PARAMETER.sub(flag, message)
