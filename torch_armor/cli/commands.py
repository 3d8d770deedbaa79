"""The ``torch-armor`` subcommands (``prune``, ``eval``, ``demo``): build objects from the parsed
arguments and call the library (:func:`torch_armor.cli.parser.main` parses them)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch

from torch_armor._io import RUN_DIR_NAME
from torch_armor.cli.flags import config_from_flags, with_flags
from torch_armor.cli.names import DENSE, FULL_PROTOCOL, HARNESS_JSON, QUICK_PROTOCOL, REPORT_JSON, REPORT_PNG
from torch_armor.config.armor import ArmorConfig
from torch_armor.engine.topology import launched_rank
from torch_armor.engine.methods import method_named
from torch_armor.engine.options import PruneOptions, check_out
from torch_armor.engine.paths import check_prune_paths
from torch_armor.engine.plan import check_paths, plan_prune
from torch_armor.engine.prune import execute
from torch_armor.errors import ArmorError, ArmorInputError, MissingExtraError, write_failed
from torch_armor.progress import is_interactive, quiet_third_party_progress
from torch_armor.recipes.data import calibration_windows, check_window_memory, eval_windows
from torch_armor.recipes.demo_record import DEMO_RECORD
from torch_armor.recipes.demo_runs import TABLE_MD, DemoRuns
from torch_armor.recipes.demo_time import DemoClock, forward_seconds, matches_record, row_work
from torch_armor.recipes.evaluate import perplexity
from torch_armor.recipes.harness import check_tasks, evaluate, results_table, write_results
from torch_armor.recipes.models import load_model, load_tokenizer, loading_note, parse_dtype, pruning_source
from torch_armor.recipes.quality import quality_table, run_quality
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.finetune import checkpoint_size
from torch_armor.threads import choose_threads, load_average, physical_cores

__all__ = ["cmd_prune", "cmd_quantize", "cmd_eval", "cmd_demo", "demo_protocol", "log", "prune_calibration"]


def log(message: str) -> None:
    """A phase message on stderr (rank 0 only under ``torchrun``)."""

    if launched_rank() == 0:
        print(message, file=sys.stderr, flush=True)


def setup(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    elif not os.environ.get("OMP_NUM_THREADS"):  # the user's own setting stands
        threads, why = choose_threads(physical_cores(), load_average())
        torch.set_num_threads(threads)
        if why:
            log(why)
    if args.no_progress or not is_interactive():
        quiet_third_party_progress()


def method_config(args: argparse.Namespace) -> Any:
    """The config of ``--method`` from the flags given for it (:func:`~torch_armor.cli.flags.config_from_flags`;
    an error names the flag)."""
    return config_from_flags(args, method_named(args.method).config_type)


def from_text(flag: str, source: str, windows: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """``windows(source, ...)`` (calibration or evaluation windows); an error about the text names ``flag``."""
    try:
        return windows(source, *args, **kwargs)
    except ArmorInputError as err:
        raise ArmorInputError(f"{flag} {source!r}: {err}") from None


@contextlib.contextmanager
def _writes(run_dir: Optional[Path] = None) -> Iterator[None]:
    """A failed write (disk full, read-only) as torch_armor's own :class:`ArmorIOError`."""
    try:
        yield
    except OSError as err:
        if isinstance(err, ArmorError):
            raise
        kept = f" (finished layers are kept in {run_dir})" if run_dir is not None else ""
        raise write_failed(err, f"free space or fix permissions, then rerun the same command{kept}") from err


