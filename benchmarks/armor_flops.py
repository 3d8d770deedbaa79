"""FLOPs of an ARMOR linear, from shapes, checked with ``FlopCounterMode`` on the meta device (no GPU).

    python benchmarks/armor_flops.py [--shapes 4096x4096 ...] [--block-sizes 16 64 128]

Per token, ``y = ((x·Bᵀ)·coreᵀ)·Aᵀ`` costs ``2·d_b·(d_in + d_out)`` FLOPs in the two block-diagonal
products and ``d_out·d_in`` in the 2:4 GEMM (half the ``2·d_out·d_in`` of a dense GEMM: the kernel
skips the zeros). ``wrapper %`` = wrapper / 2:4 GEMM; tokens cancel. ``FlopCounterMode`` runs
``F.linear`` on a meta :class:`ArmorTensor` with a *dense* core (a meta tensor cannot be
semi-structured), so it must count exactly ``tokens·2·d_b·(d_in+d_out)`` in ``bmm`` and
``tokens·2·d_out·d_in`` in ``mm``; ``ok`` says it did. ``benchmarks/inference_gpu.py`` prints the
same table next to its timings.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Dict, List, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from torch_armor.tensor.armor_tensor import from_parts

SHAPES = ["4096x4096", "11008x4096", "4096x11008", "8192x8192", "28672x8192", "8192x28672"]
Row = Dict[str, object]


def flop_rows(shapes: Sequence[str], block_sizes: Sequence[int], tokens: int = 16) -> List[Row]:
    """Analytic FLOPs per token, checked with FlopCounterMode on a meta ArmorTensor (``tokens`` rows)."""
    rows: List[Row] = []
    for shape in shapes:
        d_out, d_in = (int(s) for s in shape.split("x"))
        for d_b in block_sizes:
            if d_out % d_b or d_in % d_b:
                continue
            wrapper, gemm24 = 2 * d_b * (d_in + d_out), d_out * d_in
            meta = dict(device="meta", dtype=torch.bfloat16)
            w = from_parts("dense", torch.empty(d_out // d_b, d_b, d_b, **meta), torch.empty(d_in // d_b, d_b, d_b, **meta),
                           "2:4", torch.bfloat16, core=torch.empty(d_out, d_in, **meta))
            with FlopCounterMode(display=False) as counter:
                F.linear(torch.empty(tokens, d_in, **meta), w)
            ops = {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}
            counted_ok = ops.get("bmm") == tokens * wrapper and ops.get("mm") == tokens * 2 * gemm24
            rows.append({"shape": shape, "d_b": d_b, "wrapper_mflop": wrapper / 1e6, "gemm24_mflop": gemm24 / 1e6,
                         "dense_mflop": 2 * gemm24 / 1e6, "wrapper_pct": 100 * wrapper / gemm24,
                         "counted": "ok" if counted_ok else f"MISMATCH {ops}"})
    return rows


FLOP_COLS = [("shape", "shape", ""), ("d_b", "d_b", ""), ("wrapper MFLOP/token", "wrapper_mflop", ".3f"),
             ("2:4 GEMM MFLOP/token", "gemm24_mflop", ".3f"), ("dense MFLOP/token", "dense_mflop", ".3f"),
             ("wrapper %", "wrapper_pct", ".1f"), ("FlopCounterMode", "counted", "")]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=SHAPES)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 128])
    args = p.parse_args(argv)
    rows = flop_rows(args.shapes, args.block_sizes)
    print("| " + " | ".join(c[0] for c in FLOP_COLS) + " |\n|" + "|".join("---" for _ in FLOP_COLS) + "|")
    for r in rows:
        print("| " + " | ".join(f"{r[k]:{f}}" if f else str(r[k]) for _, k, f in FLOP_COLS) + " |")


if __name__ == "__main__":
    main()
