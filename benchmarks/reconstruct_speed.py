"""Time of one block reconstruction: this checkout's code against a git revision's (``--rev``), on
a decoder block of SmolLM2-135M's shape (hidden 576, MLP 1536, 9 query / 3 key-value heads) with
random weights, ARMOR factors from 2 exact sweeps, and 16 calibration windows of 512 tokens.

Each implementation runs in its own child process (the revision's package exported with ``git
archive`` into a temporary folder, first on ``sys.path``), the two alternating ``--repeats`` times;
the table gives medians of CPU and wall seconds, and whether the factors are bit-identical.

Run:  python benchmarks/reconstruct_speed.py --rev HEAD~1 --threads 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def measure(steps: int, threads: int, out: str) -> None:
    from torch import nn  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    import torch_armor  # noqa: PLC0415
    from torch_armor import ArmorConfig  # noqa: PLC0415
    from torch_armor.config.armor import BcdConfig, ReconstructConfig  # noqa: PLC0415
    from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, run_block  # noqa: PLC0415
    from torch_armor.armor.reconstruct import reconstruct_block  # noqa: PLC0415
    from torch_armor.engine.runner import solve_layer  # noqa: PLC0415

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    block = model.model.layers[0]
    inputs = capture_block_inputs(model, block, list(torch.randint(0, 512, (16, 512)).split(4)))
    layers = {n: m for n, m in block.named_modules() if isinstance(m, nn.Linear)}
    stats = block_statistics(block, layers, inputs, device=torch.device("cpu"), track_xtx=True)
    solve = ArmorConfig(optimizer=BcdConfig(iters=2), refine=None)
    factors = {n: solve_layer(m.weight, stats[n], solve, n).payload for n, m in layers.items()}
    targets = [run_block(block, inp, torch.device("cpu")) for inp in inputs]
    wall, cpu = time.perf_counter(), time.process_time()
    result = reconstruct_block(block, factors, inputs, targets, ReconstructConfig(steps=steps, checks=1))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    torch.save({n: (f.a_blocks, f.core, f.b_blocks) for n, f in result.factors.items()}, out + ".pt")
    Path(out).write_text(json.dumps({"wall": wall, "cpu": cpu, "package": torch_armor.__file__}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", default="HEAD", help="the git revision to compare with")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", nargs=2, metavar=("TREE", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.insert(0, args.child[0])
        measure(args.steps, args.threads, args.child[1])
        return 0
    print("python benchmarks/reconstruct_speed.py " + " ".join(sys.argv[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        old_tree = Path(tmp) / "rev"
        old_tree.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.rev, "torch_armor"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old_tree)], input=archive, check=True)
        runs = {args.rev: [], "this checkout": []}
        for k in range(args.repeats):
            for name, tree in ((args.rev, old_tree), ("this checkout", ROOT)):
                out = str(Path(tmp) / f"{k}-{len(runs[name])}-{name.replace(' ', '_').replace('/', '_')}.json")
                subprocess.run([sys.executable, __file__, "--child", str(tree), out, "--steps", str(args.steps),
                                "--threads", str(args.threads)], check=True)
                runs[name].append((json.loads(Path(out).read_text()), torch.load(out + ".pt")))
        same = all(torch.equal(x, y) for (_, a), (_, b) in zip(runs[args.rev], runs["this checkout"])
                   for n in a for x, y in zip(a[n], b[n]))
        print(f"\none block of SmolLM2-135M's shape, {args.steps} reconstruction steps of one 512-token window, "
              f"{args.threads} threads, {args.repeats} alternating runs each\n")
        print("| code | median CPU s | median wall s |\n|---|---:|---:|")
        for name, rows in runs.items():
            print(f"| {name} | {statistics.median(r['cpu'] for r, _ in rows):.2f} | "
                  f"{statistics.median(r['wall'] for r, _ in rows):.2f} |")
        print(f"\nfactors bit-identical: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
