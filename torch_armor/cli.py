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
    # zero-shot accuracy with lm-evaluation-harness (pip install 'torch_armor[eval]')
    torch-armor eval runs/smollm2-armor --tasks arc_easy,boolq
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
import dataclasses
import json
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

# Only what the parser needs is imported here (torch, no torchao or transformers), so that
# `torch-armor --help` answers fast; a subcommand imports the rest when it runs (_commands()).
from torch_armor._io import RUN_DIR_NAME
from torch_armor.core.config import ArmorConfig
from torch_armor.core.levers import OPTIMIZERS, ReconstructConfig, RefineConfig
from torch_armor.engine.methods import method_named, method_names
from torch_armor.errors import CLEAR_ERRORS, ArmorError, MissingExtraError, debug_enabled
from torch_armor.progress import is_interactive, quiet_third_party_progress

__all__ = ["main", "build_parser"]

REPORT_JSON = "prune_report.json"
REPORT_PNG = "prune_report.png"
HARNESS_JSON = "lm_eval_results.json"
DENSE = "dense"
#: rows of the demo table, in order
DEMO_METHODS = (DENSE,) + tuple(method_names())
#: the demo's quick protocol (the default): a first table in minutes; --full is the README's
_QUICK = {"methods": (DENSE, "sparsegpt", "armor"), "n_calib": 16, "n_eval": 16, "iters": 10}
_FULL = {"methods": DEMO_METHODS, "n_calib": 64, "n_eval": 64, "iters": None}


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
    default = ArmorConfig()
    g = p.add_argument_group("ARMOR")
    g.add_argument("--block-size", type=_block_size, default=default.block_size,
                   help=f"wrapper block size d_b; 'auto': per layer, the largest d_b dividing both dimensions "
                        f"within --max-overhead; 'budget': one --max-overhead budget for the whole model, "
                        f"spent where it lowers the loss most (default {default.block_size})")
    g.add_argument("--max-overhead", type=_positive_float, default=default.max_overhead,
                   help="wrapper-overhead budget of --block-size auto/budget, a fraction (default 0.05 = 5%%)")
    refine = "output" if default.refine is not None else "none"
    g.add_argument("--refine", choices=("output", "none"), default=refine,
                   help=f"after each layer's optimizer, refine A, core values and B under the output-space "
                        f"loss tr((W-Ŵ) XᵀX (W-Ŵ)ᵀ) (default {refine})")
    steps = default.reconstruct.steps if default.reconstruct is not None else 0
    g.add_argument("--reconstruct-steps", type=int, default=steps,
                   help=f"Adam steps of block reconstruction per decoder block (default {steps}; 0: off)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=default.optimizer.name,
                   help=f"per-layer optimizer (default {default.optimizer.name})")
    g.add_argument("--iters", type=int, default=None,
                   help="iterations per layer (default: "
                        + "; ".join(f"{kind().iters} {name}" for name, kind in OPTIMIZERS.items()) + ")")
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
    p.add_argument("--method", choices=method_names(), default="armor", help="pruning method (default armor)")
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

    e = sub.add_parser("eval", help="perplexity or lm-evaluation-harness accuracy of a model or a pruned directory",
                       description="Token-level perplexity over the first --n-eval non-overlapping "
                                   "--seq-len windows of --data; with --tasks, lm-evaluation-harness tasks instead "
                                   "(the eval extra: pip install 'torch_armor[eval]').")
    _add_model(e, "a directory written by 'prune', 'smollm2', a local Hugging Face directory, or a hub id")
    e.add_argument("--data", default="wiki",
                   help="evaluation text: wiki (default), sotu, a file/dir/glob, or a datasets name")
    e.add_argument("--n-eval", type=_positive_int, default=64, help="evaluation windows (default 64)")
    e.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    e.add_argument("--tasks", default=None,
                   help="lm-evaluation-harness tasks, comma-separated (e.g. arc_easy,boolq): prints the harness's "
                        "table and writes its JSON beside a pruned directory's report (or to --out)")
    e.add_argument("--include-path", action="append", default=None, metavar="DIR",
                   help="a directory of your own task YAMLs (repeatable)")
    e.add_argument("--num-fewshot", type=int, default=None, help="few-shot examples (default: each task's own)")
    e.add_argument("--limit", type=_positive_int, default=None, help="only the first N documents of each task")
    e.add_argument("--out", type=Path, default=None, metavar="PATH",
                   help=f"with --tasks: write the results JSON here (default: MODEL/{HARNESS_JSON} for a pruned "
                        "directory, nowhere otherwise)")
    _add_common(e)

    d = sub.add_parser("demo", help="quality table of the methods on SmolLM2-135M (quick; --full: the README's)",
                       description="SmolLM2-135M, sotu calibration, Wikipedia evaluation: prune with each method "
                                   "and print the quality table, a row as soon as its method is done. Quick by "
                                   f"default ({', '.join(_QUICK['methods'])}; {_QUICK['n_calib']} calibration and "
                                   f"{_QUICK['n_eval']} evaluation windows; ARMOR {_QUICK['iters']} sweeps); --full: "
                                   "every method under the README's protocol (about an hour on 2 cores). Finished "
                                   "rows are saved in --run-dir: after Ctrl-C the same command resumes.")
    d.add_argument("--full", action="store_true",
                   help="the README's protocol: every method, 64 calibration and 64 evaluation windows, "
                        "ArmorConfig's defaults (about an hour on 2 cores)")
    d.add_argument("--methods", nargs="+", choices=DEMO_METHODS, default=None,
                   help=f"rows to run (default: {' '.join(_QUICK['methods'])}; --full: all)")
    d.add_argument("--pattern", default="2:4", help="sparsity pattern (default 2:4)")
    d.add_argument("--calib", default="sotu", help="calibration text (default sotu)")
    d.add_argument("--n-calib", type=_positive_int, default=None,
                   help=f"calibration windows (default {_QUICK['n_calib']}; --full: 64)")
    d.add_argument("--data", default="wiki", help="evaluation text (default wiki)")
    d.add_argument("--n-eval", type=_positive_int, default=None,
                   help=f"evaluation windows (default {_QUICK['n_eval']}; --full: 64)")
    d.add_argument("--run-dir", default=None,
                   help="where finished rows (rows.json, table.md) and ARMOR's finished layers are kept; "
                        "rerunning the same command resumes (default runs/demo-quick, --full: runs/demo-full)")
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
    """A phase message on stderr (rank 0 only under ``torchrun``)."""
    from torch_armor.engine.distributed import launched_rank  # heavy: see the imports above

    if launched_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def _setup(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_progress or not is_interactive():
        quiet_third_party_progress()


def _armor_config(args: argparse.Namespace) -> ArmorConfig:
    """The ArmorConfig of the ARMOR options; an option not given keeps ArmorConfig's default."""
    kind = OPTIMIZERS[args.optimizer]
    optimizer = kind(**({"iters": args.iters} if args.iters is not None else {}), time_budget_s=args.time_budget)
    return ArmorConfig(block_size=args.block_size, max_overhead=args.max_overhead, pattern=args.pattern,
                       seed=args.seed, optimizer=optimizer, refine=RefineConfig() if args.refine == "output" else None,
                       reconstruct=ReconstructConfig(steps=args.reconstruct_steps) if args.reconstruct_steps else None)


def _method_config(args: argparse.Namespace) -> Any:
    """The config of ``--method`` from the options that apply to it."""
    kind = method_named(args.method).config_type
    if issubclass(kind, ArmorConfig):
        return _armor_config(args)
    given = {"pattern": args.pattern, "block_size": args.sparsegpt_block_size, "damp": args.damp}
    return kind(**{f.name: given[f.name] for f in dataclasses.fields(kind) if f.name in given})


def _cmd_prune(args: argparse.Namespace) -> int:
    from torch_armor.engine.options import PruneOptions
    from torch_armor.engine.prune import prune_model
    from torch_armor.recipes.data import calibration_windows
    from torch_armor.recipes.models import parse_dtype, pruning_source
    from torch_armor.tensor.finetune import checkpoint_size

    _setup(args)
    start = time.perf_counter()
    out = Path(args.out)
    model, tokenizer = pruning_source(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device,
                                      log=_log)
    _log(f"calibrating on {args.n_calib}×{args.seq_len} tokens of {args.calib}, "
         f"{'sequentially' if not args.one_shot else 'one-shot'}, one decoder block at a time")
    windows = calibration_windows(args.calib, tokenizer, n_windows=args.n_calib, seq_len=args.seq_len, seed=args.seed)
    options = PruneOptions(
        out=out, overwrite=args.overwrite,
        run_dir=args.run_dir or (out / RUN_DIR_NAME if args.keep_run_dir else None),  # given: kept after success
        device=args.device, dtype=parse_dtype(args.dtype), storage=args.storage, sequential=not args.one_shot,
        batch_size=args.batch_size, progress=not args.no_progress, log=_log)
    report = prune_model(model, windows, _method_config(args), layers=args.layers, options=options)
    if report.rank != 0:
        return 0
    tokenizer.save_pretrained(str(out))
    meta = {
        "command": "torch-armor " + shlex.join(args.argv),
        "model": args.model,
        "ranks": report.world_size,
        "calibration": {"source": args.calib, "n_windows": args.n_calib, "seq_len": args.seq_len,
                        "seed": args.seed, "sequential": not args.one_shot},
    }
    report.save_json(out / REPORT_JSON, **meta)
    saved = ["model", "tokenizer", REPORT_JSON]
    try:
        report.save_plot(out / REPORT_PNG, title=None)
        saved.append(REPORT_PNG)
    except MissingExtraError as err:
        _log(f"skipped {REPORT_PNG}: {err}")
    total = time.perf_counter() - start
    print(f"pruned {len(report.layers)} linears of {args.model} with {args.method} {report.pattern}: "
          f"mean relative proxy loss {report.mean_relative_proxy_loss:.4f} (NoWag-P = 1)"
          + (f", mean relative output loss {report.mean_relative_output_loss:.4f}"
             if report.mean_relative_output_loss is not None else "")
          + (f", wrapper overhead {100 * report.overhead:.2f}%" if report.overhead else "")
          + f", pruning {report.seconds:.1f} s, total {total:.1f} s")
    size = checkpoint_size(out)
    print(f"size: {size.parameters:,} stored parameters, {size.parameter_bytes / 2**20:.1f} MiB of weights "
          f"(dense model: {size.dense_parameters:,} parameters, {size.dense_parameter_bytes / 2**20:.1f} MiB)")
    print(f"saved {', '.join(saved[:-1])} and {saved[-1]} to {out}")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    if args.tasks is not None:
        return _eval_tasks(args)
    from torch_armor.recipes.data import eval_windows
    from torch_armor.recipes.evaluate import perplexity
    from torch_armor.recipes.models import load_model

    _setup(args)
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


def _eval_tasks(args: argparse.Namespace) -> int:
    from torch_armor.recipes.harness import evaluate, parse_tasks, require_lm_eval, results_table, write_results

    from torch_armor.recipes.models import load_model

    require_lm_eval()  # before loading a model: one line naming the extra
    tasks = parse_tasks(args.tasks)
    _setup(args)
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    t = time.perf_counter()
    results = evaluate(model, tokenizer, tasks, include_path=args.include_path, num_fewshot=args.num_fewshot,
                       limit=args.limit, batch_size=args.batch_size)
    seconds = time.perf_counter() - t
    out = args.out
    if out is None and (Path(args.model) / REPORT_JSON).is_file():
        out = Path(args.model) / HARNESS_JSON
    if out is not None:
        write_results(results, out)
    if args.json:
        print(json.dumps({"model": args.model, "tasks": tasks, "results": results["results"], "seconds": seconds,
                          "json": None if out is None else str(out)}, default=str))
    else:
        print(results_table(results))
        print(f"lm-evaluation-harness {results.get('lm_eval_version', '')}, {seconds:.1f} s"
              + (f"; results written to {out}" if out is not None else ""))
    return 0


def _demo_protocol(args: argparse.Namespace) -> None:
    """Fill in the options not given from the quick protocol, or the full one with ``--full``."""
    protocol = _FULL if args.full else _QUICK
    args.methods = args.methods or list(protocol["methods"])
    args.n_calib = args.n_calib or protocol["n_calib"]
    args.n_eval = args.n_eval or protocol["n_eval"]
    if args.iters is None:
        args.iters = protocol["iters"]
    args.run_dir = args.run_dir or str(Path("runs") / ("demo-full" if args.full else "demo-quick"))


def _cmd_demo(args: argparse.Namespace) -> int:
    from torch_armor.recipes.demo_runs import TABLE_MD, DemoRuns
    from torch_armor.recipes.quality import quality_table, run_quality

    _demo_protocol(args)
    _setup(args)
    config = _armor_config(args)
    settings = {"methods": args.methods, "pattern": args.pattern, "calib": args.calib, "n_calib": args.n_calib,
                "eval": args.data, "n_eval": args.n_eval, "seq_len": args.seq_len, "layers": args.layers,
                "seed": args.seed, "sequential": not args.one_shot, "armor_eval": args.armor_eval,
                "armor": repr(config)}
    runs = DemoRuns(args.run_dir, settings, log=_log)
    todo = [m for m in args.methods if _method_label(m) not in runs.finished]
    protocol = _FULL if args.full else _QUICK
    minutes = (sum(_DEMO_MINUTES["full" if args.full else "quick"][m] for m in todo)
               * (args.n_calib + args.n_eval) / (protocol["n_calib"] + protocol["n_eval"]))
    _log(f"demo ({'full' if args.full else 'quick'}): {', '.join(args.methods)} on SmolLM2-135M, calibration "
         f"{args.n_calib}×{args.seq_len} tokens of {args.calib}, evaluation {args.n_eval}×{args.seq_len} tokens "
         f"of {args.data}; " + (f"{len(args.methods) - len(todo)} row(s) already done, " if len(todo) < len(args.methods)
                                else "") + f"about {max(1, round(minutes))} min on 2 cores. "
         f"Rows are kept in {args.run_dir} as they finish (Ctrl-C, then the same command resumes)"
         + ("" if args.full else "; the README's full protocol: --full (about an hour)"))
    header = []

    def on_row(row) -> None:
        runs.add(row)
        lines = quality_table([row]).splitlines()
        if not header:
            header.append(True)
            print("\n".join(lines[:2]))
        print(lines[2], flush=True)

    result = run_quality(
        "smollm2", methods=args.methods, configs=[config], pattern=args.pattern,
        calib=args.calib, n_calib=args.n_calib, eval_data=args.data, n_eval=args.n_eval, seq_len=args.seq_len,
        layers=args.layers, batch_size=args.batch_size, seed=args.seed, armor_eval=args.armor_eval,
        sequential=not args.one_shot, progress=not args.no_progress, log=_log,
        finished=runs.finished, on_row=on_row, armor_run_dir=runs.store_for,
    )
    print()
    s = result.settings
    print(f"SmolLM2-135M fp32, {args.pattern}; calibration {s['n_calib']}×{s['seq_len']} tokens of {s['calib']}, "
          f"evaluation {s['n_eval']}×{s['seq_len']} tokens of {s['eval']}; {s['num_layers']} linears pruned; "
          f"{s['threads']} threads; ARMOR evaluated {args.armor_eval}")
    print()
    print(result.table())
    print()
    print(f"total wall time {result.timings['total'] / 60:.1f} min (this run); table and rows also in "
          f"{Path(args.run_dir) / TABLE_MD}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result.to_dict(), fh, indent=2, default=str)
    return 0


#: minutes per row on 2 cores (prune + eval; full: the README's measured runs; quick: the full row
#: scaled by its 32 of 128 windows, ARMOR by its 10 of 30 sweeps), scaled by the windows asked for
_DEMO_MINUTES = {
    "full": {"dense": 2.0, "magnitude": 6.0, "wanda": 20.0, "sparsegpt": 10.0, "nowag": 3.0, "armor": 11.0},
    "quick": {"dense": 0.5, "magnitude": 1.0, "wanda": 3.0, "sparsegpt": 2.0, "nowag": 1.0, "armor": 2.0},
}


def _method_label(method: str) -> str:
    return method if method == DENSE else method_named(method).label


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupt leaves behind, true for the subcommand that was running."""
    if args.command == "demo" and getattr(args, "run_dir", None):
        return (f"interrupted; finished rows are kept in {args.run_dir} (and ARMOR's finished layers), "
                "rerun the same command to resume")
    if args.command == "prune" and method_named(args.method).factorizes:
        run_dir = args.run_dir or str(Path(args.out) / RUN_DIR_NAME)
        return f"interrupted; finished layers are kept in {run_dir}, rerun the same command to resume"
    if args.command == "prune":
        return f"interrupted; {args.method} keeps no finished layers, so a rerun starts over"
    return "interrupted"


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
    import torch_armor

    torch_armor.prune_model  # noqa: B018 - loads the package as `import torch_armor` does outside the CLI
    commands = {"prune": _cmd_prune, "eval": _cmd_eval, "demo": _cmd_demo}
    from torch_armor.engine.interrupt import terminate_as_interrupt

    with terminate_as_interrupt():  # SIGTERM ends like Ctrl-C: one line, files consistent
        return _run(args, commands[args.command])


def _run(args: argparse.Namespace, command) -> int:
    from torch_armor.engine.interrupt import PruneInterrupted
    from torch_armor.engine.options import check_device

    if args.debug or debug_enabled():
        check_device(getattr(args, "device", None), "--device")
        return command(args)
    try:
        check_device(getattr(args, "device", None), "--device")
        return command(args)
    except CLEAR_ERRORS as err:
        print(f"torch-armor {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        line = str(err) if isinstance(err, PruneInterrupted) else _interrupted(args)
        print(f"torch-armor {args.command}: {line}", file=sys.stderr)
        return 128 + getattr(err, "signum", signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line, no traceback
        print(f"torch-armor {args.command}: internal error: {type(err).__name__}: {_one_line(err)} "
              "(rerun with --debug for the traceback, and please report it)", file=sys.stderr)
        return 1


def _one_line(err: BaseException) -> str:
    """The error's message on one line; an OSError names its file."""
    if isinstance(err, OSError) and not isinstance(err, ArmorError) and err.strerror:
        text = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
        text += "; free space or fix permissions, then rerun the same command (finished layers are kept)"
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
