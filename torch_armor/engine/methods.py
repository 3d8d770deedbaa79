"""The method registry: one table, keyed by config type, that every front end reads.

A method is registered next to the code that runs it on one layer, with what it needs from
calibration as functions of its config::

    @register_method(SparseGPTConfig, label="SparseGPT", needs_xtx=True)
    def _sparsegpt(weight, stats, config, name) -> (mask, pruned) | ArmorFactors: ...

:func:`method_for` finds a config's method; :func:`config_for_method` maps the names the command
line and the reports use (``"armor"``, ``"sparsegpt"``, ``"wanda"``, ``"nowag"``,
``"magnitude"``) to configs. This module is the one place where a method is told apart from
another: the engine asks a :class:`Method` what it needs, never which one it is.

Example::

    >>> method_for(SparseGPTConfig()).label, method_for(ArmorConfig()).factorizes
    ('SparseGPT', True)
    >>> config_for_method("wanda", pattern="4:8")
    WandaConfig(pattern='4:8')
    >>> method_names()
    ('magnitude', 'wanda', 'sparsegpt', 'nowag', 'armor')
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from torch_armor.core import baselines
from torch_armor.core.config import ArmorConfig
from torch_armor.core.config_format import serializable
from torch_armor.core.factorize import factorize
from torch_armor.core.factorize_batched import factorize_batched
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.method_config import MagnitudeConfig, NoWagConfig, SparseGPTConfig, WandaConfig
from torch_armor.core.proxy import nowag_prune
from torch_armor.errors import ArmorInputError

__all__ = ["Method", "METHODS", "register_method", "method_for", "method_named", "config_for_method", "method_names",
           "method_label"]

#: What a method makes of one layer: ARMOR factors, or ``(keep-mask, pruned dense weight)``.
Result = Union[ArmorFactors, Tuple[torch.Tensor, torch.Tensor]]
Solve = Callable[[torch.Tensor, Any, Any, str], Result]


def _never(config: Any) -> bool:
    return False


def _always(config: Any) -> bool:
    return True


@dataclass(frozen=True)
class Method:
    """One pruning method: its config type, names, the code that solves one layer, and what it needs.

    Attributes:
        config_type: the config class that selects it.
        name: its name on the command line and in reports (``"sparsegpt"``).
        label: its name in tables (``"SparseGPT"``).
        solve: ``solve(weight, stats, config, name)`` for one layer (``stats``: a
            :class:`~torch_armor.calibration.observer.LayerStatistics`, or the ``Σx²`` tensor alone).
        needs_statistics: whether it needs calibration data at all.
        needs_xtx: ``needs_xtx(config)``: whether it needs ``XᵀX`` (not just ``Σx²``).
        reconstructs: ``reconstructs(config)``: whether the engine tunes each block's results
            against the dense block's outputs afterwards.
        factorizes: it returns :class:`~torch_armor.core.factors.ArmorFactors`: finished layers
            go through the run store (resumable) and are shared out across ``torchrun`` ranks.
        describe: ``describe(config)``: its settings in a few words, for tables.
    """

    config_type: type
    name: str
    label: str
    solve: Solve
    needs_statistics: bool = True
    needs_xtx: Callable[[Any], bool] = _never
    reconstructs: Callable[[Any], bool] = _never
    factorizes: bool = False
    describe: Callable[[Any], str] = lambda config: ""


#: The registry: config type -> :class:`Method`, in registration order.
METHODS: Dict[type, Method] = {}


def _as_rule(value: Union[bool, Callable[[Any], bool]]) -> Callable[[Any], bool]:
    if callable(value):
        return value
    return _always if value else _never


def register_method(config_type: type, *, label: Optional[str] = None, name: Optional[str] = None,
                    needs_statistics: bool = True,
                    needs_xtx: Union[bool, Callable[[Any], bool]] = False,
                    reconstructs: Union[bool, Callable[[Any], bool]] = False, factorizes: bool = False,
                    describe: Optional[Callable[[Any], str]] = None) -> Callable[[Solve], Solve]:
    """Decorator: register ``solve(weight, stats, config, name)`` as the method of ``config_type``.

    ``name`` (the command line's and the reports' name) defaults to the type's name without
    ``Config``, lower case (``SparseGPTConfig`` -> ``"sparsegpt"``); ``label`` (tables) to ``name``.
    A dataclass ``config_type`` is also registered as serializable
    (:func:`~torch_armor.core.config_format.serializable`): reports and run directories hold it.
    """
    name = name or config_type.__name__.removesuffix("Config").lower()
    label = label or name

    def decorate(solve: Solve) -> Solve:
        taken = [m for m in METHODS.values() if m.name == name and m.config_type is not config_type]
        if taken:
            raise ArmorInputError(f"method name {name!r} is already registered for {taken[0].config_type.__name__}")
        if dataclasses.is_dataclass(config_type):
            serializable(config_type)
        METHODS[config_type] = Method(config_type, name, label, solve, needs_statistics, _as_rule(needs_xtx),
                                      _as_rule(reconstructs), factorizes, describe or (lambda config: ""))
        return solve

    return decorate


def method_for(config: Any) -> Method:
    """The registered method of ``config`` (by its type, or the nearest registered base class)."""
    for kind in type(config).__mro__:
        if kind in METHODS:
            return METHODS[kind]
    kinds = ", ".join(f"{m.config_type.__name__}()" for m in METHODS.values())
    raise ArmorInputError(f"config must be a method config ({kinds}), got {type(config).__name__}")


def method_named(name: str) -> Method:
    """The method a name stands for (``"armor"``, ``"sparsegpt"``, …)."""
    for method in METHODS.values():
        if method.name == name:
            return method
    raise ArmorInputError(f"method must be one of {method_names()}, got {name!r}")


def method_names() -> Tuple[str, ...]:
    """Every registered method's name, in registration order."""
    return tuple(m.name for m in METHODS.values())