def cmd_prune(args: argparse.Namespace) -> int:
    out = Path(args.out)
    # the run directory outlives prune_model (which holds its lock) until the tokenizer, report and plot
    # are written: a failure after the last block leaves a state the same command resumes
    run_dir = Path(args.run_dir) if args.run_dir else out / RUN_DIR_NAME
    options = PruneOptions(
        out=out, overwrite=args.overwrite, run_dir=run_dir,
        device=args.device, dtype=parse_dtype(args.dtype), storage=args.storage, sequential=not args.one_shot,
        batch_size=args.batch_size, progress=not args.no_progress, strict=args.strict,
        log=lambda line: log(with_flags(line)))
    check_paths(args.model, options)  # plan_prune's own path checks, first: before the slow model load
    check_window_memory(args.n_calib, args.seq_len, ("--n-calib", "--seq-len"))
    config = method_config(args)  # the method's settings checked before the model is loaded
    code = _prune(args, options, config)
    if launched_rank() == 0 and not args.run_dir and not args.keep_run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)
    return code


def _prune(args: argparse.Namespace, options: PruneOptions, config: Any) -> int:
    setup(args)
    out, run_dir = Path(options.out), Path(options.run_dir)
    start = time.perf_counter()
    model, tokenizer = pruning_source(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device,
                                      log=log, stream=args.stream)
    log(f"calibrating on {args.n_calib}×{args.seq_len} tokens of {args.calib}, "
        f"{'sequentially' if not args.one_shot else 'one-shot'}, one decoder block at a time")
    windows = from_text("--calib", args.calib, calibration_windows, tokenizer, n_windows=args.n_calib,
                        seq_len=args.seq_len, seed=args.seed)
    with warnings.catch_warnings():  # what the library skips and says why (e.g. distillation when streamed): a log line
        warnings.showwarning = lambda message, *rest, **kw: log(str(message))
        report = execute(plan_prune(model, windows, config, layers=args.layers, options=options))
    if report.rank != 0:
        return 0
    with _writes(run_dir):
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
            log(f"skipped {REPORT_PNG}: {err}")
    total = time.perf_counter() - start
    print(f"pruned {len(report.layers)} linears of {args.model} with {args.method} {report.pattern}: "
          f"{report.loss_summary()}"
          + (f"; wrapper overhead {100 * report.overhead:.2f}%" if report.overhead else "")
          + f"; pruning {report.seconds:.1f} s, total {total:.1f} s")
    for line in report.stage_lines():
        print(line)
    size = checkpoint_size(out)
    print(f"size: {size.parameters:,} stored parameters, {size.parameter_bytes / 2**20:.1f} MiB of weights "
          f"(dense model: {size.dense_parameters:,} parameters, {size.dense_parameter_bytes / 2**20:.1f} MiB)")
    print(f"saved {', '.join(saved[:-1])} and {saved[-1]} to {out}")
    return 0


def prune_calibration(source: Path, calib: Optional[str] = None) -> Tuple[str, int]:
    """``(text source, seq_len)`` for ``quantize --smooth``: ``--calib`` if given, else the prune's own."""
    recorded: Dict[str, Any] = {}
    try:
        recorded = json.loads((source / REPORT_JSON).read_text()).get("calibration") or {}
    except (OSError, ValueError, AttributeError):
        pass
    return calib or recorded.get("source") or "sotu", int(recorded.get("seq_len") or 512)


