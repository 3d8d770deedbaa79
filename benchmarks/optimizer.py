"""Optimizer benchmark on real SmolLM2-135M layers (layer 10, sotu statistics, 16 × 512 tokens).

Three tables, single thread (``torch.set_num_threads(1)``); times are CPU seconds of this
process by default (``--clock cpu``), which other load on a shared machine barely changes:

* ``paper``: the paper's recipe (Adam lr 1e-4, l1-random, seed 0, block 32, 2:4) against the
  reference trajectory the issue gives (relative proxy loss = loss / NoWag-P loss).
* ``sweep``: ms per Adam iteration and relative loss at 100 / 300 / 1000 / 3000 iterations for
  each block size.
* ``selection``: ``bcd`` with each group-selection rule at block 32: CPU time to reach the
  reference Adam losses at 1000 / 3000 iterations, and the loss at the end of the budget.
* ``compare``: ``bcd`` against ``adam``, interleaved and repeated: wall time for ``bcd`` to
  reach the loss ``adam`` reaches at 1000 / 3000 (/ 20,000 with ``--long``) iterations, as a
  ratio of ``adam``'s time, and both losses at equal time.

Run:  python benchmarks/optimizer.py paper
      python benchmarks/optimizer.py sweep --blocks 16 32 64 --iters 3000
      python benchmarks/optimizer.py selection --budget 20
      python benchmarks/optimizer.py compare --blocks 16 32 64 --repeats 2 [--long]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layer_stats import layer_problem  # noqa: E402

factorize_module = importlib.import_module("torch_armor.core.factorize")  # the module, not the function
from torch_armor import ArmorConfig  # noqa: E402
from torch_armor.config.armor import AdamConfig, BcdConfig  # noqa: E402
from torch_armor.core.factorize import factorize  # noqa: E402

LAYERS = ("q_proj", "k_proj", "up_proj", "down_proj")
PAPER = {  # relative proxy loss of the paper's recipe at block 32, from the issue
    "q_proj": {100: 0.899, 300: 0.761, 1000: 0.545, 3000: 0.445, 20000: 0.425},
    "k_proj": {100: 0.867, 300: 0.682, 1000: 0.397, 3000: 0.256},
    "up_proj": {100: 0.927, 300: 0.829, 1000: 0.663, 3000: 0.585},
    "down_proj": {100: 0.926, 300: 0.825, 1000: 0.657, 3000: 0.578},
}


def run(weight, h, block_size, optimizer, seed=0):
    start = factorize_module.clock()
    f = factorize(weight, h, ArmorConfig(block_size=block_size, optimizer=optimizer, seed=seed))
    elapsed = factorize_module.clock() - start
    return f, elapsed


def trajectory(f):
    return list(zip(f.history_iters.tolist(), f.history.tolist(), f.history_time_s.tolist()))


def at_iter(f, it):
    hist = dict(zip(f.history_iters.tolist(), f.history.tolist()))
    return hist.get(it, float("nan"))


def cmd_paper(args, problems):
    iters = max(args.iters, 1000)
    marks = [k for k in (100, 300, 1000, 3000) if k <= iters]
    print("\nPaper recipe (adam lr 1e-4, l1-random, seed 0), block 32, 2:4 — ours / reference (|diff|)")
    print("| layer | shape | ms/iter | " + " | ".join(f"it {k}" for k in marks) + " | max abs diff |")
    print("|---|---|---|" + "---|" * len(marks) + "---|")
    for name in LAYERS:
        w, h = problems[name]
        f, el = run(w, h, 32, AdamConfig(iters=iters, lr=1e-4, log_every=100), seed=0)
        cells, diffs = [], []
        for k in marks:
            ours, ref = at_iter(f, k), PAPER[name].get(k)
            cells.append(f"{ours:.3f} / {ref:.3f}" if ref else f"{ours:.3f}")
            if ref:
                diffs.append(abs(ours - ref))
        print(f"| {name} | {w.shape[0]}×{w.shape[1]} | {el / iters * 1e3:.1f} | " + " | ".join(cells)
              + f" | {max(diffs):.3f} |", flush=True)


def cmd_sweep(args, problems):
    marks = [k for k in (100, 300, 1000, 3000) if k <= args.iters]
    print("\nAdam (paper recipe) by block size: ms/iter and relative proxy loss")
    print("| layer | block | ms/iter | " + " | ".join(f"it {k}" for k in marks) + " |")
    print("|---|---|---|" + "---|" * len(marks))
    for name in LAYERS:
        w, h = problems[name]
        for bs in args.blocks:
            f, el = run(w, h, bs, AdamConfig(iters=args.iters, log_every=100))
            print(f"| {name} | {bs} | {el / args.iters * 1e3:.1f} | "
                  + " | ".join(f"{at_iter(f, k):.3f}" for k in marks) + " |", flush=True)


def time_to_reach(traj, target):
    for _, loss, t in traj:
        if loss <= target:
            return t
    return float("inf")


def loss_at_time(traj, t_query):
    best = traj[0][1]
    for _, loss, t in traj:
        if t <= t_query:
            best = min(best, loss)
    return best


def cmd_selection(args, problems):
    rules = ("l1-random", "decrease-greedy", "mixed")
    print(f"\nbcd group selection, block 32, {args.budget:g} CPU s per run: time (s) to reach the reference "
          "adam loss at 1000 / 3000 iterations, and the final relative loss")
    print("| layer | " + " | ".join(rules) + " |")
    print("|---|" + "---|" * len(rules))
    for name in LAYERS:
        w, h = problems[name]
        cells = []
        for rule in rules:
            f, _ = run(w, h, 32, BcdConfig(iters=100000, selection=rule, time_budget_s=args.budget))
            traj = trajectory(f)
            t1, t3 = (time_to_reach(traj, PAPER[name][k]) for k in (1000, 3000))
            cells.append(f"{t1:.2f} / {t3:.2f} / {float(f.history.min()):.3f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


def cmd_compare(args, problems):
    rows = []
    for name in LAYERS:
        w, h = problems[name]
        for bs in args.blocks:
            long_run = args.long and name == "q_proj" and bs == 32
            n_adam = 20000 if long_run else 3000
            adam_runs, bcd_runs = [], []
            for _ in range(args.repeats):
                fa, ta = run(w, h, bs, AdamConfig(iters=n_adam, log_every=50))
                adam_runs.append((fa, ta))
                budget = args.bcd_fraction * ta
                fb, tb = run(w, h, bs, BcdConfig(iters=100000, time_budget_s=budget))
                bcd_runs.append((fb, tb))
            marks = [1000, 3000] + ([20000] if long_run else [])
            for k in marks:
                ratios = []
                for (fa, _), (fb, _) in zip(adam_runs, bcd_runs):
                    ta_k = dict(zip(fa.history_iters.tolist(), fa.history_time_s.tolist()))[k]
                    tb_k = time_to_reach(trajectory(fb), at_iter(fa, k))
                    ratios.append(tb_k / ta_k)
                fa0, fb0 = adam_runs[0][0], bcd_runs[0][0]
                t_eq = float(fb0.history_time_s[-1])
                rows.append((name, bs, k, at_iter(fa0, k),
                             statistics.median(dict(zip(fa.history_iters.tolist(), fa.history_time_s.tolist()))[k]
                                               for fa, _ in adam_runs),
                             statistics.median(ratios), t_eq, loss_at_time(trajectory(fa0), t_eq),
                             float(fb0.history.min())))
            print(f"done {name} block {bs}", file=sys.stderr, flush=True)
    print(f"\nbcd vs adam (single thread, interleaved, {args.repeats} repeat(s); bcd budget "
          f"{args.bcd_fraction:.0%} of adam's longest run)")
    print("| layer | block | adam iters | adam loss | adam time s | bcd time to reach / adam time | "
          "equal time s | adam loss @t | bcd loss @t |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3f} | {r[4]:.1f} | {r[5]:.3f} | {r[6]:.1f} | {r[7]:.3f} | {r[8]:.3f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", choices=["paper", "sweep", "selection", "compare"])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--bcd-fraction", type=float, default=0.25)
    parser.add_argument("--budget", type=float, default=20.0, help="selection: CPU seconds per bcd run")
    parser.add_argument("--long", action="store_true", help="also run adam 20,000 iterations on q_proj, block 32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                        help="cpu: CPU seconds of this process (robust to other load; use with 1 thread)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    factorize_module.clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"# python benchmarks/optimizer.py {' '.join(sys.argv[1:])}  (threads={args.threads}, clock={args.clock})")
    problems = layer_problem(names=LAYERS)
    {"paper": cmd_paper, "sweep": cmd_sweep, "selection": cmd_selection, "compare": cmd_compare}[args.table](args, problems)


if __name__ == "__main__":
    main()
