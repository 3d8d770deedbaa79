"""Mixture-of-experts pruning on a random Qwen3-MoE: quality per layer kind, cost vs number of
experts, routed vs all-token expert calibration.

1. Quality: a random ``Qwen3MoeForCausalLM`` (hidden 512, 16 experts of intermediate 256, top-2,
   ``--layers`` decoder layers; router weights drawn N(0, 0.5²) so that tokens spread) pruned to
   2:4 by ARMOR, NoWag-P and SparseGPT on random calibration tokens (``--windows`` × ``--seq-len``).
   Each layer's relative output loss ``tr(E H Eᵀ) / tr(W H Wᵀ)`` (``E = W − Ŵ``) is measured with
   ``H = XᵀX`` of the tokens the router sends to it (routed tokens, dense model's block inputs),
   averaged per layer kind (attention q/k/v/o, experts' gate_up, experts' down).
2. Routed vs all: the same ARMOR and NoWag-P prunes with ``expert_calibration="all"`` (every
   token through every expert for the statistics), measured on routed tokens as above.
3. Cost vs E: one decoder layer with 4, 8 and 16 experts, ARMOR; seconds for the expert layers
   and per expert, with the experts of a fused parameter factorized as one batch (the default,
   ``factorize_batched``) and one after another (the serial loop, by making ``expert_batches``
   return single layers), in the same run (``--cost``: only this part).
4. ``--rss``: peak RSS of a streamed prune (NoWag-P, ``prune_model(DIR, …, out=…)`` in a child
   process) of an 8-layer (``--rss-layers``), 16-expert checkpoint written by ``save_pretrained`` (per-expert keys),
   against the checkpoint's bytes; the peak of a child that only imports torch_armor and builds
   the model on ``meta`` is printed too (the interpreter's own share).

Run:  python benchmarks/moe.py --threads 1                 # ~20 min on one loaded core
      python benchmarks/moe.py --threads 1 --rss           # ~2 min
      python benchmarks/moe.py --threads 1 --cost          # ~10 min: only the cost vs E part
      python benchmarks/moe.py --threads 1 --tiny          # seconds: smoke test of the script
"""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, decoder_blocks  # noqa: E402
from torch_armor.calibration.experts import split_expert_name  # noqa: E402
from torch_armor.calibration.selection import prunable_names  # noqa: E402
from torch_armor.config.armor import ArmorConfig, BcdConfig  # noqa: E402
from torch_armor.engine import layers as engine_layers  # noqa: E402
from torch_armor.engine.experts import layer_module  # noqa: E402
from torch_armor.engine.methods import config_for_method, method_label  # noqa: E402
from torch_armor.engine.prune import PruneOptions, prune_model  # noqa: E402

SHAPE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, vocab_size=4096, num_experts_per_tok=2)
TINY = dict(SHAPE, hidden_size=64, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=128)


def build(shape: dict, layers: int, experts: int, seed: int = 0) -> Qwen3MoeForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(num_hidden_layers=layers, num_experts=experts, **shape)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
    model.set_experts_implementation("eager")
    return model


def kind(name: str) -> str:
    split = split_expert_name(name)
    if split is not None:
        return "experts." + split[0].rsplit(".", 1)[1]
    return "attention" if "self_attn" in name else name.rsplit(".", 1)[1]


def dense_weight(model, name: str) -> torch.Tensor:
    """The dense matrix a layer applies now (``A·core·B`` for ARMOR tensors)."""
    split = split_expert_name(name)
    if split is not None:
        p = model.get_parameter(split[0])
        full = p.dense_weight() if hasattr(p, "dense_weight") else p
        return full[split[1]].detach().float()
    lin = model.get_submodule(name)
    return lin(torch.eye(lin.in_features)).T.detach().float()


def routed_xtx(model, calib) -> dict:
    """``{layer: XᵀX}`` of the dense model on routed tokens, every block on the dense block inputs."""
    prefix, blocks = decoder_blocks(model)
    inputs = capture_block_inputs(model, blocks[0], list(calib.split(4)))
    out = {}
    names = prunable_names(model)
    for i, block in enumerate(blocks):
        layers = {n: layer_module(model, n) for n in names if n.startswith(f"{prefix}.{i}.")}
        stats = block_statistics(block, layers, inputs, device=torch.device("cpu"), track_xtx=True, propagate=True)
        out.update({n: s.xtx.double() for n, s in stats.items()})
    return out


def output_losses(dense, pruned, xtx: dict) -> dict:
    losses = {}
    for name, h in xtx.items():
        w = dense_weight(dense, name).double()
        err = w - dense_weight(pruned, name).double()
        losses[name] = float(torch.einsum("ij,jk,ik->", err, h, err) / torch.einsum("ij,jk,ik->", w, h, w))
    return losses


def by_kind(losses: dict) -> dict:
    groups: dict = {}
    for n, v in losses.items():
        groups.setdefault(kind(n), []).append(v)
    return {k: sum(v) / len(v) for k, v in groups.items()}


def armor_config(iters: int) -> ArmorConfig:
    return ArmorConfig(block_size=32, optimizer=BcdConfig(iters=iters), reconstruct=None)


def run(model, calib, cfg, **options):
    pruned = copy.deepcopy(model)
    start = time.perf_counter()
    report = prune_model(pruned, calib, cfg, options=PruneOptions(progress=False, **options))
    return pruned, report, time.perf_counter() - start


def load() -> str:
    with open("/proc/loadavg") as fh:
        return " ".join(fh.read().split()[:3])


