"""Scale benchmark: per-layer peak memory and time, 7B / 70B projections, 1 rank vs 2 ranks.

Three parts (``all`` runs them in this order and prints one report):

* ``memory``: ``factorize`` on random fp32 layers of 576×1536 (SmolLM2 MLP, block 64),
  4096×4096 and 4096×11008 (Llama-2-7B attention / MLP, block 128), with ``bcd`` and
  ``adam``, each in a fresh process. Peak memory is the kernel's high-water mark of the
  process's resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` after the inputs
  are allocated) minus the resident set at that point: torch's CPU allocator is malloc, and
  large tensors are mmap-ed and returned on free, so this is what the layer costs the
  machine. Reported as a multiple of the layer's fp32 size ``4·d_out·d_in``. Time per
  iteration (``bcd`` sweep / ``adam`` step) comes from ``ArmorFactors.history_time_s``.
* ``projection``: time and memory for Llama-2-7B and Llama-2-70B, scaling the measured time
  per iteration by ``d_out·d_in·d_b`` (both optimizers do block-diagonal products and
  ``O(d_b)``-per-entry group updates) and memory by the layer size.
* ``ranks``: a SmolLM2-135M prune (all 210 decoder linears, real sotu statistics, short budget
  ``ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3))``) through
  :func:`torch_armor.armor.distributed.distributed_factorize` with 1 rank × 1 thread, 1 rank ×
  2 threads, and ``torchrun --nproc-per-node 2`` × 1 thread, from the same cached weights and
  statistics (``benchmarks/out/``), timing the factorization (all ranks started) and the whole
  process, and checking that the factors are bit-identical.

Measured on the 2-core shared dev VM (full report: ``benchmarks/out/scale.txt``): factorize's
peak memory above its inputs is about 14x the layer's fp32 size with ``bcd`` and 18-20x with
``adam`` (4096x4096 and 4096x11008); small layers add a fixed ~50-100 MB of allocator overhead.
One bcd sweep costs ~3-4 ns per ``d_out·d_in·d_b``, one adam step ~1.1-1.2 ns (1 thread).

Run:  python benchmarks/scale.py [all|memory|ranks] [--threads 2] [--out benchmarks/out/scale.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT_DIR = Path(__file__).resolve().parent / "out"

# (d_out, d_in, block size, {optimizer: iterations measured})
SHAPES = [
    (576, 1536, 64, {"bcd": 3, "adam": 10}),
    (4096, 4096, 128, {"bcd": 1, "adam": 4}),
    (4096, 11008, 128, {"bcd": 1, "adam": 4}),
]
# projection budgets: bcd 200 sweeps, adam 1000 steps (its ArmorConfig default) and the paper's 20,000
BUDGETS = [("bcd", 200), ("adam", 1000), ("adam", 20000)]
MODELS = {
    "Llama-2-7B": (32, [(4096, 4096)] * 4 + [(11008, 4096)] * 2 + [(4096, 11008)]),
    "Llama-2-70B": (80, [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192),
                         (28672, 8192), (28672, 8192), (8192, 28672)]),
}
SMOL_BLOCK, SMOL_ITERS = 16, 3


def smol_config():
    """``ArmorConfig(block_size=16, optimizer=BcdConfig(iters=3))`` (torch_armor imported on use)."""
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig

    return ArmorConfig(block_size=SMOL_BLOCK, optimizer=BcdConfig(iters=SMOL_ITERS))
SMOL_WINDOWS = 8


# ------------------------------------------------------------------------------ helpers


def _proc_status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    if match is None:
        raise RuntimeError(f"/proc/self/status has no {key}: this benchmark needs Linux")
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS (Linux ≥ 4.0)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.0f} MB" if n < 2**30 else f"{n / 2**30:,.2f} GB"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class Report:
    def __init__(self, path: Optional[Path]) -> None:
        self.lines: List[str] = []
        self.path = path

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def save(self) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("\n".join(self.lines) + "\n")


def _python(*args: str, threads: int, timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def _last_json(proc: subprocess.CompletedProcess, what: str) -> dict:
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what} printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


# ------------------------------------------------------------------------------ memory


def cmd_measure(args: argparse.Namespace) -> None:
    """(fresh process) factorize one random layer; print peak memory and times as JSON."""
    torch.set_num_threads(args.threads)
    from torch_armor import ArmorConfig
    from torch_armor.core.factorize import factorize
    from torch_armor.config.levers import OPTIMIZERS

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(args.d_out, args.d_in, generator=g)
    h = torch.rand(args.d_in, generator=g).pow(3) * 10 + 1e-2
    cfg = ArmorConfig(block_size=args.block, optimizer=OPTIMIZERS[args.optimizer](iters=args.iters))
    # warm up on a small layer: thread pools, allocator arenas and kernels are set up once per
    # process (~50-100 MB here), not per layer
    b = args.block
    factorize(torch.randn(2 * b, 4 * b, generator=g), torch.rand(4 * b, generator=g) + 0.1,
              ArmorConfig(block_size=b, optimizer=OPTIMIZERS[args.optimizer](iters=2)))
    _reset_peak()
    base = _proc_status("VmRSS")
    start = time.perf_counter()
    factors = factorize(weight, h, cfg)
    total = time.perf_counter() - start
    peak = _proc_status("VmHWM")
    times = factors.history_time_s.tolist()
    steps = [b - a for a, b in zip(times, times[1:])]
    result_bytes = sum(t.numel() * t.element_size() for t in (factors.a_blocks, factors.core, factors.b_blocks,
                                                              factors.mask))
    print(json.dumps({
        "d_out": args.d_out, "d_in": args.d_in, "block": args.block, "optimizer": args.optimizer,
        "iters": args.iters, "threads": args.threads, "layer_bytes": 4 * args.d_out * args.d_in,
        "base_rss": base, "peak_extra": peak - base, "result_bytes": result_bytes,
        "total_s": total, "setup_s": total - times[-1], "first_iter_s": steps[0],
        "iter_s": statistics.median(steps[1:]) if len(steps) > 1 else steps[0],
    }))


def run_memory(report: Report, thread_counts: List[int]) -> List[dict]:
    report("## Per-layer peak memory and time (fp32, CPU, a fresh process per row)")
    report("")
    report("peak extra = high-water RSS during factorize() minus RSS with the inputs allocated (after a small "
           "warm-up layer in the same process); x layer = ÷ 4·d_out·d_in; result = the returned factors; "
           "setup = normalization, NoWag-P init and packing the result; iter = median bcd sweep / adam step "
           "after the first")
    report("")
    header = (f"{'shape':>12} {'d_b':>4} {'opt':>5} {'thr':>3} {'iters':>5} | {'layer':>8} {'peak extra':>10} "
              f"{'x layer':>7} {'result':>8} | {'setup':>7} {'1st iter':>8} {'iter':>8} {'ns/(elem·d_b)':>13}")
    report(header)
    report("-" * len(header))
    rows = []
    for d_out, d_in, block, iters in SHAPES:
        for optimizer in ("bcd", "adam"):
            for threads in thread_counts:
                proc = _python(__file__, "measure", "--d-out", str(d_out), "--d-in", str(d_in), "--block", str(block),
                               "--optimizer", optimizer, "--iters", str(iters[optimizer]), "--threads", str(threads),
                               threads=threads, timeout=3600)
                r = _last_json(proc, f"measure {d_out}x{d_in} {optimizer}")
                r["ns_per_elem_db"] = r["iter_s"] / (d_out * d_in * block) * 1e9
                rows.append(r)
                report(f"{f'{d_out}x{d_in}':>12} {block:>4} {optimizer:>5} {threads:>3} {r['iters']:>5} | "
                       f"{_mb(r['layer_bytes']):>8} "
                       f"{_mb(r['peak_extra']):>10} {r['peak_extra'] / r['layer_bytes']:>6.1f}x "
                       f"{_mb(r['result_bytes']):>8} | {r['setup_s']:>6.1f}s {r['first_iter_s']:>7.2f}s "
                       f"{r['iter_s']:>7.2f}s {r['ns_per_elem_db']:>13.3f}")
    report("")
    return rows


def run_projection(report: Report, rows: List[dict]) -> None:
    big = [r for r in rows if r["block"] == 128]
    cost, used = {}, {}
    for opt in ("bcd", "adam"):  # the faster thread count measured (per-element cost averaged over both shapes)
        per_threads = {t: statistics.mean(r["ns_per_elem_db"] for r in big if r["optimizer"] == opt and r["threads"] == t)
                       for t in sorted({r["threads"] for r in big})}
        used[opt] = min(per_threads, key=per_threads.get)
        cost[opt] = per_threads[used[opt]] * 1e-9
    ratio = max(r["peak_extra"] / r["layer_bytes"] for r in big)
    report("## Projection to Llama-2 (block 128, fp32, one CPU process)")
    report("")
    report("Assumptions: time per iteration = c · d_out·d_in·d_b, with c the per-element cost measured on 4096x4096 "
           "and 4096x11008 (mean of the two) at the faster thread count measured ("
           + ", ".join(f"{o}: {c * 1e9:.3f} ns at {used[o]} thread{'s' if used[o] > 1 else ''}" for o, c in cost.items())
           + "); the one-off setup per layer is left out (a few iterations' worth); peak memory per process = "
           f"{ratio:.1f}x (the largest measured ratio) the largest layer's fp32 size, on top of that layer's weight "
           "and whatever holds the model (pass layers lazily to keep one resident). R ranks / GPUs divide the time "
           "by about R (LPT keeps the busiest rank within one layer of the mean). GPU speed was not measured here.")
    report("")
    header = f"{'model':>12} {'linears':>7} {'elements':>9} {'largest layer':>14} {'peak/process':>12} | " + " ".join(
        f"{f'{o} x{n:,}':>14}" for o, n in BUDGETS)
    report(header)
    report("-" * len(header))
    for model, (n_layers, shapes) in MODELS.items():
        elements = n_layers * sum(a * b for a, b in shapes)
        largest = max(a * b for a, b in shapes) * 4
        per_iter = {opt: c * elements * 128 for opt, c in cost.items()}
        report(f"{model:>12} {n_layers * len(shapes):>7} {elements / 1e9:>8.2f}B {_mb(largest):>14} "
               f"{_mb(ratio * largest):>12} | " + " ".join(f"{_duration(per_iter[o] * n):>14}" for o, n in BUDGETS))
    report("")
    for model, (n_layers, shapes) in MODELS.items():
        elements = n_layers * sum(a * b for a, b in shapes)
        report(f"{model}: one bcd sweep over all linears {_duration(cost['bcd'] * elements * 128)}, "
               f"one adam step {_duration(cost['adam'] * elements * 128)}")
    report("")


# ------------------------------------------------------------------------------ ranks


def smollm2_cache(report: Report) -> Path:
    """Weights and sotu statistics of SmolLM2's 210 decoder linears, cached as safetensors."""
    from safetensors.torch import save_file

    path = OUT_DIR / f"smollm2_linears_{SMOL_WINDOWS}x512_seed0.safetensors"
    if path.exists():
        report(f"(SmolLM2 weights and statistics from the cache {path.relative_to(ROOT)})")
        return path
    from torch_armor.recipes.assets import load_smollm2
    from torch_armor.recipes.data import calibration_windows
    from torch_armor.calibration.observer import collect_statistics, decoder_linear_names
    from torch_armor.engine.identity import hash_statistics

    start = time.perf_counter()
    model, tokenizer = load_smollm2(torch.float32)
    names = decoder_linear_names(model)
    windows = calibration_windows("sotu", tokenizer, n_windows=SMOL_WINDOWS, seq_len=512, seed=0)
    stats = collect_statistics(model, names, windows, batch_size=4, progress=False)
    modules = dict(model.named_modules())
    tensors = {}
    for n in names:
        tensors[f"{n}.weight"] = modules[n].weight.detach().float().contiguous()
        tensors[f"{n}.act_sq_norm"] = stats[n].act_sq_norm.float().contiguous()
    meta = {"names": json.dumps(names), "stats_hash": hash_statistics({n: stats[n] for n in names}),
            "protocol": f"sotu, {SMOL_WINDOWS} windows x 512 tokens, seed 0"}
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)
    report(f"(cached SmolLM2 weights and statistics for {len(names)} linears in {time.perf_counter() - start:.0f} s: "
           f"{path.relative_to(ROOT)})")
    return path