def method_label(name: str) -> str:
    """A method's table label (``"armor"`` -> ``"ARMOR"``); other names (``"dense"``) as given."""
    return next((m.label for m in METHODS.values() if m.name == name), name)


def config_for_method(name: str, **fields: Any) -> Any:
    """The config of the method called ``name`` with ``fields`` (e.g. ``"sparsegpt", damp=0.1``)."""
    return method_named(name).config_type(**fields)


def _h(stats: Any, weight: torch.Tensor) -> torch.Tensor:
    """``Σx²`` per input channel from a LayerStatistics or the bare tensor, on the weight's device."""
    h = stats if isinstance(stats, torch.Tensor) else stats.act_sq_norm
    return h.to(weight.device)


def _xtx(stats: Any) -> Optional[torch.Tensor]:
    return None if isinstance(stats, torch.Tensor) else getattr(stats, "xtx", None)


@register_method(MagnitudeConfig, needs_statistics=False)
def _magnitude(weight: torch.Tensor, stats: Any, config: MagnitudeConfig, name: str = "") -> Result:
    return baselines.magnitude_prune(weight, config.pattern)


@register_method(WandaConfig, label="Wanda")
def _wanda(weight: torch.Tensor, stats: Any, config: WandaConfig, name: str = "") -> Result:
    return baselines.wanda_prune(weight, _h(stats, weight), config.pattern)


@register_method(SparseGPTConfig, label="SparseGPT", needs_xtx=True,
                 describe=lambda config: f"block {config.block_size}, damp {config.damp:g}")
def _sparsegpt(weight: torch.Tensor, stats: Any, config: SparseGPTConfig, name: str = "") -> Result:
    xtx = _xtx(stats)
    if xtx is None:
        raise ArmorInputError(f"layer {name!r}: SparseGPT needs XᵀX statistics (calibrate with track_xtx=True)")
    return baselines.sparsegpt_prune(weight, xtx.to(weight.device), config.pattern, block_size=config.block_size,
                                     damp=config.damp)


@register_method(NoWagConfig, label="NoWag-P")
def _nowag(weight: torch.Tensor, stats: Any, config: NoWagConfig, name: str = "") -> Result:
    return nowag_prune(weight, _h(stats, weight), config.pattern)


def _armor_needs_xtx(config: ArmorConfig) -> bool:
    """Refinement fits to ``XᵀX``; block reconstruction reports each layer's output loss with it."""
    return config.refines or config.reconstructs


def _armor_describe(cfg: ArmorConfig) -> str:
    """``d_b=16, bcd, ≤30 it, output refine ×3, block reconstruction 32 steps``."""
    opt = cfg.optimizer
    size = f"{100 * cfg.max_overhead:g}% model-wide budget" if cfg.block_size == "budget" else f"d_b={cfg.block_size}"
    parts = [size, opt.name]
    if opt.time_budget_s is not None:
        parts.append(f"{opt.time_budget_s:g} s/layer")
    parts.append(f"≤{opt.iterations} it")
    parts.append(f"output refine ×{cfg.refine.rounds}" if cfg.refine is not None and cfg.refine.rounds else "no refine")
    if cfg.reconstruct is not None:
        parts.append(f"block reconstruction {cfg.reconstruct.steps} steps")
    return ", ".join(parts)


@register_method(ArmorConfig, label="ARMOR", needs_xtx=_armor_needs_xtx,
                 reconstructs=lambda config: config.reconstructs, factorizes=True, describe=_armor_describe)
def _armor(weight: torch.Tensor, stats: Any, config: ArmorConfig, name: str = "") -> Result:
    xtx = _xtx(stats)  # a bare Σx² tensor: the diagonal proxy only, no refinement
    if config.refines and xtx is None and not isinstance(stats, torch.Tensor):
        raise ArmorInputError(f"layer {name!r}: output-space refinement needs XᵀX statistics (calibrate with "
                              "track_xtx=True), or set ArmorConfig(refine=None)")
    return factorize(weight, _h(stats, weight), config, xtx=xtx, name=name or None)


def armor_experts(weights: Sequence[torch.Tensor], stats: Sequence[Any], config: ArmorConfig,
                  names: Sequence[str]) -> List[ArmorFactors]:
    """ARMOR on the same-shape experts of one fused parameter at once
    (:func:`~torch_armor.core.factorize_batched.factorize_batched`), with the checks of one layer."""
    for s, name in zip(stats, names):
        if s is None or getattr(s, "num_tokens", None) == 0:
            raise ArmorInputError(f"layer {name!r} saw no calibration data: run forward passes on calibration "
                                  "inputs before solving it")
        if config.refines and _xtx(s) is None and not isinstance(s, torch.Tensor):
            raise ArmorInputError(f"layer {name!r}: output-space refinement needs XᵀX statistics (calibrate with "
                                  "track_xtx=True), or set ArmorConfig(refine=None)")
    hs = torch.stack([_h(s, w) for s, w in zip(stats, weights)])
    return factorize_batched(torch.stack([w.detach() for w in weights]), hs, config, xtxs=[_xtx(s) for s in stats],
                             names=list(names))
