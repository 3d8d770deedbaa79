"""The call forms of ``prune_model`` from earlier releases (deprecated, one release).

``prune_model(model, calib, "sparsegpt", BaselineConfig(damp=0.1), sequential=False)`` and
``prune_model(model, calib, "armor", cfg, out=..., run_dir=..., pattern=...)`` become
``prune_model(model, calib, SparseGPTConfig(damp=0.1), options=PruneOptions(sequential=False))``:
the method string picks the config type (:func:`~torch_armor.engine.methods.config_for_method`), a
``BaselineConfig``'s fields go into it, ``pattern=`` replaces the config's pattern, and the run
settings go into :class:`~torch_armor.engine.options.PruneOptions`. A warning names the new form.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Dict, Tuple

from torch_armor.core.config_compat import short_repr
from torch_armor.core.method_config import BaselineConfig
from torch_armor.core.pattern import parse_pattern
from torch_armor.engine.methods import method_named
from torch_armor.engine.options import PruneOptions
from torch_armor.errors import ArmorInputError, deprecated

__all__ = ["RUN_KEYWORDS", "accept_legacy_call", "translate_call"]

#: The keyword arguments of ``prune_model`` that became :class:`PruneOptions` fields.
RUN_KEYWORDS = ("out", "run_dir", "device", "dtype", "storage", "sequential", "batch_size", "hidden_dtype",
                "hidden_dir", "progress", "log")
_NEW_KEYWORDS = ("model_or_path", "calibration", "config", "layers", "options")


def _is_legacy(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> bool:
    return (len(args) > 3 or (len(args) == 3 and isinstance(args[2], str)) or isinstance(kwargs.get("config"), str)
            or any(k not in _NEW_KEYWORDS for k in kwargs))


def translate_call(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Tuple[Any, ...], Dict[str, Any], str]:
    """``(args, kwargs)`` of the new form for an old call, and the warning that spells it out."""
    if len(args) < 2:
        raise TypeError("prune_model() needs the model (or a checkpoint directory) and the calibration data")
    model, calibration, rest = args[0], args[1], list(args[2:])
    kwargs = dict(kwargs)
    method = kwargs.pop("method", None)
    config = kwargs.pop("config", None)
    if rest and isinstance(rest[0], str):
        method = rest.pop(0)
    elif isinstance(config, str):
        method, config = config, None
    if rest:
        config = rest.pop(0)
    if rest:
        raise TypeError(f"prune_model() takes at most 4 positional arguments in the old form, got {len(args)}")
    pattern = kwargs.pop("pattern", None)
    run = {k: kwargs.pop(k) for k in RUN_KEYWORDS if k in kwargs}
    options = kwargs.pop("options", PruneOptions())
    layers = kwargs.pop("layers", None)
    if kwargs:
        raise TypeError(f"prune_model() got unexpected keyword arguments {sorted(kwargs)}")
    if method is not None:
        kind = method_named(method).config_type
        if config is None:
            config = kind()
        elif isinstance(config, BaselineConfig):
            config = kind(**config.fields_for(kind))
        elif not isinstance(config, kind):
            raise ArmorInputError(f"method {method!r} takes a {kind.__name__}, got {type(config).__name__}")
    elif isinstance(config, BaselineConfig):
        raise ArmorInputError("a BaselineConfig does not say its method: pass SparseGPTConfig, WandaConfig, "
                              "NoWagConfig or MagnitudeConfig as config")
    if pattern is not None and config is not None and str(parse_pattern(pattern)) != config.pattern:
        config = dataclasses.replace(config, pattern=str(parse_pattern(pattern)))
    options = dataclasses.replace(options, **run) if run else options
    new_args = ", ".join([short_repr(config) if config is not None else "ArmorConfig()"]
                         + ([f"layers={layers!r}"] if layers is not None else [])
                         + ([f"options=PruneOptions({', '.join(f'{k}={v!r}' for k, v in run.items())})"] if run else []))
    message = f"prune_model with a method string or run keywords is deprecated: write prune_model(model, calibration, " \
              f"{new_args})"
    new_kwargs: Dict[str, Any] = {"layers": layers, "options": options}
    if config is not None:
        new_kwargs["config"] = config
    return (model, calibration), new_kwargs, message


def accept_legacy_call(prune_model: Callable[..., Any]) -> Callable[..., Any]:
    """``prune_model`` that also takes the old call forms (with a deprecation warning)."""

    @functools.wraps(prune_model)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _is_legacy(args, kwargs):
            args, kwargs, message = translate_call(args, kwargs)
            deprecated(message, stacklevel=3)
        return prune_model(*args, **kwargs)

    return wrapper
