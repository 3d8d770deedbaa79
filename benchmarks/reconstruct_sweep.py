"""Choosing ARMOR's settings without looking at the evaluation text: perplexity on held-out
*calibration* windows (sotu text that no calibration window touches), and optionally Wikipedia.

The quality protocol's model and calibration (SmolLM2-135M, 2:4, 64 random 512-token sotu windows,
seed 0; pruned sequentially through ``prune_model``). Held-out windows: consecutive non-overlapping
``seq_len`` windows of the sotu tokens, in order, skipping every window that shares a token with
a calibration window. Each setting prunes from the dense weights; the table gives held-out
calibration perplexity (the column settings are chosen on), Wikipedia perplexity when
``--wiki`` (the first ``--n-eval`` non-overlapping windows, as ``benchmarks/quality.py``), prune
wall time and this process's CPU time during the prune (others share the machine: wall under
load overstates the cost alone).

Settings (``--settings``): the presets (``fast``, ``default``, ``max``: :mod:`torch_armor.config.presets`)
and the named changes of :data:`SETTINGS` (``steps32`` … : changes of :data:`SETTINGS_BASE`, the
block pass they were measured on).

Run:  python benchmarks/reconstruct_sweep.py --settings default steps32 --threads 1
      python benchmarks/reconstruct_sweep.py --settings default --wiki --threads 1     # the chosen setting
      python benchmarks/reconstruct_sweep.py --settings steps8 steps32 --layers 0-5 --n-heldout 8  # quick look
      python benchmarks/reconstruct_sweep.py --settings steps8 steps128 --wiki --device cuda  # on a GPU

``--json FILE`` is rewritten after every setting, so an interrupted sweep keeps its finished rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_armor import ArmorConfig, PruneOptions, prune_model  # noqa: E402
from torch_armor.config.armor import BcdConfig, DistillConfig, ReconstructConfig, RefineConfig  # noqa: E402
from torch_armor.config.levers import DEFAULT_RECONSTRUCT, DEFAULT_REFINE  # noqa: E402
from torch_armor.config.presets import PRESETS  # noqa: E402
from torch_armor.engine.options import check_device  # noqa: E402
from torch_armor.recipes.data import calibration_windows, eval_windows, load_text, tokenize_text  # noqa: E402
from torch_armor.recipes.evaluate import perplexity  # noqa: E402
from torch_armor.calibration.selection import select_layers  # noqa: E402
from torch_armor.recipes.models import load_model  # noqa: E402
from torch_armor.recipes.quality import _materialize  # noqa: E402

_R = ReconstructConfig()  # 32 steps of one window: the default's block pass before it moved to 64
#: The ``max`` preset the ``max-…`` settings change (measured as it was before it moved to single-window steps).
PREVIOUS_MAX = {"optimizer": BcdConfig(iters=30), "refine": RefineConfig(rounds=3, core_steps=16),
               "reconstruct": ReconstructConfig(steps=64, micro_batch=None), "distill": DistillConfig(steps=48, lr=2e-3)}
#: What :data:`SETTINGS` change: ``ArmorConfig()`` with the block pass they were measured with (3 refinement
#: rounds and 32 reconstruction steps, the default's until it moved to one round and 64 steps), so that each
#: named setting keeps meaning what its rows measured.
SETTINGS_BASE = dataclasses.replace(ArmorConfig(), refine=RefineConfig(), reconstruct=_R)
#: Today's default's levers, for the settings that switch one of them on or off.
_ON = {"refine": DEFAULT_REFINE, "reconstruct": DEFAULT_RECONSTRUCT, "distill": ArmorConfig().distill}
#: Named settings: :data:`SETTINGS_BASE` with these changes (reconstruction fields replace the default's).
#: The reconstruction settings run without end-to-end distillation (as they were first measured, before it
#: was on by default), so that each row shows reconstruction alone; on today's defaults (20 sweeps, steps of
#: one window: the first table of docs/results.md was measured with 30 sweeps and 4-window steps).
SETTINGS = {
    "no-reconstruct": {"reconstruct": None, "distill": None},
    # the default before one refinement round and 64 steps (its rows ran as --settings default then)
    "previous-default": {},
    "steps8": {"reconstruct": dataclasses.replace(_R, steps=8), "distill": None},
    "steps32": {"reconstruct": dataclasses.replace(_R, steps=32), "distill": None},
    "steps128": {"reconstruct": dataclasses.replace(_R, steps=128), "distill": None},
    "steps512": {"reconstruct": dataclasses.replace(_R, steps=512), "distill": None},
    "steps32-mb4": {"reconstruct": dataclasses.replace(_R, steps=32, micro_batch=4), "distill": None},
    "steps128-mb1": {"reconstruct": dataclasses.replace(_R, steps=128, micro_batch=1), "distill": None},
    "no-schedule": {"reconstruct": dataclasses.replace(_R, warmup=0.0, decay="constant"), "distill": None},
    "split-stages": {"reconstruct": dataclasses.replace(_R, split_stages=True), "distill": None},
    # the default's 32 single-window steps at other peak learning rates (5e-3 overshoots after a short warm-up)
    "steps32-lr2e-3": {"reconstruct": dataclasses.replace(_R, lr=2e-3), "distill": None},
    "steps32-lr1e-2": {"reconstruct": dataclasses.replace(_R, lr=1e-2), "distill": None},
    "steps32-lr2e-3-warmup25": {"reconstruct": dataclasses.replace(_R, lr=2e-3, warmup=0.25), "distill": None},
    # the factorization's time moved into reconstruction steps (about the default's cost)
    "refine1-steps64": {"refine": RefineConfig(rounds=1), "reconstruct": dataclasses.replace(_R, steps=64),
                        "distill": None},
    "bcd10-steps48": {"optimizer": BcdConfig(iters=10), "reconstruct": dataclasses.replace(_R, steps=48),
                      "distill": None},
    # the better of the two above with the default's distillation: a candidate default
    "default-refine1-steps64": {"refine": RefineConfig(rounds=1), "reconstruct": dataclasses.replace(_R, steps=64)},
    "refine1": {"refine": RefineConfig(rounds=1), "distill": None},
    # today's default with fewer sweeps, and with fewer sweeps for more reconstruction steps: candidates
    # for a cheaper default (neither better on held-out text: docs/results.md)
    "default-bcd16": {"optimizer": BcdConfig(iters=16), "refine": RefineConfig(rounds=1),
                      "reconstruct": ReconstructConfig(steps=64)},
    "default-bcd12-steps80": {"optimizer": BcdConfig(iters=12), "refine": RefineConfig(rounds=1),
                              "reconstruct": ReconstructConfig(steps=80)},
    # the default of that time (3 rounds, 32 steps) with refinement off (distillation stays on)
    "no-refine": {"refine": None},
    # the reconstruction's time (about 150 s of the default's 899 s alone) spent on distillation instead
    "no-reconstruct-distill28": {"reconstruct": None,
                                 "distill": DistillConfig(steps=28, lr=2e-3)},
    # candidates for a default within 15 minutes: 20 bcd sweeps and a quarter of the reconstruction's windows
    # (32 steps on 1 window, or 16 on 2), distillation as in the default
    "bcd20-mb1": {"optimizer": BcdConfig(iters=20), "reconstruct": dataclasses.replace(_R, micro_batch=1),
                  "distill": DistillConfig(lr=2e-3)},
    "bcd20-steps16-mb2": {"optimizer": BcdConfig(iters=20),
                          "reconstruct": dataclasses.replace(_R, steps=16, micro_batch=2),
                          "distill": DistillConfig(lr=2e-3)},
    # candidates for the max preset: its reconstruction run four times longer (16 epochs of 4-window steps)
    "max-rec256": {**PREVIOUS_MAX, "reconstruct": ReconstructConfig(steps=256, micro_batch=None)},
    "max-rec256-distill96": {**PREVIOUS_MAX, "reconstruct": ReconstructConfig(steps=256, micro_batch=None),
                             "distill": DistillConfig(steps=96, lr=1e-3, warmup=0.05, decay="cosine", eval_every=8)},
    # max's reconstruction on single windows: the same windows-worth of work in 256 steps, or twice it in 512
    "max-mb1-256": {**PREVIOUS_MAX, "reconstruct": ReconstructConfig(steps=256)},
    "max-mb1-512": {**PREVIOUS_MAX, "reconstruct": ReconstructConfig(steps=512)},
    # and the factorization's time moved into reconstruction steps, as for the default
    "max-bcd20-refine1-mb1-512": {**PREVIOUS_MAX, "optimizer": BcdConfig(iters=20),
                                  "refine": RefineConfig(rounds=1, core_steps=16),
                                  "reconstruct": ReconstructConfig(steps=512)},
    "previous-max": PREVIOUS_MAX,
    # the ablation of today's default: each lever off alone, and on alone from the paper's proxy (20 sweeps)
    "default-no-refine": {**_ON, "refine": None},
    "default-no-reconstruct": {**_ON, "reconstruct": None},
    "default-no-distill": {**_ON, "distill": None},
    "proxy-only": {"refine": None, "reconstruct": None, "distill": None},
    "proxy+refine": {"refine": _ON["refine"], "reconstruct": None, "distill": None},
    "proxy+reconstruct": {"refine": None, "reconstruct": _ON["reconstruct"], "distill": None},
    "proxy+distill": {"refine": None, "reconstruct": None, "distill": _ON["distill"]},
    # today's default with the kept core values trained by distillation too (DistillConfig(train_core=True))
    "default-distill-core": {**_ON, "distill": dataclasses.replace(_ON["distill"], train_core=True)},
    # each block fitted to the dense model's hidden states (ReconstructConfig(target="model"))
    "default-target-model": {**_ON, "reconstruct": dataclasses.replace(_ON["reconstruct"], target="model")},
    "default-no-distill-target-model": {**_ON, "reconstruct": dataclasses.replace(_ON["reconstruct"], target="model"),
                                        "distill": None},
    # the fast preset as it was before its reconstruction moved to target="model" (its rows ran as --settings fast)
    "fast-target-block": {**PRESETS["fast"],
                          "reconstruct": dataclasses.replace(PRESETS["fast"]["reconstruct"], target="block")},
    "fast-target-model": {**PRESETS["fast"],
                          "reconstruct": dataclasses.replace(PRESETS["fast"]["reconstruct"], target="model")},
    # max before its distillation took sampled windows (48 plain steps), fitted to the dense model's hidden states
    "max-target-model": {**PRESETS["max"], "distill": PREVIOUS_MAX["distill"],
                         "reconstruct": dataclasses.replace(PRESETS["max"]["reconstruct"], target="model")},
    # max with its sampled windows calibrating the block pass too (DistillConfig(sampled_in_block_pass=True))
    "max-sampled-block-pass": {**PRESETS["max"], "distill": dataclasses.replace(PRESETS["max"]["distill"],
                                                                                sampled_in_block_pass=True)},
}


def heldout_windows(ids: torch.Tensor, calib_starts: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """The first ``count`` non-overlapping windows of ``ids`` that share no token with a calibration window."""
    covered = torch.zeros(ids.numel(), dtype=torch.bool)
    for s in calib_starts.tolist():
        covered[s:s + seq_len] = True
    rows = [ids[k * seq_len:(k + 1) * seq_len] for k in range(ids.numel() // seq_len)
            if not covered[k * seq_len:(k + 1) * seq_len].any()]
    if len(rows) < count:
        raise SystemExit(f"only {len(rows)} held-out calibration windows of {seq_len} tokens exist; ask for fewer")
    return torch.stack(rows[:count])


def add_protocol_arguments(parser: argparse.ArgumentParser) -> None:
    """The protocol's data, threads and output options (read by :func:`protocol_data` and :func:`start`)."""
    parser.add_argument("--n-calib", type=int, default=64)
    parser.add_argument("--n-heldout", type=int, default=16, help="held-out calibration windows")
    parser.add_argument("--wiki", action="store_true", help="also Wikipedia perplexity (the reported number)")
    parser.add_argument("--n-eval", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="where the model is pruned and evaluated (cpu, cuda)")
    parser.add_argument("--json", default=None)


