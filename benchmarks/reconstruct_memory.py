"""Peak memory of one block reconstruction above what is already resident, in units of the
block's fp32 linear weights (W): this code's :func:`reconstruct_block` against an earlier
implementation given by file (``--old PATH``, e.g. ``git show REV:torch_armor/engine/reconstruct.py``).

A Llama decoder block (default hidden 1024, MLP 2816: a 1.1B Llama's shape at half width) with
random 2:4 ARMOR factors; calibration batches of ``--batch × --seq-len`` tokens. Linux only: the
peak is ``VmHWM`` of ``/proc/self/status``, reset through ``/proc/self/clear_refs`` just before
the call, minus ``VmRSS`` at that moment; glibc's mmap threshold pinned as in a streamed prune
(:mod:`torch_armor.engine.memory`). One process per implementation (``--which``).

Run:  python benchmarks/reconstruct_memory.py --old /tmp/old_reconstruct.py --threads 1
      (old: ``git show a5822b6:torch_armor/engine/reconstruct.py``, W_hat kept in the graph; or 666267c's, before
      the rewrite)
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from peak_memory import peak_above_resident, run_each  # noqa: E402


def measure(which: str, old: str, hidden: int, inter: int, batch: int, seq_len: int, steps: int) -> None:
    from transformers import LlamaConfig  # noqa: PLC0415  (only in the measuring child)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding  # noqa: PLC0415

    from torch_armor.calibration.blocks import BlockInput, run_block  # noqa: PLC0415
    from torch_armor.core.factors import ArmorFactors  # noqa: PLC0415
    from torch_armor.config.levers import ReconstructConfig  # noqa: PLC0415

    from torch_armor.engine.memory import fix_mmap_threshold  # noqa: PLC0415

    fix_mmap_threshold()  # as a streamed prune does: freed tensors go back to the system
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=hidden // 64,
                      num_key_value_heads=max(1, hidden // 512), num_hidden_layers=1)
    block = LlamaDecoderLayer(cfg, 0).eval()
    rope = LlamaRotaryEmbedding(cfg)
    d_b = 16
    factors = {}
    for name, m in block.named_modules():
        if isinstance(m, torch.nn.Linear):
            d_out, d_in = m.weight.shape
            core = m.weight.detach().clone()
            keep = core.abs().reshape(d_out, -1, 4).topk(2, dim=-1).indices
            mask = torch.zeros(d_out, d_in // 4, 4, dtype=torch.bool).scatter_(-1, keep, True).reshape(d_out, d_in)
            eye = torch.eye(d_b)
            factors[name] = ArmorFactors(a_blocks=eye.repeat(d_out // d_b, 1, 1).clone(), core=core * mask,
                                         b_blocks=eye.repeat(d_in // d_b, 1, 1).clone(), mask=mask)
    positions = torch.arange(seq_len)[None]
    inputs = []
    for _ in range(2):
        h = torch.randn(batch, seq_len, hidden)
        cos, sin = rope(h, positions)
        inputs.append(BlockInput(h, {"position_embeddings": (cos, sin), "position_ids": positions}))
    targets = [run_block(block, inp, torch.device("cpu")) for inp in inputs]
    w_bytes = sum(f.core.numel() for f in factors.values()) * 4
    if which == "old":
        spec = importlib.util.spec_from_file_location("old_reconstruct", old)
        module = importlib.util.module_from_spec(spec)
        sys.modules["old_reconstruct"] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        if "config" in inspect.signature(module.reconstruct_block).parameters:  # since ReconstructConfig
            call = lambda: module.reconstruct_block(block, factors, inputs, targets,  # noqa: E731
                                                    ReconstructConfig(steps=steps, held_out=1, checks=steps))
        else:
            call = lambda: module.reconstruct_block(block, factors, inputs, targets, steps=steps)  # noqa: E731
    else:
        from torch_armor.armor.reconstruct import reconstruct_block  # noqa: PLC0415

        call = lambda: reconstruct_block(block, factors, inputs, targets,  # noqa: E731
                                         ReconstructConfig(steps=steps, held_out=1, checks=steps))
    peak = peak_above_resident(call)
    print(f"| {which} | {w_bytes / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | {peak / w_bytes:.2f} W |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default=None, help="an earlier reconstruct.py to compare with")
    ap.add_argument("--which", choices=("new", "old"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=2816)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = (args.hidden, args.inter, args.batch, args.seq_len, args.steps)
    if args.which:
        measure(args.which, args.old, *shape)
        return 0
    print("python benchmarks/reconstruct_memory.py " + " ".join(sys.argv[1:]))
    print(f"block hidden {args.hidden}, MLP {args.inter}; 2 batches of {args.batch}×{args.seq_len} tokens; "
          f"{args.steps} steps\n\n| implementation | W (block linears, fp32) | peak above resident | peak / W |\n|---|---|---|---|",
          flush=True)
    run_each(__file__, sys.argv[1:], old=bool(args.old))
    return 0


if __name__ == "__main__":
    sys.exit(main())