STREAM_CHILD = """import sys, torch
torch.set_num_threads(int(sys.argv[4]))
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.engine.checkpoint import LazyCheckpoint
if sys.argv[3] == "baseline":
    LazyCheckpoint(sys.argv[1])
else:
    calib = torch.randint(0, int(sys.argv[5]), (32, 64), generator=torch.Generator().manual_seed(1))
    prune_model(sys.argv[1], calib, config_for_method("nowag"), options=PruneOptions(progress=False, out=sys.argv[2]))
"""


def child_peak(args: list) -> int:
    """Peak RSS (bytes) of a child run through a bare ``python -S`` wrapper (its own high-water mark)."""
    wrapper = ("import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
    out = subprocess.run([sys.executable, "-S", "-c", wrapper, sys.executable, "-c", STREAM_CHILD, *args],
                         check=True, capture_output=True, text=True, cwd=str(ROOT))
    return int(out.stdout.strip().splitlines()[-1]) * 1024


def rss(shape: dict, threads: int, layers: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        ckpt, out = Path(work) / "ckpt", Path(work) / "out"
        build(shape, layers, 16).save_pretrained(ckpt)
        size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        base = child_peak([str(ckpt), str(out), "baseline", str(threads), str(shape["vocab_size"])])
        peak = child_peak([str(ckpt), str(out), "prune", str(threads), str(shape["vocab_size"])])
    print(f"\n## Streamed prune of a {layers}-layer, 16-expert checkpoint (NoWag-P, 32 x 64 tokens)\n")
    print("| checkpoint MB | peak RSS MB | imports + meta model MB | (peak - that) / checkpoint |")
    print("|---:|---:|---:|---:|")
    print(f"| {size / 2**20:.0f} | {peak / 2**20:.0f} | {base / 2**20:.0f} | {(peak - base) / size:.1%} |")


def cost(shape: dict, args, calib) -> None:
    """Part 3: ARMOR's expert-layer seconds for 4, 8, 16 experts, batched and serial."""
    print("\n## ARMOR prune time vs number of experts (one decoder layer)\n")
    print("| experts | expert layers | batched: expert-layer s | s per expert | serial: expert-layer s | s per expert |")
    print("|---:|---:|---:|---:|---:|---:|")
    real = engine_layers.expert_batches
    for experts in (4, 8, 16):
        spent = []
        for batched in (True, False):
            engine_layers.expert_batches = real if batched else (lambda todo, configs: [[n] for n in todo])
            try:
                _, report, _ = run(build(shape, 1, experts), calib, armor_config(args.iters))
            finally:
                engine_layers.expert_batches = real
            expert_layers = [r for r in report.layers if split_expert_name(r.name) is not None]
            spent.append(sum(r.seconds for r in expert_layers))
        print(f"| {experts} | {len(expert_layers)} | {spent[0]:.1f} | {spent[0] / experts:.2f} | {spent[1]:.1f} | "
              f"{spent[1] / experts:.2f} |", flush=True)


def quality(shape: dict, args, calib) -> None:
    """Parts 1 and 2: relative output loss per layer kind, routed and all-token calibration."""
    model = build(shape, args.layers, args.experts)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: Qwen3-MoE random, {args.layers} layers, {args.experts} experts (top-2), hidden {shape['hidden_size']}, "
          f"expert intermediate {shape['moe_intermediate_size']}: {params / 1e6:.1f} M parameters; calibration "
          f"{args.windows} x {args.seq_len} random tokens")
    xtx = routed_xtx(model, calib)

    print("\n## Relative output loss on routed tokens (mean per layer kind; lower is better)\n")
    methods = [("armor", armor_config(args.iters)), ("nowag", config_for_method("nowag")),
               ("sparsegpt", config_for_method("sparsegpt"))]
    rows = {}
    for mode in ("routed", "all"):
        for name, cfg in methods:
            if mode == "all" and name == "sparsegpt":
                continue
            pruned, report, seconds = run(model, calib, cfg, expert_calibration=mode)
            rows[(name, mode)] = (by_kind(output_losses(model, pruned, xtx)), seconds)
            print(f"  {method_label(name)} ({mode}): {seconds:.0f} s", flush=True)
    kinds = list(next(iter(rows.values()))[0])
    print("\n| method | expert calibration | " + " | ".join(kinds) + " | prune s |")
    print("|---|---|" + "---:|" * (len(kinds) + 1))
    for (name, mode), (values, seconds) in rows.items():
        print(f"| {method_label(name)} | {mode} | " + " | ".join(f"{values[k]:.4f}" for k in kinds) + f" | {seconds:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--rss", action="store_true", help="only the streamed prune's peak RSS")
    ap.add_argument("--cost", action="store_true", help="only the prune time vs number of experts")
    ap.add_argument("--rss-layers", type=int, default=8, help="decoder layers of the --rss checkpoint")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    shape = TINY if args.tiny else SHAPE
    print(f"# benchmarks/moe.py  threads={args.threads}  load average at start: {load()}  (other helpers running)")
    if args.rss:
        rss(shape, args.threads, args.rss_layers)
        return
    calib = torch.randint(0, shape["vocab_size"], (args.windows, args.seq_len), generator=torch.Generator().manual_seed(1))
    if not args.cost:
        quality(shape, args, calib)
    cost(shape, args, calib)
    print(f"\nload average at the end: {load()}; pid {os.getpid()}")


if __name__ == "__main__":
    main()
