"""End-to-end distillation: after the block pass, tune every ARMOR layer's wrappers (linears' and
every fused expert's) so that the pruned model's next-token distributions match the dense model's.

Block reconstruction sees one block; errors that pile up across blocks, and how they reach the
logits, are seen only here. With the masks fixed, ``A``, ``B`` (and the kept core values) are
continuous, so Adam on KL(dense ‖ pruned) over the calibration windows applies. The weights
``Ŵ = A · (core ⊙ M) · B`` are built from leaf tensors (``torch.func.functional_call``; the
model is not modified until the end), and the iterate with the lowest KL on held-out windows
(calibration windows never trained on) is written back.

The dense teacher is cached before the block pass prunes the model in place: per token its
``top_k`` log-probabilities, their token ids and the log of the remaining mass
(:func:`dense_top_k`; 64 × 512 tokens at ``top_k=64``: 17 MB, where full fp32 logits of a
49152-token vocabulary would be 6.4 GB). The loss is the KL between the two distributions
coarsened to those ``top_k`` tokens plus one bin for the rest (:func:`coarse_kl`): by the chain
rule of the KL divergence it equals the full KL minus ``p_rest · KL(p(·|rest) ‖ q(·|rest))``, a
lower bound that is exact when ``top_k`` covers the vocabulary.

The pieces: the teacher and the loss in :mod:`~torch_armor.armor.distill_kl`, the one training
loop and the in-memory student in :mod:`~torch_armor.armor.distill_train`, the streamed teacher
and student (one decoder block resident) in :mod:`~torch_armor.armor.distill_stream`; here, what
:func:`~torch_armor.prune_model` runs (:class:`Distillation`) and what it skips, as ARMOR's pass around the
block pass (:func:`distillation_pass`, the method's ``model_pass`` hook).
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch import nn

from torch_armor._io import atomic_write
from torch_armor.config.armor import ArmorConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.armor.distill_kl import TopK, Window, dense_top_k, sample_windows, windows_of
from torch_armor.armor.distill_stream import BlockStream, StreamedStudent
from torch_armor.armor.distill_train import (ArmorWeight, InMemoryStudent, TrainingState, armor_layers, core_of,
                                              distill_model, held_out_split, windows_needed)
from torch_armor.engine.methods import ModelPass, ModelPassRun, RunState
from torch_armor.errors import ArmorInputError

__all__ = ["distill_skip_reason", "sampling_skip_reason", "NO_DISTILL_COST", "Distillation", "DISTILLED_NAME",
           "SAMPLED_NAME", "STATE_NAME", "DistillationPass", "distillation_pass"]

logger = logging.getLogger("torch_armor")

#: In a run directory: the distilled wrappers (and cores) of a finished distillation.
DISTILLED_NAME = "distilled.safetensors"
#: In a run directory: the windows sampled from the dense model (a resumed run reuses them).
SAMPLED_NAME = "sampled.safetensors"
#: In a run directory, while distillation runs: its state after the last finished step.
STATE_NAME = "distill-state.safetensors"


#: what skipping distillation costs, from the ablation in docs/results.md ("Each lever on alone and off alone")
NO_DISTILL_COST = "on SmolLM2-135M the default without it measured 41.13 Wikipedia perplexity, with it 34.87"


def distill_skip_reason(config: DistillConfig, *, n_windows: int) -> str:
    """Why :func:`~torch_armor.prune_model` cannot distill here (``""``: it can): distillation needs
    training windows besides the held-out ones."""
    if n_windows <= config.held_out:
        return (f"{n_windows} calibration windows leave none to train on besides the {config.held_out} held-out ones "
                "(give more windows or lower DistillConfig.held_out)")
    return ""


def sampling_skip_reason(config: DistillConfig, *, streamed: bool) -> str:
    """Why distillation goes without its sampled windows here (``""``: it samples them): sampling
    generates token by token through the whole dense model, which a streamed checkpoint never holds."""
    if streamed and config.sampled_windows:
        return (f"its {config.sampled_windows} sampled windows are not drawn: sampling runs the whole dense model token "
                "by token and a streamed checkpoint is never in memory whole (load the model and pass the module)")
    return ""


class Distillation:
    """:func:`~torch_armor.prune_model`'s distillation: the dense teacher cached before the block
    pass (:meth:`capture`), the training after it (:meth:`run`), and, with a run directory, the
    finished result in :data:`DISTILLED_NAME` — written atomically once distillation ends, so a
    resumed run applies it instead of distilling again and a crash loses at most the distillation.
    """

    def __init__(self, config: DistillConfig, batches: Sequence[Any], *, seed: int = 0,
                 run_dir: Optional[Path] = None, identity: str = "", storage: str = "dense",
                 stream: Optional[BlockStream] = None, device: torch.device = torch.device("cpu"),
                 rank: int = 0, world_size: int = 1, log: Optional[Callable[[str], None]] = None,
                 progress: bool = False) -> None:
        self.config, self.seed, self.storage, self.log = config, seed, storage, log or logger.info
        self.progress, self.stream, self.device = progress, stream, device
        self.rank, self.world_size = rank, world_size  # torchrun: data-parallel over the windows; rank 0 writes
        self.windows = windows_of(batches)
        self.needed = windows_needed(len(self.windows), config, seed, config.sampled_windows)  # checks held_out first
        self.sampled: List[Window] = []
        self.path = None if run_dir is None else Path(run_dir) / DISTILLED_NAME
        self.state_path = None if run_dir is None else Path(run_dir) / STATE_NAME
        self.identity = json.dumps({"run": identity, "distill": asdict(config), "seed": seed}, sort_keys=True)
        self.teacher: Dict[int, TopK] = {}
        self.teacher_seconds = 0.0

    def _finished(self) -> bool:
        if self.path is None or not self.path.exists():
            return False
        with safe_open(str(self.path), framework="pt") as fh:
            return (fh.metadata() or {}).get("identity") == self.identity

    def capture(self, model: nn.Module) -> None:
        """Sample windows from the dense model (``sampled_windows``; a resumed run reads the run
        directory's) and cache its top-k distributions on the windows distillation reads (skipped
        when the run directory holds a finished distillation)."""
        start = time.perf_counter()
        if self.config.sampled_windows:
            if self.stream is not None:
                raise ArmorInputError(f"distillation: {sampling_skip_reason(self.config, streamed=True)}; set "
                                      "DistillConfig(sampled_windows=0)")
            self.sampled = self._sampled_windows(model)
        if self._finished():
            return
        every = [*self.windows, *self.sampled]
        chosen = [every[j] for j in self.needed]
        if self.stream is not None:
            tops = self.stream.dense_top_k(chosen, self.config.top_k, progress=self.progress)
        else:
            tops = dense_top_k(model, chosen, self.config.top_k, progress=self.progress)
        self.teacher = dict(zip(self.needed, tops))
        self.teacher_seconds = time.perf_counter() - start
        self.log(f"distillation: dense top-{self.config.top_k} cached on {len(self.needed)} windows "
                 f"({self.teacher_seconds:.0f} s)")

    def _sampled_windows(self, model: nn.Module) -> List[Window]:
        path = None if self.path is None else self.path.parent / SAMPLED_NAME
        if path is not None and path.exists():
            with safe_open(str(path), framework="pt") as fh:
                if (fh.metadata() or {}).get("identity") == self.identity:
                    return windows_of([fh.get_tensor("ids")])
        start = time.perf_counter()
        _, train = held_out_split(len(self.windows), self.config)
        sampled = sample_windows(model, [self.windows[j] for j in train], self.config.sampled_windows,
                                 max(w[0].shape[1] for w in self.windows), seed=self.seed,
                                 prompt_tokens=self.config.sample_prompt_tokens, progress=self.progress)
        self.log(f"distillation: {len(sampled)} windows sampled from the dense model "
                 f"({time.perf_counter() - start:.0f} s)")
        if path is not None and self.rank == 0:
            ids = torch.cat([w[0] for w in sampled]).contiguous()
            atomic_write(path, save({"ids": ids}, metadata={"identity": self.identity}))
        return sampled

    def block_pass_batches(self, batches: Sequence[Any], batch_size: int) -> Tuple[List[Any], int]:
        """The block pass's calibration batches and how many sampled windows lead them: with
        ``sampled_in_block_pass``, the sampled windows (after :meth:`capture`) in batches of
        ``batch_size`` before ``batches`` (with all-ones attention masks when ``batches`` carry
        masks); else ``batches`` as they are."""
        if not (self.config.sampled_in_block_pass and self.sampled):
            return list(batches), 0
        ids = torch.cat([w[0] for w in self.sampled])
        masked = any(isinstance(b, (tuple, list)) for b in batches)
        lead = [(part, torch.ones_like(part, dtype=torch.bool)) if masked else part for part in ids.split(batch_size)]
        self.log(f"block pass: {len(self.sampled)} sampled windows calibrate it besides the {len(self.windows)} "
                 "calibration windows")
        return [*lead, *batches], len(self.sampled)

    def run(self, model: nn.Module) -> Dict[str, Any]:
        """Distill ``model`` (pruned, in place), or apply the run directory's finished result;
        returns the report's ``distill`` entry."""
        if self._finished():
            return self._apply_saved(model)
        if not self.teacher:
            raise ArmorInputError("distillation: Distillation.capture(dense model) must run before the block pass")
        if self.world_size > 1:
            dist.barrier()  # rank 0 has written every block's shard
        if self.stream is not None:
            student = StreamedStudent(self.stream, self.config, writes=self.rank == 0)
        else:
            student = InMemoryStudent(model, self.config)
        state = None if self.state_path is None else TrainingState(self.state_path, self.identity)
        result = distill_model(student, self.windows, self.teacher, self.config, seed=self.seed, storage=self.storage,
                               sampled=self.sampled, device=self.device, state=state, log=self.log,
                               progress=self.progress and self.rank == 0, rank=self.rank, world_size=self.world_size)
        result.teacher_seconds = self.teacher_seconds
        summary = {"before": result.before, "after": result.after, "best_step": result.best_step,
                   "curve": [list(c) for c in result.curve], "seconds": result.seconds,
                   "teacher_seconds": result.teacher_seconds}
        self.log(f"distillation: held-out KL {result.before:.5f} -> {result.after:.5f} (step {result.best_step}, "
                 f"{result.seconds:.0f} s)")
        if self.path is not None and self.rank == 0:
            tensors = student.result_tensors(self.config.train_core)
            atomic_write(self.path, save(tensors, metadata={"identity": self.identity, "summary": json.dumps(summary)}))
            state.remove()
        return summary

    def _apply_saved(self, model: nn.Module) -> Dict[str, Any]:
        with safe_open(str(self.path), framework="pt") as fh:
            keys = set(fh.keys())

            def apply(name: str, site: ArmorWeight) -> None:
                stored = core_of(site.tensor).detach()
                core = fh.get_tensor(f"{name}.core") if f"{name}.core" in keys else stored
                site.write(fh.get_tensor(f"{name}.a_blocks"), core, fh.get_tensor(f"{name}.b_blocks"), stored != 0,
                           self.storage, name)

            if self.stream is not None:
                if self.rank == 0:
                    self.stream.for_each_layer(apply, write=True)
            else:
                for name, site in armor_layers(model).items():
                    apply(name, site)
            summary = json.loads((fh.metadata() or {})["summary"])
        self.log(f"distillation already finished in {self.path.parent}: applied")
        return summary


