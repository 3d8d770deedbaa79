"""End-to-end distillation as ARMOR's pass around the block pass: whether it runs (and the warning
when it cannot, or runs without its sampled windows), the dense teacher captured before the block
pass, the training after it (:class:`~torch_armor.engine.distill.Distillation`)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Optional, Sequence, Tuple

from torch import nn

from torch_armor.core.config import ArmorConfig
from torch_armor.core.levers import DistillConfig
from torch_armor.engine.distill import NO_DISTILL_COST, Distillation, distill_skip_reason, sampling_skip_reason
from torch_armor.engine.distill_kl import windows_of
from torch_armor.engine.distill_stream import BlockStream
from torch_armor.engine.methods import ModelPass, RunContext

__all__ = ["DistillationPass", "distillation_pass"]


@dataclasses.dataclass
class DistillationPass(ModelPass):
    """Distillation with ``distill`` (``None``: skipped, for the reason ``skipped``), seeded by ``seed``;
    ``sampling_skipped``: why it runs without its sampled windows (``""``: it samples them)."""

    distill: Optional[DistillConfig]
    seed: int
    skipped: str = ""
    sampling_skipped: str = ""
    distillation: Optional[Distillation] = None

    def before_blocks(self, model: nn.Module, batches: Sequence[Any], run: RunContext) -> Tuple[Sequence[Any], int]:
        if self.distill is None:
            return batches, 0
        stream = (BlockStream(run.source, run.blocks_prefix, run.n_blocks, run.writer, run.device)
                  if run.writer is not None else None)
        self.distillation = Distillation(self.distill, batches, seed=self.seed, run_dir=run.run_dir,
                                         identity=run.identity, storage=run.storage, stream=stream, device=run.device,
                                         rank=run.rank, world_size=run.world_size, log=run.log, progress=run.progress)
        self.distillation.capture(model)  # the dense teacher, before the block pass prunes in place
        return self.distillation.block_pass_batches(batches, run.batch_size)

    def after_model(self, model: nn.Module, report: Any) -> None:
        if self.distillation is not None:
            report.distill = self.distillation.run(model)
            if self.sampling_skipped:
                report.distill["sampled_windows_skipped"] = self.sampling_skipped
        elif self.skipped:  # prune_report.json says what the run did not do, and why
            report.distill = {"skipped": self.skipped, "expected_cost": NO_DISTILL_COST}


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
                      + samples + hint + f" ({NO_DISTILL_COST})", stacklevel=4)
        return DistillationPass(None, config.seed, skipped=why_not)
    sampling_skipped = sampling_skip_reason(distill, streamed=streamed)
    if sampling_skipped:
        block_pass = " and the block pass calibrates on the calibration windows alone" \
            if distill.sampled_in_block_pass else ""
        warnings.warn(f"end-to-end distillation runs on the calibration windows alone: {sampling_skipped}"
                      f"{block_pass}", stacklevel=4)
        distill = dataclasses.replace(distill, sampled_windows=0, sampled_in_block_pass=False)
    return DistillationPass(distill, config.seed, sampling_skipped=sampling_skipped)
