"""Whole-model cost and quality: the default ``torch-armor prune`` against lean Adam at 1000 iterations.

Runs, as separate processes, exactly the commands a user types (SmolLM2-135M, all 210 decoder
linears, block 16, 2:4, sotu calibration 64×512, seed 0):

    default  torch-armor prune smollm2 --block-size 16 --out OUT/default
    adam1000 torch-armor prune smollm2 --block-size 16 --optimizer adam --iters 1000 --out OUT/adam1000

then ``torch-armor eval`` on each (Wikipedia, 64×512 windows — the quality protocol) and prints one
table: whole-command wall time, time spent in the per-layer optimizer, CPU time of the process,
mean relative proxy loss, perplexity. Wall and CPU times both appear because the machine is shared:
CPU time is less sensitive to other jobs.

Run:  python benchmarks/default_vs_adam.py                       # both rows (about 1.5 h on 2 cores)
      python benchmarks/default_vs_adam.py --rows default        # the default command only
      python benchmarks/default_vs_adam.py --extra --layers 0    # quick look on one decoder layer
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "default": [],
    "adam1000": ["--optimizer", "adam", "--iters", "1000"],
}


def _run(cmd: list, log) -> tuple:
    """Run ``cmd``; return (stdout, wall seconds, child CPU seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {shlex.join(cmd)}\n{proc.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, wall, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--out", default="benchmarks/out/default_vs_adam", help="run directories go here")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[],
                        help="further arguments for every prune command (e.g. --layers 0)")
    parser.add_argument("--json", default=None, help="also write the rows as JSON")
    args = parser.parse_args(argv)

    exe = [sys.executable, "-m", "torch_armor"]
    print("python benchmarks/default_vs_adam.py " + shlex.join(sys.argv[1:] if argv is None else argv))
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"load average at start {os.getloadavg()[0]:.1f}")
    sys.stdout.flush()
    rows = []
    for name in args.rows:
        out = Path(args.out) / name
        prune_cmd = exe + ["prune", "smollm2", "--block-size", "16", "--out", str(out), "--overwrite",
                           "--no-progress"] + ROWS[name] + args.extra
        print(f"[{name}] {shlex.join(prune_cmd[2:])}", file=sys.stderr, flush=True)
        _, wall, cpu = _run(prune_cmd, sys.stderr)
        report = json.loads((ROOT / out / "prune_report.json").read_text())
        eval_cmd = exe + ["eval", str(out), "--json", "--no-progress"]
        stdout, _, _ = _run(eval_cmd, sys.stderr)
        ppl = json.loads(stdout.strip().splitlines()[-1])["perplexity"]
        rows.append({
            "row": name, "command": "torch-armor " + shlex.join(prune_cmd[3:]),
            "wall_s": wall, "cpu_s": cpu, "optimizer_s": report.get("seconds"),
            "layers": len(report.get("layers", [])),
            "mean_relative_proxy_loss": report.get("mean_relative_proxy_loss"), "perplexity": ppl,
        })
        print(f"[{name}] {wall / 60:.1f} min, perplexity {ppl:.2f}", file=sys.stderr, flush=True)

    print()
    print("| row | command | linears | prune wall (min) | optimizer (min) | process CPU (min) "
          "| mean rel. proxy loss | Wikipedia ppl |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        opt = f"{r['optimizer_s'] / 60:.1f}" if r["optimizer_s"] is not None else "—"
        loss = f"{r['mean_relative_proxy_loss']:.4f}" if r["mean_relative_proxy_loss"] is not None else "—"
        print(f"| {r['row']} | `{r['command']}` | {r['layers']} | {r['wall_s'] / 60:.1f} | {opt} "
              f"| {r['cpu_s'] / 60:.1f} | {loss} | {r['perplexity']:.2f} |")
    if len(rows) == 2:
        print(f"\nwall-time ratio {rows[1]['row']} / {rows[0]['row']}: {rows[1]['wall_s'] / rows[0]['wall_s']:.2f}×")
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
