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

Progress bars and phase messages go to stderr; results (perplexity, tables) to stdout. When stderr
is not a terminal (a log file), each stage prints one line instead of a bar.

Errors: a bad argument, model, file or a failed write prints one line
``torch-armor CMD: error: …`` naming what is at fault and what to do, and exits with status 2;
``--debug`` (or ``TORCH_ARMOR_DEBUG=1``) shows the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
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
    if text in ("auto", "budget"):
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, 'auto' or 'budget', got {text!r}") from None
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


_SEED_MAX = 2**63 - 1


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer seed, got {text!r}") from None
    if not 0 <= value <= _SEED_MAX:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**63 - 1], got {value}")
    return value


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=_positive_int, default=512, help="tokens per window (default 512)")
    p.add_argument("--batch-size", type=_positive_int, default=8, help="windows per forward pass (default 8)")
    p.add_argument("--threads", type=_positive_int, default=None,
                   help="torch.set_num_threads (default: PyTorch's choice)")
    p.add_argument("--no-progress", action="store_true",
                   help="hide progress bars (also transformers' loading bar)")
    p.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error (also TORCH_ARMOR_DEBUG=1)")


def _add_model(p: argparse.ArgumentParser, help_text: str) -> None:
    p.add_argument("model", metavar="MODEL", help=help_text)
    p.add_argument("--gguf-file", default=None, help="GGUF file inside the MODEL directory / hub repo")
    p.add_argument("--dtype", default=None,
                   help="load dtype: float32 (default for fresh loads), bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default), cuda, …")


def _add_armor(p: argparse.ArgumentParser) -> None:
    """The ARMOR options; their defaults are ArmorConfig's (documented there, in one place)."""
    from torch_armor.config import ArmorConfig

    default = ArmorConfig()
    g = p.add_argument_group("ARMOR")
    g.add_argument("--block-size", type=_block_size, default=default.block_size,
                   help=f"wrapper block size d_b; 'auto': per layer, the largest d_b dividing both dimensions "
                        f"within --max-overhead; 'budget': one --max-overhead budget for the whole model, "
                        f"spent where it lowers the loss most (default {default.block_size})")
    g.add_argument("--max-overhead", type=_positive_float, default=default.max_overhead,
                   help="wrapper-overhead budget of --block-size auto/budget, a fraction (default 0.05 = 5%%)")
    g.add_argument("--refine", choices=("output", "none"), default=default.refine or "none",
                   help=f"after each layer's optimizer, refine A, core values and B under the output-space "
                        f"loss tr((W-Ŵ) XᵀX (W-Ŵ)ᵀ) (default {default.refine or 'none'})")
    g.add_argument("--reconstruct-steps", type=int, default=default.reconstruct_steps,
                   help=f"Adam steps of block reconstruction per decoder block (default {default.reconstruct_steps}: off)")
    g.add_argument("--optimizer", choices=("bcd", "adam"), default=default.optimizer,
                   help=f"per-layer optimizer (default {default.optimizer})")
    g.add_argument("--iters", type=int, default=None,
                   help=f"iterations per layer (default: {default.iterations} bcd sweeps; 1000 adam steps)")
    g.add_argument("--time-budget", type=_positive_float, default=None,
                   help="also stop each layer after this many wall seconds (default: no limit)")
    g.add_argument("--seed", type=_seed, default=0, help="seed of calibration windows and group selection")


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
    _add_armor(p)
    g = p.add_argument_group("runs (ARMOR)")
    g.add_argument("--run-dir", default=None,
                   help=f"where statistics and every finished layer are saved as they complete; rerunning the "
                        f"same command resumes from it (default OUT/{RUN_DIR_NAME}, deleted after a successful "
                        "save; a given --run-dir is kept)")
    g.add_argument("--keep-run-dir", action="store_true", help=f"keep OUT/{RUN_DIR_NAME} after success")
    p.add_argument("--storage", choices=("auto", "dense", "compact", "semi_structured"), default=None,
                   help="ARMOR core storage at run time after loading (default: dense on CPU, auto elsewhere; "
                        "the file always stores compact N:M cores)")
    p.add_argument("--one-shot", action="store_true",
                   help="calibrate every block on the dense model's hidden states (default: sequentially, "
                        "on the outputs of the already-pruned blocks before it)")
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
    _add_armor(d)
    d.add_argument("--one-shot", action="store_true",
                   help="calibrate every block on the dense model's hidden states (default: sequentially)")
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

    from torch_armor.progress import is_interactive, quiet_third_party_progress

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress or not is_interactive():
        quiet_third_party_progress()


