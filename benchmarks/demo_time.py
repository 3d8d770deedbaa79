"""The demo's time: record a run's work for the demo's estimate, and check the estimate against a run.

    python benchmarks/demo_time.py --record --threads 1   # run the quick demo with every method; write the record
    python benchmarks/demo_time.py --check      # run the quick demo as a user would; its first estimate
                                                # against the time its rows took, and the targets

``--record`` runs ``torch-armor demo --methods <every method>`` (the quick protocol) in a fresh run
directory and writes ``torch_armor/recipes/demo_record.py``: each row's CPU seconds (the demo process, all
threads) and its prune and eval wall seconds, and the forward pass over one window timed at the run's start
(its CPU seconds are the unit the demo's estimate counts work in: ``torch_armor/recipes/demo_time.py``;
CPU time, so that other jobs on the machine do not inflate the work), with the machine and its load.
``--check`` runs ``torch-armor demo`` as it is (fresh run directory) and prints its first estimate against
the time its rows took, with the targets (on an idle machine): the first estimate within ±30%, the first
row within 2 min of the start, the whole table within 15 min. ``tests/recipes/test_demo_time.py`` fails if
the record was made with other settings than today's quick demo.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pprint
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RECORD = Path(__file__).resolve().parents[1] / "torch_armor" / "recipes" / "demo_record.py"


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    return f"{os.cpu_count()} cores of {model}"


def run_demo(args: list, work: Path) -> dict:
    """Run the demo in a fresh run directory; its JSON, the wall time and the load averages around it."""
    result = work / "result.json"
    cmd = [sys.executable, "-m", "torch_armor", "demo", "--run-dir", str(work / "run"), "--json", str(result), *args]
    print("$", " ".join(cmd), flush=True)
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    data = json.loads(result.read_text())
    data["wall_s"], data["load"] = wall, [round(load_before, 2), round(os.getloadavg()[1], 2)]
    data["armor"] = json.loads((work / "run" / "rows.json").read_text())["settings"]["armor"]
    return data


def rows_seconds(data: dict) -> float:
    return sum(row["prune_s"] + row["eval_s"] for row in data["rows"])


def write_record(record: dict) -> None:
    RECORD.write_text('"""The recorded demo run the demo\'s estimate scales (written by benchmarks/demo_time.py; '
                      'do not edit)."""\n\nDEMO_RECORD = ' + pprint.pformat(record, width=110, sort_dicts=True) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true", help="run every method and write the record")
    mode.add_argument("--check", action="store_true", help="run the demo as it is and check its first estimate")
    ap.add_argument("--work", default=None, help="working directory (default: a temporary one)")
    ap.add_argument("--threads", type=int, default=None,
                    help="the demo's --threads (record: 1, so that the CPU time has no threads waiting on a busy "
                         "machine; check: the demo's own choice)")
    args = ap.parse_args()
    from torch_armor.cli.names import DEMO_METHODS, QUICK_PROTOCOL

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        if args.record:
            threads = [] if args.threads is None else ["--threads", str(args.threads)]
            data = run_demo(["--methods", *DEMO_METHODS, *threads], work)
            record = {
                "machine": machine(), "load": data["load"],
                "command": "python benchmarks/demo_time.py --record" + (f" --threads {args.threads}" if threads else ""),
                "settings": {"n_calib": QUICK_PROTOCOL["n_calib"], "n_eval": QUICK_PROTOCOL["n_eval"],
                             "seq_len": data["settings"]["seq_len"], "armor": data["armor"]},
                "forward_s": round(data["estimate"]["forward_s"], 4),
                "forward_cpu_s": round(data["estimate"]["forward_cpu_s"], 4),
                "rows": {row["method"]: {"cpu_s": round(data["estimate"]["row_cpu_s"][row["method"]], 1),
                                         "prune_s": round(row["prune_s"], 1), "eval_s": round(row["eval_s"], 1)}
                         for row in data["rows"]},
            }
            write_record(record)
            print(f"record written to {RECORD}: rows {rows_seconds(data):.0f} s, forward pass "
                  f"{record['forward_s']:.3f} s ({record['forward_cpu_s']:.3f} CPU-s) per window")
        else:
            data = run_demo([] if args.threads is None else ["--threads", str(args.threads)], work)
            estimate, actual = data["estimate"]["first_estimate_s"], rows_seconds(data)
            first_row = data["timings_s"]["load"] + data["rows"][0]["prune_s"] + data["rows"][0]["eval_s"]
            print(f"first estimate {estimate:.0f} s, the rows took {actual:.0f} s (estimate / actual "
                  f"{estimate / actual:.2f}, target 0.7-1.3); first row after about {first_row:.0f} s (target "
                  f"120 s); whole command {data['wall_s']:.0f} s (target 900 s); load average {data['load']}, "
                  f"{machine()}")

if __name__ == "__main__":
    main()
