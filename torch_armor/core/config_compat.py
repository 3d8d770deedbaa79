"""The flat form of :class:`~torch_armor.core.config.ArmorConfig`: how it is serialized, and the
flat keyword arguments and attributes of earlier releases (deprecated, one release).

Serialized form (:func:`flat_dict`): the keys and values ``config_to_dict`` always wrote — run
directories, ``prune_report.json`` settings and sparsifier states from earlier releases stay
readable and resumable.

Old keywords (:func:`translate`): ``ArmorConfig(num_iters=5, optimizer="adam", lr=1e-3,
refine="output", refine_rounds=2, reconstruct_steps=0, …)`` builds the nested config
``ArmorConfig(optimizer=AdamConfig(iters=5, lr=0.001), refine=RefineConfig(rounds=2),
reconstruct=None)`` and warns with that new form; so does ``dataclasses.replace(cfg, num_iters=5)``.
Reading ``cfg.num_iters``, ``cfg.iterations``, ``cfg.refine_rounds``, … returns the flat value,
with a warning.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Tuple

from torch_armor.core.levers import (DEFAULT_RECONSTRUCT, DEFAULT_REFINE, OPTIMIZERS, AdamConfig, BcdConfig,
                                     ReconstructConfig, RefineConfig)
from torch_armor.errors import ArmorInputError, deprecated

__all__ = ["LEGACY_KEYWORDS", "translate", "accept_flat_keywords", "flat_dict", "legacy_attribute", "short_repr"]

_OPTIMIZERS = OPTIMIZERS
#: flat keyword -> (lever, field of the lever's config)
_LEVER_FIELDS: Dict[str, Tuple[str, str]] = {
    "num_iters": ("optimizer", "iters"),
    "lr": ("optimizer", "lr"),
    "time_budget_s": ("optimizer", "time_budget_s"),
    "tol": ("optimizer", "tol"),
    "cg_steps": ("optimizer", "cg_steps"),
    "group_updates": ("optimizer", "group_updates"),
    "ridge": ("optimizer", "ridge"),
    "selection": ("optimizer", "selection"),
    "log_every": ("optimizer", "log_every"),
    "refine_rounds": ("refine", "rounds"),
    "refine_cg_steps": ("refine", "cg_steps"),
    "refine_damp": ("refine", "damp"),
    "reconstruct_steps": ("reconstruct", "steps"),
    "reconstruct_lr": ("reconstruct", "lr"),
}
LEGACY_KEYWORDS = frozenset(_LEVER_FIELDS)
#: attributes of the flat config that were derived values
_DERIVED = {"iterations": "num_iters", "group_updates_per_sweep": "group_updates", "selection_rule": "selection"}
_LEVER_DEFAULTS = {"optimizer": BcdConfig(), "refine": DEFAULT_REFINE, "reconstruct": DEFAULT_RECONSTRUCT}


def short_repr(obj: Any) -> str:
    """``ArmorConfig(optimizer=BcdConfig(iters=5))``: a config by its non-default fields (nested too).

    Example::

        >>> short_repr(BcdConfig(iters=5)), short_repr(None)
        ('BcdConfig(iters=5)', 'None')
    """
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return repr(obj)
    given = [f"{f.name}={short_repr(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
             if f.init and getattr(obj, f.name) != f.default]
    return f"{type(obj).__name__}({', '.join(given)})"


def _build(kind: type, base: Any, changes: Dict[str, Any], spelled: str) -> Any:
    """``kind`` from ``base`` (``None``: defaults) with ``changes`` on the fields it has; the
    others are checked by the config that has them and then dropped (they never applied)."""
    own = {f.name for f in dataclasses.fields(kind)}
    try:
        for key, value in changes.items():
            if key not in own:  # e.g. lr= with bcd: checked as before, still unused
                other = next(k for k in (*_OPTIMIZERS.values(), RefineConfig, ReconstructConfig)
                             if key in {f.name for f in dataclasses.fields(k)} and k is not kind)
                other(**{key: value})
        mine = {k: v for k, v in changes.items() if k in own}
        return dataclasses.replace(base, **mine) if base is not None else kind(**mine)
    except ArmorInputError as err:
        raise ArmorInputError(f"ArmorConfig({spelled}): {err}") from None


def translate(kwargs: Dict[str, Any]) -> Tuple[Dict[str, Any], str]:
    """The nested keyword arguments of ``ArmorConfig`` for ``kwargs`` in the flat form, and the
    new form spelled out for the warning."""
    kwargs = dict(kwargs)
    flat = {k: kwargs.pop(k) for k in list(kwargs) if k in LEGACY_KEYWORDS}
    legacy = dict(flat)
    spelled = ", ".join(f"{k}={v!r}" for k, v in {**flat, **{k: kwargs[k] for k in ("optimizer", "refine")
                                                               if isinstance(kwargs.get(k), str)}}.items())
    changed = []
    optimizer = kwargs.get("optimizer", _LEVER_DEFAULTS["optimizer"])
    if isinstance(optimizer, str):
        if optimizer not in _OPTIMIZERS:
            raise ArmorInputError(f"optimizer must be one of {tuple(sorted(_OPTIMIZERS))} (or BcdConfig() / "
                                  f"AdamConfig()), got {optimizer!r}")
        optimizer, legacy["optimizer"] = _OPTIMIZERS[optimizer](), optimizer
    refine = kwargs.get("refine", _LEVER_DEFAULTS["refine"])
    if isinstance(refine, str):
        if refine != "output":
            raise ArmorInputError(f"refine must be one of ('output', None) or a RefineConfig(...), got {refine!r}")
        refine, legacy["refine"] = DEFAULT_REFINE, refine
    reconstruct = kwargs.get("reconstruct", _LEVER_DEFAULTS["reconstruct"])
    per_lever: Dict[str, Dict[str, Any]] = {"optimizer": {}, "refine": {}, "reconstruct": {}}
    for key, value in flat.items():
        lever, name = _LEVER_FIELDS[key]
        if key == "num_iters" and value is None:
            value = type(optimizer)().iters
        per_lever[lever][name] = value
    if per_lever["optimizer"] or "optimizer" in legacy:
        optimizer = _build(type(optimizer), optimizer, per_lever["optimizer"], spelled)
        kwargs["optimizer"] = optimizer
        changed.append(f"optimizer={short_repr(optimizer)}")
    if per_lever["refine"] or "refine" in legacy:
        new = _build(RefineConfig, refine, per_lever["refine"], spelled)
        refine = new if refine is not None else None
        kwargs["refine"] = refine
        changed.append(f"refine={short_repr(refine)}")
    if per_lever["reconstruct"]:
        steps = per_lever["reconstruct"].get("steps", reconstruct.steps if reconstruct is not None else None)
        if steps == 0 and not isinstance(steps, bool):  # 0 steps was "off"
            reconstruct = None
            _build(ReconstructConfig, None, {k: v for k, v in per_lever["reconstruct"].items() if k != "steps"},
                   spelled)
        elif steps is None:  # only reconstruct_lr, reconstruction off: checked, unused
            _build(ReconstructConfig, None, per_lever["reconstruct"], spelled)
        else:
            reconstruct = _build(ReconstructConfig, reconstruct, {**per_lever["reconstruct"], "steps": steps},
                                 spelled)
        kwargs["reconstruct"] = reconstruct
        changed.append(f"reconstruct={short_repr(reconstruct)}")
    return kwargs, f"ArmorConfig({spelled}) is deprecated: write ArmorConfig({', '.join(changed)})"


def accept_flat_keywords(init: Callable[..., None]) -> Callable[..., None]:
    """``ArmorConfig.__init__`` that also takes the flat keywords of earlier releases (warning)."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if LEGACY_KEYWORDS.intersection(kwargs) or any(isinstance(kwargs.get(k), str) for k in ("optimizer", "refine")):
            kwargs, message = translate(kwargs)
            deprecated(message, stacklevel=3)
        init(self, *args, **kwargs)

    return __init__


