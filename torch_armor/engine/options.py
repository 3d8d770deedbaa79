"""How :func:`~torch_armor.engine.prune.prune_model` runs: :class:`PruneOptions`, and the checks
of a device and an output directory (shared with the command line).

Example::

    >>> PruneOptions(out="runs/x", sequential=False).batch_size
    4
    >>> PruneOptions(batch_size=0)
    Traceback (most recent call last):
    ...
    torch_armor.errors.ArmorInputError: batch_size must be a positive integer, got 0
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Sequence, Union

import torch

from torch_armor._io import RUN_DIR_NAME
from torch_armor.calibration.experts import EXPERT_CALIBRATIONS
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import STORAGES
from torch_armor.format.serialization import PICKLE_SUFFIXES

__all__ = ["PruneOptions", "RUN_DIR_NAME", "check_device", "check_out", "out_contents"]

PathLike = Union[str, "os.PathLike[str]"]

def check_device(device: Union[str, torch.device, None], label: str = "device") -> None:
    """Refuse a device this torch cannot run on, before anything is loaded (``label`` names the
    argument in the message, e.g. ``"PruneOptions.device"``)."""
    if device is None:
        return
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError, TypeError) as err:
        raise ArmorInputError(f"{label} {device!r} is not a device ({err}); use cpu, cuda or cuda:N") from None
    if dev.type == "meta":
        raise ArmorInputError(f"{label} meta holds no values, so nothing can be calibrated or evaluated; "
                              "use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArmorInputError(f"{label} {device}: this torch build ({torch.__version__}) sees no CUDA GPU; "
                                  "use cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArmorInputError(f"{label} {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        module = getattr(torch, dev.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ArmorInputError(f"{label} {device}: the {dev.type} backend is not available in this torch; "
                                  "use cpu")


def _optional_dtype(label: str, value: Any) -> None:
    if value is not None and not isinstance(value, torch.dtype):
        raise ArmorInputError(f"PruneOptions.{label} must be a torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class PruneOptions:
    """How :func:`prune_model` runs (not what it computes: that is the method config).

    Args:
        out: save the pruned model there (:func:`torch_armor.save_pretrained` format); needed
            for a checkpoint directory, which is streamed. Must be empty or new unless
            ``overwrite``; pickle weights there are refused. Checked again when the model is
            saved (one writer at a time): if another process wrote there meanwhile, the model
            goes to ``run_dir/pruned`` instead and an error says so.
        overwrite: write into a non-empty ``out``.
        run_dir: keep every finished ARMOR layer and the hidden states at each block boundary
            there; rerunning resumes bit-identically; a directory of another run (other weights,
            calibration or settings) is refused (:class:`~torch_armor.errors.RunMismatchError`).
            Default with ``out``: ``out/armor_run``, removed after a successful save; a given
            ``run_dir`` is kept. Required under ``torchrun`` without ``out``.
        device: where each block is calibrated and pruned (default: CPU, or the model's device).
        dtype: streamed checkpoints only: load the weights in this dtype.
        storage: ARMOR core storage in the model (default ``"dense"`` on CPU, ``"auto"`` on CUDA).
        sequential: calibrate each block on the outputs of the already-pruned blocks before it
            (default, as SparseGPT and llm-compressor do); ``False``: on the dense model's.
        batch_size: calibration windows per forward pass.
        hidden_dtype: dtype the calibration hidden states are kept in (default: the model's).
        hidden_dir: keep the calibration hidden states in files there instead of in memory (one
            per batch; each is read when its batch runs).
        progress: a progress bar over the blocks.
        expert_calibration: mixture-of-experts models: each expert's statistics from the tokens the
            router sends to it (``"routed"``, default) or from every token (``"all"``, llm-compressor's
            ``calibrate_all_experts``; the block's output stays routed). See docs/moe.md.
        min_expert_tokens: an expert routed fewer calibration tokens than this takes the statistics
            of all tokens reaching its block (through its own weights), with a warning naming it.
        log: called with a line of text about resuming and distillation (default: the ``torch_armor`` logger).
        strict: refuse a model with a layer the settings do not fit (block size, pattern); by default
            such a layer gets the largest block size that fits it within ``max_overhead``, or stays
            dense, named in one warning and in ``PruneReport.unfit_layers``.
    """

    out: Optional[PathLike] = None
    overwrite: bool = False
    run_dir: Optional[PathLike] = None
    device: Optional[Union[str, torch.device]] = None
    dtype: Optional[torch.dtype] = None
    storage: Optional[str] = None
    sequential: bool = True
    batch_size: int = 4
    hidden_dtype: Optional[torch.dtype] = None
    hidden_dir: Optional[PathLike] = None
    progress: bool = True
    log: Optional[Callable[[str], None]] = None
    expert_calibration: str = "routed"
    min_expert_tokens: int = 16
    strict: bool = False

    def __post_init__(self) -> None:
        for label in ("out", "run_dir", "hidden_dir"):
            value = getattr(self, label)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ArmorInputError(f"PruneOptions.{label} must be a path or None, got {type(value).__name__}")
            if isinstance(value, str) and not value.strip():  # Path("") is the working directory
                raise ArmorInputError(f"PruneOptions.{label} is an empty path (an unset variable?); give a directory "
                                      "or None")
        for label in ("overwrite", "sequential", "progress", "strict"):
            if not isinstance(getattr(self, label), bool):
                raise ArmorInputError(f"PruneOptions.{label} must be True or False, got {getattr(self, label)!r}")
        check_device(self.device, "PruneOptions.device")
        _optional_dtype("dtype", self.dtype)
        _optional_dtype("hidden_dtype", self.hidden_dtype)
        if self.storage is not None and self.storage not in STORAGES + ("auto",):
            raise ArmorInputError(f"PruneOptions.storage must be one of {STORAGES + ('auto',)} or None, "
                                  f"got {self.storage!r}")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ArmorInputError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if self.expert_calibration not in EXPERT_CALIBRATIONS:
            raise ArmorInputError(f"PruneOptions.expert_calibration must be one of {EXPERT_CALIBRATIONS}, "
                                  f"got {self.expert_calibration!r}")
        if isinstance(self.min_expert_tokens, bool) or not isinstance(self.min_expert_tokens, int) \
                or self.min_expert_tokens < 0:
            raise ArmorInputError(f"PruneOptions.min_expert_tokens must be an integer >= 0, got {self.min_expert_tokens!r}")
        if self.log is not None and not callable(self.log):
            raise ArmorInputError("PruneOptions.log must be a callable taking one line of text")


def out_contents(out: Path, allowed: Sequence[str] = ()) -> List[Path]:
    """What ``out`` holds besides the ``allowed`` names (nothing when it does not exist)."""
    return sorted(p for p in out.iterdir() if p.name not in allowed) if out.is_dir() else []


def check_out(out: Path, overwrite: bool, allowed: Sequence[str] = ()) -> None:
    """``out`` must be a new or empty directory (``allowed`` entries and ``overwrite`` aside) and
    hold no pickle weights a checkpoint cannot sit beside."""
    if out.exists() and not out.is_dir():
        raise ArmorInputError(f"out={out} exists and is not a directory")
    leftovers = out_contents(out, allowed)
    if leftovers and not overwrite:
        raise ArmorInputError(f"out={out} is not empty; pass overwrite=True to write into it")
    pickles = sorted(p.name for p in leftovers if p.is_file() and p.suffix.lower() in PICKLE_SUFFIXES)
    if pickles:
        raise ArmorInputError(f"out={out} holds pickle weights {pickles} that a torch_armor checkpoint cannot sit "
                              "beside (the loader refuses the directory); remove them, or give another directory as out=")
