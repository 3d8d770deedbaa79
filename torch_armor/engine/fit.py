"""Layers the method's settings do not fit: a smaller block size, or dense, instead of no run.

A model can hold a few layers no block size fits: Qwen4-exp's ``(4, H)`` layer, Doge's attention
``dt_proj``, a width that is not a multiple of 16. :func:`fit_layers` checks every selected layer
against the config before anything is pruned. A layer the config fits is pruned as asked. One it
does not fit gets, with ARMOR, the largest block size that divides it within ``max_overhead``
(an entry of ``block_sizes`` for that layer alone); with no such size (or a pattern whose ``M`` does
not divide its input width) it stays dense. Either way it is named in the report
(``PruneReport.unfit_layers``, and ``dense_weights`` for the dense ones) and in one warning.
``strict=True`` (``--strict``) refuses the run instead, naming the layer and the block sizes that fit.

Example::

    >>> from torch import nn
    >>> from torch_armor.config.armor import ArmorConfig
    >>> model = nn.ModuleDict({"wide": nn.Linear(64, 64), "odd": nn.Linear(1000, 2048), "tiny": nn.Linear(64, 4)})
    >>> names, config, unfit = fit_layers(model, ["wide", "odd", "tiny"], ArmorConfig(block_size=16), strict=False)
    >>> names, config.block_sizes
    (['wide', 'odd'], (('odd', 8),))
    >>> unfit["tiny"]
    'dense: block_size=16 does not divide the weight shape (4, 64); no block size fits a (4, 64) layer within 5.0% wrapper overhead: the smallest valid one, 4, costs 106.2%; raise max_overhead or give an integer block size'
    >>> unfit["odd"]
    'block size 8: block_size=16 does not divide the weight shape (2048, 1000)'
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict, List, Sequence, Tuple

from torch import nn

from torch_armor.calibration.experts import split_expert_name
from torch_armor.engine.experts import layer_module
from torch_armor.engine.methods import method_for
from torch_armor.errors import ArmorInputError

__all__ = ["fit_layers", "unfit_warning", "warn_unfit", "dense_reasons", "grouped_layers", "uncalled_warning",
           "shared_warning"]


def _cause(err: ArmorInputError) -> str:
    """The message without its ``layer 'name': `` prefix and its list of sizes that fit."""
    text = re.sub(r"^layer '[^']*': ", "", str(err))
    return text.split("; block sizes that fit")[0]


def fit_layers(model: nn.Module, names: Sequence[str], config: Any,
               strict: bool) -> Tuple[List[str], Any, Dict[str, str]]:
    """``(layers to prune, config, {layer: what was done instead and why})`` for ``names`` under ``config``.

    Layers the config does not fit get a setting of their own where the method has one that fits
    (its ``fit_fallback`` hook; ARMOR with an integer block size: a smaller block size in
    ``config.block_sizes``) or are left out of the layers to prune. ``strict``: raise instead.

    Raises:
        ArmorInputError: ``strict`` and a layer the config does not fit (the message names it).
    """
    method = method_for(config)
    kept: List[str] = []
    fallbacks: List[Tuple[str, Any]] = []
    unfit: Dict[str, str] = {}
    for name in names:
        d_out, d_in = (int(s) for s in layer_module(model, name).weight.shape)
        try:
            config.check_layer(d_out, d_in, name=name)
            kept.append(name)
            continue
        except ArmorInputError as err:
            if strict:
                raise
            cause = _cause(err)
        try:
            fallback = method.fit_fallback(config, d_out, d_in)
        except ArmorInputError as no_fallback:
            if _cause(no_fallback) != cause:  # the pattern's own refusal is said once
                cause += f"; {_cause(no_fallback)}"
            fallback = None
        if fallback is not None:
            setting, what = fallback
            fallbacks.append((name, setting))
            kept.append(name)
            unfit[name] = f"{what}: {cause}"
            continue
        unfit[name] = f"dense: {cause}"
    return kept, method.with_fallbacks(config, fallbacks), unfit


def dense_reasons(unfit: Dict[str, str], kept: Sequence[str]) -> Dict[str, str]:
    """``{weight name: why}`` of the layers :func:`fit_layers` left dense (a fused expert parameter once)."""
    left = set(kept)
    return {(split[0] if split is not None else f"{name}.weight"): what
            for name, what in unfit.items() if name not in left
            for split in (split_expert_name(name),)}


def grouped_layers(layers: Dict[str, str]) -> str:
    """``{layer: what}`` as ``pattern (count): what; …``, decoder-block indices folded into ``*``."""
    grouped: Dict[Tuple[str, str], int] = {}
    for name, what in layers.items():
        key = (re.sub(r"\.\d+(\.|$)", r".*\1", name), what)
        grouped[key] = grouped.get(key, 0) + 1
    return "; ".join(f"{pattern} ({count}): {what}" for (pattern, what), count in grouped.items())


def unfit_warning(unfit: Dict[str, str]) -> str:
    """One line for every layer the settings did not fit, decoder-block indices folded into ``*``."""
    return (f"{len(unfit)} layer(s) the settings do not fit are pruned differently: " + grouped_layers(unfit)
            + ". Pass strict=True to refuse such a model instead")


def uncalled_warning(uncalled: Dict[str, str]) -> str:
    """One line for every selected linear calibration never called (left dense)."""
    return (f"{len(uncalled)} selected linear(s) left dense, never called as a module during calibration: "
            + grouped_layers(uncalled) + "; they are listed in PruneReport.uncalled_layers and dense_weights")


def shared_warning(shared: Dict[str, str]) -> str:
    """One line for every selected linear left dense because several decoder layers share its weight."""
    return (f"{len(shared)} selected linear(s) left dense, each holding a weight that several decoder layers "
            "share: prune_model calibrates one layer at a time, and pruning such a weight from one layer's statistics "
            "would change the other layers' inputs unseen: " + grouped_layers(shared)
            + "; they are listed in PruneReport.dense_weights")


def warn_unfit(unfit: Dict[str, str]) -> None:
    """The one warning about :func:`fit_layers`' changes, if there are any."""
    if unfit:
        warnings.warn(unfit_warning(unfit), UserWarning, stacklevel=4)
