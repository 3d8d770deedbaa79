"""How long loading the embedded SmolLM2 takes: its first load (converting the GGUF file and keeping the
float32 copy) against a later one (reading the kept copy), each in a fresh process.

    python benchmarks/smollm2_load.py            # 3 rounds; each load's seconds, the medians, the kept copy's size

Each round empties a temporary cache directory (``TORCH_ARMOR_CACHE``), then loads twice. The seconds are
those of ``load_smollm2()`` alone (imports excluded), wall clock; say what else ran on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

_LOAD = ("import time; from torch_armor.recipes.assets import load_smollm2; t = time.perf_counter(); "
         "load_smollm2(); print(time.perf_counter() - t)")


def _load_seconds(cache: Path) -> float:
    env = dict(os.environ, TORCH_ARMOR_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", _LOAD], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    first, later = [], []
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for r in range(args.rounds):
            shutil.rmtree(cache, ignore_errors=True)
            first.append(_load_seconds(cache))
            later.append(_load_seconds(cache))
            print(f"round {r + 1}: first load {first[-1]:.1f} s (converts and keeps), later load {later[-1]:.1f} s",
                  flush=True)
        kept = sum(f.stat().st_size for f in cache.rglob("*") if f.is_file())
    print(f"median of {args.rounds}: first load {statistics.median(first):.1f} s, later load "
          f"{statistics.median(later):.1f} s ({statistics.median(first) / statistics.median(later):.0f}x); the kept "
          f"copy: {kept / 1e6:.0f} MB")


if __name__ == "__main__":
    main()
