"""Peak memory of one output-space refinement above what is already resident, in units of the
layer's fp32 weight (W): this code's :func:`refine_output` against an earlier implementation given
by file (``--old PATH``, e.g. ``git show REV:torch_armor/core/refine.py``).

The layer defaults to a 1.1B Llama's ``down_proj`` (2048 × 5632), the widest linear of a streamed
prune and where its peak was: every ``d_in × d_in`` matrix is 2.75 W there. Random weight, ``XᵀX``
of random correlated inputs, 2:4 factors with identity wrappers; resident before the call: the
weight, ``XᵀX`` and the factors, as in the engine. Linux only: the peak is ``VmHWM`` of
``/proc/self/status``, reset through ``/proc/self/clear_refs`` just before the call, minus
``VmRSS`` at that moment; glibc's mmap threshold pinned as in a streamed prune. One process per
implementation. The peak does not depend on the number of rounds or CG steps (one round of 2 by default).

Run:  python benchmarks/refine_memory.py --old /tmp/old_refine.py
      (old: ``git show 6db3d16:torch_armor/core/refine.py``, before the tiled products and in-place CG)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peak_memory import peak_above_resident, run_each  # noqa: E402


def measure(which: str, old: str, d_out: int, d_in: int, rounds: int, cg_steps: int) -> None:
    from torch_armor.core.factors import ArmorFactors  # noqa: PLC0415
    from torch_armor.engine.memory import fix_mmap_threshold  # noqa: PLC0415

    fix_mmap_threshold()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(d_out, d_in, generator=gen)
    x = torch.randn(2 * d_in, d_in, generator=gen)
    x[:, 1:] += 0.5 * x[:, :-1]  # neighbouring channels correlate
    xtx = x.T @ x
    del x
    keep = weight.abs().reshape(d_out, -1, 4).topk(2, dim=-1).indices
    mask = torch.zeros(d_out, d_in // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(d_out, d_in)
    d_b = 16
    eye = torch.eye(d_b)
    factors = ArmorFactors(a_blocks=eye.repeat(d_out // d_b, 1, 1).clone(), core=weight * mask,
                           b_blocks=eye.repeat(d_in // d_b, 1, 1).clone(), mask=mask)
    if which == "old":
        spec = importlib.util.spec_from_file_location("old_refine", old)
        module = importlib.util.module_from_spec(spec)
        sys.modules["old_refine"] = module
        spec.loader.exec_module(module)
        refine_output = module.refine_output
    else:
        from torch_armor.core.refine import refine_output  # noqa: PLC0415
    peak = peak_above_resident(lambda: refine_output(weight, xtx, factors, rounds=rounds, cg_steps=cg_steps))
    w_bytes = weight.numel() * 4
    print(f"| {which} | {w_bytes / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {peak / w_bytes:.2f} W |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None, help="an earlier refine.py to compare with")
    ap.add_argument("--which", choices=("new", "old"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--d-out", type=int, default=2048)
    ap.add_argument("--d-in", type=int, default=5632)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--cg-steps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = (args.d_out, args.d_in, args.rounds, args.cg_steps)
    if args.which:
        measure(args.which, args.old, *shape)
        return 0
    print("python benchmarks/refine_memory.py " + " ".join(sys.argv[1:]))
    print(f"layer {args.d_out} × {args.d_in}, {args.rounds} round(s) of {args.cg_steps} CG steps\n\n"
          "| implementation | W (fp32 weight) | peak above resident | peak / W |\n|---|---|---|---|", flush=True)
    run_each(__file__, sys.argv[1:], old=bool(args.old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