def flat_dict(cfg: Any, plain: Callable[[Any], Any]) -> Dict[str, Any]:
    """The flat serialized form of an ``ArmorConfig`` (see its ``to_dict``)."""
    opt, refine, recon = cfg.optimizer, cfg.refine, cfg.reconstruct
    bcd = opt if isinstance(opt, BcdConfig) else _LEVER_DEFAULTS["optimizer"]
    adam_lr = opt.lr if isinstance(opt, AdamConfig) else AdamConfig().lr
    named = cfg.block_size in ("auto", "budget")
    out: Dict[str, Any] = {
        "block_size": plain(cfg.block_size),
        "pattern": cfg.pattern,
        "num_iters": opt.iterations,
        "optimizer": opt.name,
        "lr": adam_lr,
        "time_budget_s": opt.time_budget_s,
        "tol": opt.tol,
        "cg_steps": bcd.cg_steps,
        "group_updates": bcd.group_updates if named and bcd.group_updates is None
        else bcd.group_updates_per_sweep(cfg.block_size),
        "ridge": bcd.ridge,
        "selection": opt.selection_rule,
        "seed": cfg.seed,
        "device": plain(cfg.device),
        "dtype": plain(cfg.dtype),
        "log_every": opt.log_every,
        "max_overhead": cfg.max_overhead,
        "block_sizes": plain(cfg.block_sizes),
        "refine": "output" if refine is not None else None,
    }
    for key, (lever, name) in _LEVER_FIELDS.items():
        if lever != "optimizer":  # a lever that is off keeps its defaults
            out[key] = plain(getattr(getattr(cfg, lever) or _LEVER_DEFAULTS[lever], name))
    if recon is None:
        out["reconstruct_steps"] = 0
    if cfg.distill is None:  # distillation (on by default) keys only when changed: earlier forms are kept
        out["distill_steps"] = 0
    else:
        out.update({f"distill_{f.name}": plain(getattr(cfg.distill, f.name)) for f in dataclasses.fields(cfg.distill)
                    if getattr(cfg.distill, f.name) != f.default})
    known = set(_LEVER_FIELDS.values())
    for lever in ("optimizer", "refine", "reconstruct"):  # fields added after the flat form: only when set
        value = getattr(cfg, lever)
        for f in dataclasses.fields(value) if value is not None else ():
            if (lever, f.name) not in known and getattr(value, f.name) != f.default:
                out[f"{lever}_{f.name}"] = plain(getattr(value, f.name))
    return out


def legacy_attribute(cfg: Any, name: str) -> Any:
    """``cfg.num_iters`` and the other flat attributes: their flat value, with a warning."""
    key = _DERIVED.get(name, name)
    if key not in LEGACY_KEYWORDS:
        raise AttributeError(f"{type(cfg).__name__!r} object has no attribute {name!r}")
    lever, field = _LEVER_FIELDS[key]
    new = {"iterations": "optimizer.iterations", "group_updates_per_sweep": "optimizer.group_updates_per_sweep"
           "(block_size)", "selection_rule": "optimizer.selection_rule"}.get(name, f"{lever}.{field}")
    deprecated(f"ArmorConfig.{name} is deprecated: read config.{new}", stacklevel=4)
    return flat_dict(cfg, lambda v: v)[key]
