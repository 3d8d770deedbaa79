"""Quality table of the README: SmolLM2-135M under the quality protocol (docs: /work/shared/DESIGN.md).

Dense, magnitude, Wanda, SparseGPT, NoWag-P and one ARMOR row per (block size × time budget)
— every method prunes the 210 decoder linears through ``prune_model``, block by block, from the
same calibration windows (sotu, 64 random 512-token windows, seed 0): sequentially (each block
calibrated on the outputs of the already-pruned blocks) and, for the methods named by
``--one-shot`` (default SparseGPT and ARMOR), also one-shot (every block on the dense model's
hidden states); evaluated on the first 64 non-overlapping 512-token windows of the Wikipedia text. Prints the command line, the settings, the table
(perplexity, gap closed vs NoWag-P, wrapper overhead, mean relative proxy loss, prune and eval
wall time) and the phase timings.

Run:  python benchmarks/quality.py                                  # default ArmorConfig() (d_b=16, 20 bcd sweeps, output refine, …)
      python benchmarks/quality.py --methods armor --variants default budget+refine --one-shot --threads 1
                                                                    # issue #12's ARMOR rows (VARIANTS below)
      python benchmarks/quality.py --armor-blocks 16 32 --budgets 2.5 10
      python benchmarks/quality.py --methods dense nowag armor --layers 0-3 --n-eval 8   # quick look
      python benchmarks/quality.py --json benchmarks/out/quality.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch_armor import ArmorConfig  # noqa: E402
from torch_armor.config.armor import DistillConfig, ReconstructConfig, RefineConfig  # noqa: E402
from torch_armor.config.levers import OPTIMIZERS  # noqa: E402
from torch_armor.config.presets import PRESETS  # noqa: E402
from torch_armor.recipes.quality import DEMO_METHODS, run_quality  # noqa: E402
from reconstruct_sweep import PREVIOUS_MAX  # noqa: E402

DEFAULT = ArmorConfig()
#: Named ARMOR rows for the ablation (``--variants``): each is ``ArmorConfig()`` with these changes.
VARIANTS = {
    "default": {},                                                # refine + block reconstruction, block 16
    "proxy-only": {"block_size": 16, "refine": None, "reconstruct": None, "distill": None},   # issue #11's default
    "refine": {"block_size": 16, "refine": RefineConfig(), "reconstruct": None, "distill": None},   # + output-space refinement
    "refine+reconstruct": {"block_size": 16, "refine": RefineConfig(), "reconstruct": ReconstructConfig(steps=8),
                           "distill": None},
    # end-to-end distillation of the wrappers (A, B) after the block pass: the default since it was measured
    "default+distill": {"distill": DistillConfig(steps=16, lr=2e-3)},
    "fast": dict(PRESETS["fast"]),
    "max": dict(PRESETS["max"]),
    # the max preset before its reconstruction moved to 512 single-window steps (its rows in docs/results.md)
    "max-previous": dict(PREVIOUS_MAX),
    # the max preset's candidates: 128 distillation steps with warm-up and cosine decay, wrappers only or + cores
    "max-distill128": {"refine": RefineConfig(core_steps=16), "reconstruct": ReconstructConfig(steps=64),
                       "distill": DistillConfig(steps=128, lr=2e-3, warmup=0.05, decay="cosine", eval_every=8)},
    "max-distill128-core": {"refine": RefineConfig(core_steps=16), "reconstruct": ReconstructConfig(steps=64),
                            "distill": DistillConfig(steps=128, lr=2e-3, warmup=0.05, decay="cosine", eval_every=8,
                                                     train_core=True)},
    # one lever off alone from the default, and each lever on alone on top of the paper's proxy (proxy-only)
    "default-no-distill": {"distill": None},
    "default-no-reconstruct": {"reconstruct": None},
    "default-no-refine": {"refine": None},
    "proxy+reconstruct": {"refine": None, "distill": None},     # the default's reconstruction alone
    "proxy+distill": {"refine": None, "reconstruct": None},
    "default+distill-core": {"distill": DistillConfig(train_core=True, lr=2e-3)},
    "budget+refine": {"block_size": "budget", "refine": RefineConfig(), "reconstruct": None, "distill": None},  # one model-wide budget
    # the default + full-H sparse-core steps after refinement (the mask moves under XᵀX)
    "default+core-steps": {"refine": RefineConfig(core_steps=16)},
    # by hand, the opposite of what the budget's knapsack chose: attention at 8, down_proj at 32 (4.69%)
    "mlp-heavy+refine": {"block_size": 16, "refine": RefineConfig(), "reconstruct": None, "distill": None,
                         "block_sizes": {"*.self_attn.*": 8, "*.mlp.down_proj": 32}},
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=DEMO_METHODS, default=list(DEMO_METHODS))
    parser.add_argument("--armor-blocks", nargs="+", type=int, default=[DEFAULT.block_size],
                        help="one ARMOR row per block size (× per budget)")
    parser.add_argument("--budgets", nargs="+", type=float, default=[DEFAULT.optimizer.time_budget_s or 0],
                        help="ARMOR time budgets in seconds per layer (0 = no budget)")
    parser.add_argument("--variants", nargs="+", choices=tuple(VARIANTS), default=None,
                        help="named ARMOR rows (instead of the --armor-blocks × --budgets grid)")
    parser.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=DEFAULT.optimizer.name)
    parser.add_argument("--iters", type=int, default=None, help="ARMOR iterations per layer (default: config's)")
    parser.add_argument("--armor-seed", type=int, default=DEFAULT.seed, help="seed of ARMOR's group selection")
    parser.add_argument("--pattern", default="2:4")
    parser.add_argument("--n-calib", type=int, default=64)
    parser.add_argument("--n-eval", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", default=None, help="restrict pruning to some decoder layers (quick looks only)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--armor-eval", choices=("materialized", "tensor"), default="materialized",
                        help="ARMOR perplexity with W_hat materialized (default) or through ArmorTensor weights")
    parser.add_argument("--one-shot", nargs="*", default=["sparsegpt", "armor"], choices=DEMO_METHODS,
                        help="methods that also get a one-shot row (dense-model statistics); default sparsegpt armor")
    parser.add_argument("--json", default=None, help="write rows, per-layer reports and timings here")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.variants and any(VARIANTS[v].get("distill") for v in args.variants):  # the held-out KL curve
        logging.basicConfig(format="%(message)s")
        logging.getLogger("torch_armor").setLevel(logging.INFO)
    configs = [dataclasses.replace(DEFAULT, **VARIANTS[v], seed=args.armor_seed) for v in args.variants or ()]
    for block in args.armor_blocks if not args.variants else ():
        for budget in args.budgets:
            optimizer = OPTIMIZERS[args.optimizer](**({"iters": args.iters} if args.iters is not None else {}),
                                                   time_budget_s=budget if budget > 0 else None)
            configs.append(dataclasses.replace(DEFAULT, block_size=block, optimizer=optimizer, pattern=args.pattern,
                                               seed=args.armor_seed))

    command = "python benchmarks/quality.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    print(command)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    sys.stdout.flush()

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    start = time.perf_counter()
    result = run_quality(
        "smollm2", methods=args.methods, configs=configs, pattern=args.pattern,
        sequential={m: (True, False) for m in args.one_shot},
        n_calib=args.n_calib, n_eval=args.n_eval, seq_len=args.seq_len, layers=args.layers,
        armor_eval=args.armor_eval, progress=not args.no_progress, log=log,
    )
    s = result.settings
    print(f"SmolLM2-135M-Instruct (Q4_1 GGUF → fp32), {args.pattern}, {s['num_layers']} decoder linears pruned "
          f"block by block; "
          f"calibration sotu {s['n_calib']}×{s['seq_len']} (seed 0), evaluation wiki {s['n_eval']}×{s['seq_len']}; "
          f"ARMOR evaluated {args.armor_eval}")
    print()
    print(result.table())
    print()
    if "armor" in args.methods:
        for i, cfg in enumerate(configs, 1):
            print(f"ARMOR{f' #{i}' if len(configs) > 1 else ''} config: {cfg}")
    print("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in result.timings.items()))
    print(f"total wall time {(time.perf_counter() - start) / 60:.1f} min")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result.to_dict() | {"command": command}, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