def cmd_quantize(args: argparse.Namespace) -> int:
    from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig,  # local: only this command needs them
                                      Int8DynamicActivationInt8WeightConfig, quantize_)

    from torch_armor.tensor.quant import ArmorCoreConfig  # local: as above
    from torch_armor.format.serialization import load_pretrained, save_pretrained  # local: as above
    from torch_armor.tensor.smoothing import DEFAULT_ALPHA, smooth_core_inputs  # local: as above

    out = Path(args.out)
    if not str(args.out).strip():
        raise ArmorInputError("--out is empty; give the directory to write the quantized model to")
    source = Path(args.model)
    check_prune_paths(inputs=[source], out=out)  # the one output check of every command
    check_out(out, args.overwrite)
    if args.no_progress or not is_interactive():
        quiet_third_party_progress()
    alpha = args.smooth if args.smooth is not None else DEFAULT_ALPHA[args.format]
    windows = None
    if alpha > 0:  # the text and the tokenizer checked before the model loads
        text, seq_len = prune_calibration(source, args.calib)
        windows = from_text("--calib", text, calibration_windows, load_tokenizer(source), n_windows=args.n_calib,
                            seq_len=seq_len)
    model = load_pretrained(source)
    storages = {m.weight.storage_format for m in model.modules() if isinstance(getattr(m, "weight", None), ArmorTensor)}
    if not storages:
        raise ArmorInputError(f"{source} holds no ARMOR layers: quantize a directory written by 'torch-armor prune'")
    if not storages <= {"compact", "dense", "semi_structured"}:
        raise ArmorInputError(f"{source} already has quantized cores ({', '.join(sorted(storages))}); quantize the "
                              "directory 'torch-armor prune' wrote")
    inner = {"int8": Int8DynamicActivationInt8WeightConfig, "fp8": Float8DynamicActivationFloat8WeightConfig}[args.format]
    before = checkpoint_size(source)
    if windows is not None:
        log(f"smoothing the cores' inputs (alpha {alpha}) on {windows.shape[0]}x{windows.shape[1]} tokens of {text}")
        smooth_core_inputs(model, windows.split(1), alpha)
    quantize_(model, ArmorCoreConfig(inner(set_inductor_config=False)))
    with _writes():
        save_pretrained(model, out)
        for pattern in ("tokenizer*", "special_tokens_map.json", "vocab.*", "merges.txt", "*.model", "chat_template*"):
            for file in source.glob(pattern):
                shutil.copy2(file, out / file.name)
    log(f"saved {args.format} 2:4 cores to {out}: {checkpoint_size(out).bytes / 1e6:.1f} MB of tensors (was "
        f"{before.bytes / 1e6:.1f} MB)")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    if args.tasks is not None:
        return _eval_tasks(args)

    setup(args)
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    windows = from_text("--data", args.data, eval_windows, tokenizer, n_windows=args.n_eval, seq_len=args.seq_len)
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
    # before loading a model: the extra, the task names and their data (offline: one line saying what to do)
    tasks = check_tasks(args.tasks, include_path=args.include_path)
    setup(args)
    log(f"loading {args.model} …{loading_note(args.model)}")
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, dtype=args.dtype, device=args.device)
    log("lm-evaluation-harness: reading the task data and building its requests, then scoring them")
    t = time.perf_counter()
    results = evaluate(model, tokenizer, tasks, include_path=args.include_path, num_fewshot=args.num_fewshot,
                       limit=args.limit, batch_size=args.batch_size)
    seconds = time.perf_counter() - t
    out = Path(args.out) if args.out is not None else None
    if out is None and (Path(args.model) / REPORT_JSON).is_file():
        out = Path(args.model) / HARNESS_JSON
    if out is not None:
        with _writes():
            write_results(results, out)
    if args.json:
        print(json.dumps({"model": args.model, "tasks": tasks, "results": results["results"], "seconds": seconds,
                          "json": None if out is None else str(out)}, default=str))
    else:
        print(results_table(results))
        print(f"lm-evaluation-harness {results.get('lm_eval_version', '')}, {seconds:.1f} s"
              + (f"; results written to {out}" if out is not None else ""))
    return 0


def demo_protocol(args: argparse.Namespace) -> None:
    """Fill in the options not given from the quick protocol, or the full one with ``--full``."""
    protocol = FULL_PROTOCOL if args.full else QUICK_PROTOCOL
    args.methods = args.methods or list(protocol["methods"])
    args.n_calib = args.n_calib or protocol["n_calib"]
    args.n_eval = args.n_eval or protocol["n_eval"]
    if args.iters is None:
        args.iters = protocol["iters"]
    if args.reconstruct_steps is None:
        args.reconstruct_steps = protocol["reconstruct_steps"]
    if args.distill_steps is None:
        args.distill_steps = protocol["distill_steps"]
    args.run_dir = args.run_dir or str(Path("runs") / ("demo-full" if args.full else "demo-quick"))