@dataclass(frozen=True)
class DistillationPass(ModelPass):
    """Distillation with ``distill`` (``None``: skipped, for the reason ``skipped``), seeded by ``seed``;
    ``sampling_skipped``: why it runs without its sampled windows (``""``: it samples them)."""

    distill: Optional[DistillConfig]
    seed: int
    skipped: str = ""
    sampling_skipped: str = ""

    def before_blocks(self, plan: Any, run: RunState) -> "DistillationRun":
        if self.distill is None:
            return DistillationRun(plan.batches, 0, self, None)
        stream = (BlockStream(plan.source, plan.blocks_prefix, len(plan.blocks), run.sink, plan.device)
                  if run.sink is not None else None)
        distillation = Distillation(self.distill, plan.batches, seed=self.seed, run_dir=plan.paths.run_dir,
                                    identity=run.identity, storage=plan.storage, stream=stream, device=plan.device,
                                    rank=run.rank, world_size=run.world_size, log=plan.options.log,
                                    progress=run.shows_progress(plan))
        distillation.capture(plan.model)  # the dense teacher, before the block pass prunes in place
        batches, held_out_from = distillation.block_pass_batches(plan.batches, plan.options.batch_size)
        return DistillationRun(batches, held_out_from, self, distillation)


@dataclass
class DistillationRun(ModelPassRun):
    """A :class:`DistillationPass` (``settings``) under way: its ``distillation`` (``None``: skipped) trains the
    pruned model."""

    settings: Optional[DistillationPass] = None
    distillation: Optional[Distillation] = None

    def after_model(self, model: nn.Module, report: Any) -> None:
        if self.distillation is not None:
            report.stages["distillation"] = self.distillation.run(model)
            if self.settings.sampling_skipped:
                report.stages["distillation"]["sampled_windows_skipped"] = self.settings.sampling_skipped
        elif self.settings.skipped:  # prune_report.json says what the run did not do, and why
            report.stages["distillation"] = {"skipped": self.settings.skipped, "expected_cost": NO_DISTILL_COST}


