"""The method registry and the hooks the engine calls: one table, keyed by config type, that every front end reads.

A method is a config type plus a :class:`Method`: what it observes during calibration
(``Method.needs_xtx``), how it solves one layer (``solve``) and a decoder block's layers
(:meth:`Method.solve_block`), what it does after each block (:meth:`Method.after_block`) and
around the whole model (:meth:`Method.model_pass`), and what it plans up front
(:meth:`Method.plan`, :meth:`Method.fit_fallback`). The base class's hooks are a one-shot
method's: every layer solved on its own, nothing before or after. A method is registered next to
the code that runs it on one layer::

    @register_method(SparseGPTConfig, label="SparseGPT", needs_xtx=True)
    def _sparsegpt(weight, stats, config, name) -> (mask, pruned): ...

and a method with hooks of its own passes its :class:`Method` subclass as ``kind``. What a method
makes of a layer is opaque to the engine: the method's hooks turn it into a :class:`LayerSolution`
(:meth:`Method.solution`), write it into the module (:meth:`Method.apply_solution`,
:meth:`Method.apply_experts`), say what the report shows of it (:meth:`Method.report_fields`) and
keep it in the run store (:meth:`Method.to_store`, :meth:`Method.from_store`). The engine
calls the hooks and never asks which method it runs, and it imports none: the methods register
themselves when their modules are imported (:mod:`torch_armor.baselines`, :mod:`torch_armor.armor`;
``import torch_armor`` imports both, so the registry is the same whatever was imported first).

:func:`method_for` finds a config's method; :func:`config_for_method` maps the names the command
line and the reports use (``"armor"``, ``"sparsegpt"``, ``"wanda"``, ``"nowag"``,
``"magnitude"``) to configs.

Example::

    >>> from torch_armor.config.methods import SparseGPTConfig
    >>> method_for(SparseGPTConfig()).label, method_for(default_config()).stores_layers
    ('SparseGPT', True)
    >>> config_for_method("wanda", pattern="4:8")
    WandaConfig(pattern='4:8')
    >>> method_names()
    ('magnitude', 'wanda', 'sparsegpt', 'nowag', 'armor')
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from torch_armor.config.serialized import serializable
from torch_armor.engine.solution import LayerSolution, StoredSolution
from torch_armor.errors import ArmorInputError

__all__ = ["Method", "ModelPass", "ModelPassRun", "RunState", "METHODS", "register_method", "method_for", "method_named",
           "config_for_method", "method_names", "method_label", "default_config",
           "act_sq_norm_for", "xtx_of"]

#: What ``solve`` makes of one layer: a one-shot method's ``(keep-mask, pruned dense weight)``, or what
#: the method's own hooks read (ARMOR's factors).
Result = Any
Solve = Callable[[torch.Tensor, Any, Any, str], Result]


def _never(config: Any) -> bool:
    return False


def _always(config: Any) -> bool:
    return True


@dataclass(frozen=True)
class RunState:
    """What exists of a ``prune_model`` run only once its :class:`~torch_armor.engine.plan.PrunePlan`
    executes: the run store and the run's identity (``None``, ``""``: no run directory, or a method
    that stores no layers), the sink of finished blocks (a streamed model's shard writer), this
    process's rank and the world size, and the first calibration batch that is not a sampled
    window (:meth:`ModelPass.before_blocks` chooses it). Everything else is the plan's."""

    store: Any
    identity: str
    sink: Any
    rank: int
    world_size: int
    held_out_from: int = 0  # block reconstruction holds out windows from this one on (earlier ones: sampled)

    def shows_progress(self, plan: Any) -> bool:
        """Whether this process draws progress bars (rank 0 only, when the plan's options ask for them)."""
        return plan.options.progress and self.rank == 0


@dataclass
class ModelPassRun:
    """A model pass under way (:meth:`ModelPass.before_blocks`): the block pass's calibration ``batches``,
    the index ``held_out_from`` where the calibration windows start among them (the windows before it are
    the pass's own), and what it does once every block is pruned (:meth:`after_model`)."""

    batches: Sequence[Any]
    held_out_from: int = 0

    def after_model(self, model: nn.Module, report: Any) -> None:
        """After every block is pruned: sees the pruned model, adds to the run's ``PruneReport``."""


class ModelPass:
    """What a method does with the whole model around the block pass (:meth:`Method.model_pass`), as the
    frozen plan holds it; :meth:`before_blocks` starts it on the dense model."""

    def before_blocks(self, plan: Any, run: RunState) -> ModelPassRun:
        """Start the pass on the :class:`~torch_armor.engine.plan.PrunePlan` ``plan``'s dense model and
        batches: what the block pass calibrates on, and what runs after it."""
        return ModelPassRun(plan.batches)


@dataclass(frozen=True)
class Method:
    """One pruning method: its config type, names, the code that solves one layer, and its hooks.

    The hooks' defaults are a one-shot method's; a method that does more subclasses this and is
    registered with ``register_method(..., kind=Subclass)``.

    Attributes:
        config_type: the config class that selects it.
        name: its name on the command line and in reports (``"sparsegpt"``).
        label: its name in tables (``"SparseGPT"``).
        solve: ``solve(weight, stats, config, name)`` for one layer (``stats``: a
            :class:`~torch_armor.calibration.observer.LayerStatistics`, or the ``Σx²`` tensor alone).
        needs_statistics: whether it needs calibration data at all.
        needs_xtx: ``needs_xtx(config)``: whether it observes ``XᵀX`` (not just ``Σx²``).
        describe: ``describe(config)``: its settings in a few words, for tables.
        default: its config's defaults are what ``prune_model`` runs without a config (:func:`default_config`).
        minimises_proxy: whether the diagonal proxy ``Σ (W − Ŵ)² h_j``, the per-layer loss every report
            measures (relative to NoWag-P's), is what it minimises (ARMOR's and NoWag-P's objective,
            not SparseGPT's or Wanda's): the report then calls it the loss the method minimised.
    """

    config_type: type
    name: str
    label: str
    solve: Solve
    needs_statistics: bool = True
    needs_xtx: Callable[[Any], bool] = _never
    describe: Callable[[Any], str] = lambda config: ""
    default: bool = False
    minimises_proxy: bool = False

    #: Finished layers go through the run store (a rerun resumes them), ``torchrun`` ranks share them
    #: out, and the experts of one fused parameter are solved together (all of them or none).
    stores_layers = False

    def solve_layer(self, weight: torch.Tensor, stats: Any, config: Any, name: str = "") -> LayerSolution:
        """``solve`` on one weight, timed, its errors naming the layer."""
        if self.needs_statistics and (stats is None or getattr(stats, "num_tokens", None) == 0):
            raise ArmorInputError(
                f"layer {name!r} saw no calibration data: run forward passes on calibration inputs before solving it"
            )
        start = time.perf_counter()
        with torch.no_grad():
            try:
                result = self.solve(weight.detach(), stats, config, name)
            except ArmorInputError as err:  # name the layer; any other error (torch's own) passes as it is
                if name and name not in str(err):
                    raise type(err)(f"layer {name!r}: {err}") from err
                raise
        return self.solution(name, result, time.perf_counter() - start)

    # -- what it made of a layer (the payload of a LayerSolution: here the pruned dense weight) --------
    def solution(self, name: str, result: Result, seconds: Optional[float] = None) -> LayerSolution:
        """Layer ``name``'s :class:`LayerSolution` from what ``solve`` returned (``seconds``: how long it
        took; ``None``: what the result itself records, nothing for a one-shot method)."""
        mask, pruned = result
        return LayerSolution(name, self, pruned, 0.0 if seconds is None else seconds, mask)

    def approximation(self, payload: Any) -> torch.Tensor:
        """The dense approximation of the weight a solution's payload stands for."""
        return payload

    def apply_solution(self, solution: LayerSolution, module: nn.Linear, storage: str) -> None:
        """Write ``solution`` into ``module`` (``storage``: a format of the method's own weights): the
        pruned weight, with the old one's dtype, device and ``requires_grad``."""
        old = module.weight
        module.weight = nn.Parameter(solution.payload.to(device=old.device, dtype=old.dtype),
                                     requires_grad=old.requires_grad)

    def apply_experts(self, param_fqn: str, slots: Sequence[Any], solutions: Sequence[LayerSolution],
                      storage: str) -> None:
        """Write the solutions of experts of one fused parameter ``param_fqn`` into it (``slots``: their
        :class:`~torch_armor.calibration.experts.ExpertSlot`, in the order of ``solutions``)."""
        old = getattr(slots[0].module, slots[0].attr)
        with torch.no_grad():
            for slot, sol in zip(slots, solutions):
                slot.weight.copy_(sol.payload.to(dtype=old.dtype, device=old.device))

    def report_fields(self, payload: Any) -> Dict[str, Any]:
        """The :class:`~torch_armor.engine.report.LayerResult` fields it reports of a payload itself:
        ``shape``, ``relative_proxy_loss`` when it measured that itself (the engine measures it
        otherwise), ``extra_params`` and ``relative_output_loss`` where they apply, and ``details``:
        anything else of its own."""
        return {"shape": tuple(payload.shape)}

    def stage_lines(self, stages: Mapping[str, Any]) -> List[str]:
        """One line on each stage it recorded in ``PruneReport.stages`` (none by default)."""
        return []

    def to_store(self, payload: Any) -> StoredSolution:
        """A payload as the run store writes it (a method whose ``stores_layers`` is true)."""
        raise ArmorInputError(f"method {self.name!r} keeps no layers in a run directory (its stores_layers is False)")

    def from_store(self, tensors: Dict[str, torch.Tensor], header: Dict[str, str]) -> Any:
        """The payload :meth:`to_store` wrote, from the layer file's tensors and header. Raises
        ``ValueError``: they do not make one."""
        raise ArmorInputError(f"method {self.name!r} keeps no layers in a run directory (its stores_layers is False)")

    def solve_block(self, names: Sequence[str], layers: Dict[str, Any], stats: Dict[str, Any], configs: Dict[str, Any],
                    run: Any) -> Dict[str, LayerSolution]:
        """Every selected layer of one decoder block (``configs``: each layer's resolved config;
        ``run``: the :class:`~torch_armor.engine.blocks.BlockPipeline`: its ``plan``, its ``state``
        (:class:`RunState`), the config it runs ``run.run_config`` and its progress bar ``run.bar``)."""
        solutions = {}
        for n in names:
            run.bar.set_postfix_str(n[-40:], refresh=False)
            solutions[n] = self.solve_layer(layers[n].weight, stats[n], configs[n], n)
        return solutions

    def block_targets(self, config: Any, sequential: bool) -> Optional[str]:
        """What :meth:`after_block` fits a block's results to: ``None`` (nothing: no data is kept),
        ``"block"`` (the dense block's outputs on the block's inputs) or ``"model"`` (the dense
        model's hidden states after the block, carried beside the pruned ones)."""
        return None

    def after_block(self, index: int, block: nn.Module, layers: Dict[str, Any], stats: Dict[str, Any],
                    solutions: Dict[str, LayerSolution], configs: Dict[str, Any], data: Any, run: Any,
                    report: Any) -> Dict[str, LayerSolution]:
        """The block's solutions before they are written into it (``data``: the block's inputs and
        :meth:`block_targets`' targets, ``None`` without targets)."""
        return solutions

    def replay_block(self, index: int, run: Any, report: Any) -> None:
        """A block an earlier run finished (resumed from the run store): what :meth:`after_block`
        reported of it, back into ``report``."""

    def plan(self, config: Any, run: Any, inputs: Sequence[Any], by_block: List[List[str]]) -> Any:
        """The config the block pass runs, decided before it (``inputs``: the first block's inputs,
        ``by_block``: the selected layers of each block)."""
        return config

    def fit_fallback(self, config: Any, d_out: int, d_in: int) -> Optional[Tuple[Any, str]]:
        """For a layer ``config`` does not fit: ``(a setting that fits it, how to say it)``, or ``None``
        (it stays dense). Raises :class:`~torch_armor.errors.ArmorInputError`: none fits (the cause)."""
        return None

    def with_fallbacks(self, config: Any, fallbacks: Sequence[Tuple[str, Any]]) -> Any:
        """``config`` with :meth:`fit_fallback`'s ``(layer, setting)`` pairs applied."""
        return config

    def model_pass(self, config: Any, batches: Sequence[Any], *, streamed: bool) -> Optional[ModelPass]:
        """What it does with the whole model around the block pass (``None``: nothing); it may warn here
        about what it leaves out."""
        return None


#: The registry: config type -> :class:`Method`, in registration order.
METHODS: Dict[type, Method] = {}


def _as_rule(value: Union[bool, Callable[[Any], bool]]) -> Callable[[Any], bool]:
    if callable(value):
        return value
    return _always if value else _never


def register_method(config_type: type, *, label: Optional[str] = None, name: Optional[str] = None,
                    needs_statistics: bool = True, needs_xtx: Union[bool, Callable[[Any], bool]] = False,
                    describe: Optional[Callable[[Any], str]] = None, kind: type = Method,
                    default: bool = False, minimises_proxy: bool = False) -> Callable[[Solve], Solve]:
    """Decorator: register ``solve(weight, stats, config, name)`` as the method of ``config_type``.

    ``name`` (the command line's and the reports' name) defaults to the type's name without
    ``Config``, lower case (``SparseGPTConfig`` -> ``"sparsegpt"``); ``label`` (tables) to ``name``.
    ``kind``: the :class:`Method` subclass whose hooks it runs. ``default``: its config's defaults
    are what ``prune_model`` runs without a config. ``minimises_proxy``: :attr:`Method.minimises_proxy`. A dataclass ``config_type`` is also registered
    as serializable (:func:`~torch_armor.config.serialized.serializable`): reports and run
    directories hold it.
    """
    name = name or config_type.__name__.removesuffix("Config").lower()
    label = label or name

    def decorate(solve: Solve) -> Solve:
        taken = [m for m in METHODS.values() if m.name == name and m.config_type is not config_type]
        if taken:
            raise ArmorInputError(f"method name {name!r} is already registered for {taken[0].config_type.__name__}")
        if dataclasses.is_dataclass(config_type):
            serializable(config_type)
        METHODS[config_type] = kind(config_type, name, label, solve, needs_statistics, _as_rule(needs_xtx),
                                    describe or (lambda config: ""), default, minimises_proxy)
        return solve

    return decorate


def default_config() -> Any:
    """The default method's config with its defaults (``ArmorConfig()``): what ``prune_model`` runs without one."""
    method = next((m for m in METHODS.values() if m.default), None)
    if method is None:
        raise ArmorInputError("no default method is registered: import torch_armor (it registers the built-in methods)")
    return method.config_type()


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


def act_sq_norm_for(stats: Any, weight: torch.Tensor) -> torch.Tensor:
    """``Σx²`` per input channel from a LayerStatistics or the bare tensor, on the weight's device."""
    h = stats if isinstance(stats, torch.Tensor) else stats.act_sq_norm
    return h.to(weight.device)


def xtx_of(stats: Any) -> Optional[torch.Tensor]:
    """``XᵀX`` of a LayerStatistics (``None`` if it was not tracked, or for a bare ``Σx²`` tensor)."""
    return None if isinstance(stats, torch.Tensor) else getattr(stats, "xtx", None)
