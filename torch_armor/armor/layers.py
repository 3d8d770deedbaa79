"""Factorize many layers through a run store: skip the finished ones, save each as it finishes.

:func:`factorize_layers` is the single-process loop over ``{name: (weight, act_sq_norm)}``:
every layer's config (:func:`layer_configs`: the run's config, per-layer overrides, block size
resolved for the layer's shape), the layers a :class:`~torch_armor.engine.runstore.RunStore`
does not hold yet (a finished layer computed with other settings or of another shape is
refused with :class:`~torch_armor.engine.runstore.RunMismatchError`), then each of them
factorized and written to the store as soon as it is done, so an interrupted run loses at most
the layer in progress. :func:`~torch_armor.armor.distributed.distributed_factorize` shares the
same pieces out across ``torchrun`` ranks.

Example::

    >>> import tempfile, torch
    >>> from torch_armor.config.armor import ArmorConfig, BcdConfig
    >>> from torch_armor.engine.runstore import RunStore
    >>> from torch_armor.engine.identity import hash_statistics
    >>> g = torch.Generator().manual_seed(0)
    >>> layers = {f"fc{i}": (torch.randn(32, 32, generator=g), torch.rand(32, generator=g) + 0.1)
    ...           for i in range(3)}
    >>> cfg = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3))
    >>> stats_hash = hash_statistics({k: h for k, (w, h) in layers.items()})
    >>> with tempfile.TemporaryDirectory() as run_dir:
    ...     store = RunStore(run_dir, cfg, model_id="toy", stats_hash=stats_hash)
    ...     first = factorize_layers(layers, cfg, store, progress=False)
    ...     again = RunStore(run_dir, cfg, model_id="toy", stats_hash=stats_hash)  # e.g. after a crash
    ...     second = factorize_layers(layers, cfg, again, progress=False)  # nothing is recomputed
    ...     sorted(again.finished()), torch.equal(first["fc1"].core, second["fc1"].core)
    (['fc0', 'fc1', 'fc2'], True)
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factorize_batched import factorize_batched
from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.identity import act_sq_norm_of
from torch_armor.engine.methods import act_sq_norm_for, xtx_of
from torch_armor.engine.runner import solve_layer
from torch_armor.engine.runstore import RunStore
from torch_armor.errors import ArmorInputError, RunMismatchError
from torch_armor.progress import tqdm

__all__ = ["factorize_layers", "armor_experts", "layer_configs", "check_layer_inputs", "eager_shapes", "compute_layers", "expert_batches",
           "pending_layers", "LayerInput"]

logger = logging.getLogger("torch_armor")

#: A layer: ``(weight, act_sq_norm)``, or a callable returning it (called only if the layer
#: still has to be computed). ``act_sq_norm`` may also be a
#: :class:`~torch_armor.calibration.observer.LayerStatistics`.
LayerInput = Union[Tuple[torch.Tensor, Any], Callable[[], Tuple[torch.Tensor, Any]]]


# --------------------------------------------------------------------------- per-layer configs


def _layer_config(base: ArmorConfig, override: Any, fqn: str, shape: Optional[Sequence[int]]) -> ArmorConfig:
    """``base`` with ``override`` applied, resolved by :meth:`ArmorConfig.for_layer` if ``shape`` is known."""
    cfg = base.with_override(override, fqn)
    return cfg if shape is None else cfg.for_layer(int(shape[0]), int(shape[1]), name=fqn)


def layer_configs(
    names: Iterable[str],
    config: ArmorConfig,
    per_layer_overrides: Optional[Mapping[str, Any]] = None,
    shapes: Optional[Mapping[str, Sequence[int]]] = None,
) -> Dict[str, ArmorConfig]:
    """The config of every layer: ``config`` with its per-layer override applied and, for the
    layers in ``shapes`` (``{name: (d_out, d_in)}``), resolved by :meth:`ArmorConfig.for_layer`
    (concrete block size, shape checked). Derived values follow the override: a layer that
    overrides ``block_size`` gets that block size's default ``group_updates``.

    Example::

        >>> cfgs = layer_configs(["a", "b"], ArmorConfig(block_size=16), {"b": {"block_size": 32}})
        >>> cfgs["a"].block_size, cfgs["b"].block_size, cfgs["b"].optimizer.group_updates_per_sweep(32)
        (16, 32, 16)
    """
    if not isinstance(config, ArmorConfig):
        raise ArmorInputError(f"config must be an ArmorConfig, got {type(config).__name__}")
    overrides = dict(per_layer_overrides or {})
    shapes = shapes or {}
    names = list(names)
    stray = sorted(set(overrides) - set(names))
    if stray:
        raise ArmorInputError(f"per_layer_overrides names layers that are not being factorized: {stray[:5]}")
    return {n: _layer_config(config, overrides.get(n), n, shapes.get(n)) for n in names}


def eager_shapes(layers: Mapping[str, Any]) -> Dict[str, Tuple[int, int]]:
    """``{name: weight shape}`` of the layers given as ``(weight, act_sq_norm)`` (not lazily)."""
    return {fqn: tuple(v[0].shape) for fqn, v in layers.items()
            if not callable(v) and isinstance(v, (tuple, list)) and v and isinstance(v[0], torch.Tensor)}


# --------------------------------------------------------------------------- the loop


def armor_experts(weights: Sequence[torch.Tensor], stats: Sequence[Any], config: ArmorConfig,
                  names: Sequence[str]) -> List[ArmorFactors]:
    """ARMOR on the same-shape experts of one fused parameter at once
    (:func:`~torch_armor.core.factorize_batched.factorize_batched`), with the checks of one layer."""
    for s, name in zip(stats, names):
        if s is None or getattr(s, "num_tokens", None) == 0:
            raise ArmorInputError(f"layer {name!r} saw no calibration data: run forward passes on calibration "
                                  "inputs before solving it")
        if config.refines and xtx_of(s) is None and not isinstance(s, torch.Tensor):
            raise ArmorInputError(f"layer {name!r}: output-space refinement needs XᵀX statistics (calibrate with "
                                  "track_xtx=True), or set ArmorConfig(refine=None)")
    hs = torch.stack([act_sq_norm_for(s, w) for s, w in zip(stats, weights)])
    return factorize_batched(torch.stack([w.detach() for w in weights]), hs, config, xtxs=[xtx_of(s) for s in stats],
                             names=list(names))




def _materialize(fqn: str, value: LayerInput) -> Tuple[torch.Tensor, torch.Tensor]:
    if callable(value):
        value = value()
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], torch.Tensor)):
        raise ArmorInputError(
            f"layer {fqn!r}: expected (weight, act_sq_norm) or a callable returning it, got {type(value).__name__}"
        )
    stats = value[1]
    return value[0], stats if getattr(stats, "xtx", None) is not None else act_sq_norm_of(stats, fqn)


def check_layer_inputs(layers: Any) -> Mapping[str, LayerInput]:
    if not isinstance(layers, Mapping):
        raise ArmorInputError(
            "layers must be a mapping {name: (weight, act_sq_norm)} or {name: callable returning it}, "
            f"got {type(layers).__name__}"
        )
    if not layers:
        raise ArmorInputError("layers is empty: nothing to factorize")
    return layers


def compute_layers(
    layers: Mapping[str, LayerInput],
    todo: Sequence[str],
    configs: Mapping[str, ArmorConfig],
    store: Optional[RunStore],
    *,
    progress: bool,
    on_layer_done: Optional[Callable[[str, ArmorFactors], None]],
    keep: bool,
    total: Optional[int] = None,
    desc: str = "factorize",
) -> Dict[str, ArmorFactors]:
    """Factorize ``todo`` in order, saving each to ``store`` as soon as it is finished."""
    total = len(todo) if total is None else total
    out: Dict[str, ArmorFactors] = {}
    bar = tqdm(total=total, initial=total - len(todo), desc=desc, unit="layer", disable=not progress)

    def finish(fqn: str, factors: ArmorFactors, cfg, seconds: float) -> None:
        if store is not None:
            store.save(fqn, factors, config=cfg, seconds=seconds, device=cfg.device)
        logger.info("%s: %s (%.1fs)", fqn, factors.loss_text(), seconds)
        if on_layer_done is not None:
            on_layer_done(fqn, factors)
        if keep:
            out[fqn] = factors
        bar.update(1)

    try:
        with torch.no_grad():
            for group in expert_batches(todo, configs):
                bar.set_postfix_str(group[0][-40:])
                inputs = [_materialize(fqn, layers[fqn]) for fqn in group]
                start = time.perf_counter()
                try:
                    cfgs = [configs[fqn].for_layer(*w.shape, name=fqn) if w.dim() == 2 else configs[fqn]
                            for fqn, (w, _) in zip(group, inputs)]
                    if len(group) > 1:
                        solved = armor_experts([w for w, _ in inputs], [h for _, h in inputs], cfgs[0], group)
                    else:
                        solved = [solve_layer(inputs[0][0], inputs[0][1], cfgs[0], group[0]).payload]
                except Exception as err:
                    if store is not None:
                        for fqn in group:
                            store.mark_failed(fqn, err)
                    raise
                seconds = (time.perf_counter() - start) / len(group)
                del inputs
                for fqn, factors, cfg in zip(group, solved, cfgs):
                    finish(fqn, factors, cfg, seconds)
    finally:
        bar.close()
    return out


def expert_batches(todo: Sequence[str], configs: Mapping[str, Any]) -> List[List[str]]:
    """``todo`` cut into the runs factorized together: consecutive expert layers of one fused parameter
    with one ARMOR config (:func:`~torch_armor.core.factorize_batched.factorize_batched`), else single layers.

    Example::

        >>> cfg = ArmorConfig()
        >>> names = ["m.mlp.experts.down_proj.0", "m.mlp.experts.down_proj.1", "m.self_attn.q_proj"]
        >>> expert_batches(names, dict.fromkeys(names, cfg))
        [['m.mlp.experts.down_proj.0', 'm.mlp.experts.down_proj.1'], ['m.self_attn.q_proj']]
    """
    groups: List[List[str]] = []
    key_of_last = None
    for fqn in todo:
        split = split_expert_name(fqn)
        cfg = configs[fqn]
        key = (split[0], cfg) if split is not None and isinstance(cfg, ArmorConfig) else None
        if key is not None and key == key_of_last:
            groups[-1].append(fqn)
        else:
            groups.append([fqn])
        key_of_last = key
    return groups


def pending_layers(
    layers: Mapping[str, LayerInput], configs: Mapping[str, ArmorConfig], store: RunStore
) -> List[str]:
    """Layers not finished in ``store``; raises if a finished one has other settings or shape."""
    pending = []
    for fqn in layers:
        if not store.done(fqn):
            pending.append(fqn)
            continue
        shape = store.layer_info(fqn).get("shape")
        cfg = configs[fqn]
        if isinstance(shape, list) and len(shape) == 2:  # compare with the config the layer was resolved to
            cfg = cfg.for_layer(*shape, name=fqn)
        store.check_layer_config(fqn, cfg)
        value = layers[fqn]
        if not callable(value) and isinstance(value, (tuple, list)) and isinstance(value[0], torch.Tensor):
            if shape is not None and list(value[0].shape) != list(shape):
                raise RunMismatchError(
                    f"run directory {store.directory}: finished layer {fqn!r} has shape {tuple(shape)}, the "
                    f"weight given now is {tuple(value[0].shape)}; this run is for another model"
                )
    return pending


def factorize_layers(
    layers: Mapping[str, LayerInput],
    config: ArmorConfig,
    store: Optional[RunStore] = None,
    *,
    progress: bool = True,
    per_layer_overrides: Optional[Mapping[str, Any]] = None,
    on_layer_done: Optional[Callable[[str, ArmorFactors], None]] = None,
    return_factors: bool = True,
) -> Dict[str, ArmorFactors]:
    """Factorize many layers, skipping those ``store`` already holds; save each as it finishes.

    Args:
        layers: ``{name: (weight, act_sq_norm)}`` in the order to process them; a value may be a
            zero-argument callable returning the pair, called only if the layer has to be
            computed (so a resumed run loads only the weights it needs). ``act_sq_norm`` may be a
            :class:`~torch_armor.calibration.observer.LayerStatistics`.
        config: the :class:`ArmorConfig` for every layer.
        store: a :class:`RunStore`; ``None`` computes everything and saves nothing.
        progress: show a tqdm progress bar.
        per_layer_overrides: ``{name: ArmorConfig or {field: value}}`` for layers that need other
            settings (e.g. another ``block_size``); kept per layer in the store.
        on_layer_done: ``on_layer_done(name, factors)`` after each computed layer is saved.
        return_factors: return the factors of every layer (finished ones are loaded from the
            store); ``False`` returns only the ones computed now (none are kept in memory).

    Returns:
        ``{name: ArmorFactors}`` in the order of ``layers``.

    Raises:
        RunMismatchError: a finished layer was computed with other per-layer settings or has
            another shape (checked for every layer before any work starts).
        ValueError: malformed ``layers`` or overrides.
    """
    layers = check_layer_inputs(layers)
    configs = layer_configs(layers, config, per_layer_overrides, eager_shapes(layers))
    if store is not None and store.rank != 0:
        raise ArmorInputError(
            f"this store writes as rank {store.rank}; factorize_layers runs a single process (rank 0). "
            "Use torch_armor.armor.distributed.distributed_factorize for multi-rank runs"
        )
    todo = list(layers) if store is None else pending_layers(layers, configs, store)
    if store is not None:
        skipped = len(layers) - len(todo)
        if skipped:
            logger.info("run %s: %d of %d layers already finished, %d to compute",
                        store.directory, skipped, len(layers), len(todo))
        store.plan(todo)
    computed = compute_layers(layers, todo, configs, store, progress=progress, on_layer_done=on_layer_done,
                               keep=return_factors, total=len(layers))
    if store is not None:
        store.finalize()
    if not return_factors:
        return computed
    return {fqn: computed[fqn] if fqn in computed else store.load(fqn) for fqn in layers}
