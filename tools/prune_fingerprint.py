#!/usr/bin/env python3
"""Fingerprint ``prune_model`` on the tests' tiny Llama: one sha256 per state-dict tensor and of the logits.

Prunes ``make_tiny_llama()`` (tests/conftest.py) with the default ``ArmorConfig()`` (refinement, block
reconstruction and distillation on), with ARMOR's other engine paths (``block_size="budget"``, reconstruction
against the dense model's hidden states, a run directory) and with every baseline config, on a few calibration
windows at one thread; prints one line per tensor. Two trees that print the same lines prune bit-identically::

    OMP_NUM_THREADS=1 PYTHONPATH=. python tools/prune_fingerprint.py > before.txt   # then change, rerun, diff
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conftest import make_tiny_llama  # noqa: E402  (the tests' tiny model, not a copy of it)

from torch_armor.config.armor import ArmorConfig, BcdConfig  # noqa: E402
from torch_armor.config.levers import DistillConfig, ReconstructConfig  # noqa: E402
from torch_armor.config.methods import MagnitudeConfig, NoWagConfig, SparseGPTConfig, WandaConfig  # noqa: E402
from torch_armor.engine.prune import PruneOptions, prune_model  # noqa: E402


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _flat(name: str, value: torch.Tensor):
    """A state-dict entry, an ArmorTensor weight as its inner tensors."""
    if hasattr(type(value), "__tensor_flatten__"):
        inner, _ = value.__tensor_flatten__()
        for key in inner:
            yield from _flat(f"{name}.{key}", getattr(value, key))
    else:
        yield name, value


def fingerprint(label: str, config, **options) -> None:
    model = make_tiny_llama()
    calibration = torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prune_model(model, calibration, config, options=PruneOptions(progress=False, **options))
    with torch.no_grad():
        logits = model(calibration[:2]).logits
    for name, value in model.state_dict().items():
        for key, tensor in _flat(name, value):
            print(f"{label} {key} {tuple(tensor.shape)} {_sha(tensor)}")
    print(f"{label} logits {tuple(logits.shape)} {_sha(logits)}")


def main() -> None:
    torch.set_num_threads(1)
    small = dict(optimizer=BcdConfig(iters=3), distill=DistillConfig(steps=2, held_out=2, eval_every=1))
    fingerprint("armor-default", ArmorConfig())
    fingerprint("armor-budget", ArmorConfig(block_size="budget", max_overhead=0.3, distill=None, optimizer=BcdConfig(iters=3)))
    fingerprint("armor-model-target", ArmorConfig(reconstruct=ReconstructConfig(target="model", steps=4), **small))
    with tempfile.TemporaryDirectory() as run_dir:
        fingerprint("armor-run-dir", ArmorConfig(**small), run_dir=str(Path(run_dir) / "run"))
    fingerprint("armor-one-shot", dataclasses.replace(ArmorConfig(**small), refine=None), sequential=False)
    for config in (MagnitudeConfig(), WandaConfig(), NoWagConfig(), SparseGPTConfig(), WandaConfig(pattern="4:8")):
        fingerprint(type(config).__name__ + "-" + config.pattern, config)


if __name__ == "__main__":
    main()
