"""End-to-end distillation settings compared from one block pass: prune once without distillation,
then distill a copy per setting and measure held-out calibration perplexity (the column settings
are chosen on) and, with ``--wiki``, Wikipedia perplexity.

The quality protocol's model and calibration (SmolLM2-135M, 2:4, all linears, 64 random 512-token
sotu windows, seed 0) and the held-out sotu windows of ``benchmarks/reconstruct_sweep.py``. The
block pass is ``--base``'s preset with distillation off (with ``--reconstruct-steps N``, N block
reconstruction steps; the block pass of ``--base max`` has no sampled windows, which come with
its distillation); every setting starts from the same pruned weights, so rows differ by
distillation alone. Times: wall and this process's CPU per setting
(teacher, sampling and training).

Run:  python benchmarks/distill_sweep.py --settings max-48 sampled64 --wiki --threads 1

``--base-cache FILE`` saves the block pass to FILE (or loads it when FILE exists and was made with the
same ``--base`` and calibration), so that several processes can compare settings from one block pass.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from reconstruct_sweep import PREVIOUS_MAX, add_protocol_arguments, protocol_data, start  # noqa: E402
from torch_armor import ArmorConfig, PruneOptions, prune_model  # noqa: E402
from torch_armor.config.levers import DistillConfig  # noqa: E402
from torch_armor.config.presets import PRESETS  # noqa: E402
from torch_armor.armor.distill import Distillation  # noqa: E402
from torch_armor.armor.reconstruct_data import split_windows  # noqa: E402
from torch_armor.recipes.evaluate import perplexity  # noqa: E402
from torch_armor.calibration.selection import select_layers  # noqa: E402
from torch_armor.recipes.quality import _materialize  # noqa: E402

#: max's distillation before it took sampled windows: 48 steps at 2e-3 (``max-48``)
_MAX = PREVIOUS_MAX["distill"]
#: the previous default's distillation: 16 float32 steps at 2e-3, checks every 4
_PREVIOUS = DistillConfig(steps=16, lr=2e-3, eval_every=4, bf16_steps=False)
#: Named distillation settings (``none``: the block pass alone).
SETTINGS = {
    "none": None,
    "default-16": _PREVIOUS,
    "max-48": _MAX,
    "max-48-core": dataclasses.replace(_MAX, train_core=True),
    "max-48-lr5e-4": dataclasses.replace(_MAX, lr=5e-4),
    "max-48-lr1e-3": dataclasses.replace(_MAX, lr=1e-3),
    "max-48-recon-held": _MAX,
    "sampled64": dataclasses.replace(_MAX, sampled_windows=64),
    "sampled64-96": dataclasses.replace(_MAX, steps=96, sampled_windows=64),
    "sampled128-128": dataclasses.replace(_MAX, steps=128, sampled_windows=128, warmup=0.05, decay="cosine",
                                          eval_every=8),
    # sampled windows that continue a training window's first 64 / 128 tokens
    "sampled64-96-prompt64": dataclasses.replace(_MAX, steps=96, sampled_windows=64, sample_prompt_tokens=64),  # max's
    "sampled64-96-prompt128": dataclasses.replace(_MAX, steps=96, sampled_windows=64, sample_prompt_tokens=128),
    "sampled128-128-prompt64": dataclasses.replace(_MAX, steps=128, sampled_windows=128, sample_prompt_tokens=64,
                                                   warmup=0.05, decay="cosine", eval_every=8),
    "default-sampled32": dataclasses.replace(_PREVIOUS, sampled_windows=32),
    # the default's cost (32 window passes), other step sizes and schedules
    "default-core": dataclasses.replace(_PREVIOUS, train_core=True),
    "default-lr1e-3": dataclasses.replace(_PREVIOUS, lr=1e-3),  # today's DistillConfig()
    "default-lr4e-3": dataclasses.replace(_PREVIOUS, lr=4e-3),
    "w1-32": dataclasses.replace(_PREVIOUS, steps=32, windows_per_step=1, eval_every=8),
    "w1-32-cosine-lr4e-3": dataclasses.replace(_PREVIOUS, steps=32, windows_per_step=1, eval_every=8, lr=4e-3,
                                               warmup=0.1, decay="cosine"),
    # bfloat16 training steps: more steps in about the default's time
    "bf16-24": DistillConfig(steps=24, lr=2e-3, eval_every=6, bf16_steps=True),
    "bf16-24-lr1e-3": DistillConfig(steps=24, eval_every=6, lr=1e-3, bf16_steps=True),
    "bf16-20": DistillConfig(steps=20, lr=2e-3, eval_every=10, bf16_steps=True),
    "bf16-20-lr1e-3": DistillConfig(steps=20, eval_every=10, lr=1e-3, bf16_steps=True),
}
#: settings that hold out block reconstruction's held-out windows (not the last calibration windows,
#: which reconstruction trained on): the calibration windows reordered so that they come last
RECONSTRUCTION_HELD_OUT = {"max-48-recon-held"}
BATCH_SIZE = 4  # the block pass's PruneOptions(batch_size=...)


def reconstruction_held_out(n_windows: int, config: ArmorConfig) -> list:
    """Indices of the calibration windows block reconstruction held out in the block pass."""
    sizes = [min(BATCH_SIZE, n_windows - i) for i in range(0, n_windows, BATCH_SIZE)]
    held, _ = split_windows(sizes, config.reconstruct.held_out, config.reconstruct.micro_batch, config.seed)
    return [unit.batch * BATCH_SIZE + r for unit in held for r in unit.rows]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", choices=tuple(SETTINGS), default=["max-48", "sampled64"])
    parser.add_argument("--base", choices=tuple(PRESETS), default="default",
                        help="the preset of the block pass (distillation off)")
    parser.add_argument("--reconstruct-steps", type=int, default=None,
                        help="the block pass's reconstruction steps (default: --base's)")
    parser.add_argument("--base-cache", default=None, help="file to save the block pass to, or load it from")
    parser.add_argument("--distill-threads", type=int, default=None,
                        help="threads for the settings after the block pass (default: --threads)")
    add_protocol_arguments(parser)
    args = parser.parse_args(argv)
    command = start("distill_sweep.py", args, argv)

    dense, calib, heldout, wiki = protocol_data(args)
    names = select_layers(dense, None)
    base_cfg = dataclasses.replace(ArmorConfig.preset(args.base), distill=None)
    if args.reconstruct_steps:
        base_cfg = dataclasses.replace(base_cfg, reconstruct=dataclasses.replace(base_cfg.reconstruct,
                                                                               steps=args.reconstruct_steps))

    def measure(model):
        return (perplexity(model, heldout, batch_size=8, progress=False),
                perplexity(model, wiki, batch_size=8, progress=False) if wiki is not None else None)

    made_with = {"base": args.base, "n_calib": args.n_calib, "seq_len": args.seq_len}
    if args.reconstruct_steps:
        made_with["reconstruct_steps"] = args.reconstruct_steps
    cache = Path(args.base_cache) if args.base_cache else None
    if cache is not None and cache.exists():
        saved = torch.load(cache, weights_only=False)
        if saved["made_with"] != made_with:
            raise SystemExit(f"{cache} holds a block pass made with {saved['made_with']}, not {made_with}: "
                             "remove it or pass another --base-cache")
        pruned = saved["model"]
        print(f"block pass ({args.base}, no distillation) loaded from {cache}", flush=True)
    else:
        pruned = copy.deepcopy(dense)
        wall = time.perf_counter()
        prune_model(pruned, calib, base_cfg, layers=names, options=PruneOptions(batch_size=BATCH_SIZE, progress=False))
        print(f"block pass ({args.base}, no distillation): {(time.perf_counter() - wall) / 60:.1f} min wall",
              flush=True)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"made_with": made_with, "model": pruned}, cache.with_suffix(".tmp"))
            cache.with_suffix(".tmp").replace(cache)

    if args.distill_threads:
        torch.set_num_threads(args.distill_threads)
    rows = []
    for name in args.settings:
        cfg = SETTINGS[name]
        model = copy.deepcopy(pruned)
        wall, cpu = time.perf_counter(), time.process_time()
        summary = {}
        if cfg is not None:
            windows = calib
            if name in RECONSTRUCTION_HELD_OUT:
                held = reconstruction_held_out(calib.shape[0], base_cfg)
                windows = calib[[j for j in range(calib.shape[0]) if j not in held] + held[-cfg.held_out:]]
                print(f"{name}: held out calibration windows {held[-cfg.held_out:]} (block reconstruction's)", flush=True)
            distillation = Distillation(cfg, [windows], seed=base_cfg.seed)
            distillation.capture(dense)
            summary = distillation.run(model)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        _materialize(model, names)
        held, wik = measure(model)
        row = {"setting": name, "config": str(cfg), "heldout_ppl": held, "wiki_ppl": wik, "wall_s": wall,
               "cpu_s": cpu, "held_out_kl": [summary.get("before"), summary.get("after")],
               "best_step": summary.get("best_step"), "curve": summary.get("curve")}
        rows.append(row)
        print(f"{name}: held-out calibration ppl {held:.3f}" + (f", wiki ppl {wik:.3f}" if wik is not None else "")
              + f", held-out KL {row['held_out_kl']}, {wall / 60:.1f} min wall, {cpu / 60:.1f} min CPU", flush=True)
        del model

    print()
    print(f"SmolLM2-135M, 2:4, {len(names)} linears, block pass `{args.base}` without distillation, calibration sotu "
          f"{args.n_calib}×{args.seq_len} (seed 0), held-out sotu {args.n_heldout}×{args.seq_len}"
          + (f", wiki {args.n_eval}×{args.seq_len}" if args.wiki else ""))
    print()
    print("| distillation | held-out KL before → kept | held-out calib ppl | Wikipedia ppl | wall (min) | CPU (min) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        kl = "–" if r["held_out_kl"][0] is None else f"{r['held_out_kl'][0]:.3f} → {r['held_out_kl'][1]:.3f}"
        wiki_s = f"{r['wiki_ppl']:.2f}" if r["wiki_ppl"] is not None else "–"
        print(f"| {r['setting']} | {kl} | {r['heldout_ppl']:.2f} | {wiki_s} | {r['wall_s'] / 60:.1f} | "
              f"{r['cpu_s'] / 60:.1f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
