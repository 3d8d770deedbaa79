"""Peak memory of a block-streamed prune on a >1B-parameter checkpoint, and a Llama-3-70B projection.

1. Builds (once, into ``--work``) a random-weight Llama checkpoint: hidden 2048, intermediate 5632,
   22 layers, 32 heads, 4 KV heads, vocab 49152, untied embeddings: 1.17 B parameters, 4.7 GB of
   fp32 safetensors in 24 shards (embeddings, one per decoder layer, final norm + lm_head) with a
   ``model.safetensors.index.json``, ``config.json`` and the SmolLM2 tokenizer. Tensors are drawn
   one at a time (fixed seed) and written one shard at a time: the model is never held whole.
2. Runs ``python -m torch_armor prune DIR --out OUT --iters 1 --n-calib N --seq-len L --calib sotu
   --threads T --no-progress`` as a child process (the table is printed only if it succeeds); peak RSS is ``getrusage(RUSAGE_CHILDREN).ru_maxrss`` (the kernel's
   high-water mark of the largest waited-for child, read by a bare ``python -S`` wrapper that
   starts it, so the benchmark's own RSS is not inherited) and, as a cross-check, the largest sum
   of RSS over the child's process tree sampled by psutil every 0.1 s.
3. Prints a markdown table (checkpoint and per-block figures, peak, peak / checkpoint bytes) and a
   projection of the peak per process for Llama-3-70B in bf16 (assumptions printed with it).

``--dry-run`` replaces the prune by a child that only streams every block through
:class:`torch_armor.engine.checkpoint.LazyCheckpoint` (load, release): the loader's own peak.

Run:  python benchmarks/memory.py [--work DIR] [--n-calib 8 --seq-len 256] [--threads 1] [--keep]
      python benchmarks/memory.py --n-calib 4 --seq-len 128 --prune-args "--refine none" --keep
      python benchmarks/memory.py --dry-run          # build + streaming-only child
      python benchmarks/memory.py --tiny --dry-run   # seconds: smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=49152)
TINY = dict(SHAPE, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=2)
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256)
BCD_MULTIPLE = 14.0  # factorize(bcd) peak above its inputs / the layer's fp32 bytes (README "Scale")
STREAM_ONLY = """import sys
from torch_armor.engine.checkpoint import LazyCheckpoint
c = LazyCheckpoint(sys.argv[1]); c.materialize_non_decoder(); p, layers = c.decoder_layers()
for i in range(len(layers)):
    c.materialize(f"{p}.{i}"); c.release(f"{p}.{i}")
for q in c.post_decoder_prefixes():
    c.materialize(q)
