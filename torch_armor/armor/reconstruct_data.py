"""Block reconstruction's data: calibration windows split into held-out windows and training
micro-batches, and the learning-rate schedule.

A *window* is one row of a calibration batch. Held-out windows are drawn (seeded) from all
windows and never trained on; the rest are grouped, within their batch, into micro-batches of
``micro_batch`` windows. Rows are cut from the hidden states, the dense block's outputs and every
keyword-argument tensor whose first dimension is the batch (attention masks, per-row position
embeddings); tensors shared by the batch (first dimension 1) pass unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import tree_map

from torch_armor.calibration.blocks import BlockInput
from torch_armor.errors import ArmorInputError

__all__ = ["Unit", "split_windows", "lr_factor", "set_scheduled_lr", "take_rows"]


@dataclass(frozen=True)
class Unit:
    """Rows ``rows`` of calibration batch ``batch`` (one step's micro-batch, or held-out rows)."""

    batch: int
    rows: Tuple[int, ...]


def split_windows(batch_sizes: Sequence[int], held_out: int, micro_batch: Optional[int],
                  seed: int, held_out_from: int = 0) -> Tuple[List[Unit], List[Unit]]:
    """``(held_out_units, train_units)`` over batches of ``batch_sizes`` rows.

    ``held_out`` windows (seeded choice among the windows from the ``held_out_from``-th on, in
    batch order; at most all but one, and the only window is both held out and trained on) form
    the held-out units, one per batch that has any; the other windows of each batch are cut into
    consecutive micro-batches of ``micro_batch`` rows (``None``: all of them).
    """
    windows = [(j, r) for j, size in enumerate(batch_sizes) for r in range(size)]
    if not windows:
        raise ArmorInputError("block reconstruction: no calibration windows reach the block")
    if not 0 <= held_out_from < len(windows):
        raise ArmorInputError(f"block reconstruction: held-out windows are drawn from window {held_out_from} on, "
                              f"but only {len(windows)} windows reach the block")
    candidates = windows[held_out_from:]
    count = min(held_out, len(windows) - 1, len(candidates)) or 1
    order = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed)).tolist()
    held = set(candidates[i] for i in order[:count])
    held_units, train_units = [], []
    for j, size in enumerate(batch_sizes):
        rows = tuple(r for r in range(size) if (j, r) in held)
        if rows:
            held_units.append(Unit(j, rows))
        rest = [r for r in range(size) if (j, r) not in held] if len(windows) > 1 else list(range(size))
        step = micro_batch or max(len(rest), 1)
        train_units.extend(Unit(j, tuple(rest[i:i + step])) for i in range(0, len(rest), step))
    return held_units, train_units


def _rows(value: Any, rows: torch.Tensor, size: int) -> Any:
    def cut(v: Any) -> Any:
        return v.index_select(0, rows) if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[0] == size else v
    return tree_map(cut, value)


def take_rows(inp: BlockInput, target: torch.Tensor, unit: Unit) -> Tuple[BlockInput, torch.Tensor]:
    """The unit's rows of one batch's input (hidden states and keyword arguments) and target."""
    hidden = inp.hidden
    size = hidden.shape[0]
    if len(unit.rows) == size:  # the whole batch (also every batch of one row)
        return BlockInput(hidden, inp.kwargs), target
    rows = torch.tensor(unit.rows, dtype=torch.long)
    return BlockInput(hidden.index_select(0, rows), _rows(inp.kwargs, rows, size)), target.index_select(0, rows)


def lr_factor(step: int, steps: int, warmup_steps: int, decay: str) -> float:
    """The learning-rate multiplier at ``step`` (1-based) of ``steps``: ``step / warmup_steps``
    during the warm-up, then ``decay`` over the rest with progress ``p = (step − warmup_steps − 1)
    / (steps − warmup_steps)`` in ``[0, 1)``: ``"cosine"`` ``(1 + cos πp) / 2``, ``"linear"``
    ``1 − p``, ``"constant"`` 1 (no step has a zero learning rate).

    Example::

        >>> [round(lr_factor(s, 6, 2, "linear"), 3) for s in range(1, 7)]
        [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
    """
    if step <= warmup_steps:
        return step / warmup_steps
    p = (step - warmup_steps - 1) / (steps - warmup_steps)
    if decay == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if decay == "linear":
        return 1.0 - p
    return 1.0


def set_scheduled_lr(optimizer: torch.optim.Optimizer, peaks: Sequence[float], step: int, steps: int,
                     warmup_steps: int, decay: str) -> None:
    """Each param group's learning rate at ``step``: its peak × :func:`lr_factor`."""
    scale = lr_factor(step, steps, warmup_steps, decay)
    for group, peak in zip(optimizer.param_groups, peaks):
        group["lr"] = peak * scale
