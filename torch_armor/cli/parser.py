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

Errors: a bad argument, model, file or a failed write (torch_armor's own error types,
:mod:`torch_armor.errors`) prints one line ``torch-armor CMD: error: …`` naming what is at fault
and what to do, with the library's parameter names as flags (``out=`` as ``--out``), and exits
with status 2. Anything else is a bug: one line ``torch-armor CMD: internal error: …`` saying
where its traceback was written, exit status 1. ``--debug`` (or ``TORCH_ARMOR_DEBUG=1``) shows the
traceback instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import signal
import sys
import tempfile
import traceback
from pathlib import Path
from typing import List, Optional, Sequence

from torch_armor.cli import commands as cli_commands
from torch_armor._io import RUN_DIR_NAME
from torch_armor.config.armor import ArmorConfig
from torch_armor.config.levers import OPTIMIZERS
from torch_armor.core.pattern import parse_pattern
from torch_armor.config.presets import PRESETS
from torch_armor.cli.flags import flags_that_do_not_apply, with_flags
from torch_armor.cli.names import (DEMO_METHODS, DENSE, FULL_PROTOCOL, HARNESS_JSON, QUICK_PROTOCOL, REPORT_JSON,
                                   REPORT_PNG)
from torch_armor.engine.interrupt import terminate_as_interrupt
from torch_armor.engine.methods import method_named, method_names
from torch_armor.errors import ArmorError, debug_enabled
from torch_armor.recipes.needs import Need, check_installed, needs_for

__all__ = ["main", "build_parser", "QUICK_PROTOCOL", "FULL_PROTOCOL", "DEMO_METHODS", "DENSE", "REPORT_JSON",
           "REPORT_PNG", "HARNESS_JSON"]



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


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _path(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path (an unset shell variable?); give a directory")
    return text


def _pattern(text: str) -> str:
    try:
        parse_pattern(text)
    except ArmorError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


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
                   help="threads (default: one per physical core, fewer when the machine is busy; "
                        "OMP_NUM_THREADS also sets it)")
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
    """The ARMOR options: ``--preset`` (default ``default``, i.e. ArmorConfig()), then options that
    change single levers on top of it; an option not given keeps the preset's value."""
    default = ArmorConfig()
    g = p.add_argument_group("ARMOR")
    g.add_argument("--preset", choices=tuple(PRESETS), default=None,
                   help="a named set of ARMOR settings (torch_armor.config.presets: fast, default = ArmorConfig(), "
                        "max; default: default); the options below change it")
    g.add_argument("--block-size", type=_block_size, default=None,
                   help=f"wrapper block size d_b; 'auto': per layer, the largest d_b dividing both dimensions "
                        f"within --max-overhead; 'budget': one --max-overhead budget for the whole model, "
                        f"spent where it lowers the loss most (default {default.block_size})")
    g.add_argument("--max-overhead", type=_positive_float, default=None,
                   help="wrapper-overhead budget of --block-size auto/budget, a fraction (default 0.05 = 5%%)")
    refine = "output" if default.refine is not None else "none"
    g.add_argument("--refine", choices=("output", "none"), default=None,
                   help=f"after each layer's optimizer, refine A, core values and B under the output-space "
                        f"loss tr((W-Ŵ) XᵀX (W-Ŵ)ᵀ) (default {refine})")
    steps = default.reconstruct.steps if default.reconstruct is not None else 0
    g.add_argument("--reconstruct-steps", type=int, default=None,
                   help=f"Adam steps of block reconstruction per decoder block (default {steps}; 0: off)")
    distill_steps = default.distill.steps if default.distill is not None else 0
    g.add_argument("--distill-steps", type=int, default=None,
                   help=f"Adam steps of end-to-end distillation after the block pass (default {distill_steps}; "
                        "0: off)")
    g.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default=None,
                   help=f"per-layer optimizer (default {default.optimizer.name})")
    g.add_argument("--iters", type=int, default=None,
                   help="iterations per layer (default: "
                        + "; ".join(f"{kind().iters} {name}" for name, kind in OPTIMIZERS.items()) + ")")
    g.add_argument("--time-budget", type=_positive_float, default=None,
                   help="also stop each layer after this many wall seconds (default: no limit)")
    g.add_argument("--seed", type=_seed, default=0, help="seed of calibration windows and group selection")