def start(script: str, args: argparse.Namespace, argv) -> str:
    """Set the thread count, print the command line and the machine; returns the command line."""
    if args.threads:
        torch.set_num_threads(args.threads)
    command = f"python benchmarks/{script} " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(command)
    check_device(args.device, "--device")
    gpu = (f", {torch.cuda.get_device_name(args.device)}, CUDA {torch.version.cuda}"
           if torch.device(args.device).type == "cuda" else "")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {os.getloadavg()[0]:.1f}{gpu}", flush=True)
    return command


def protocol_data(args: argparse.Namespace):
    """``(model, calibration, held-out calibration, Wikipedia or None)`` windows of the quality protocol
    (``args``: ``n_calib``, ``n_heldout``, ``seq_len``, ``wiki``, ``n_eval``)."""
    net, tokenizer = load_model("smollm2")
    ids = tokenize_text(load_text("sotu"), tokenizer)
    starts = torch.randint(0, ids.numel() - args.seq_len + 1, (args.n_calib,), generator=torch.Generator().manual_seed(0))
    calib = calibration_windows(ids, None, n_windows=args.n_calib, seq_len=args.seq_len, seed=0)
    assert torch.equal(calib, ids[starts[:, None] + torch.arange(args.seq_len)])
    heldout = heldout_windows(ids, starts, args.seq_len, args.n_heldout)
    wiki = eval_windows("wiki", tokenizer, n_windows=args.n_eval, seq_len=args.seq_len) if args.wiki else None
    return net.to(args.device), calib, heldout, wiki


