"""How long the demo takes here: the recorded demo run's work, measured in forward passes.

The work of each row (pruning, evaluation) is taken from a recorded run of the demo
(:data:`~torch_armor.recipes.demo_record.DEMO_RECORD`, written by ``benchmarks/demo_time.py``): the
row's CPU time in units of the CPU time of one forward pass of the dense model over one window, timed
in the same process at its start (CPU time, so that other jobs on the recording machine do not inflate
the work). The demo times the same forward pass here after loading the model (:func:`forward_seconds`,
a few seconds): the first estimate is the recorded work at the wall-clock speed of this machine under
its present load. As rows finish, :class:`DemoClock` rescales what is left by how the finished rows
compared with their estimate.

Example::

    >>> clock = DemoClock({"dense": (0.0, 16.0), "armor": (600.0, 16.0)}, forward_s=0.5)
    >>> clock.left_s()
    316.0
    >>> clock.finished("dense", 16.0)       # the dense row took twice its estimate: so will the rest
    >>> clock.left_s()
    616.0
"""

from __future__ import annotations

import time
from typing import Dict, Mapping, Sequence, Tuple

import torch
from torch import nn

from torch_armor.recipes.demo_record import DEMO_RECORD

__all__ = ["forward_seconds", "row_work", "DemoClock"]


def forward_seconds(model: nn.Module, windows: torch.Tensor, repeats: int = 4) -> Tuple[float, float]:
    """Wall-clock and CPU seconds (this process, all threads) of one forward pass of ``model`` over one
    window, called as the evaluation calls it (no KV cache): the fastest of ``repeats`` timed passes over
    the first two ``windows`` (after one untimed pass), divided by their number.

    The fastest pass, not the median: a pass is only ever slowed down (by another job, a page fault, a
    frequency step), so the minimum is the steadiest unit; the record is made with the same unit."""
    batch = windows[:2]
    config = getattr(model, "config", None)
    kwargs = {"use_cache": False} if getattr(config, "use_cache", None) is not None else {}
    was_training = model.training
    model.eval()
    passes = []
    try:
        with torch.no_grad():
            for k in range(repeats + 1):
                start, start_cpu = time.perf_counter(), time.process_time()
                model(batch, **kwargs)
                if k:
                    passes.append((time.perf_counter() - start, time.process_time() - start_cpu))
    finally:
        model.train(was_training)
    return min(w for w, _ in passes) / batch.shape[0], min(c for _, c in passes) / batch.shape[0]


def row_work(method: str, *, n_calib: int, n_eval: int, seq_len: int,
             record: Mapping = DEMO_RECORD) -> Tuple[float, float]:
    """The work of ``method``'s row in forward passes over one window: ``(prune, eval)``, from the
    recorded row's CPU time (split between pruning and evaluation as its wall time was), scaled
    linearly to ``n_calib`` calibration and ``n_eval`` evaluation windows of ``seq_len`` tokens (exact
    for the settings recorded; a rough guide for others)."""
    settings = record["settings"]
    row = record["rows"][method]
    units = row["cpu_s"] / record["forward_cpu_s"] / ((row["prune_s"] + row["eval_s"]) or 1.0)
    tokens = seq_len / settings["seq_len"]
    prune = units * row["prune_s"] * n_calib / settings["n_calib"] * tokens
    evaluate = units * row["eval_s"] * n_eval / settings["n_eval"] * tokens
    return prune, evaluate


def matches_record(methods: Sequence[str], *, n_calib: int, n_eval: int, seq_len: int,
                   armor_config: str, record: Mapping = DEMO_RECORD) -> bool:
    """Whether the demo's settings are the recorded run's (then the estimate's work is measured, not scaled)."""
    settings = record["settings"]
    return (set(methods) <= set(record["rows"]) and n_calib == settings["n_calib"] and n_eval == settings["n_eval"]
            and seq_len == settings["seq_len"] and armor_config == settings["armor"])


class DemoClock:
    """The time left for the rows still to run.

    Args:
        work: per row still to run, ``(prune, eval)`` in forward passes over one window (:func:`row_work`).
        forward_s: seconds of one such forward pass here (:func:`forward_seconds`).
    """

    def __init__(self, work: Mapping[str, Tuple[float, float]], forward_s: float) -> None:
        self.work: Dict[str, float] = {name: (prune + evaluate) * forward_s for name, (prune, evaluate) in work.items()}
        self.done: Dict[str, float] = {}

    def finished(self, name: str, seconds: float) -> None:
        """Row ``name`` took ``seconds``."""
        self.done[name] = seconds

    def speed(self) -> float:
        """How many times longer the finished rows took than estimated (1 before any finished)."""
        estimated = sum(self.work[n] for n in self.done if n in self.work)
        return sum(self.done[n] for n in self.done if n in self.work) / estimated if estimated > 0 else 1.0

    def left_s(self) -> float:
        """Seconds the rows not yet finished should take."""
        return self.speed() * sum(s for n, s in self.work.items() if n not in self.done)
