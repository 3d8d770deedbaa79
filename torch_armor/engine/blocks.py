"""The block-by-block engine: calibrate, prune and propagate one decoder block at a time.

For each decoder block, in order:

1. statistics of the block's linears from the inputs that reach the block — with
   ``sequential=True`` the outputs of the already-pruned blocks before it (as SparseGPT and
   llm-compressor do), with ``False`` the dense model's;
2. the config's method (:mod:`torch_armor.engine.methods`) on every selected linear of the block
   (its ``solve_block`` hook; ARMOR's sends the layers through the run store, every finished layer
   written atomically, and shares them out across ``torchrun`` ranks by cost), then its
   ``after_block`` hook (ARMOR: block reconstruction);
3. the block's outputs become the next block's inputs; a streamed block is written to its own
   shard and freed.

With a run directory, the hidden states at each block boundary are written too, so a rerun
resumes at the first unfinished block bit-identically to an uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.calibration.blocks import BlockInput, block_statistics, capture_block_inputs, run_block
from torch_armor.config.serialized import config_to_dict
from torch_armor.engine.experts import layer_module, write_experts
from torch_armor.engine.methods import Method, RunState
from torch_armor.engine.plan import PrunePlan
from torch_armor.engine.report import LayerResult, PruneReport
from torch_armor.engine.runner import LayerSolution, ProxyReference
from torch_armor.engine.runstore import RunStore
from torch_armor.errors import ArmorInputError
from torch_armor.progress import tqdm

__all__ = ["BlockPipeline", "HIDDEN_NAME", "BLOCKS_DIR"]

logger = logging.getLogger("torch_armor")

HIDDEN_NAME = "hidden.safetensors"
BLOCKS_DIR = "blocks"
#: In a run directory: ``{layer: why}`` of the selected linears calibration never called (left dense),
#: so a resumed run replays those blocks without them.
UNCALLED_NAME = "uncalled.json"


@dataclass
class BlockPipeline:
    """One run of the engine over a :class:`~torch_armor.engine.plan.PrunePlan`'s decoder blocks.

    Everything decided before the run is the plan's (its source provides the model and loads/frees
    its blocks: :class:`~torch_armor.engine.sources.InMemory`, or :class:`~torch_armor.engine.sources.Streamed`
    whose blocks are materialized one at a time; its layers, device, storage and options); ``state``
    is what exists once it executes (:class:`~torch_armor.engine.methods.RunState`: the run store,
    the sink that keeps each finished block on rank 0 and tells which ones an earlier, interrupted
    run already kept, the ranks). ``run_config`` is the config the block pass runs: the plan's, as the
    method's :meth:`~torch_armor.engine.methods.Method.plan` hook completes it when the run begins.
    """

    plan: PrunePlan
    state: RunState
    run_config: Any = field(default=None, init=False)
    bar: Any = field(default=None, init=False, repr=False)  # the progress bar while the loop runs (for the hooks)

    @property
    def method(self) -> Method:
        return self.plan.method

    # -- hidden states at block boundaries ---------------------------------------------------
    def _hidden_path(self) -> Optional[Path]:
        return None if self.state.store is None else self.state.store.directory / HIDDEN_NAME

    def _save_hidden(self, index: int, inputs: Sequence[BlockInput], dense: Sequence[BlockInput] = ()) -> None:
        path = self._hidden_path()
        if path is None or self.state.rank != 0:
            return
        tensors = {f"batch.{j:06d}": inp.hidden.contiguous() for j, inp in enumerate(inputs)}
        tensors.update({f"dense.{j:06d}": inp.hidden.contiguous() for j, inp in enumerate(dense)})
        atomic_write(path, save(tensors, metadata={"block": str(index), "identity": self.state.identity}))

    def _load_hidden(self, inputs: List[BlockInput], dense: Sequence[BlockInput] = ()) -> int:
        """Replace the captured inputs (and the dense stream's) by the saved ones; returns the
        block they feed (0: none)."""
        path = self._hidden_path()
        if path is None or not path.exists():
            return 0
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            if meta.get("identity") != self.state.identity or len(list(fh.keys())) != len(inputs) + len(dense):
                return 0
            for j, inp in enumerate(inputs):
                inp.hidden = fh.get_tensor(f"batch.{j:06d}")
            for j, inp in enumerate(dense):
                inp.hidden = fh.get_tensor(f"dense.{j:06d}")
        return int(meta.get("block", 0))

    def _dense_stream(self, inputs: Sequence[BlockInput]) -> List[BlockInput]:
        """The dense model's hidden states, carried beside the pruned stream when the method's
        ``after_block`` fits each block to them (its ``block_targets`` is ``"model"``; empty otherwise:
        a one-shot prune's inputs already are the dense stream)."""
        if self.method.block_targets(self.run_config, self.plan.options.sequential) != "model":
            return []
        dense = [inp.copy() for inp in inputs]
        if self.plan.options.hidden_dir is not None:
            for j, inp in enumerate(dense):
                inp.offload(Path(self.plan.options.hidden_dir) / f"dense-{j:06d}.safetensors")
        return dense

    # -- the loop ------------------------------------------------------------------------------
    def run(self, calibration: Sequence[torch.Tensor]) -> PruneReport:
        method = self.method
        start_all = time.perf_counter()
        plan = self.plan
        plan.source.prepare_inputs()
        inputs = capture_block_inputs(plan.source.model, plan.blocks[0], calibration,
                                      hidden_dtype=plan.options.hidden_dtype, blocks=plan.blocks,
                                      blocks_prefix=plan.blocks_prefix)
        plan.source.release_inputs()
        by_block = self._names_by_block()
        self.run_config = method.plan(self.plan.config, self, inputs, by_block)
        report = PruneReport(method=method.name, pattern=self.run_config.pattern,
                             settings={"config": config_to_dict(self.run_config)}, rank=self.state.rank,
                             world_size=self.state.world_size)
        if self.plan.options.hidden_dir is not None:
            for j, inp in enumerate(inputs):
                inp.offload(Path(self.plan.options.hidden_dir) / f"batch-{j:06d}.safetensors")
        dense = self._dense_stream(inputs)
        start_block = self._resume_point(inputs, by_block, dense)
        self.bar = bar = tqdm(total=len(self.plan.blocks), initial=start_block, desc=f"prune {method.label}",
                              unit="block", disable=not self.state.shows_progress(self.plan), mininterval=1.0)
        try:
            for index in range(len(self.plan.blocks)):
                prefix = f"{self.plan.blocks_prefix}.{index}"
                if index < start_block:
                    self._replay(index, prefix, by_block[index], report)
                    continue
                block = self.plan.source.load_block(prefix)
                block.to(self.plan.device).eval()
                for inp in (*inputs, *dense):
                    inp.enter_block(index)
                names = by_block[index]
                dense_out = [run_block(block, inp, self.plan.device) for inp in dense]  # the block is still dense
                if names:
                    layers = {n: layer_module(self.plan.source.model, n) for n in names}
                    recon = self._reconstruction_data(inputs, dense_out if dense else None)
                    uncalled: Dict[str, str] = {}
                    stats = block_statistics(block, layers, inputs, device=self.plan.device,
                                             track_xtx=method.needs_xtx(self.run_config),
                                             propagate=not self.plan.options.sequential,
                                             outputs=recon[1] if recon is not None and not dense else None,
                                             expert_calibration=self.plan.options.expert_calibration,
                                             min_expert_tokens=self.plan.options.min_expert_tokens,
                                             expert_tokens=report.expert_tokens, uncalled=uncalled)
                    self._keep_uncalled(uncalled, report)
                    solved = [n for n in names if n not in uncalled]
                    if solved:
                        self._solve_block(solved, layers, stats, report, index=index, block=block, recon=recon)
                if self.plan.options.sequential or not names:  # the (pruned) block's outputs feed the next block
                    for inp in inputs:
                        inp.hidden = run_block(block, inp, self.plan.device)
                for inp, out in zip(dense, dense_out):
                    inp.hidden = out
                del dense_out
                if self.state.sink is not None and self.state.rank == 0:
                    self.state.sink.write(index, prefix, block)
                self.plan.source.release_block(prefix)
                self._save_hidden(index + 1, inputs, dense)
                bar.update(1)
        finally:
            bar.close()
        report.seconds = time.perf_counter() - start_all
        return report

    def _names_by_block(self) -> List[List[str]]:
        by_block: List[List[str]] = [[] for _ in self.plan.blocks]
        for name in self.plan.names:
            rest = name[len(self.plan.blocks_prefix) + 1:] if name.startswith(self.plan.blocks_prefix + ".") else ""
            head = rest.split(".", 1)[0]
            if not head.isdigit():
                raise ArmorInputError(f"layer {name!r} is not inside a decoder block of {self.plan.blocks_prefix!r}; "
                                 "prune_model prunes linears of decoder blocks only")
            by_block[int(head)].append(name)
        return by_block

    def _resume_point(self, inputs: List[BlockInput], by_block: List[List[str]],
                      dense: Sequence[BlockInput] = ()) -> int:
        """The first block to compute: blocks before it are finished and their outputs saved."""
        if self.state.store is None:
            return 0
        saved = self._load_hidden(inputs, dense)
        path = self.state.store.directory / UNCALLED_NAME
        uncalled = json.loads(path.read_text()) if saved and path.exists() else {}
        for index in range(saved):
            if not all(self.state.store.done(n) or n in uncalled for n in by_block[index]):
                raise ArmorInputError(f"run directory {self.state.store.directory}: saved hidden states follow block "
                                 f"{saved - 1} but block {index} is unfinished; delete {HIDDEN_NAME} to redo them")
            if self.state.sink is not None and not self.state.sink.done(index):
                raise ArmorInputError(f"run directory {self.state.store.directory}: block {index} was not written; "
                                 f"delete {HIDDEN_NAME} to redo it")
        if saved:
            logger.info("resuming at decoder block %d of %d", saved, len(self.plan.blocks))
        return saved

    def _replay(self, index: int, prefix: str, names: List[str], report: PruneReport) -> None:
        """A block finished by an earlier run: its solutions are written from the store (an
        in-memory model) or it was already written (a streamed one)."""
        self.method.replay_block(index, self, report)
        path = self.state.store.directory / UNCALLED_NAME
        uncalled = json.loads(path.read_text()) if path.exists() else {}
        report.uncalled_layers.update((n, uncalled[n]) for n in names if n in uncalled)
        names = [n for n in names if n not in uncalled]
        solutions = {}
        for name in names:
            solutions[name] = sol = self.method.solution(name, self.state.store.load(name))
            report.layers.append(_result(sol))
        if self.state.sink is None:
            self._apply(solutions, {n: layer_module(self.plan.source.model, n) for n in names})

    def _keep_uncalled(self, uncalled: Dict[str, str], report: PruneReport) -> None:
        """Selected linears calibration never called stay dense: into the report and (rank 0) the run
        directory, before the block's hidden states are saved."""
        if not uncalled:
            return
        report.uncalled_layers.update(uncalled)
        if self.state.store is not None and self.state.rank == 0:
            path = self.state.store.directory / UNCALLED_NAME
            known = json.loads(path.read_text()) if path.exists() else {}
            atomic_write(path, json.dumps({**known, **uncalled}, indent=1).encode())

    def _reconstruction_data(self, inputs: Sequence[BlockInput], model_targets: Optional[List[Any]]):
        """The data of the method's ``after_block`` (``None`` when its ``block_targets`` is): the inputs
        that reach the block, taken before a one-shot run replaces them, and the targets —
        ``model_targets`` (the dense model's hidden states after the block) or, when that is
        ``None``, a list that the statistics pass fills with the dense block's outputs on these inputs."""
        if self.method.block_targets(self.run_config, self.plan.options.sequential) is None:
            return None
        return [BlockInput(inp.hidden, inp.kwargs) for inp in inputs], ([] if model_targets is None else model_targets)

    def fresh_store(self) -> RunStore:
        """This rank's view of the run store after rank 0 wrote to it (re-read from disk)."""
        store = self.state.store
        return RunStore(store.directory, self.run_config, store.model_id, store.stats_hash, rank=self.state.rank)

    def _solve_block(self, names: List[str], layers: Dict[str, nn.Linear], stats, report: PruneReport,
                     index: int = 0, block: Optional[nn.Module] = None, recon=None) -> None:
        cfgs = {n: self.run_config.for_layer(*layers[n].weight.shape, name=n) for n in names}
        solutions = self.method.solve_block(names, layers, stats, cfgs, self)
        solutions = self.method.after_block(index, block, layers, stats, solutions, cfgs, recon, self, report)
        for n in names:
            sol = solutions[n]
            result = _result(sol)
            if result.relative_proxy_loss is None:  # the method did not measure it: against NoWag-P's
                weight = layers[n].weight.detach()
                ref = ProxyReference(weight, stats[n].act_sq_norm, cfgs[n].pattern)
                result.relative_proxy_loss = ref.relative(weight, sol.approximation())
            report.layers.append(result)
        self._apply({n: solutions[n] for n in names}, layers)

    def _apply(self, solutions: Dict[str, LayerSolution], layers: Dict[str, Any]) -> None:
        """Write every solution into the model: linears one by one, a fused expert parameter at once."""
        slots = {n: m for n, m in layers.items() if not isinstance(m, nn.Module)}
        for n, sol in solutions.items():
            if n not in slots:
                sol.apply(layers[n], self.plan.storage)
        if slots:
            write_experts(slots, {n: solutions[n] for n in slots}, self.plan.storage)

def _result(solution: LayerSolution) -> LayerResult:
    """The report's line of one layer: what its method reports of it (``relative_proxy_loss`` ``None``:
    not measured by the method)."""
    fields = {"relative_proxy_loss": None, **solution.method.report_fields(solution.payload)}
    return LayerResult(name=solution.name, seconds=solution.seconds, **fields)
