"""Output-space refinement on real single-layer problems: SmolLM2-135M layer L, dense statistics.

For each linear of the layer: the relative output loss ``‖(W − Ŵ)Xᵀ‖² / ‖(W − W_NoWag)Xᵀ‖²`` and
the relative proxy loss of the default ``bcd`` factors, then after ``refine_output`` with the
given rounds and CG steps, and the CPU seconds of each (this process's clock).

Run:  python benchmarks/refine_layer.py                       # layer 10, 16 × 512 sotu tokens, 3 rounds × 30 CG steps
      python benchmarks/refine_layer.py --layer 3 --rounds 3 --cg-steps 10 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_armor import ArmorConfig, factorize  # noqa: E402
from torch_armor.calibration.observer import collect_statistics  # noqa: E402
from torch_armor.core.proxy import nowag_prune  # noqa: E402
from torch_armor.core.refine import output_loss, refine_output  # noqa: E402
from torch_armor.recipes.assets import load_smollm2  # noqa: E402
from torch_armor.recipes.data import calibration_windows  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=10)
    parser.add_argument("--n-calib", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cg-steps", type=int, nargs="+", default=[30])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("python benchmarks/refine_layer.py " + " ".join(sys.argv[1:] if argv is None else argv))
    model, tokenizer = load_smollm2(torch.float32)
    prefix = f"model.layers.{args.layer}."
    names = [n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, torch.nn.Linear)]
    windows = calibration_windows("sotu", tokenizer, n_windows=args.n_calib, seq_len=512, seed=0)
    stats = collect_statistics(model, names, windows, track_xtx=True, progress=False)
    print(f"SmolLM2-135M layer {args.layer}, statistics from {args.n_calib} × 512 sotu tokens (dense model), "
          f"{args.threads} thread(s), CPU seconds")
    print()
    print("| linear | shape | bcd: rel. output / proxy loss | bcd s | CG steps | refined: rel. output / proxy loss | refine s |")
    print("|---|---|---|---:|---:|---|---:|")
    for name in names:
        w = model.get_submodule(name).weight.detach()
        h, xtx = stats[name].act_sq_norm, stats[name].xtx
        _, nowag = nowag_prune(w, h, "2:4")
        reference = float(output_loss(w, nowag, xtx))
        start = time.process_time()
        f = factorize(w, h, ArmorConfig(refine=None))
        bcd_s = time.process_time() - start
        before = float(output_loss(w, f.dense(), xtx)) / reference
        for steps in args.cg_steps:
            start = time.process_time()
            r = refine_output(w, xtx, f, rounds=args.rounds, cg_steps=steps)
            refine_s = time.process_time() - start
            print(f"| {name[len(prefix):]} | {tuple(w.shape)} | {before:.3f} / {f.relative_loss:.3f} | {bcd_s:.1f} | "
                  f"{steps} | {r.relative_output_loss:.3f} / {r.relative_loss:.3f} | {refine_s:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
