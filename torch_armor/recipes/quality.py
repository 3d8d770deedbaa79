"""The quality protocol: prune SmolLM2 (or any model) with every method, measure perplexity,
print the table (``torch-armor demo``, ``benchmarks/quality.py``).

Every method prunes through :func:`torch_armor.prune_model` — block by block, calibrated
sequentially (each block on the outputs of the already-pruned blocks) unless asked for the
one-shot rows (``sequential=(False,)``: every block on the dense model's hidden states). Methods
are named as in the method registry (:func:`~torch_armor.engine.methods.method_names`), plus
``"dense"`` for the unpruned model.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from torch_armor.config.armor import ArmorConfig
from torch_armor.engine.methods import config_for_method, method_for, method_label, method_names
from torch_armor.engine.options import PruneOptions
from torch_armor.engine.prune import prune_model
from torch_armor.engine.report import PruneReport
from torch_armor.errors import ArmorInputError
from torch_armor.recipes.data import calibration_windows, eval_windows
from torch_armor.recipes.evaluate import perplexity
from torch_armor.calibration.selection import select_layers
from torch_armor.recipes.models import load_model, loading_note
from torch_armor.tensor.armor_tensor import ArmorTensor

__all__ = ["DEMO_METHODS", "QualityRow", "QualityResult", "quality_table", "run_quality"]

#: The unpruned model's row.
DENSE = "dense"
#: Rows of the demo table, in order.
DEMO_METHODS = (DENSE,) + method_names()


@dataclass
class QualityRow:
    """One row of the quality table.

    Attributes:
        method: ``"dense"`` or a registered method's name.
        ppl: perplexity on the evaluation windows.
        label: shown name (default: the method's, e.g. ``"ARMOR"``).
        settings: short description of the settings (``"d_b=16, bcd, 2 s/layer"``).
        overhead: wrapper overhead fraction (ARMOR), else 0.
        prune_s: wall time of pruning; ``eval_s``: of the perplexity evaluation.
        mean_relative_proxy_loss: mean over layers of the relative proxy loss (``None`` for dense).
        mean_relative_output_loss: ARMOR refined in output space: mean relative output loss.
    """

    method: str
    ppl: float
    label: Optional[str] = None
    settings: str = ""
    overhead: float = 0.0
    prune_s: float = 0.0
    eval_s: float = 0.0
    mean_relative_proxy_loss: Optional[float] = None
    mean_relative_output_loss: Optional[float] = None

    @property
    def name(self) -> str:
        return self.label or method_label(self.method)


def _fmt_time(seconds: Optional[float]) -> str:
    if seconds is None or seconds == 0:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min"


def quality_table(rows: Sequence[Union[QualityRow, Mapping[str, Any]]]) -> str:
    """Markdown table: method, settings, perplexity, gap closed vs NoWag-P, overhead, mean
    relative proxy loss (only where it is what the method minimised last: not after output-space
    refinement), mean relative output loss (ARMOR refined in output space), prune and eval time.

    Gap closed vs NoWag-P ``= (ppl_nowag − ppl) / (ppl_nowag − ppl_dense)``: 0 % for NoWag-P,
    100 % for the dense model, shown as ``–`` when either row is missing.

    Example::

        >>> print(quality_table([QualityRow("dense", 10.0), QualityRow("nowag", 20.0),
        ...                      QualityRow("armor", 15.0, overhead=0.046, prune_s=500)]))
        | method | settings | ppl | gap closed vs NoWag-P | overhead | rel. proxy loss | rel. output loss | prune time | eval time |
        |---|---|---:|---:|---:|---:|---:|---:|---:|
        | dense |  | 10.00 | 100.0% | – | – | – | – | – |
        | NoWag-P |  | 20.00 | 0.0% | – | – | – | – | – |
        | ARMOR |  | 15.00 | 50.0% | 4.60% | – | – | 8.3 min | – |
    """
    parsed = [r if isinstance(r, QualityRow) else QualityRow(**dict(r)) for r in rows]
    first: Dict[str, float] = {}
    for r in parsed:
        first.setdefault(r.method, r.ppl)
    dense, nowag = first.get(DENSE), first.get("nowag")
    lines = [
        "| method | settings | ppl | gap closed vs NoWag-P | overhead | rel. proxy loss | rel. output loss | prune time "
        "| eval time |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in parsed:
        if dense is not None and nowag is not None and nowag != dense and math.isfinite(r.ppl):
            gap = f"{100 * (nowag - r.ppl) / (nowag - dense):.1f}%"
        else:
            gap = "–"
        overhead = f"{100 * r.overhead:.2f}%" if r.overhead else "–"
        # after output-space refinement the proxy is no longer what was minimised: only the output loss
        shown = r.mean_relative_proxy_loss if r.mean_relative_output_loss is None else None
        rel = f"{shown:.3f}" if shown is not None else "–"
        out = f"{r.mean_relative_output_loss:.3f}" if r.mean_relative_output_loss is not None else "–"
        lines.append(f"| {r.name} | {r.settings} | {r.ppl:.2f} | {gap} | {overhead} | {rel} | {out} | "
                     f"{_fmt_time(r.prune_s)} | {_fmt_time(r.eval_s)} |")
    return "\n".join(lines)


@dataclass
class QualityResult:
    """Output of :func:`run_quality`: the rows, the pruning reports and phase timings."""

    rows: List[QualityRow]
    reports: Dict[str, PruneReport]
    timings: Dict[str, float]
    settings: Dict[str, Any]

    def table(self) -> str:
        return quality_table(self.rows)

    def to_dict(self) -> Dict[str, Any]:
        return {
            "settings": self.settings,
            "timings_s": self.timings,
            "rows": [dataclasses.asdict(r) | {"name": r.name} for r in self.rows],
            "reports": {k: v.to_dict() for k, v in self.reports.items()},
        }


def _materialize(model: nn.Module, names: Sequence[str]) -> None:
    """Replace every ArmorTensor weight among ``names`` by its dense ``W_hat`` (a plain Parameter)."""
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module.weight, ArmorTensor):
            module.weight = nn.Parameter(module.weight.dense_weight().detach(), requires_grad=False)


def run_quality(
    model: Union[str, nn.Module] = "smollm2",
    tokenizer: Any = None,
    *,
    methods: Sequence[str] = DEMO_METHODS,
    configs: Sequence[Any] = (ArmorConfig(),),
    sequential: Union[bool, Sequence[bool], Mapping[str, Sequence[bool]]] = True,
    pattern: str = "2:4",
    calib: Any = "sotu",
    n_calib: int = 64,
    eval_data: Any = "wiki",
    n_eval: int = 64,
    seq_len: int = 512,
    layers: Optional[str] = None,
    batch_size: int = 8,
    seed: int = 0,
    armor_eval: str = "materialized",
    progress: bool = True,
    log: Optional[Callable[[str], None]] = None,
    finished: Mapping[str, QualityRow] = {},
    on_row: Optional[Callable[[QualityRow], None]] = None,
    armor_run_dir: Optional[Callable[[str], Any]] = None,
    on_loaded: Optional[Callable[[nn.Module, torch.Tensor], None]] = None,
) -> QualityResult:
    """The quality protocol: prune with every method (each from the dense weights), measure perplexity.

    Args:
        model: ``"smollm2"`` / a path / a hub id (see :func:`~torch_armor.recipes.models.load_model`)
            or a loaded model (then give ``tokenizer``).
        methods: rows to produce: ``"dense"`` and registered method names (:data:`DEMO_METHODS`).
        configs: method configs to use, one row each (their pattern replaced by ``pattern``); a
            method without one here runs its default config (default: ``ArmorConfig()``).
        sequential: ``True`` — each block calibrated on the outputs of the already-pruned blocks;
            ``False`` — on the dense model's ("one-shot"); a sequence gives one row per entry; a
            mapping ``{method: (True, False)}`` says it per method (others: sequential).
        calib, n_calib: calibration source and number of random windows (seed ``seed``).
        eval_data, n_eval: evaluation source and number of non-overlapping windows.
        seq_len: tokens per window (both).
        layers: restrict pruning to some layers (:func:`~torch_armor.calibration.selection.select_layers`).
        batch_size: windows per forward pass (evaluation; calibration uses half).
        armor_eval: ``"materialized"`` (default) — each ``W_hat = A·core·B`` written into its linear
            as a dense matrix, the same function up to float rounding and the fastest on CPU;
            ``"tensor"`` — through the ArmorTensor weights.
        log: called with one line of text after each phase (e.g. ``print``).
        finished: rows already done, by label (an earlier, interrupted run): kept, not recomputed.
        on_row: called with each row as soon as it is done.
        armor_run_dir: the run directory of an ARMOR row, from its label (finished layers are kept
            there, so an interrupted row resumes); default none.
        on_loaded: called with the dense model and the calibration windows once both are ready,
            before the first row (the demo times a forward pass there for its estimate).

    Example::

        >>> result = run_quality("smollm2", layers="0", n_calib=2, n_eval=2, seq_len=64)   # doctest: +SKIP
        >>> print(result.table())                                                         # doctest: +SKIP
    """
    if armor_eval not in ("materialized", "tensor"):
        raise ArmorInputError(f"armor_eval must be 'materialized' or 'tensor', got {armor_eval!r}")
    known = (DENSE, *method_names())
    unknown = [m for m in methods if m not in known]
    if unknown:
        raise ArmorInputError(f"unknown methods {unknown}; choose from {known}")
    given = [dataclasses.replace(c, pattern=pattern) for c in configs]

    def configs_of(name: str) -> List[Any]:
        return [c for c in given if method_for(c).name == name] or [config_for_method(name, pattern=pattern)]

    def modes(name: str) -> List[bool]:
        chosen = sequential.get(name, (True,)) if isinstance(sequential, Mapping) else sequential
        return [bool(s) for s in (chosen if isinstance(chosen, (list, tuple)) else (chosen,))]

    say = log or (lambda _line: None)
    timings: Dict[str, float] = {}
    t0 = time.perf_counter()
    if isinstance(model, nn.Module):
        if tokenizer is None:
            raise ArmorInputError("pass the tokenizer along with a loaded model")
        net = model
    else:
        say(f"loading {model} …{loading_note(model)}")
        net, tokenizer = load_model(model)
    timings["load"] = time.perf_counter() - t0
    say(f"loaded model in {timings['load']:.1f} s")

    t = time.perf_counter()
    calib_ids = calibration_windows(calib, tokenizer, n_windows=n_calib, seq_len=seq_len, seed=seed)
    eval_ids = eval_windows(eval_data, tokenizer, n_windows=n_eval, seq_len=seq_len)
    timings["tokenize"] = time.perf_counter() - t
    names = select_layers(net, layers)
    dense = {n: net.get_submodule(n).weight for n in names}
    if on_loaded is not None:
        on_loaded(net, calib_ids)
    rows: List[QualityRow] = []
    reports: Dict[str, PruneReport] = {}
    try:
        for name in methods:
            pruned = name != DENSE
            row_configs = configs_of(name) if pruned else [None]
            for seq in (modes(name) if pruned else (True,)):
                for k, cfg in enumerate(row_configs):
                    _restore(net, dense)
                    label = method_label(name)
                    if len(row_configs) > 1:
                        label += f" #{k + 1}"
                    if pruned and len(modes(name)) > 1:
                        label += " sequential" if seq else " one-shot"
                    if label in finished:
                        rows.append(finished[label])
                        say(f"{label}: ppl {finished[label].ppl:.3f} (kept from an earlier run)")
                        continue
                    report, prune_s, settings = None, 0.0, ""
                    if pruned:
                        settings = method_for(cfg).describe(cfg)
                        t = time.perf_counter()
                        store = armor_run_dir(label) if armor_run_dir and method_for(cfg).stores_layers else None
                        report = prune_model(net, calib_ids, cfg, layers=names, options=PruneOptions(
                            sequential=seq, batch_size=max(1, batch_size // 2), progress=progress, run_dir=store))
                        prune_s = time.perf_counter() - t
                        settings = ", ".join(s for s in (settings, "sequential" if seq else "one-shot") if s)
                    if armor_eval == "materialized":
                        _materialize(net, names)
                    t = time.perf_counter()
                    ppl = perplexity(net, eval_ids, batch_size=batch_size, progress=progress)
                    eval_s = time.perf_counter() - t
                    row = QualityRow(method=name, ppl=ppl, label=label, settings=settings,
                                     overhead=report.overhead if report else 0.0, prune_s=prune_s, eval_s=eval_s,
                                     mean_relative_proxy_loss=report.mean_relative_proxy_loss if report else None,
                                     mean_relative_output_loss=report.mean_relative_output_loss if report else None)
                    rows.append(row)
                    if report is not None:
                        reports[label] = report
                    timings[f"{label}: prune"] = prune_s
                    timings[f"{label}: eval"] = eval_s
                    say(f"{row.name}: ppl {ppl:.3f} (prune {prune_s:.1f} s, eval {eval_s:.1f} s)")
                    if on_row is not None:
                        on_row(row)
    finally:
        _restore(net, dense)
    timings["total"] = time.perf_counter() - t0
    settings_out = {
        "model": model if isinstance(model, str) else type(model).__name__,
        "pattern": pattern, "calib": _describe(calib), "n_calib": n_calib, "eval": _describe(eval_data),
        "n_eval": n_eval, "seq_len": seq_len, "layers": layers, "num_layers": len(names),
        "threads": torch.get_num_threads(), "armor_eval": armor_eval,
        "sequential": {m: modes(m) for m in methods if m != DENSE},
    }
    return QualityResult(rows=rows, reports=reports, timings=timings, settings=settings_out)


def _describe(source: Any) -> str:
    """A text source by name; token ids by shape (never a tensor's whole repr)."""
    if isinstance(source, torch.Tensor):
        return f"token ids {tuple(source.shape)}"
    return str(source)


def _restore(model: nn.Module, dense: Mapping[str, nn.Parameter]) -> None:
    """Put the dense weights back (pruning replaces the Parameter objects, never edits them)."""
    for name, weight in dense.items():
        model.get_submodule(name).weight = weight