def config_of(name: str) -> ArmorConfig:
    return ArmorConfig.preset(name) if name in PRESETS else dataclasses.replace(SETTINGS_BASE, **SETTINGS[name])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=(*PRESETS, *SETTINGS), default=["default"])
    parser.add_argument("--layers", default=None, help="restrict pruning to some decoder layers (quick looks only)")
    add_protocol_arguments(parser)
    args = parser.parse_args(argv)
    command = start("reconstruct_sweep.py", args, argv)

    net, calib, heldout, wiki = protocol_data(args)
    names = select_layers(net, args.layers)
    dense = {n: net.get_submodule(n).weight for n in names}

    rows = []
    base = {"setting": "dense", "heldout_ppl": perplexity(net, heldout, batch_size=8, progress=False),
            "wiki_ppl": perplexity(net, wiki, batch_size=8, progress=False) if wiki is not None else None,
            "prune_s": 0.0, "prune_cpu_s": 0.0}
    rows.append(base)
    print(f"dense: held-out calibration ppl {base['heldout_ppl']:.3f}", flush=True)
    for name in args.settings:
        for n, w in dense.items():
            net.get_submodule(n).weight = w
        cfg = config_of(name)
        wall, cpu = time.perf_counter(), time.process_time()
        report = prune_model(net, calib, cfg, layers=names, options=PruneOptions(batch_size=4, progress=False))
        if torch.device(args.device).type == "cuda":
            torch.cuda.synchronize(args.device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        _materialize(net, names)  # W_hat written into each linear, as benchmarks/quality.py evaluates ARMOR
        row = {"setting": name, "config": str(cfg),
               "heldout_ppl": perplexity(net, heldout, batch_size=8, progress=False),
               "wiki_ppl": perplexity(net, wiki, batch_size=8, progress=False) if wiki is not None else None,
               "prune_s": wall, "prune_cpu_s": cpu, "overhead": report.overhead,
               "reconstruction": next((line for line in report.stage_lines() if line.startswith("block recon")), None),
               "block_curves": {str(k): v for k, v in report.stages.get("reconstruction", {}).get("curves", {}).items()}}
        rows.append(row)
        print(f"{name}: held-out calibration ppl {row['heldout_ppl']:.3f}"
              + (f", wiki ppl {row['wiki_ppl']:.3f}" if wiki is not None else "")
              + f", prune {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU; {row['reconstruction']}", flush=True)
        save_rows(args, command, rows)
    for n, w in dense.items():
        net.get_submodule(n).weight = w

    print()
    print(f"SmolLM2-135M, 2:4, {len(names)} linears, calibration sotu {args.n_calib}×{args.seq_len} (seed 0), "
          f"held-out sotu {args.n_heldout}×{args.seq_len}" + (f", wiki {args.n_eval}×{args.seq_len}" if args.wiki else ""))
    print()
    print("| setting | held-out calib ppl | Wikipedia ppl | prune wall (min) | prune CPU (min) |")
    print("|---|---|---|---|---|")
    for r in rows:
        wiki_s = f"{r['wiki_ppl']:.2f}" if r["wiki_ppl"] is not None else "–"
        print(f"| {r['setting']} | {r['heldout_ppl']:.2f} | {wiki_s} | {r['prune_s'] / 60:.1f} | {r['prune_cpu_s'] / 60:.1f} |")
    save_rows(args, command, rows)
    return 0


def save_rows(args: argparse.Namespace, command: str, rows) -> None:
    """Write ``rows`` to ``--json`` (if given), replacing the file's previous rows."""
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2, default=str))


if __name__ == "__main__":
    sys.exit(main())