def distillation_pass(config: ArmorConfig, batches: Sequence[Any], *, streamed: bool) -> Optional[DistillationPass]:
    """The distillation ``config`` asks for on these calibration batches (``None``: ``distill=None``),
    with a warning when it is skipped (too few windows) or runs without its sampled windows (``streamed``)."""
    distill = config.distill
    if distill is None:
        return None
    why_not = distill_skip_reason(distill, n_windows=len(windows_of(batches)))
    if why_not:
        recon = config.reconstruct
        hint = ('; ReconstructConfig(target="model") makes up for part of it by fitting each block to the dense '
                "model's hidden states" if recon is not None and recon.target == "block" else "")
        samples = (f"; its {distill.sampled_windows} sampled windows are not drawn, so the block pass calibrates on "
                   "the calibration windows alone" if distill.sampled_in_block_pass else "")
        warnings.warn(f"end-to-end distillation skipped: {why_not}; ArmorConfig(distill=None) prunes without it"
                      + samples + hint + f" ({NO_DISTILL_COST})", stacklevel=5)
        return DistillationPass(None, config.seed, skipped=why_not)
    sampling_skipped = sampling_skip_reason(distill, streamed=streamed)
    if sampling_skipped:
        block_pass = " and the block pass calibrates on the calibration windows alone" \
            if distill.sampled_in_block_pass else ""
        warnings.warn(f"end-to-end distillation runs on the calibration windows alone: {sampling_skipped}"
                      f"{block_pass}", stacklevel=5)
        distill = replace(distill, sampled_windows=0, sampled_in_block_pass=False)
    return DistillationPass(distill, config.seed, sampling_skipped=sampling_skipped)
