"""The block-by-block engine: calibrate, prune and propagate one decoder block at a time.

For each decoder block, in order:

1. statistics of the block's linears from the inputs that reach the block — with
   ``sequential=True`` the outputs of the already-pruned blocks before it (as SparseGPT and
   llm-compressor do), with ``False`` the dense model's;
2. the config's method (:mod:`torch_armor.engine.methods`) on every selected linear of the block;
   a method that factorizes (ARMOR) sends its layers through the run store (every finished layer
   written atomically) and shares them out across ``torchrun`` ranks by cost;
3. the block's outputs become the next block's inputs; a streamed block is written to its own
   shard and freed.

With a run directory, the hidden states at each block boundary are written too, so a rerun
resumes at the first unfinished block bit-identically to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.calibration.blocks import BlockInput, block_statistics, capture_block_inputs, run_block
from torch_armor.core.config_format import config_to_dict
from torch_armor.core.pattern import candidate_block_sizes
from torch_armor.core.refine import with_losses
from torch_armor.engine.allocate import allocate_block_sizes, layer_kind, loss_curves
from torch_armor.engine.distributed import distributed_factorize
from torch_armor.engine.experts import layer_module, write_experts
from torch_armor.engine.methods import Method, method_for
from torch_armor.engine.reconstruct import reconstruct_block
from torch_armor.engine.report import LayerResult, PruneReport
from torch_armor.engine.runner import LayerSolution, ProxyReference, solve_layer
from torch_armor.engine.runstore import RunStore
from torch_armor.engine.sources import BlockSink, BlockSource
from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm

__all__ = ["BlockPipeline", "HIDDEN_NAME", "BLOCKS_DIR"]

logger = logging.getLogger("torch_armor")

HIDDEN_NAME = "hidden.safetensors"
RECONSTRUCTED_DIR = "reconstructed"
#: In a run directory, while a block is reconstructed: its linears' ``XᵀX`` (removed afterwards).
XTX_OFFLOAD_NAME = "xtx-offload.safetensors"
#: ``block_size="budget"`` measures loss-versus-block-size curves on this many decoder blocks
#: (first, middle, last) and applies each layer kind's mean curve to every block.
ALLOCATION_SAMPLE_BLOCKS = 3
BLOCKS_DIR = "blocks"
#: In a run directory: ``{layer: why}`` of the selected linears calibration never called (left dense),
#: so a resumed run replays those blocks without them.
UNCALLED_NAME = "uncalled.json"


@dataclass
class BlockPipeline:
    """One run of the engine over a model's decoder blocks with one method config.

    ``source`` provides the model and loads/frees its blocks (:class:`~torch_armor.engine.sources.InMemory`,
    or :class:`~torch_armor.engine.sources.Streamed` whose blocks are materialized one at a time);
    ``sink`` (rank 0) keeps each finished block (e.g. a shard per block) and tells which ones an
    earlier, interrupted run already kept.
    """

    source: BlockSource
    blocks_prefix: str
    blocks: nn.ModuleList
    names: Sequence[str]
    config: Any
    sequential: bool = True
    store: Optional[RunStore] = None
    identity: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    hidden_dtype: Optional[torch.dtype] = None
    hidden_dir: Optional[Path] = None
    storage: str = "dense"
    progress: bool = True
    sink: Optional[BlockSink] = None
    rank: int = 0
    world_size: int = 1
    expert_calibration: str = "routed"
    min_expert_tokens: int = 0
    held_out_from: int = 0  # block reconstruction holds out windows from this one on (earlier ones: sampled)

    @property
    def method(self) -> Method:
        return method_for(self.config)

    # -- hidden states at block boundaries ---------------------------------------------------
    def _hidden_path(self) -> Optional[Path]:
        return None if self.store is None else self.store.directory / HIDDEN_NAME

    def _save_hidden(self, index: int, inputs: Sequence[BlockInput], dense: Sequence[BlockInput] = ()) -> None:
        path = self._hidden_path()
        if path is None or self.rank != 0:
            return
        tensors = {f"batch.{j:06d}": inp.hidden.contiguous() for j, inp in enumerate(inputs)}
        tensors.update({f"dense.{j:06d}": inp.hidden.contiguous() for j, inp in enumerate(dense)})
        atomic_write(path, save(tensors, metadata={"block": str(index), "identity": self.identity}))

    def _load_hidden(self, inputs: List[BlockInput], dense: Sequence[BlockInput] = ()) -> int:
        """Replace the captured inputs (and the dense stream's) by the saved ones; returns the
        block they feed (0: none)."""
        path = self._hidden_path()
        if path is None or not path.exists():
            return 0
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("identity") != self.identity or len(list(fh.keys())) != len(inputs) + len(dense):
                return 0
            for j, inp in enumerate(inputs):
                inp.hidden = fh.get_tensor(f"batch.{j:06d}")
            for j, inp in enumerate(dense):
                inp.hidden = fh.get_tensor(f"dense.{j:06d}")
        return int(meta.get("block", 0))

    def _dense_stream(self, inputs: Sequence[BlockInput]) -> List[BlockInput]:
        """The dense model's hidden states, carried beside the pruned stream when block
        reconstruction fits each block to them (``ReconstructConfig(target="model")`` in a
        sequential prune; empty otherwise: a one-shot prune's inputs already are the dense stream)."""
        if not (self.sequential and self.method.reconstructs(self.config)
                and self.config.reconstruct.target == "model"):
            return []
        dense = [inp.copy() for inp in inputs]
        if self.hidden_dir is not None:
            for j, inp in enumerate(dense):
                inp.offload(Path(self.hidden_dir) / f"dense-{j:06d}.safetensors")
        return dense

    # -- the loop ------------------------------------------------------------------------------
    def run(self, calibration: Sequence[torch.Tensor]) -> PruneReport:
        method = self.method
        start_all = time.perf_counter()
        self.source.prepare_inputs()
        inputs = capture_block_inputs(self.source.model, self.blocks[0], calibration, hidden_dtype=self.hidden_dtype,
                                      blocks=self.blocks, blocks_prefix=self.blocks_prefix)
        self.source.release_inputs()
        by_block = self._names_by_block()
        if self.config.needs_allocation:
            self.config = self._allocate(inputs, by_block)
        report = PruneReport(method=method.name, pattern=self.config.pattern, settings={"config": config_to_dict(self.config)},
                             rank=self.rank, world_size=self.world_size)
        if self.hidden_dir is not None:
            for j, inp in enumerate(inputs):
                inp.offload(Path(self.hidden_dir) / f"batch-{j:06d}.safetensors")
        dense = self._dense_stream(inputs)
        start_block = self._resume_point(inputs, by_block, dense)
        bar = tqdm(total=len(self.blocks), initial=start_block, desc=f"prune {method.label}", unit="block",
                   disable=not self.progress, mininterval=1.0)
        try:
            for index in range(len(self.blocks)):
                prefix = f"{self.blocks_prefix}.{index}"
                if index < start_block:
                    self._replay(index, prefix, by_block[index], report)
                    continue
                block = self.source.load_block(prefix)
                block.to(self.device).eval()
                for inp in (*inputs, *dense):
                    inp.enter_block(index)
                names = by_block[index]
                dense_out = [run_block(block, inp, self.device) for inp in dense]  # the block is still dense
                if names:
                    layers = {n: layer_module(self.source.model, n) for n in names}
                    recon = self._reconstruction_data(inputs, dense_out if dense else None)
                    uncalled: Dict[str, str] = {}
                    stats = block_statistics(block, layers, inputs, device=self.device,
                                             track_xtx=method.needs_xtx(self.config), propagate=not self.sequential,
                                             outputs=recon[1] if recon is not None and not dense else None,
                                             expert_calibration=self.expert_calibration,
                                             min_expert_tokens=self.min_expert_tokens,
                                             expert_tokens=report.expert_tokens, uncalled=uncalled)
                    self._keep_uncalled(uncalled, report)
                    solved = [n for n in names if n not in uncalled]
                    if solved:
                        self._solve_block(solved, layers, stats, report, bar, index=index, block=block, recon=recon)
                if self.sequential or not names:  # the (pruned) block's outputs feed the next block
                    for inp in inputs:
                        inp.hidden = run_block(block, inp, self.device)
                for inp, out in zip(dense, dense_out):
                    inp.hidden = out
                del dense_out
                if self.sink is not None and self.rank == 0:
                    self.sink.write(index, prefix, block)
                self.source.release_block(prefix)
                self._save_hidden(index + 1, inputs, dense)
                bar.update(1)
        finally:
            bar.close()
        report.seconds = time.perf_counter() - start_all
        return report

    def _allocate(self, inputs: Sequence[BlockInput], by_block: List[List[str]]) -> Any:
        """``block_size="budget"``: measure each layer kind's loss at every candidate block size on
        a few blocks (dense stream), then give every layer its size within the model-wide budget."""
        cfg = dataclasses.replace(self.config, block_size=16)
        with_layers = [i for i, names in enumerate(by_block) if names]
        count = min(ALLOCATION_SAMPLE_BLOCKS, len(with_layers))
        sample = sorted({with_layers[round(k * (len(with_layers) - 1) / max(1, count - 1))] for k in range(count)})
        work = [BlockInput(inp.hidden, inp.kwargs, layer_kwargs=inp.layer_kwargs) for inp in inputs]
        multiple = cfg.sparsity.group
        measured: Dict[str, Dict[int, float]] = {}
        uncalled: Dict[str, str] = {}
        start = time.perf_counter()
        for index in range(sample[-1] + 1):
            prefix = f"{self.blocks_prefix}.{index}"
            block = self.source.load_block(prefix)
            block.to(self.device).eval()
            for inp in work:
                inp.enter_block(index)
            if index in sample:
                layers = {n: layer_module(self.source.model, n) for n in by_block[index]}
                stats = block_statistics(block, layers, work, device=self.device,
                                         track_xtx=self.method.needs_xtx(cfg), propagate=True,
                                         expert_calibration=self.expert_calibration,
                                         min_expert_tokens=self.min_expert_tokens, uncalled=uncalled)
                for n, layer in layers.items():
                    if n in uncalled:  # left dense by the block pass: no curve
                        continue
                    d_out, d_in = layer.weight.shape
                    measured[n] = {}
                    for size in candidate_block_sizes(d_out, d_in, multiple):
                        f = solve_layer(layer.weight, stats[n], dataclasses.replace(cfg, block_size=size), n).factors
                        measured[n][size] = f.relative_output_loss if f.refined else f.relative_loss
            else:
                for inp in work:
                    inp.hidden = run_block(block, inp, self.device)
            self.source.release_block(prefix)
        unmeasured = {layer_kind(n) for n in uncalled} - {layer_kind(n) for n in measured}  # left dense everywhere
        allocated = [n for n in self.names if layer_kind(n) not in unmeasured]
        shapes = {n: tuple(layer_module(self.source.model, n).weight.shape) for n in allocated}
        sizes = allocate_block_sizes(loss_curves(measured, allocated), shapes, cfg.max_overhead)
        logger.info("block sizes within a %.1f%% model-wide overhead, from blocks %s (%.0f s): %s",
                    100 * cfg.max_overhead, sample, time.perf_counter() - start,
                    {k: v for k, v in sorted(sizes.items()) if k.startswith(f"{self.blocks_prefix}.{sample[0]}.")})
        return dataclasses.replace(self.config, block_sizes=tuple(sizes.items()))

    def _names_by_block(self) -> List[List[str]]:
        by_block: List[List[str]] = [[] for _ in self.blocks]
        for name in self.names:
            rest = name[len(self.blocks_prefix) + 1:] if name.startswith(self.blocks_prefix + ".") else ""
            head = rest.split(".", 1)[0]
            if not head.isdigit():
                raise ArmorInputError(f"layer {name!r} is not inside a decoder block of {self.blocks_prefix!r}; "
                                 "prune_model prunes linears of decoder blocks only")
            by_block[int(head)].append(name)
        return by_block

    def _resume_point(self, inputs: List[BlockInput], by_block: List[List[str]],
                      dense: Sequence[BlockInput] = ()) -> int:
        """The first block to compute: blocks before it are finished and their outputs saved."""
        if self.store is None:
            return 0
        saved = self._load_hidden(inputs, dense)
        path = self.store.directory / UNCALLED_NAME
        uncalled = json.loads(path.read_text()) if saved and path.exists() else {}
        for index in range(saved):
            if not all(self.store.done(n) or n in uncalled for n in by_block[index]):
                raise ArmorInputError(f"run directory {self.store.directory}: saved hidden states follow block "
                                 f"{saved - 1} but block {index} is unfinished; delete {HIDDEN_NAME} to redo them")
            if self.sink is not None and not self.sink.done(index):
                raise ArmorInputError(f"run directory {self.store.directory}: block {index} was not written; "
                                 f"delete {HIDDEN_NAME} to redo it")
        if saved:
            logger.info("resuming at decoder block %d of %d", saved, len(self.blocks))
        return saved

    def _replay(self, index: int, prefix: str, names: List[str], report: PruneReport) -> None:
        """A block finished by an earlier run: its factors are converted from the store (an
        in-memory model) or it was already written (a streamed one)."""
        self._replay_errors(index, report)
        path = self.store.directory / UNCALLED_NAME
        uncalled = json.loads(path.read_text()) if path.exists() else {}
        report.uncalled_layers.update((n, uncalled[n]) for n in names if n in uncalled)
        names = [n for n in names if n not in uncalled]
        solutions = {}
        for name in names:
            factors = self.store.load(name)
            report.layers.append(_result(name, factors.shape, float(factors.relative_loss),
                                         float(factors.history_time_s[-1]), factors))
            solutions[name] = LayerSolution(name, self.method.name, factors=factors)
        if self.sink is None:
            self._apply(solutions, {n: layer_module(self.source.model, n) for n in names})

    def _keep_uncalled(self, uncalled: Dict[str, str], report: PruneReport) -> None:
        """Selected linears calibration never called stay dense: into the report and (rank 0) the run
        directory, before the block's hidden states are saved."""
        if not uncalled:
            return
        report.uncalled_layers.update(uncalled)
        if self.store is not None and self.rank == 0:
            path = self.store.directory / UNCALLED_NAME
            known = json.loads(path.read_text()) if path.exists() else {}
            atomic_write(path, json.dumps({**known, **uncalled}, indent=1).encode())

    def _reconstruction_data(self, inputs: Sequence[BlockInput], model_targets: Optional[List[Any]]):
        """Block reconstruction's data (``None`` when reconstruction is off): the inputs that reach
        the block, taken before a one-shot run replaces them, and the targets — ``model_targets``
        (the dense model's hidden states after the block, ``target="model"``) or, when that is
        ``None``, a list that the statistics pass fills with the dense block's outputs on these inputs."""
        if not self.method.reconstructs(self.config):
            return None
        return [BlockInput(inp.hidden, inp.kwargs) for inp in inputs], ([] if model_targets is None else model_targets)

    def _marker(self, index: int) -> Optional[Path]:
        return None if self.store is None else self.store.directory / RECONSTRUCTED_DIR / f"block-{index:05d}.json"

    def _replay_errors(self, index: int, report: PruneReport) -> bool:
        """Copy the held-out errors and curve of a block a run already reconstructed (its marker)
        into ``report``; ``False`` if there is no marker."""
        marker = self._marker(index)
        if marker is None or not marker.exists():
            return False
        saved = json.loads(marker.read_text())
        report.block_errors[index] = tuple(saved["errors"])
        report.block_curves[index] = [tuple(point) for point in saved.get("curve", ())]
        return True

    def _fresh_store(self) -> RunStore:
        """This rank's view of the run store after rank 0 wrote to it (re-read from disk)."""
        return RunStore(self.store.directory, self.config, self.store.model_id, self.store.stats_hash, rank=self.rank)

    @contextmanager
    def _xtx_on_disk(self, stats: Dict[str, Any]) -> Iterator[None]:
        """The block's ``XᵀX`` (one per distinct input: q/k/v share one) written to the run
        directory and dropped from ``stats`` while block reconstruction runs — it reads none; the
        report's output losses after it do — then read back (bit-identical). Without a run
        directory nothing moves."""
        first: Dict[int, str] = {}
        for name, s in stats.items():
            if s.xtx is not None:
                first.setdefault(id(s.xtx), name)
        if self.store is None or not first:
            yield
            return
        path = self.store.directory / XTX_OFFLOAD_NAME
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

    def _reconstruct(self, index: int, block: nn.Module, layers: Dict[str, nn.Linear], stats,
                     solutions: Dict[str, LayerSolution], cfgs: Dict[str, Any], recon,
                     report: PruneReport) -> Dict[str, LayerSolution]:
        """Adam on the block's factors against the dense block's outputs (rank 0; the result goes
        through the run store, and a marker says the block's stored factors are final)."""
        names = list(solutions)
        if self._replay_errors(index, report):  # an interrupted run finished it: the store holds the result
            return solutions
        prefix = f"{self.blocks_prefix}.{index}."
        if self.rank == 0:
            start = time.perf_counter()
            with self._xtx_on_disk(stats):
                result = reconstruct_block(block, {n[len(prefix):]: solutions[n].factors for n in names}, recon[0],
                                           recon[1], self.config.reconstruct, device=self.device,
                                           seed=self.config.seed, held_out_from=self.held_out_from)
            new, before, after = result.factors, result.before, result.after
            seconds = (time.perf_counter() - start) / len(names)
            solutions = {n: LayerSolution(n, self.method.name, seconds=solutions[n].seconds + seconds,
                                          factors=with_losses(new[n[len(prefix):]], layers[n].weight, stats[n].xtx,
                                                              stats[n].act_sq_norm, seconds))
                         for n in names}
            if self.store is not None:
                for n in names:
                    self.store.save(n, solutions[n].factors, config=cfgs[n], seconds=solutions[n].seconds)
                marker = self._marker(index)
                marker.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(marker, json.dumps({"errors": [before, after], "curve": result.curve}).encode())
            report.block_errors[index] = (before, after)
            report.block_curves[index] = [tuple(point) for point in result.curve]
            logger.info("block %d reconstructed (%d steps): held-out relative output error %s", index, result.steps,
                        " -> ".join(f"{e:.5f}" for _, e in result.curve))
        if self.world_size > 1:
            dist.barrier()  # rank 0 saved the reconstructed factors: every rank reads them
            if self.rank != 0:
                store = self._fresh_store()
                solutions = {n: LayerSolution(n, self.method.name, factors=store.load(n), seconds=solutions[n].seconds)
                             for n in names}
                self._replay_errors(index, report)
        return solutions

    def _solve_block(self, names: List[str], layers: Dict[str, nn.Linear], stats, report: PruneReport, bar,
                     index: int = 0, block: Optional[nn.Module] = None, recon=None) -> None:
        cfgs = {n: self.config.for_layer(*layers[n].weight.shape, name=n) for n in names}
        if self.method.factorizes:
            solutions = self._factorize_block(names, layers, stats, cfgs, bar)
            if recon is not None:
                # the block's last stage, seconds on a real model: the bar says so (and a log line, when long)
                bar.set_postfix_str(f"block {index}: reconstruction, {self.config.reconstruct.steps} steps")
                solutions = self._reconstruct(index, block, layers, stats, solutions, cfgs, recon, report)
        else:
            solutions = {}
            for n in names:
                bar.set_postfix_str(n[-40:], refresh=False)
                solutions[n] = solve_layer(layers[n].weight, stats[n], cfgs[n], n)
        for n in names:
            weight = layers[n].weight.detach()
            sol = solutions[n]
            if sol.factors is not None:  # factors: the loss the optimizer measured, as a resumed run replays it
                rel = float(sol.factors.relative_loss)
            else:
                ref = ProxyReference(weight, stats[n].act_sq_norm, cfgs[n].pattern)
                rel = ref.relative(weight, sol.approximation())
            report.layers.append(_result(n, tuple(weight.shape), rel, sol.seconds, sol.factors))
        self._apply({n: solutions[n] for n in names}, layers)

    def _apply(self, solutions: Dict[str, LayerSolution], layers: Dict[str, Any]) -> None:
        """Write every solution into the model: linears one by one, a fused expert parameter at once."""
        slots = {n: m for n, m in layers.items() if not isinstance(m, nn.Module)}
        for n, sol in solutions.items():
            if n not in slots:
                sol.apply(layers[n], self.storage)
        if slots:
            write_experts(slots, {n: solutions[n] for n in slots}, self.storage)

    def _factorize_block(self, names, layers, stats, cfgs, bar) -> Dict[str, LayerSolution]:
        def done(fqn: str, factors) -> None:
            bar.set_postfix_str(f"{fqn[-32:]} {factors.loss_text()}", refresh=False)

        todo = {n: (layers[n].weight.detach(), stats[n]) for n in names}
        factors = distributed_factorize(todo, self.config, self.store, per_layer_overrides=cfgs,
                                        progress=False, on_layer_done=done, return_factors=True)
        if self.world_size > 1:
            dist.barrier()  # rank 0 has merged the manifests: every rank reads every layer
            if self.rank != 0:
                store = self._fresh_store()
                factors = {n: store.load(n) for n in names}
        return {n: LayerSolution(n, self.method.name, factors=factors[n],
                                 seconds=float(factors[n].history_time_s[-1])) for n in names}


def _result(name: str, shape, rel: float, seconds: float, factors=None) -> LayerResult:
    extra: Dict[str, Any] = {}
    if factors is not None:
        extra = {"block_size": factors.block_size, "wrapper_params": factors.num_wrapper_params(),
                 "iterations": int(factors.history_iters[-1]),
                 "relative_output_loss": float(factors.relative_output_loss) if factors.refined else None}
    return LayerResult(name=name, shape=tuple(shape), relative_proxy_loss=rel, seconds=seconds, **extra)
