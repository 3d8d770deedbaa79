"""What a streamed prune costs against the same prune in memory, and what pinning glibc's mmap threshold
costs a streamed prune (torch_armor/engine/memory.py).

Runs ``python -m torch_armor prune CHECKPOINT --out TMP ARGS`` as child processes, one per mode and
repeat (the order alternating between repeats): ``pinned`` (``--stream``, the threshold pinned),
``default`` (``--stream``, glibc's default threshold) and ``memory`` (``--no-stream``: the checkpoint
loaded whole). The child forces ``memory.pin_needed`` in the streamed modes. Prints each child's wall,
user and system CPU seconds, minor page faults and peak RSS (``getrusage`` of the child), then the
medians. The two streamed modes give bit-identical results; only where freed memory goes differs.

Run:  python benchmarks/stream_cost.py /tmp/smollm2-fp32            # a save_pretrained SmolLM2-135M
      python benchmarks/stream_cost.py DIR --modes default memory --prune-args "--layers 0-1 --n-calib 16"
      python benchmarks/stream_cost.py DIR --repeats 3 --prune-args "--preset fast --layers 0-1 --n-calib 16"
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = """
import resource, sys, time
import torch_armor.engine.memory as memory
pinned = sys.argv[1] == "pinned"
memory.pin_needed = lambda *args: pinned
from torch_armor.cli.parser import main
start = time.perf_counter()
rc = main(sys.argv[2:])
r = resource.getrusage(resource.RUSAGE_SELF)
print("RESULT", rc, time.perf_counter() - start, r.ru_utime, r.ru_stime, r.ru_minflt, r.ru_maxrss * 1024)
"""

MODES = ("pinned", "default", "memory")


def run(mode: str, checkpoint: str, prune_args: list, threads: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-c", CHILD, mode, "prune", checkpoint, "--out", str(Path(out) / "o"),
               "--no-stream" if mode == "memory" else "--stream", "--threads", str(threads), "--no-progress",
               *prune_args]
        done = subprocess.run(cmd, capture_output=True, text=True)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    if line is None or line.split()[1] != "0":
        sys.exit(f"stream_cost: the {mode} prune failed:\n{done.stderr[-2000:]}")
    _, _, wall, user, system, faults, rss = line.split()
    return dict(wall=float(wall), user=float(user), sys=float(system), minflt=int(faults), rss=int(rss))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="a local Hugging Face safetensors directory")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prune-args", default="--preset fast --layers 0-1 --n-calib 16")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=["pinned", "default"])
    args = ap.parse_args()
    rows: dict = {mode: [] for mode in args.modes}
    print("| run | mode | wall s | user s | sys s | minor faults | peak RSS GB |\n|---|---|---:|---:|---:|---:|---:|")
    for i in range(args.repeats):
        for mode in (args.modes if i % 2 == 0 else args.modes[::-1]):
            r = run(mode, args.checkpoint, shlex.split(args.prune_args), args.threads)
            rows[mode].append(r)
            print(f"| {i + 1} | {mode} | {r['wall']:.1f} | {r['user']:.1f} | {r['sys']:.1f} | {r['minflt']} | "
                  f"{r['rss'] / 1e9:.2f} |", flush=True)
    for mode, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("wall", "user", "sys")}
        print(f"median {mode}: wall {med['wall']:.1f} s, user {med['user']:.1f} s, sys {med['sys']:.1f} s")


if __name__ == "__main__":
    main()