def _check_device(device: Optional[str]) -> None:
    """Refuse a ``--device`` this torch cannot run on, before anything is loaded."""
    if device is None:
        return
    import torch

    from torch_armor.errors import ArmorInputError

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise ArmorInputError(f"--device {device!r} is not a device ({err}); use cpu, cuda or cuda:N") from None
    if dev.type == "meta":
        raise ArmorInputError("--device meta holds no values, so nothing can be calibrated or evaluated; "
                              "use cpu or cuda")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ArmorInputError(f"--device {device}: this torch build ({torch.__version__}) sees no CUDA GPU; "
                                  "use --device cpu, or install a CUDA build of torch")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ArmorInputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif dev.type != "cpu":
        module = getattr(torch, dev.type, None)
        available = getattr(module, "is_available", None)
        if available is None or not available():
            raise ArmorInputError(f"--device {device}: the {dev.type} backend is not available in this torch; "
                                  "use --device cpu")


def _armor_config(args: argparse.Namespace):
    """The ArmorConfig of the ARMOR options; an option not given keeps ArmorConfig's default."""
    from torch_armor.config import ArmorConfig

    return ArmorConfig(block_size=args.block_size, max_overhead=args.max_overhead, pattern=args.pattern,
                       optimizer=args.optimizer, num_iters=args.iters, time_budget_s=args.time_budget,
                       seed=args.seed, refine=None if args.refine == "none" else args.refine,
                       reconstruct_steps=args.reconstruct_steps)


RUN_DIR_NAME = "armor_run"


def _check_out(out: Path, overwrite: bool, allowed: Sequence[str] = ()) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} exists and is not a directory")
    leftovers = [p for p in out.iterdir() if p.name not in allowed] if out.is_dir() else []
    if leftovers and not overwrite:
        raise ValueError(f"--out {out} is not empty; pass --overwrite to write into it")
    from torch_armor.tensor.serialization import _PICKLE_SUFFIXES

    pickles = sorted(p.name for p in leftovers if p.is_file() and p.suffix.lower() in _PICKLE_SUFFIXES)
    if pickles:
        raise ValueError(f"--out {out} holds pickle weights {pickles} that a torch_armor checkpoint cannot sit "
                         "beside (the loader refuses the directory); remove them or choose another --out")


def _cmd_prune(args: argparse.Namespace) -> int:
    from torch_armor.engine.distributed import init_distributed
    from torch_armor.engine.lock import run_lock
    from torch_armor.engine.paths import check_prune_paths, mark_run_target, model_source_dirs, resumes_into

    out = Path(args.out)
    run_dir = Path(args.run_dir) if args.run_dir else out / RUN_DIR_NAME
    if args.method != "armor" and int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        raise ValueError(f"only --method armor runs on several ranks; run {args.method} without torchrun")
    check_prune_paths(model_source_dirs(args.model), out=out, run_dir=args.run_dir, out_flag="--out")
    _check_out(out, args.overwrite or resumes_into(run_dir, out), allowed=(RUN_DIR_NAME,) if not args.run_dir else ())
    from torch_armor.recipes.models import check_model_source

    if check_model_source(args.model, args.gguf_file) == "armor":
        raise ValueError(f"MODEL {args.model!r} is already pruned by torch_armor (it has armor_config.json); "
                         "prune the original dense checkpoint instead")
    topo = init_distributed(device=args.device)
    try:
        with run_lock(run_dir) if topo.rank == 0 else contextlib.nullcontext():
            mark_run_target(run_dir, out)
            return _prune(args, out, run_dir, topo)
    finally:
        if topo.initialized_here:
            import torch.distributed as dist

            dist.destroy_process_group()