def cmd_prune_worker(args: argparse.Namespace) -> None:
    """(one rank) factorize every cached SmolLM2 linear; rank 0 prints the time and a fingerprint."""
    torch.set_num_threads(args.threads)
    import torch.distributed as dist
    from safetensors import safe_open

    from torch_armor.armor.distributed import distributed_factorize, layer_cost
    from torch_armor.engine.topology import init_distributed
    from torch_armor.engine.identity import hash_tensors
    from torch_armor.engine.runstore import RunStore

    topo = init_distributed()
    cfg = smol_config()
    with safe_open(args.cache, framework="pt") as fh:
        meta = fh.metadata()
        names = json.loads(meta["names"])
        names = names[:args.limit] if args.limit else names
        layers = {n: (lambda n=n: (fh.get_tensor(f"{n}.weight"), fh.get_tensor(f"{n}.act_sq_norm"))) for n in names}
        costs = {n: layer_cost(tuple(fh.get_slice(f"{n}.weight").get_shape()), cfg.block_size) for n in names}
        store = RunStore(args.run_dir, cfg, "SmolLM2-135M-Instruct Q4_1 (benchmark)", meta["stats_hash"])
        if topo.world_size > 1:
            dist.barrier()
        start = time.perf_counter()
        factors = distributed_factorize(layers, cfg, store, costs=costs, progress=False)
        seconds = time.perf_counter() - start
    if topo.rank == 0:
        keys = ("a_blocks", "core", "b_blocks", "mask", "history", "history_iters")
        fingerprint = hash_tensors({f"{n}/{k}": getattr(f, k) for n, f in factors.items() for k in keys})
        cpu = time.process_time()
        print(json.dumps({"seconds": seconds, "layers": len(factors), "fingerprint": fingerprint,
                          "rank0_cpu_s": cpu, "world": topo.world_size}), flush=True)
    if topo.initialized_here:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(report: Report, limit: int = 0) -> None:
    report("## SmolLM2-135M prune: 1 rank vs 2 ranks (torchrun, gloo) on this machine")
    report("")
    cache = smollm2_cache(report)
    report(f"config: {smol_config()!r}, "
           f"{limit or 210} linears, "
           f"statistics: sotu {SMOL_WINDOWS} x 512 tokens; layers loaded lazily per rank from the cache")
    report("")
    header = f"{'setup':>24} | {'factorize wall':>14} {'process wall':>12} | {'vs 1x2':>6} {'identical to 1x1':>16}"
    report(header)
    report("-" * len(header))
    runs = [("1 rank x 1 thread", 1, 1), ("1 rank x 2 threads", 1, 2), ("2 ranks x 1 thread", 2, 1)]
    results: Dict[str, dict] = {}
    for label, ranks, threads in runs:
        with tempfile.TemporaryDirectory() as run_dir:
            worker = [__file__, "prune-worker", "--cache", str(cache), "--run-dir", run_dir, "--threads", str(threads),
                      "--limit", str(limit)]
            if ranks > 1:
                cmd = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                       "--master-port", str(_free_port()), *worker]
            else:
                cmd = worker
            start = time.perf_counter()
            proc = _python(*cmd, threads=threads, timeout=3600)
            wall = time.perf_counter() - start
        r = _last_json(proc, label)
        r["wall"] = wall
        results[label] = r
        base = results.get("1 rank x 2 threads")
        vs = f"{r['seconds'] / base['seconds']:.2f}" if base else "-"
        same = r["fingerprint"] == results["1 rank x 1 thread"]["fingerprint"]
        report(f"{label:>24} | {r['seconds']:>13.1f}s {wall:>11.1f}s | {vs:>6} {str(same):>16}")
    two, one2, one1 = (results[k]["seconds"] for k in ("2 ranks x 1 thread", "1 rank x 2 threads", "1 rank x 1 thread"))
    report("")
    report(f"2 ranks / 1 rank (same 2 cores): {two / one2:.2f} against 1 rank x 2 threads, "
           f"{two / one1:.2f} against 1 rank x 1 thread. Process wall includes Python/torch start-up "
           "(twice for torchrun) and rank 0 loading every layer's factors back at the end. 'identical' compares "
           "every factor tensor bit for bit: results are reproducible at equal threads per process; another "
           "thread count changes the order of floating-point reductions, hence the last bits.")
    report("")


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    for name in ("all", "memory", "ranks"):
        p = sub.add_parser(name)
        p.add_argument("--threads", type=int, nargs="+", default=[1, 2],
                       help="thread counts to measure the per-layer part with (default: 1 and 2)")
        p.add_argument("--out", default=str(OUT_DIR / "scale.txt"), help="also write the report here ('' = no)")
        p.add_argument("--limit", type=int, default=0, help="ranks part: only the first N linears (smoke test)")
    m = sub.add_parser("measure")
    for flag in ("--d-out", "--d-in", "--block", "--iters", "--threads"):
        m.add_argument(flag, type=int, required=True)
    m.add_argument("--optimizer", required=True)
    w = sub.add_parser("prune-worker")
    w.add_argument("--cache", required=True)
    w.add_argument("--run-dir", required=True)
    w.add_argument("--threads", type=int, default=1)
    w.add_argument("--limit", type=int, default=0)
    args = parser.parse_args()
    if args.cmd == "measure":
        return cmd_measure(args)
    if args.cmd == "prune-worker":
        return cmd_prune_worker(args)
    cmd = args.cmd or "all"
    thread_counts = getattr(args, "threads", [1, 2])
    out = getattr(args, "out", str(OUT_DIR / "scale.txt"))
    report = Report(Path(out) if out else None)
    report("$ " + shlex.join(["python", "benchmarks/scale.py", *sys.argv[1:]]))
    report(f"# {platform.node()}: {os.cpu_count()} CPUs, torch {torch.__version__}, load average at start "
           f"{', '.join(f'{x:.1f}' for x in os.getloadavg())} (shared machine: times are wall clock)")
    report("")
    start = time.perf_counter()
    if cmd in ("all", "memory"):
        rows = run_memory(report, thread_counts)
        run_projection(report, rows)
    if cmd in ("all", "ranks"):
        run_ranks(report, args.limit)
    report(f"(total {time.perf_counter() - start:.0f} s; load average at end "
           f"{', '.join(f'{x:.1f}' for x in os.getloadavg())})")
    report.save()


if __name__ == "__main__":
    main()
