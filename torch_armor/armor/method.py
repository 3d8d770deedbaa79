"""ARMOR's hooks into the engine: one layer factorized, a block's layers through the run store
(resumable, shared out across ``torchrun`` ranks), block reconstruction after each block, the
block-size budget planned up front, and end-to-end distillation around the block pass
(:mod:`torch_armor.armor.distill`).

Registered as the method of :class:`~torch_armor.config.armor.ArmorConfig` (the default) when this
module is imported (``import torch_armor`` does).

Example::

    >>> from torch_armor.config.armor import ArmorConfig
    >>> from torch_armor.engine.methods import method_for
    >>> method = method_for(ArmorConfig())
    >>> method.label, method.stores_layers, method.block_targets(ArmorConfig(), sequential=True)
    ('ARMOR', True, 'block')
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.calibration.blocks import BlockInput, block_statistics, run_block
from torch_armor.calibration.experts import out_in_shape
from torch_armor.config.armor import ArmorConfig
from torch_armor.core.factorize import factorize
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.pattern import auto_block_size, candidate_block_sizes, check_layer_shape
from torch_armor.core.refine import with_losses
from torch_armor.armor.allocate import allocate_block_sizes, layer_kind, loss_curves
from torch_armor.armor.distill import distillation_pass
from torch_armor.armor.distributed import distributed_factorize
from torch_armor.engine.experts import layer_module
from torch_armor.engine.methods import Method, ModelPass, Result, act_sq_norm_for, register_method, xtx_of
from torch_armor.armor.reconstruct import reconstruct_block
from torch_armor.engine.runner import LayerSolution, solve_layer
from torch_armor.engine.solution import StoredSolution
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors
from torch_armor.tensor.experts import armor_experts_from_factors

__all__ = ["ArmorMethod", "wrapper_overhead", "RECONSTRUCTED_DIR", "XTX_OFFLOAD_NAME", "ALLOCATION_SAMPLE_BLOCKS"]

logger = logging.getLogger("torch_armor")

RECONSTRUCTED_DIR = "reconstructed"
#: In a run directory, while a block is reconstructed: its linears' ``XᵀX`` (removed afterwards).
XTX_OFFLOAD_NAME = "xtx-offload.safetensors"
#: ``block_size="budget"`` measures loss-versus-block-size curves on this many decoder blocks
#: (first, middle, last) and applies each layer kind's mean curve to every block.
ALLOCATION_SAMPLE_BLOCKS = 3


def _needs_xtx(config: ArmorConfig) -> bool:
    """Refinement fits to ``XᵀX``; block reconstruction reports each layer's output loss with it."""
    return config.refines or config.reconstructs


def _describe(cfg: ArmorConfig) -> str:
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


def _marker(run: Any, index: int) -> Optional[Path]:
    """The run directory's record that block ``index`` was reconstructed (its stored factors are final)."""
    store = run.state.store
    return None if store is None else store.directory / RECONSTRUCTED_DIR / f"block-{index:05d}.json"


def _replay_errors(run: Any, index: int, report: Any) -> bool:
    """Copy the held-out errors and curve of a block a run already reconstructed (its marker)
    into ``report``; ``False`` if there is no marker."""
    marker = _marker(run, index)
    if marker is None or not marker.exists():
        return False
    saved = json.loads(marker.read_text())
    _record_reconstruction(report, index, tuple(saved["errors"]), saved.get("curve", ()))
    return True


def _record_reconstruction(report: Any, index: int, errors: Tuple[float, float], curve: Sequence[Any]) -> None:
    stage = report.stages.setdefault("reconstruction", {"errors": {}, "curves": {}})
    stage["errors"][index] = tuple(errors)
    stage["curves"][index] = [tuple(point) for point in curve]