def _version() -> str:
    try:
        return importlib.metadata.version("torch_armor")
    except importlib.metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
        return "(not installed: a source checkout)"


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - torch is a dependency
        return "not installed"


def build_parser() -> argparse.ArgumentParser:
    """The ``torch-armor`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="torch-armor",
        description="ARMOR 2:4 semi-structured pruning: prune a checkpoint, evaluate it, or run the demo.",
    )
    parser.add_argument("--version", action="version", version=f"torch-armor {_version()}, torch {_torch_version()}")
    sub = parser.add_subparsers(dest="command", metavar="{prune,quantize,eval,demo}")
    sub.required = True

    p = sub.add_parser("prune", help="prune a model and save it with a per-layer report",
                       description="Calibrate, prune every decoder linear (never embeddings or lm_head), "
                                   "save the model (safetensors) and tokenizer to --out with a per-layer "
                                   "report (prune_report.json, prune_report.png).")
    _add_model(p, "'smollm2' (embedded SmolLM2-135M), a local Hugging Face directory, or a hub id")
    p.add_argument("--out", type=_path, required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.add_argument("--strict", action="store_true",
                   help="refuse a model with a layer the block size or pattern does not fit (default: that layer "
                        "gets the largest block size that fits within --max-overhead, or stays dense; one warning)")
    p.add_argument("--method", choices=method_names(), default="armor", help="pruning method (default armor)")
    p.add_argument("--pattern", type=_pattern, default="2:4", help="'2:4' (default), 'N:M' or 'unstructured:F'")
    p.add_argument("--calib", default="sotu",
                   help="calibration text: sotu (default), wiki, a file/dir/glob, or a datasets name")
    p.add_argument("--n-calib", type=_positive_int, default=64, help="calibration windows (default 64)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="a local safetensors MODEL: --stream holds one decoder block in memory at a time "
                        "(distillation included, without sampled windows), --no-stream loads it whole (default: whole when 3x its size "
                        "fits the free memory, and not under torchrun)")
    p.add_argument("--layers", default=None,
                   help="prune only some decoder layers: indices like '0-1' or '0,4-6', or a regex on names")
    _add_armor(p)
    g = p.add_argument_group("runs (ARMOR)")
    g.add_argument("--run-dir", type=_path, default=None,
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
    # default None: a flag counts as given only when the user gave it (cli_flags refuses those of other methods)
    p.add_argument("--sparsegpt-block-size", type=_positive_int, default=None, help="SparseGPT lazy block (128)")
    p.add_argument("--damp", type=float, default=None, help="SparseGPT dampening (0.01)")
    _add_common(p)

    q = sub.add_parser("quantize", help="give a pruned directory's 2:4 cores 8-bit values (int8 or fp8)",
                       description="Quantize every ARMOR core of a directory written by 'prune' to 8 bits (a "
                                   "scale per output channel; activations are quantized per token when the model "
                                   "runs) and save the model and tokenizer to --out. On a GPU the cores run on "
                                   "cuSPARSELt's 8-bit 2:4 kernels (int8: sm80+, fp8: sm89+).")
    q.add_argument("model", metavar="MODEL", help="a directory written by 'prune'")
    q.add_argument("--format", choices=("int8", "fp8"), required=True, help="int8 or fp8 (e4m3) cores")
    q.add_argument("--out", required=True, help="output directory")
    q.add_argument("--smooth", type=_unit_float, default=None, metavar="ALPHA",
                   help="move the cores' input outliers into B before quantizing, SmoothQuant's alpha (0 = off; "
                        "default 0.5 for int8, 0 for fp8)")
    q.add_argument("--calib", default=None,
                   help="text for --smooth's activation ranges (default: the prune's calibration text, "
                        "from prune_report.json, else sotu)")
    q.add_argument("--n-calib", type=_positive_int, default=8, help="windows of --calib for --smooth (default 8)")
    q.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    q.add_argument("--no-progress", action="store_true", help="hide transformers' loading bar")
    q.add_argument("--debug", action="store_true",
                   help="show the full traceback of an error (also TORCH_ARMOR_DEBUG=1)")

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
    e.add_argument("--out", type=_path, default=None, metavar="PATH",
                   help=f"with --tasks: write the results JSON here (default: MODEL/{HARNESS_JSON} for a pruned "
                        "directory, nowhere otherwise)")
    _add_common(e)

    d = sub.add_parser("demo", help="quality table of the methods on SmolLM2-135M (quick; --full: the README's)",
                       description="SmolLM2-135M, sotu calibration, Wikipedia evaluation: prune with each method "
                                   "and print the quality table, a row as soon as its method is done. Quick by "
                                   f"default ({', '.join(QUICK_PROTOCOL['methods'])}; {QUICK_PROTOCOL['n_calib']} calibration and "
                                   f"{QUICK_PROTOCOL['n_eval']} evaluation windows; ARMOR {QUICK_PROTOCOL['iters']} sweeps, "
                                   f"{QUICK_PROTOCOL['reconstruct_steps']} reconstruction steps, "
                                   f"{QUICK_PROTOCOL['distill_steps']} distillation steps); --full: "
                                   "every method under the README's protocol (about an hour on 2 cores). Finished "
                                   "rows are saved in --run-dir: after Ctrl-C the same command resumes.")
    d.add_argument("--full", action="store_true",
                   help="the README's protocol: every method, 64 calibration and 64 evaluation windows, "
                        "ArmorConfig's defaults (about an hour on 2 cores)")
    d.add_argument("--methods", nargs="+", choices=DEMO_METHODS, default=None,
                   help=f"rows to run (default: {' '.join(QUICK_PROTOCOL['methods'])}; --full: all)")
    d.add_argument("--pattern", type=_pattern, default="2:4", help="sparsity pattern (default 2:4)")
    d.add_argument("--calib", default="sotu", help="calibration text (default sotu)")
    d.add_argument("--n-calib", type=_positive_int, default=None,
                   help=f"calibration windows (default {QUICK_PROTOCOL['n_calib']}; --full: 64)")
    d.add_argument("--data", default="wiki", help="evaluation text (default wiki)")
    d.add_argument("--n-eval", type=_positive_int, default=None,
                   help=f"evaluation windows (default {QUICK_PROTOCOL['n_eval']}; --full: 64)")
    d.add_argument("--run-dir", type=_path, default=None,
                   help="where finished rows (rows.json, table.md) and ARMOR's finished layers are kept; "
                        "rerunning the same command resumes (default runs/demo-quick, --full: runs/demo-full)")
    d.add_argument("--layers", default=None, help="prune only some decoder layers (indices or regex)")
    _add_armor(d)
    d.add_argument("--one-shot", action="store_true",
                   help="calibrate every block on the dense model's hidden states (default: sequentially)")
    d.add_argument("--armor-eval", choices=("materialized", "tensor"), default="materialized",
                   help="evaluate ARMOR with W_hat materialized as dense matrices (default; same function, "
                        "fastest on CPU) or through the ArmorTensor weights")
    d.add_argument("--json", type=_path, default=None, metavar="PATH", help="also write rows, reports and timings as JSON")
    _add_common(d)
    return parser


def _interrupted(args: argparse.Namespace) -> str:
    """What an interrupt leaves behind, true for the subcommand that was running."""
    if args.command == "demo" and getattr(args, "run_dir", None):
        return (f"interrupted; finished rows are kept in {args.run_dir} (and ARMOR's finished layers), "
                "rerun the same command to resume")
    if args.command == "prune" and method_named(args.method).stores_layers:
        run_dir = args.run_dir or str(Path(args.out) / RUN_DIR_NAME)
        return f"interrupted; finished layers are kept in {run_dir}, rerun the same command to resume"
    if args.command == "prune":
        return f"interrupted; {args.method} keeps no finished layers, so a rerun starts over"
    return "interrupted"


def job_needs(args: argparse.Namespace) -> List[Need]:
    """The optional packages the parsed command needs (:mod:`torch_armor.recipes.needs`)."""
    if args.command == "prune":
        return needs_for(model=args.model, gguf_file=args.gguf_file, texts=[args.calib])
    if args.command == "eval" and args.tasks is not None:
        return needs_for(model=args.model, gguf_file=args.gguf_file, tasks=True)
    if args.command == "eval":
        return needs_for(model=args.model, gguf_file=args.gguf_file, texts=[args.data])
    if args.command == "demo":
        return needs_for(model="smollm2", texts=[args.calib, args.data])
    return []


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
    wrong = flags_that_do_not_apply(args, args.method) if args.command == "prune" else []
    if wrong:  # before any model is loaded
        print(f"torch-armor prune: error: {'; '.join(wrong)}", file=sys.stderr)
        return 2
    missing = check_installed(job_needs(args))  # every missing package at once, before anything loads
    if missing:
        print(f"torch-armor {args.command}: error: {with_flags(missing)}", file=sys.stderr)
        return 2
    commands = {"prune": cli_commands.cmd_prune, "quantize": cli_commands.cmd_quantize, "eval": cli_commands.cmd_eval,
                "demo": cli_commands.cmd_demo}

    with terminate_as_interrupt():  # SIGTERM ends like Ctrl-C: one line, files consistent
        return _run(args, commands[args.command])


def _run(args: argparse.Namespace, command) -> int:
    import torch  # heavy: see main

    threads = torch.get_num_threads()  # a command sets its own; a caller in the same process keeps theirs
    try:
        return _run_command(args, command)
    finally:
        torch.set_num_threads(threads)


def _run_command(args: argparse.Namespace, command) -> int:
    from torch_armor.engine.interrupt import PruneInterrupted  # heavy: see main
    from torch_armor.engine.options import check_device  # heavy: see main

    if args.debug or debug_enabled():
        check_device(getattr(args, "device", None), "--device")
        return command(args)
    try:
        check_device(getattr(args, "device", None), "--device")
        return command(args)
    except ArmorError as err:  # torch_armor's own errors: the input is at fault
        print(f"torch-armor {args.command}: error: {_one_line(with_flags(str(err)) or type(err).__name__)}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt as err:
        line = str(err) if isinstance(err, PruneInterrupted) and args.command == "prune" else _interrupted(args)
        print(f"torch-armor {args.command}: {line}", file=sys.stderr)
        return 128 + getattr(err, "signum", signal.SIGINT)
    except Exception as err:  # noqa: BLE001 - anything else is a bug: one line, never an input error
        where = _write_traceback()
        print(f"torch-armor {args.command}: internal error: {type(err).__name__}: {_one_line(str(err))} — please "
              f"report; full traceback {f'in {where} or ' if where else ''}with --debug", file=sys.stderr)
        return 1


def _write_traceback() -> str:
    """The current exception's traceback in a new file of the temporary directory; its path
    (``""`` if it cannot be written)."""
    try:
        with tempfile.NamedTemporaryFile("w", prefix="torch-armor-traceback-", suffix=".txt", delete=False,
                                         encoding="utf-8") as fh:
            fh.write(traceback.format_exc())
        return fh.name
    except OSError:
        return ""


def _one_line(text: str) -> str:
    """``text`` on one line."""
    return " ".join(text.split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