def _prune(args: argparse.Namespace, out: Path, run_dir: Path, topo) -> int:
    _setup(args)
    start = time.perf_counter()
    from torch_armor.engine.runner import BaselineConfig
    from torch_armor.recipes.data import calibration_windows
    from torch_armor.recipes.models import load_model, load_tokenizer, parse_dtype
    from torch_armor.recipes.prune import is_streamable_checkpoint, prune_model

    armor = args.method == "armor"
    rank = topo.rank
    streamed = args.gguf_file is None and is_streamable_checkpoint(args.model)
    if rank == 0:
        _log(f"{'streaming' if streamed else 'loading'} {args.model} …")
    if streamed:
        model, tokenizer = args.model, load_tokenizer(args.model)
    else:
        model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    if rank == 0:
        _log(f"calibrating on {args.n_calib}×{args.seq_len} tokens of {args.calib}, "
             f"{'sequentially' if not args.one_shot else 'one-shot'}, one decoder block at a time")
    windows = calibration_windows(args.calib, tokenizer, n_windows=args.n_calib, seq_len=args.seq_len, seed=args.seed)
    config = _armor_config(args) if armor else BaselineConfig(
        pattern=args.pattern, block_size=args.sparsegpt_block_size, damp=args.damp)
    report = prune_model(
        model, windows, args.method, config, sequential=not args.one_shot, run_dir=run_dir, device=args.device,
        progress=not args.no_progress, out=out, layers=args.layers, batch_size=args.batch_size,
        storage=args.storage, dtype=parse_dtype(args.dtype) if streamed else None, log=_log if rank == 0 else None,
    )
    if rank != 0:
        return 0
    tokenizer.save_pretrained(str(out))
    meta = {
        "command": "torch-armor " + shlex.join(args.argv),
        "model": args.model,
        "ranks": topo.world_size,
        "calibration": {"source": args.calib, "n_windows": args.n_calib, "seq_len": args.seq_len,
                        "seed": args.seed, "sequential": not args.one_shot},
    }
    report.save_json(out / REPORT_JSON, **meta)
    report.save_plot(out / REPORT_PNG, title=None)
    if not args.run_dir and not args.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    total = time.perf_counter() - start
    print(f"pruned {len(report.layers)} linears of {args.model} with {args.method} {report.pattern}: "
          f"mean relative proxy loss {report.mean_relative_proxy_loss:.4f} (NoWag-P = 1)"
          + (f", mean relative output loss {report.mean_relative_output_loss:.4f}"
             if report.mean_relative_output_loss is not None else "")
          + (f", wrapper overhead {100 * report.overhead:.2f}%" if report.overhead else "")
          + f", pruning {report.seconds:.1f} s, total {total:.1f} s")
    from torch_armor.tensor.finetune import checkpoint_size

    size = checkpoint_size(out)
    print(f"size: {size.parameters:,} stored parameters, {size.parameter_bytes / 2**20:.1f} MiB of weights "
          f"(dense model: {size.dense_parameters:,} parameters, {size.dense_parameter_bytes / 2**20:.1f} MiB)")
    print(f"saved model, tokenizer, {REPORT_JSON} and {REPORT_PNG} to {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    _setup(args)
    from torch_armor.recipes.data import eval_windows
    from torch_armor.recipes.evaluate import perplexity
    from torch_armor.recipes.models import load_model

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
    from torch_armor.recipes.quality import run_quality

    result = run_quality(
        "smollm2", methods=args.methods, armor_configs=[_armor_config(args)], pattern=args.pattern,
        calib=args.calib, n_calib=args.n_calib, eval_data=args.data, n_eval=args.n_eval, seq_len=args.seq_len,
        layers=args.layers, batch_size=args.batch_size, seed=args.seed, armor_eval=args.armor_eval,
        sequential=not args.one_shot, progress=not args.no_progress, log=_log,
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
    from torch_armor.engine.interrupt import interrupted_line, terminate_as_interrupt

    with terminate_as_interrupt():
        return _run(args, commands[args.command], interrupted_line)


def _run(args: argparse.Namespace, command, interrupted_line) -> int:
    from torch_armor.errors import CLEAR_ERRORS, debug_enabled

    if args.debug or debug_enabled():
        _check_device(getattr(args, "device", None))
        return command(args)
    try:
        _check_device(getattr(args, "device", None))
        return command(args)
    except CLEAR_ERRORS as err:
        print(f"torch-armor {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        print(f"torch-armor {args.command}: {interrupted_line(err)}", file=sys.stderr)
        return 128 + getattr(err, "signum", signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line, no traceback
        print(f"torch-armor {args.command}: internal error: {type(err).__name__}: {_one_line(err)} "
              "(rerun with --debug for the traceback, and please report it)", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    """The error's message on one line; an OSError names its file."""
    from torch_armor.errors import ArmorError

    if isinstance(err, OSError) and not isinstance(err, ArmorError) and err.strerror:
        text = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
        text += "; free space or fix permissions, then rerun the same command (finished layers are kept)"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