@contextmanager
def _xtx_on_disk(run: Any, stats: Dict[str, Any]) -> Iterator[None]:
    """The block's ``XᵀX`` (one per distinct input: q/k/v share one) written to the run
    directory and dropped from ``stats`` while block reconstruction runs — it reads none; the
    report's output losses after it do — then read back (bit-identical). Without a run
    directory nothing moves."""
    first: Dict[int, str] = {}
    for name, s in stats.items():
        if s.xtx is not None:
            first.setdefault(id(s.xtx), name)
    if run.state.store is None or not first:
        yield
        return
    path = run.state.store.directory / XTX_OFFLOAD_NAME
    keys = {name: first[id(s.xtx)] for name, s in stats.items() if s.xtx is not None}
    device = stats[next(iter(keys))].xtx.device
    atomic_write(path, save({key: stats[key].xtx.detach().cpu().contiguous() for key in set(keys.values())}))
    for name in keys:
        stats[name] = dataclasses.replace(stats[name], xtx=None)
    try:
        yield
    finally:
        with safe_open(str(path), framework="pt") as fh:
            loaded = {key: fh.get_tensor(key).to(device) for key in set(keys.values())}
        for name, key in keys.items():
            stats[name] = dataclasses.replace(stats[name], xtx=loaded[key])
        path.unlink(missing_ok=True)


