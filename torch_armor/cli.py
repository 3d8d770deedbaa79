"""Command line: ``torch-armor prune | eval | demo`` (also ``python -m torch_armor``).

Examples::

    # ARMOR 2:4 on the embedded SmolLM2-135M, block size chosen per layer within 5% overhead
    torch-armor prune smollm2 --block-size auto --out runs/smollm2-armor
    # the same on 2 processes (layers sharded by cost); rerunning a killed command resumes it
    torchrun --nproc-per-node 2 -m torch_armor prune smollm2 --block-size auto --out runs/smollm2-armor
    # a baseline on a local Hugging Face checkpoint, two decoder layers only
    torch-armor prune ./Llama-3.2-1B --method sparsegpt --layers 0-1 --out runs/llama-sgpt
    # perplexity (64 non-overlapping 512-token windows of the Wikipedia text by default)
    torch-armor eval runs/smollm2-armor
    # the quality table: dense, magnitude, Wanda, SparseGPT, NoWag-P, ARMOR on SmolLM2
    torch-armor demo

Progress bars and phase messages go to stderr; results (perplexity, tables) to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

__all__ = ["main", "build_parser"]

REPORT_JSON = "prune_report.json"
REPORT_PNG = "prune_report.png"
_METHODS = ("armor", "nowag", "wanda", "sparsegpt", "magnitude")
_DEMO_METHODS = ("dense", "magnitude", "wanda", "sparsegpt", "nowag", "armor")


def _block_size(text: str):
    if text == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"block size must be positive, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads (default: PyTorch's choice)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _add_model(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("model", metavar="MODEL", help=help_text)
    p.add_argument("--gguf-file", default=None, help="GGUF file inside the MODEL directory / hub repo")
    p.add_argument("--dtype", default=None,
                   help="load dtype: float32 (default for fresh loads), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default), cuda, …")


def _add_armor(p: argparse.ArgumentParser, optimizer_default: str, budget_default) -> None:
    from torch_armor.config import ArmorConfig

    defaults = ArmorConfig()  # the one default
    block_default = defaults.block_size
    g = p.add_argument_group("ARMOR")
    g.add_argument("--block-size", type=_block_size, default=block_default,
                   help=f"wrapper block size d_b, or 'auto': per layer, the largest d_b dividing both "
                        f"dimensions within --max-overhead (default {block_default})")
    g.add_argument("--max-overhead", type=_positive_float, default=defaults.max_overhead,
                   help="wrapper-overhead budget of --block-size auto, a fraction (default 0.05 = 5%%)")
    g.add_argument("--optimizer", choices=("bcd", "adam"), default=optimizer_default,
                   help=f"per-layer optimizer (default {optimizer_default})")
    g.add_argument("--iters", type=int, default=None,
                   help="iterations per layer (default: 30 BCD sweeps; 1000 Adam steps)")
    g.add_argument("--time-budget", type=_positive_float, default=budget_default,
                   help="stop each layer after this many wall seconds (default: no limit)")
    g.add_argument("--seed", type=int, default=0, help="seed of calibration windows and group selection")


def build_parser() -> argparse.ArgumentParser:
    """The ``torch-armor`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="torch-armor",
        description="ARMOR 2:4 semi-structured pruning: prune a checkpoint, evaluate it, or run the demo.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{prune,eval,demo}")
    sub.required = True

    p = sub.add_parser("prune", help="prune a model and save it with a per-layer report",
                       description="Calibrate, prune every decoder linear (never embeddings or lm_head), "
                                   "save the model (safetensors) and tokenizer to --out with a per-layer "
                                   "report (prune_report.json, prune_report.png).")
    _add_model(p, "'smollm2' (embedded SmolLM2-135M), a local Hugging Face directory, or a hub id")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--method", choices=_METHODS, default="armor", help="pruning method (default armor)")
    p.add_argument("--pattern", default="2:4", help="'2:4' (default), 'N:M' or 'unstructured:F'")
    p.add_argument("--calib", default="sotu",
                   help="calibration text: sotu (default), wiki, a file/dir/glob, or a datasets name")
    p.add_argument("--n-calib", type=_positive_int, default=64, help="calibration windows (default 64)")
    p.add_argument("--layers", default=None,
                   help="prune only some decoder layers: indices like '0-1' or '0,4-6', or a regex on names")
    _add_armor(p, "bcd", None)
    g = p.add_argument_group("runs (ARMOR)")
    g.add_argument("--run-dir", default=None,
                   help=f"where statistics and every finished layer are saved as they complete; rerunning the "
                        f"same command resumes from it (default OUT/{RUN_DIR_NAME}, deleted after a successful "
                        "save; a given --run-dir is kept)")
    g.add_argument("--keep-run-dir", action="store_true", help=f"keep OUT/{RUN_DIR_NAME} after success")
    p.add_argument("--storage", choices=("auto", "dense", "compact", "semi_structured"), default=None,
                   help="ARMOR core storage at run time after loading (default: dense on CPU, auto elsewhere; "
                        "the file always stores compact N:M cores)")
    p.add_argument("--sparsegpt-block-size", type=_positive_int, default=128, help="SparseGPT lazy block (128)")
    p.add_argument("--damp", type=float, default=0.01, help="SparseGPT dampening (0.01)")
    _add_common(p)

    e = sub.add_parser("eval", help="perplexity of a model or a pruned directory",
                       description="Token-level perplexity over the first --n-eval non-overlapping "
                                   "--seq-len windows of --data.")
    _add_model(e, "a directory written by 'prune', 'smollm2', a local Hugging Face directory, or a hub id")
    e.add_argument("--data", default="wiki",
                   help="evaluation text: wiki (default), sotu, a file/dir/glob, or a datasets name")
    e.add_argument("--n-eval", type=_positive_int, default=64, help="evaluation windows (default 64)")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    _add_common(e)

    d = sub.add_parser("demo", help="quality table of every method on SmolLM2-135M",
                       description="SmolLM2-135M, sotu calibration, Wikipedia evaluation: prune with every "
                                   "method from one set of statistics and print the quality table.")
    d.add_argument("--methods", nargs="+", choices=_DEMO_METHODS, default=list(_DEMO_METHODS),
                   help="rows to run (default: all)")
    d.add_argument("--pattern", default="2:4", help="sparsity pattern (default 2:4)")
    d.add_argument("--calib", default="sotu", help="calibration text (default sotu)")
    d.add_argument("--n-calib", type=_positive_int, default=64, help="calibration windows (default 64)")
    d.add_argument("--data", default="wiki", help="evaluation text (default wiki)")
    d.add_argument("--n-eval", type=_positive_int, default=64, help="evaluation windows (default 64)")
    d.add_argument("--layers", default=None, help="prune only some decoder layers (indices or regex)")
    _add_armor(d, "bcd", None)
    d.add_argument("--armor-eval", choices=("materialized", "tensor"), default="materialized",
                   help="evaluate ARMOR with W_hat materialized as dense matrices (default; same function, "
                        "fastest on CPU) or through the ArmorTensor weights")
    d.add_argument("--json", default=None, metavar="PATH", help="also write rows, reports and timings as JSON")
    _add_common(d)
    return parser


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _setup(args: argparse.Namespace) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)


def _armor_config(args: argparse.Namespace):
    """ArmorConfig from the ARMOR options (``ArmorConfig()``'s defaults for the others)."""
    from torch_armor.config import ArmorConfig, parse_pattern

    overrides = {"pattern": str(parse_pattern(args.pattern)), "optimizer": args.optimizer, "seed": args.seed,
                 "block_size": args.block_size, "max_overhead": args.max_overhead}
    if args.iters is not None:
        overrides["num_iters"] = args.iters
    if args.time_budget is not None:
        overrides["time_budget_s"] = args.time_budget
    return ArmorConfig(**overrides)


def _on_cpu(model) -> bool:
    return all(p.device.type == "cpu" for p in model.parameters())


RUN_DIR_NAME = "armor_run"


def _check_out(out: Path, overwrite: bool, allowed: Sequence[str] = ()) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    leftovers = [p for p in out.iterdir() if p.name not in allowed] if out.is_dir() else []
    if leftovers and not overwrite:
        raise ValueError(f"--out {out} is not empty; pass --overwrite to write into it")


def _run_identity(args: argparse.Namespace) -> str:
    """What must not change between the first run and a resumed one, besides the config."""
    return json.dumps({"model": args.model, "gguf_file": args.gguf_file, "dtype": args.dtype,
                       "calib": args.calib, "n_calib": args.n_calib, "seq_len": args.seq_len,
                       "seed": args.seed, "layers": args.layers}, sort_keys=True)


def _armor_factors(args, model, names, windows_fn, cfg, run_dir: Path):
    """Statistics (cached in ``run_dir``) and factors of every layer, sharded over the ranks of a
    ``torchrun`` job and resumable: finished layers in ``run_dir`` are not computed again."""
    from torch_armor.engine.distributed import distributed_factorize, shared_statistics
    from torch_armor.recipes.pipeline import armor_layer_configs, calibration_statistics
    from torch_armor.engine.runstore import RunStore, hash_statistics

    model_id = _run_identity(args)

    def compute():
        windows = windows_fn()
        return calibration_statistics(model, windows, names, batch_size=args.batch_size,
                                      progress=not args.no_progress)

    t = time.perf_counter()
    stats = shared_statistics(run_dir, model_id, compute)
    calib_s = time.perf_counter() - t
    layer_cfgs = armor_layer_configs(model, names, cfg, args.pattern, block_size=args.block_size,
                                     max_overhead=args.max_overhead)
    store = RunStore(run_dir, cfg, model_id, hash_statistics(stats))
    done = len(store.finished(names))
    if done and store.rank == 0:
        _log(f"resuming {run_dir}: {done} of {len(names)} layers already finished")
    layers = {n: (model.get_submodule(n).weight.detach(), stats[n]) for n in names}
    t = time.perf_counter()
    factors = distributed_factorize(layers, cfg, store, per_layer_overrides=layer_cfgs,
                                    progress=not args.no_progress)
    return stats, factors, calib_s, time.perf_counter() - t


def _cmd_prune(args: argparse.Namespace) -> int:
    from torch_armor.engine.distributed import init_distributed

    out = Path(args.out)
    armor = args.method == "armor"
    run_dir = Path(args.run_dir) if args.run_dir else out / RUN_DIR_NAME
    if not armor and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ValueError(f"only --method armor runs on several ranks; run {args.method} without torchrun")
    _check_out(out, args.overwrite, allowed=(RUN_DIR_NAME,) if armor and not args.run_dir else ())
    topo = init_distributed(device=args.device) if armor else None
    try:
        return _prune(args, out, run_dir, topo)
    finally:
        if topo is not None and topo.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def _prune(args: argparse.Namespace, out: Path, run_dir: Path, topo) -> int:
    _setup(args)
    start = time.perf_counter()
    from torch_armor.recipes.data import calibration_windows
    from torch_armor.recipes.pipeline import calibration_statistics, load_model, prune, select_layers
    from torch_armor.tensor.serialization import save_pretrained

    armor = args.method == "armor"
    rank, world = (topo.rank, topo.world_size) if topo is not None else (0, 1)
    cfg = _armor_config(args) if armor else None
    if rank == 0:
        _log(f"loading {args.model} …")
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    names = select_layers(model, args.layers)

    def windows():
        if rank == 0:
            _log(f"{len(names)} linears to prune with {args.method} {args.pattern}; calibrating on "
                 f"{args.n_calib}×{args.seq_len} tokens of {args.calib}")
        return calibration_windows(args.calib, tokenizer, n_windows=args.n_calib, seq_len=args.seq_len,
                                   seed=args.seed)

    factors = None
    if armor:
        if world > 1 and rank == 0:
            _log(f"{world} ranks share the layers; finished layers go to {run_dir}")
        stats, factors, calib_s, factorize_s = _armor_factors(args, model, names, windows, cfg, run_dir)
        if rank != 0:
            return 0
    else:
        t = time.perf_counter()
        stats = calibration_statistics(model, windows(), names, track_xtx=args.method == "sparsegpt",
                                       batch_size=args.batch_size, progress=not args.no_progress)
        calib_s = time.perf_counter() - t
    report = prune(model, args.method, stats, names, args.pattern, cfg,
                   block_size=args.block_size if armor else None,
                   max_overhead=args.max_overhead, sparsegpt_block_size=args.sparsegpt_block_size,
                   damp=args.damp, storage=args.storage or ("dense" if _on_cpu(model) else "auto"),
                   progress=False if armor else not args.no_progress, factors=factors)
    if armor:  # wall time of the factorization (this run's part of it, on all ranks), not the conversion
        report.seconds = factorize_s
    _log(f"saving to {out} …")
    out.mkdir(parents=True, exist_ok=True)
    save_pretrained(model, out)
    tokenizer.save_pretrained(str(out))
    meta = {
        "command": "torch-armor " + shlex.join(args.argv),
        "model": args.model,
        "ranks": world,
        "calibration": {"source": args.calib, "n_windows": args.n_calib, "seq_len": args.seq_len,
                        "seed": args.seed, "seconds": calib_s},
    }
    report.save_json(out / REPORT_JSON, **meta)
    report.save_plot(out / REPORT_PNG, title=None)
    if armor and not args.run_dir and not args.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    total = time.perf_counter() - start
    print(f"pruned {len(report.layers)} linears of {args.model} with {args.method} {report.pattern}: "
          f"mean relative proxy loss {report.mean_relative_proxy_loss:.4f} (NoWag-P = 1)"
          + (f", wrapper overhead {100 * report.overhead:.2f}%" if report.overhead else "")
          + f", pruning {report.seconds:.1f} s, total {total:.1f} s")
    print(f"saved model, tokenizer, {REPORT_JSON} and {REPORT_PNG} to {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    _setup(args)
    from torch_armor.recipes.data import eval_windows
    from torch_armor.recipes.evaluate import perplexity
    from torch_armor.recipes.pipeline import load_model

    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    windows = eval_windows(args.data, tokenizer, n_windows=args.n_eval, seq_len=args.seq_len)
    t = time.perf_counter()
    ppl = perplexity(model, windows, batch_size=args.batch_size, progress=not args.no_progress)
    seconds = time.perf_counter() - t
    if args.json:
        print(json.dumps({"model": args.model, "data": args.data, "n_eval": args.n_eval,
                          "seq_len": args.seq_len, "perplexity": ppl, "seconds": seconds}))
    else:
        print(f"perplexity: {ppl:.10g} ({args.data}, {args.n_eval} windows × {args.seq_len} tokens, {seconds:.1f} s)")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    _setup(args)
    from torch_armor.recipes.pipeline import run_quality

    cfg = _armor_config(args)
    result = run_quality(
        "smollm2", methods=args.methods, armor_configs=[cfg],
        armor_block_size="auto" if args.block_size == "auto" else None,
        max_overhead=args.max_overhead, pattern=args.pattern, calib=args.calib, n_calib=args.n_calib,
        eval_data=args.data, n_eval=args.n_eval, seq_len=args.seq_len, layers=args.layers,
        batch_size=args.batch_size, seed=args.seed, armor_eval=args.armor_eval,
        progress=not args.no_progress, log=_log,
    )
    s = result.settings
    print(f"SmolLM2-135M fp32, {args.pattern}; calibration {s['n_calib']}×{s['seq_len']} tokens of {s['calib']}, "
          f"evaluation {s['n_eval']}×{s['seq_len']} tokens of {s['eval']}; {s['num_layers']} linears pruned; "
          f"{s['threads']} threads; ARMOR evaluated {args.armor_eval}")
    print()
    print(result.table())
    print()
    print(f"total wall time {result.timings['total'] / 60:.1f} min")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=2, default=str)
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``torch-armor``; returns the exit status (2 on a usage or input error).

    Example::

        >>> main(["prune", "smollm2", "--out", "runs/x", "--layers", "0-1"])   # doctest: +SKIP
        0
    """
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(argv)
    args.argv = argv
    commands = {"prune": _cmd_prune, "eval": _cmd_eval, "demo": _cmd_demo}
    try:
        return commands[args.command](args)
    except (ValueError, FileNotFoundError) as err:
        print(f"torch-armor {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