def cmd_demo(args: argparse.Namespace) -> int:

    demo_protocol(args)
    setup(args)
    config = config_from_flags(args, ArmorConfig)
    settings = {"methods": args.methods, "pattern": args.pattern, "calib": args.calib, "n_calib": args.n_calib,
                "eval": args.data, "n_eval": args.n_eval, "seq_len": args.seq_len, "layers": args.layers,
                "seed": args.seed, "sequential": not args.one_shot, "armor_eval": args.armor_eval,
                "armor": repr(config)}
    runs = DemoRuns(args.run_dir, settings, log=log)
    todo = [m for m in args.methods if _method_label(m) not in runs.finished]
    log(f"demo ({'full' if args.full else 'quick'}): {', '.join(args.methods)} on SmolLM2-135M, calibration "
         f"{args.n_calib}×{args.seq_len} tokens of {args.calib}, evaluation {args.n_eval}×{args.seq_len} tokens "
         f"of {args.data}; " + (f"{len(args.methods) - len(todo)} row(s) already done; " if len(todo) < len(args.methods)
                                else "") + f"rows are kept in {args.run_dir} as they finish (Ctrl-C, then the same "
         "command resumes)" + ("" if args.full else "; the README's full protocol: --full"))
    header: list = []
    # the estimate: its clock, the forward pass's seconds (wall, CPU), each row's CPU seconds (the record's unit)
    timing: Dict[str, Any] = {"row_cpu_s": {}}
    exact = matches_record(todo, n_calib=args.n_calib, n_eval=args.n_eval, seq_len=args.seq_len,
                           armor_config=repr(config))

    def on_loaded(model, calib_ids) -> None:
        timing["forward_s"], timing["forward_cpu_s"] = forward_seconds(model, calib_ids)
        clock = DemoClock({m: row_work(m, n_calib=args.n_calib, n_eval=args.n_eval, seq_len=args.seq_len)
                           for m in todo}, timing["forward_s"])
        timing.update(clock=clock, first_estimate_s=clock.left_s(), cpu_mark=time.process_time())
        log(f"estimate: about {_minutes(clock.left_s())} for {len(todo)} row(s) "
            f"({'the recorded run' if exact else 'scaled from the recorded quick run: a rough guide'}, "
            f"{DEMO_RECORD['machine']}, at this machine's speed: a forward pass over one window takes "
            f"{timing['forward_s']:.2f} s here); refined as rows finish")

    def on_row(row) -> None:
        runs.add(row)
        lines = quality_table([row]).splitlines()
        if not header:
            header.append(True)
            print("\n".join(lines[:2]))
        print(lines[2], flush=True)
        clock = timing.get("clock")
        if clock is not None:
            now = time.process_time()
            timing["row_cpu_s"][row.method], timing["cpu_mark"] = now - timing["cpu_mark"], now
            clock.finished(row.method, row.prune_s + row.eval_s)
            if clock.left_s() > 0:
                log(f"estimate: about {_minutes(clock.left_s())} left (the finished rows took {clock.speed():.2f}× "
                    "their estimate)")

    result = run_quality(
        "smollm2", methods=args.methods, configs=[config], pattern=args.pattern,
        calib=args.calib, n_calib=args.n_calib, eval_data=args.data, n_eval=args.n_eval, seq_len=args.seq_len,
        layers=args.layers, batch_size=args.batch_size, seed=args.seed, armor_eval=args.armor_eval,
        sequential=not args.one_shot, progress=not args.no_progress, log=log,
        finished=runs.finished, on_row=on_row, armor_run_dir=runs.store_for, on_loaded=on_loaded,
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
        estimate = {k: v for k, v in timing.items() if k not in ("clock", "cpu_mark")} | {"exact": exact}
        with _writes(), open(args.json, "w") as fh:
            json.dump(result.to_dict() | {"estimate": estimate}, fh, indent=2, default=str)
    return 0


def _minutes(seconds: float) -> str:
    return f"{max(1, round(seconds / 60))} min"


def _method_label(name: str) -> str:
    return name if name == DENSE else method_named(name).label