class ArmorMethod(Method):
    """ARMOR's hooks: see the module docstring. A solution's payload is the layer's
    :class:`~torch_armor.core.factors.ArmorFactors`."""

    stores_layers = True

    def solution(self, name: str, result: ArmorFactors, seconds: Optional[float] = None) -> LayerSolution:
        """``seconds`` ``None``: the optimizer's own record (as a resumed run replays it)."""
        seconds = float(result.history_time_s[-1]) if seconds is None else seconds
        return LayerSolution(name, self, result, seconds, result.mask)

    def approximation(self, payload: ArmorFactors) -> torch.Tensor:
        return payload.dense()

    def apply_solution(self, solution: LayerSolution, module: nn.Linear, storage: str) -> None:
        """An ArmorTensor weight (``storage`` of its core)."""
        armor_linear_from_factors(module, solution.payload, storage=storage, name=solution.name)

    def apply_experts(self, param_fqn: str, slots: Sequence[Any], solutions: Sequence[LayerSolution],
                      storage: str) -> None:
        """All experts of the fused parameter as one ARMOR experts parameter."""
        module, attr = slots[0].module, slots[0].attr
        by_index = {slot.index: sol.payload for slot, sol in zip(slots, solutions)}
        count = out_in_shape(module, attr)[0]
        if sorted(by_index) != list(range(count)):
            raise ArmorInputError(f"{param_fqn}: ARMOR converts all {count} experts of a fused parameter "
                                  f"together, {len(by_index)} were selected; select every expert of it or none")
        factors = [by_index[e] for e in range(count)]
        armor_experts_from_factors(module, attr, factors, storage=storage, name=param_fqn)

    def report_fields(self, payload: ArmorFactors) -> Dict[str, Any]:
        """The loss the optimizer measured (as a resumed run replays it), the wrapper's parameters,
        refined, the output loss, and in ``details`` the block size and the iterations."""
        return {"shape": tuple(payload.shape), "relative_proxy_loss": float(payload.relative_loss),
                "extra_params": payload.num_wrapper_params(),
                "relative_output_loss": float(payload.relative_output_loss) if payload.refined else None,
                "details": {"block_size": payload.block_size, "iterations": int(payload.history_iters[-1])}}

    def stage_lines(self, stages: Mapping[str, Any]) -> List[str]:
        """Block reconstruction: the held-out error summed over the blocks before and after, and at
        each check (when every block has as many checks); distillation: the held-out KL before and after."""
        lines = []
        errors = stages.get("reconstruction", {}).get("errors", {})
        if errors:
            before = sum(b for b, _ in errors.values())
            after = sum(a for _, a in errors.values())
            line = (f"block reconstruction: held-out relative output error summed over {len(errors)} blocks "
                    f"{before:.4f} -> {after:.4f} ({100 * (1 - after / before) if before else 0.0:.1f}% lower)")
            curves = [c for c in stages["reconstruction"].get("curves", {}).values() if c]
            if curves and all(len(c) == len(curves[0]) for c in curves):
                line += "; by step: " + ", ".join(f"{curves[0][i][0]}: {sum(c[i][1] for c in curves):.4f}"
                                                  for i in range(len(curves[0])))
            lines.append(line)
        distilled = stages.get("distillation", {})
        if "before" in distilled and "after" in distilled:
            lines.append(f"distillation: held-out KL to the dense model {distilled['before']:.4f} -> "
                         f"{distilled['after']:.4f} (kept step {distilled.get('best_step', '?')})")
        return lines

    def to_store(self, payload: ArmorFactors) -> StoredSolution:
        """The factors' tensors; their scalars in the header; shape, block size, pattern and loss in the manifest."""
        if not isinstance(payload, ArmorFactors):
            raise ArmorInputError(f"save() expects ArmorFactors, got {type(payload).__name__}")
        scalars = payload.metadata()
        header = {"pattern": scalars["pattern"], "nowag_loss": repr(scalars["nowag_loss"]),
                  "best_iter": str(scalars["best_iter"]),
                  "relative_output_loss": repr(scalars["relative_output_loss"])}
        summary = {"shape": list(payload.core.shape), "block_size": int(payload.block_size),
                   "pattern": str(payload.pattern), "relative_loss": float(payload.relative_loss),
                   "device": str(payload.core.device)}
        return StoredSolution(payload.to_tensors(), header, summary)

    def from_store(self, tensors: Dict[str, torch.Tensor], header: Dict[str, str]) -> ArmorFactors:
        return ArmorFactors.from_tensors(tensors, pattern=header.get("pattern", "2:4"),
                                         nowag_loss=float(header.get("nowag_loss", "nan")),
                                         best_iter=int(header.get("best_iter", "0")),
                                         relative_output_loss=float(header.get("relative_output_loss", "nan")))

    def block_targets(self, config: ArmorConfig, sequential: bool) -> Optional[str]:
        """Block reconstruction fits to the dense block's outputs, or (``ReconstructConfig(target="model")``
        in a sequential prune) to the dense model's hidden states."""
        if not config.reconstructs:
            return None
        return "model" if sequential and config.reconstruct.target == "model" else "block"

    def solve_block(self, names: Sequence[str], layers: Dict[str, Any], stats: Dict[str, Any],
                    configs: Dict[str, Any], run: Any) -> Dict[str, LayerSolution]:
        """Factorize the block's layers through the run store, shared out across ranks."""
        def done(fqn: str, factors) -> None:
            run.bar.set_postfix_str(f"{fqn[-32:]} {factors.loss_text()}", refresh=False)

        todo = {n: (layers[n].weight.detach(), stats[n]) for n in names}
        factors = distributed_factorize(todo, run.run_config, run.state.store, per_layer_overrides=configs,
                                        progress=False, on_layer_done=done, return_factors=True)
        if run.state.world_size > 1:
            dist.barrier()  # rank 0 has merged the manifests: every rank reads every layer
            if run.state.rank != 0:
                store = run.fresh_store()
                factors = {n: store.load(n) for n in names}
        return {n: self.solution(n, factors[n]) for n in names}

    def after_block(self, index: int, block: nn.Module, layers: Dict[str, Any], stats: Dict[str, Any],
                    solutions: Dict[str, LayerSolution], configs: Dict[str, Any], data: Any, run: Any,
                    report: Any) -> Dict[str, LayerSolution]:
        """Block reconstruction: Adam on the block's factors against the dense block's outputs (rank 0;
        the result goes through the run store, and a marker says the block's stored factors are final)."""
        if data is None:
            return solutions
        # the block's last stage, seconds on a real model: the bar says so (and a log line, when long)
        run.bar.set_postfix_str(f"block {index}: reconstruction, {run.run_config.reconstruct.steps} steps")
        names = list(solutions)
        if _replay_errors(run, index, report):  # an interrupted run finished it: the store holds the result
            return solutions
        prefix = f"{run.plan.blocks_prefix}.{index}."
        if run.state.rank == 0:
            start = time.perf_counter()
            with _xtx_on_disk(run, stats):
                result = reconstruct_block(block, {n[len(prefix):]: solutions[n].payload for n in names}, data[0],
                                           data[1], run.run_config.reconstruct, device=run.plan.device,
                                           seed=run.run_config.seed, held_out_from=run.state.held_out_from)
            new, before, after = result.factors, result.before, result.after
            seconds = (time.perf_counter() - start) / len(names)
            solutions = {n: self.solution(n, with_losses(new[n[len(prefix):]], layers[n].weight, stats[n].xtx,
                                                         stats[n].act_sq_norm, seconds),
                                          solutions[n].seconds + seconds)
                         for n in names}
            if run.state.store is not None:
                for n in names:
                    run.state.store.save(n, solutions[n].payload, config=configs[n], seconds=solutions[n].seconds,
                                   device=configs[n].device)
                marker = _marker(run, index)
                marker.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(marker, json.dumps({"errors": [before, after], "curve": result.curve}).encode())
            _record_reconstruction(report, index, (before, after), result.curve)
            logger.info("block %d reconstructed (%d steps): held-out relative output error %s", index, result.steps,
                        " -> ".join(f"{e:.5f}" for _, e in result.curve))
        if run.state.world_size > 1:
            dist.barrier()  # rank 0 saved the reconstructed factors: every rank reads them
            if run.state.rank != 0:
                store = run.fresh_store()
                solutions = {n: self.solution(n, store.load(n), solutions[n].seconds) for n in names}
                _replay_errors(run, index, report)
        return solutions

    def replay_block(self, index: int, run: Any, report: Any) -> None:
        _replay_errors(run, index, report)

    def plan(self, config: ArmorConfig, run: Any, inputs: Sequence[Any], by_block: List[List[str]]) -> ArmorConfig:
        """``block_size="budget"``: measure each layer kind's loss at every candidate block size on
        a few blocks (dense stream), then give every layer its size within the model-wide budget."""
        if not config.needs_allocation:
            return config
        cfg = dataclasses.replace(config, block_size=16)
        with_layers = [i for i, names in enumerate(by_block) if names]
        count = min(ALLOCATION_SAMPLE_BLOCKS, len(with_layers))
        sample = sorted({with_layers[round(k * (len(with_layers) - 1) / max(1, count - 1))] for k in range(count)})
        work = [BlockInput(inp.hidden, inp.kwargs, layer_kwargs=inp.layer_kwargs) for inp in inputs]
        multiple = cfg.sparsity.group
        measured: Dict[str, Dict[int, float]] = {}
        uncalled: Dict[str, str] = {}
        start = time.perf_counter()
        for index in range(sample[-1] + 1):
            prefix = f"{run.plan.blocks_prefix}.{index}"
            block = run.plan.source.load_block(prefix)
            block.to(run.plan.device).eval()
            for inp in work:
                inp.enter_block(index)
            if index in sample:
                layers = {n: layer_module(run.plan.source.model, n) for n in by_block[index]}
                stats = block_statistics(block, layers, work, device=run.plan.device,
                                         track_xtx=self.needs_xtx(cfg), propagate=True,
                                         expert_calibration=run.plan.options.expert_calibration,
                                         min_expert_tokens=run.plan.options.min_expert_tokens, uncalled=uncalled)
                for n, layer in layers.items():
                    if n in uncalled:  # left dense by the block pass: no curve
                        continue
                    d_out, d_in = layer.weight.shape
                    measured[n] = {}
                    for size in candidate_block_sizes(d_out, d_in, multiple):
                        f = solve_layer(layer.weight, stats[n], dataclasses.replace(cfg, block_size=size), n).payload
                        measured[n][size] = f.relative_output_loss if f.refined else f.relative_loss
            else:
                for inp in work:
                    inp.hidden = run_block(block, inp, run.plan.device)
            run.plan.source.release_block(prefix)
        unmeasured = {layer_kind(n) for n in uncalled} - {layer_kind(n) for n in measured}  # left dense everywhere
        allocated = [n for n in run.plan.names if layer_kind(n) not in unmeasured]
        shapes = {n: tuple(layer_module(run.plan.source.model, n).weight.shape) for n in allocated}
        sizes = allocate_block_sizes(loss_curves(measured, allocated), shapes, cfg.max_overhead)
        logger.info("block sizes within a %.1f%% model-wide overhead, from blocks %s (%.0f s): %s",
                    100 * cfg.max_overhead, sample, time.perf_counter() - start,
                    {k: v for k, v in sorted(sizes.items()) if k.startswith(f"{run.plan.blocks_prefix}.{sample[0]}.")})
        return dataclasses.replace(config, block_sizes=tuple(sizes.items()))

    def fit_fallback(self, config: ArmorConfig, d_out: int, d_in: int) -> Optional[Tuple[int, str]]:
        """An integer block size that does not fit a layer: the largest one dividing it within
        ``max_overhead``."""
        if not isinstance(config.block_size, int):
            return None
        check_layer_shape(d_out, d_in, config.sparsity, None)
        block = auto_block_size(d_out, d_in, config.max_overhead, config.sparsity.group)
        return block, f"block size {block}"

    def with_fallbacks(self, config: ArmorConfig, fallbacks: Sequence[Tuple[str, Any]]) -> ArmorConfig:
        if not fallbacks:
            return config
        return dataclasses.replace(config, block_sizes=tuple(fallbacks) + tuple(config.block_sizes))

    def model_pass(self, config: ArmorConfig, batches: Sequence[Any], *, streamed: bool) -> Optional[ModelPass]:
        return distillation_pass(config, batches, streamed=streamed)


