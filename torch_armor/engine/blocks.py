"""The block-by-block engine: calibrate, prune and propagate one decoder block at a time.

For each decoder block, in order:

1. statistics of the block's linears from the inputs that reach the block — with
   ``sequential=True`` the outputs of the already-pruned blocks before it (as SparseGPT and
   llm-compressor do), with ``False`` the dense model's;
2. the method (:data:`~torch_armor.engine.runner.METHODS`) on every selected linear of the block;
   ARMOR layers go through the run store (every finished layer written atomically) and are
   shared out across ``torchrun`` ranks by cost;
3. the block's outputs become the next block's inputs; a streamed block is written to its own
   shard and freed.

With a run directory, the hidden states at each block boundary are written too, so a rerun
resumes at the first unfinished block bit-identically to an uninterrupted run.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch_armor.progress import tqdm

from torch_armor._io import atomic_write
from torch_armor.calibration.blocks import BlockInput, block_statistics, capture_block_inputs, run_block
from torch_armor.engine.report import LayerResult, PruneReport
from torch_armor.engine.runner import METHODS, LayerSolution, ProxyReference, layer_config, solve_layer
from torch_armor.engine.runstore import RunStore, config_to_dict

__all__ = ["BlockPipeline", "HIDDEN_NAME", "BLOCKS_DIR"]

logger = logging.getLogger("torch_armor")

HIDDEN_NAME = "hidden.safetensors"
BLOCKS_DIR = "blocks"


@dataclass
class BlockPipeline:
    """One run of the engine over a model's decoder blocks.

    ``source`` provides the model and loads/frees its blocks (an in-memory model, or a
    :class:`~torch_armor.engine.checkpoint.LazyCheckpoint` whose blocks are materialized one at
    a time); ``write_block(index, prefix, block)`` is called when a block is finished (e.g. to
    write it to a shard) and ``block_done(index)`` tells whether a block was already written by an
    earlier, interrupted run.
    """

    source: Any
    blocks_prefix: str
    blocks: nn.ModuleList
    names: Sequence[str]
    method: str
    config: Any
    sequential: bool = True
    store: Optional[RunStore] = None
    identity: str = ""
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    hidden_dtype: Optional[torch.dtype] = None
    hidden_dir: Optional[Path] = None
    storage: str = "dense"
    progress: bool = True
    write_block: Optional[Callable[[int, str, nn.Module], None]] = None
    block_done: Optional[Callable[[int], bool]] = None
    rank: int = 0
    world_size: int = 1

    # -- hidden states at block boundaries ---------------------------------------------------
    def _hidden_path(self) -> Optional[Path]:
        return None if self.store is None else self.store.directory / HIDDEN_NAME

    def _save_hidden(self, index: int, inputs: Sequence[BlockInput]) -> None:
        path = self._hidden_path()
        if path is None or self.rank != 0:
            return
        from safetensors.torch import save

        tensors = {f"batch.{j:06d}": inp.hidden.contiguous() for j, inp in enumerate(inputs)}
        atomic_write(path, save(tensors, metadata={"block": str(index), "identity": self.identity}))

    def _load_hidden(self, inputs: List[BlockInput]) -> int:
        """Replace the captured inputs by the saved ones; returns the block they feed (0: none)."""
        path = self._hidden_path()
        if path is None or not path.exists():
            return 0
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("identity") != self.identity or len(list(fh.keys())) != len(inputs):
                return 0
            for j, inp in enumerate(inputs):
                inp.hidden = fh.get_tensor(f"batch.{j:06d}")
        return int(meta.get("block", 0))

    # -- the loop ------------------------------------------------------------------------------
    def run(self, calibration: Sequence[torch.Tensor]) -> PruneReport:
        method = METHODS[self.method]
        report = PruneReport(method=self.method, pattern=self.config.pattern, settings=config_to_dict(self.config)
                             if self.method == "armor" else dict(vars(self.config)))
        start_all = time.perf_counter()
        self.source.prepare_inputs()
        inputs = capture_block_inputs(self.source.model, self.blocks[0], calibration, hidden_dtype=self.hidden_dtype)
        self.source.release_inputs()
        if self.hidden_dir is not None:
            for j, inp in enumerate(inputs):
                inp.offload(Path(self.hidden_dir) / f"batch-{j:06d}.safetensors")
        by_block = self._names_by_block()
        start_block = self._resume_point(inputs, by_block)
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
                names = by_block[index]
                if names:
                    layers = {n: self.source.model.get_submodule(n) for n in names}
                    stats = block_statistics(block, layers, inputs, device=self.device,
                                             track_xtx=method.needs_xtx, propagate=not self.sequential)
                    self._solve_block(names, layers, stats, report, bar)
                if self.sequential or not names:  # the (pruned) block's outputs feed the next block
                    for inp in inputs:
                        inp.hidden = run_block(block, inp, self.device)
                if self.write_block is not None and self.rank == 0:
                    self.write_block(index, prefix, block)
                self.source.release_block(prefix)
                self._save_hidden(index + 1, inputs)
                bar.update(1)
        finally:
            bar.close()
        report.seconds = time.perf_counter() - start_all
        return report

    def _names_by_block(self) -> List[List[str]]:
        by_block: List[List[str]] = [[] for _ in self.blocks]
        for name in self.names:
            rest = name[len(self.blocks_prefix) + 1:] if name.startswith(self.blocks_prefix + ".") else ""
            head = rest.split(".", 1)[0]
            if not head.isdigit():
                raise ValueError(f"layer {name!r} is not inside a decoder block of {self.blocks_prefix!r}; "
                                 "prune_model prunes linears of decoder blocks only")
            by_block[int(head)].append(name)
        return by_block

    def _resume_point(self, inputs: List[BlockInput], by_block: List[List[str]]) -> int:
        """The first block to compute: blocks before it are finished and their outputs saved."""
        if self.store is None or self.method != "armor":
            return 0
        saved = self._load_hidden(inputs)
        for index in range(saved):
            if not all(self.store.done(n) for n in by_block[index]):
                raise ValueError(f"run directory {self.store.directory}: saved hidden states follow block "
                                 f"{saved - 1} but block {index} is unfinished; delete {HIDDEN_NAME} to redo them")
            if self.block_done is not None and not self.block_done(index):
                raise ValueError(f"run directory {self.store.directory}: block {index} was not written; "
                                 f"delete {HIDDEN_NAME} to redo it")
        if saved:
            logger.info("resuming at decoder block %d of %d", saved, len(self.blocks))
        return saved

    def _replay(self, index: int, prefix: str, names: List[str], report: PruneReport) -> None:
        """A block finished by an earlier run: its factors are converted from the store (an
        in-memory model) or it was already written (a streamed one)."""
        for name in names:
            factors = self.store.load(name)
            report.layers.append(_result(name, factors.shape, float(factors.relative_loss),
                                         float(factors.history_time_s[-1]), factors))
            if self.write_block is None:
                LayerSolution(name, "armor", factors=factors).apply(self.source.model.get_submodule(name), self.storage)

    def _solve_block(self, names: List[str], layers: Dict[str, nn.Linear], stats, report: PruneReport, bar) -> None:
        cfgs = {n: layer_config(self.method, self.config, tuple(layers[n].weight.shape), n) for n in names}
        if self.method == "armor":
            solutions = self._armor_block(names, layers, stats, cfgs, bar)
        else:
            solutions = {}
            for n in names:
                bar.set_postfix_str(n[-40:], refresh=False)
                solutions[n] = solve_layer(self.method, layers[n].weight, stats[n], cfgs[n], n)
        for n in names:
            weight = layers[n].weight.detach()
            sol = solutions[n]
            if sol.factors is not None:  # ARMOR: the loss factorize measured, as a resumed run replays it
                rel = float(sol.factors.relative_loss)
            else:
                ref = ProxyReference(weight, stats[n].act_sq_norm, cfgs[n].pattern)
                rel = ref.relative(weight, sol.approximation())
            report.layers.append(_result(n, tuple(weight.shape), rel, sol.seconds, sol.factors))
            sol.apply(layers[n], self.storage)

    def _armor_block(self, names, layers, stats, cfgs, bar) -> Dict[str, LayerSolution]:
        from torch_armor.engine.distributed import distributed_factorize

        def done(fqn: str, factors) -> None:
            bar.set_postfix_str(f"{fqn[-32:]} rel {factors.relative_loss:.3f}", refresh=False)

        todo = {n: (layers[n].weight.detach(), stats[n]) for n in names}
        factors = distributed_factorize(todo, self.config, self.store, per_layer_overrides=cfgs,
                                        progress=False, on_layer_done=done, return_factors=True)
        if self.world_size > 1:
            dist.barrier()  # rank 0 has merged the manifests: every rank reads every layer
            if self.rank != 0:
                store = RunStore(self.store.directory, self.config, self.store.model_id, self.store.stats_hash,
                                 rank=self.rank)
                factors = {n: store.load(n) for n in names}
        return {n: LayerSolution(n, "armor", factors=factors[n],
                                 seconds=float(factors[n].history_time_s[-1])) for n in names}


def _result(name: str, shape, rel: float, seconds: float, factors=None) -> LayerResult:
    extra: Dict[str, Any] = {}
    if factors is not None:
        extra = {"block_size": factors.block_size, "wrapper_params": factors.num_wrapper_params(),
                 "iterations": int(factors.history_iters[-1])}
    return LayerResult(name=name, shape=tuple(shape), relative_proxy_loss=rel, seconds=seconds, **extra)