"""


def linears(s: dict) -> dict:
    """{name: (d_out, d_in)} of one decoder block."""
    h, i = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * (h // s["num_attention_heads"])
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}


def block_params(s: dict) -> int:
    return sum(a * b for a, b in linears(s).values()) + 2 * s["hidden_size"]


def model_params(s: dict) -> int:  # untied: embedding + lm_head
    return s["num_hidden_layers"] * block_params(s) + 2 * s["vocab_size"] * s["hidden_size"] + s["hidden_size"]


def build(d: Path, shape: dict, seed: int = 0) -> None:
    """Write the random checkpoint shard by shard; ``.complete`` marks a finished build."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from torch_armor.recipes.assets import smollm2_tokenizer

    if (d / ".complete").exists():
        return
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    tok = smollm2_tokenizer()
    assert len(tok) == shape["vocab_size"], f"tokenizer has {len(tok)} tokens, config {shape['vocab_size']}"
    h, v, n = shape["hidden_size"], shape["vocab_size"], shape["num_hidden_layers"]
    shards = [{"model.embed_tokens.weight": (v, h)}]
    for layer in range(n):
        shard = {f"model.layers.{layer}.{k}.weight": s for k, s in linears(shape).items()}
        shard.update({f"model.layers.{layer}.input_layernorm.weight": (h,),
                      f"model.layers.{layer}.post_attention_layernorm.weight": (h,)})
        shards.append(shard)
    shards.append({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    gen = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    t0 = time.time()
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: (torch.randn(s, generator=gen) * 0.02 if len(s) == 2 else torch.ones(s))
                   for k, s in shard.items()}
        total += sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, str(d / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        del tensors
        print(f"\rbuild: shard {j + 1}/{len(shards)} ({time.time() - t0:.0f} s)", end="", file=sys.stderr)
    print(file=sys.stderr)
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    LlamaConfig(**shape, max_position_embeddings=2048, tie_word_embeddings=False, dtype="float32",
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).save_pretrained(d)
    tok.save_pretrained(d)
    (d / ".complete").write_text("ok\n")


# ru_maxrss of a child starts from its parent's RSS at fork (Linux keeps the high-water mark across
# exec), so the child is started by a bare interpreter that reports its RUSAGE_CHILDREN afterwards
WRAPPER = """import resource, subprocess, sys
rc = subprocess.call(sys.argv[2:])
open(sys.argv[1], "w").write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss))
sys.exit(rc)
"""


def run_child(cmd: list, work: Path) -> dict:
    """Run ``cmd``; return exit code, wall time, ru_maxrss peak and psutil tree peak (bytes)."""
    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rss_file = work / "child_maxrss.txt"
    t0 = time.time()
    proc = subprocess.Popen([sys.executable, "-S", "-c", WRAPPER, str(rss_file)] + cmd, env=env)
    peak, done = [0], threading.Event()

    def poll():  # sum over the wrapper's descendants (the wrapper itself excluded)
        root = psutil.Process(proc.pid)
        while not done.wait(0.1):
            try:
                peak[0] = max(peak[0], sum(p.memory_info().rss for p in root.children(recursive=True)))
            except psutil.Error:
                pass

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    rc = proc.wait()
    done.set()
    poller.join()
    maxrss = int(rss_file.read_text()) * 1024 if rss_file.exists() else 0  # KiB on Linux
    rss_file.unlink(missing_ok=True)
    return {"rc": rc, "wall_s": time.time() - t0, "maxrss": maxrss, "psutil": peak[0]}


def gb(x: float) -> str:
    return f"{x / 1e9:.2f} GB"


def report(shape: dict, disk: int, r: dict, n_calib: int, seq_len: int, what: str) -> None:
    h = shape["hidden_size"]
    n_params, b_params = model_params(shape), block_params(shape)
    big = max(a * b for a, b in linears(shape).values())
    peak = max(r["maxrss"], r["psutil"])
    hidden_fp32 = 2 * n_calib * seq_len * h * 4  # block inputs + outputs, fp32
    print(f"\n### {what} (exit code {r['rc']}, wall {r['wall_s']:.1f} s)\n")
    print("| quantity | value |\n|---|---|")
    rows = [("checkpoint params", f"{n_params / 1e9:.3f} B"), ("checkpoint bytes on disk", gb(disk)),
            ("peak RSS, ru_maxrss (largest child)", gb(r["maxrss"])),
            ("peak RSS, psutil tree sum (0.1 s polls)", gb(r["psutil"])),
            ("**peak / checkpoint bytes** (target ≤ 40%)", f"**{100 * peak / disk:.1f}%**"),
            ("block params / fp32 bytes", f"{b_params / 1e6:.1f} M / {gb(4 * b_params)}"),
            ("largest linear (fp32)", f"{big / 1e6:.1f} M / {gb(4 * big)}"),
            (f"calibration hidden states {n_calib}×{seq_len}, in+out fp32", gb(hidden_fp32)),
            ("embedding (one matrix, fp32)", gb(4 * shape["vocab_size"] * h)),
            ("wall per decoder block (wall / blocks)", f"{r['wall_s'] / shape['num_hidden_layers']:.1f} s")]
    if r.get("block_s"):
        bs = r["block_s"]
        rows.append(("ARMOR solve per block, mean / max (prune_report.json)",
                     f"{sum(bs) / len(bs):.1f} s / {max(bs):.1f} s over {len(bs)} blocks"))
    for k, v in rows:
        print(f"| {k} | {v} |")
    # per-block working set of this run, and what is left of the peak: the fixed overhead
    factor = BCD_MULTIPLE * 4 * big if what == "prune" else 0.0
    working = 4 * b_params + hidden_fp32 + factor
    fixed = max(0.0, peak - working - 4 * shape["vocab_size"] * h)
    s = LLAMA3_70B
    big70 = max(a * b for a, b in linears(s).values())
    parts = [("fixed overhead (measured peak − block working set − one vocab matrix)", fixed),
             ("one vocab matrix (embedding or lm_head), bf16", 2 * s["vocab_size"] * s["hidden_size"]),
             ("one decoder block, bf16", 2 * block_params(s)),
             (f"hidden states {n_calib}×{seq_len}, in+out, bf16", 2 * n_calib * seq_len * s["hidden_size"] * 2),
             (f"factorization: {BCD_MULTIPLE:g}× largest linear ({big70 / 1e6:.0f} M) in fp32", BCD_MULTIPLE * 4 * big70)]
    print("\n### Projection: Llama-3-70B, bf16, peak per GPU/process\n")
    print("Assumptions: the engine holds one decoder block at a time; the fixed overhead (interpreter, "
          "libraries, tokenizer, allocator) does not grow with the model; the measured working set was "
          f"block fp32 + hidden states fp32{' + 14× largest linear fp32 (bcd)' if factor else ''}"
          " + one vocab matrix (the engine frees the embedding after capture and writes each large "
          "non-decoder tensor to its own shard; counted as if resident during the solve, which overestimates); "
          "factors are built one linear at a time in fp32 (README \"Scale\": bcd peak ≈ 14× the layer's fp32 "
          "size); calibration activations are kept in the model dtype. On a GPU these parts split between "
          "device memory (block, activations, factorization) and host memory (fixed overhead).\n")
    print("| part | bytes |\n|---|---|")
    for k, v in parts:
        print(f"| {k} | {gb(v)} |")
    print(f"| **projected peak per process** | **{gb(sum(v for _, v in parts))}** |")
    print(f"| (for reference: whole 70B model in bf16) | {gb(2 * model_params(s))} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "torch_armor_memory")
    ap.add_argument("--n-calib", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and output (else deleted)")
    ap.add_argument("--dry-run", action="store_true", help="skip the prune: the child only streams the blocks")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer hidden-256 model: smoke test, not a benchmark")
    ap.add_argument("--prune-args", default="", help="more options for the prune child, e.g. '--refine none'")
    args = ap.parse_args()
    shape = TINY if args.tiny else SHAPE
    ckpt, out = args.work / ("ckpt-tiny" if args.tiny else "ckpt"), args.work / "out"
    try:
        build(ckpt, shape)
        disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        print(f"checkpoint: {ckpt} ({model_params(shape) / 1e9:.3f} B params, {gb(disk)})", file=sys.stderr)
        if args.dry_run:
            what, cmd = "streaming only (dry run)", [sys.executable, "-c", STREAM_ONLY, str(ckpt)]
        else:
            what = "prune"
            cmd = [sys.executable, "-m", "torch_armor", "prune", str(ckpt), "--out", str(out), "--iters", "1",
                   "--n-calib", str(args.n_calib), "--seq-len", str(args.seq_len), "--calib", "sotu",
                   "--threads", str(args.threads), "--no-progress", "--stream"] + shlex.split(args.prune_args)
        print("child: " + " ".join(cmd[:2] + ["..."] + cmd[3:] if args.dry_run else cmd), file=sys.stderr)
        shutil.rmtree(out, ignore_errors=True)  # the prune refuses a non-empty --out
        r = run_child(cmd, args.work)
        if r["rc"] != 0:
            sys.exit(f"the child failed with exit code {r['rc']} (its output is above); no table")
        if (out / "prune_report.json").is_file():  # per-layer solve seconds, summed per block
            per_block: dict = {}
            for layer in json.loads((out / "prune_report.json").read_text())["layers"]:
                b = int(layer["name"].split(".")[2])
                per_block[b] = per_block.get(b, 0.0) + layer["seconds"]
            r["block_s"] = list(per_block.values())
        report(shape, disk, r, args.n_calib, args.seq_len, what)
    finally:
        if not args.keep:
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
