"""Output-space refinement on real single-layer problems: SmolLM2-135M layer L, dense statistics.

For each linear of the layer: the relative output loss ``‖(W − Ŵ)Xᵀ‖² / ‖(W − W_NoWag)Xᵀ‖²`` and
the relative proxy loss of the default ``bcd`` factors, then after ``refine_output`` with the
given rounds and CG steps, and the CPU seconds of each (this process's clock). With ``--core-steps``,
a column per count: the refinement with that many full-``H`` sparse-core steps (the mask may move; see
``RefineConfig.core_steps``), its loss and seconds, and the share of kept core entries that moved.
With ``--held-out N``, the output losses also under ``XᵀX`` of ``N`` other sotu windows (seed 1), after
a ``/``: the in-sample loss is what the refinement fitted, the held-out one whether the fit carries.

Run:  python benchmarks/refine_layer.py                       # layer 10, 16 × 512 sotu tokens, 3 rounds × 30 CG steps
      python benchmarks/refine_layer.py --layer 3 --rounds 3 --cg-steps 10 30
      python benchmarks/refine_layer.py --core-steps 16 64 --held-out 16   # + full-H sparse-core steps
      python benchmarks/refine_layer.py --bcd-iters 10 20 30 --held-out 16  # fewer sweeps before refining
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torch_armor import ArmorConfig  # noqa: E402
from torch_armor.config.armor import BcdConfig  # noqa: E402
from torch_armor.core.factorize import factorize  # noqa: E402
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
    parser.add_argument("--core-steps", type=int, nargs="*", default=[])
    parser.add_argument("--bcd-iters", type=int, nargs="+", default=[ArmorConfig().optimizer.iters],
                        help="bcd sweeps before the refinement: a row per count")
    parser.add_argument("--held-out", type=int, default=0, help="windows (seed 1) for held-out output losses")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("python benchmarks/refine_layer.py " + " ".join(sys.argv[1:] if argv is None else argv))
    model, tokenizer = load_smollm2(torch.float32)
    prefix = f"model.layers.{args.layer}."
    names = [n for n, m in model.named_modules() if n.startswith(prefix) and isinstance(m, torch.nn.Linear)]
    windows = calibration_windows("sotu", tokenizer, n_windows=args.n_calib, seq_len=512, seed=0)
    stats = collect_statistics(model, names, windows, track_xtx=True, progress=False)
    held = {}
    if args.held_out:
        other = calibration_windows("sotu", tokenizer, n_windows=args.held_out, seq_len=512, seed=1)
        held = collect_statistics(model, names, other, track_xtx=True, progress=False)
    print(f"SmolLM2-135M layer {args.layer}, statistics from {args.n_calib} × 512 sotu tokens (dense model), "
          f"{args.threads} thread(s), CPU seconds")
    print()
    core_head = "".join(f" core steps {k}: rel. output loss / s / mask moved |" for k in args.core_steps)
    print("| linear | shape | bcd sweeps | bcd: rel. output / proxy loss | bcd s | CG steps | refined: rel. output / proxy loss | "
          "refine s |" + core_head)
    print("|---|---|---:|---|---:|---:|---|---:|" + "---|" * len(args.core_steps))
    for name, iters in ((n, k) for n in names for k in args.bcd_iters):
        w = model.get_submodule(name).weight.detach()
        h, xtx = stats[name].act_sq_norm, stats[name].xtx
        _, nowag = nowag_prune(w, h, "2:4")
        reference = float(output_loss(w, nowag, xtx))

        def rel(approx, in_sample: float) -> str:
            if not held:
                return f"{in_sample:.3f}"
            other = held[name].xtx
            return f"{in_sample:.3f}/{float(output_loss(w, approx, other)) / float(output_loss(w, nowag, other)):.3f}"
        start = time.process_time()
        f = factorize(w, h, ArmorConfig(refine=None, optimizer=BcdConfig(iters=iters)))
        bcd_s = time.process_time() - start
        before = float(output_loss(w, f.dense(), xtx)) / reference
        for steps in args.cg_steps:
            start = time.process_time()
            r = refine_output(w, xtx, f, rounds=args.rounds, cg_steps=steps)
            refine_s = time.process_time() - start
            cells = ""
            for k in args.core_steps:
                start = time.process_time()
                moved = refine_output(w, xtx, f, rounds=args.rounds, cg_steps=steps, core_steps=k)
                seconds = time.process_time() - start
                share = float((moved.mask & ~f.mask).sum()) / float(f.mask.sum())
                cells += f" {rel(moved.dense(), moved.relative_output_loss)} / {seconds:.1f} / {share:.1%} |"
            print(f"| {name[len(prefix):]} | {tuple(w.shape)} | {iters} | {rel(f.dense(), before)} / {f.relative_loss:.3f} | "
                  f"{bcd_s:.1f} | {steps} | {rel(r.dense(), r.relative_output_loss)} / {r.relative_loss:.3f} | "
                  f"{refine_s:.1f} |{cells}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