@register_method(ArmorConfig, label="ARMOR", needs_xtx=_needs_xtx, describe=_describe, kind=ArmorMethod, default=True,
                 minimises_proxy=True)
def _armor(weight: torch.Tensor, stats: Any, config: ArmorConfig, name: str = "") -> Result:
    xtx = xtx_of(stats)  # a bare Σx² tensor: the diagonal proxy only, no refinement
    if config.refines and xtx is None and not isinstance(stats, torch.Tensor):
        raise ArmorInputError(f"layer {name!r}: output-space refinement needs XᵀX statistics (calibrate with "
                              "track_xtx=True), or set ArmorConfig(refine=None)")
    return factorize(weight, act_sq_norm_for(stats, weight), config, xtx=xtx, name=name or None)


def wrapper_overhead(obj: Any) -> float:
    """ARMOR's extra parameters ``Σ d_b·(d_in + d_out)`` ÷ the dense parameters ``Σ d_in·d_out``
    of the same (converted) linears.

    Accepts a model (its :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weights) or
    :class:`~torch_armor.core.factors.ArmorFactors` (a mapping or an iterable). Returns 0.0 when
    nothing is ARMOR-converted. A prune's report has it as ``PruneReport.overhead``.

    Example::

        >>> import torch
        >>> from torch_armor.core.factors import ArmorFactors
        >>> f = ArmorFactors(torch.eye(16).repeat(36, 1, 1), torch.zeros(576, 1536),
        ...                  torch.eye(16).repeat(96, 1, 1), torch.zeros(576, 1536, dtype=torch.bool))
        >>> round(wrapper_overhead([f]), 4)       # 16 · 2112 / (576 · 1536)
        0.0382
    """
    extra = dense = 0
    if isinstance(obj, nn.Module):
        for module in obj.modules():
            w = getattr(module, "weight", None)
            if isinstance(module, nn.Linear) and isinstance(w, ArmorTensor):
                extra += w.a_blocks.numel() + w.b_blocks.numel()
                dense += w.shape[0] * w.shape[1]
    else:
        items = obj.values() if isinstance(obj, Mapping) else obj
        for f in items:
            if not isinstance(f, ArmorFactors):
                raise ArmorInputError(f"expected ArmorFactors, got {type(f).__name__}")
            extra += f.num_wrapper_params()
            dense += f.shape[0] * f.shape[1]
    return extra / dense if dense else 0.0
