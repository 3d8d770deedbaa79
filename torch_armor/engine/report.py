"""What a prune did, layer by layer: :class:`PruneReport` (JSON and a PNG plot).

Example::

    >>> r = PruneReport("armor", "2:4", [LayerResult("fc", (16, 32), 0.5, 1.0, extra_params=768)])
    >>> round(r.overhead, 3), r.mean_relative_proxy_loss
    (1.5, 0.5)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union

from torch_armor.calibration.selection import block_index
from torch_armor.engine.methods import method_label, method_named
from torch_armor.errors import require_extra

__all__ = ["LayerResult", "PruneReport"]


@dataclass
class LayerResult:
    """One pruned linear, as its method reports it (:meth:`~torch_armor.engine.methods.Method.report_fields`):
    the relative proxy loss (÷ NoWag-P's; < 1 is better), wall time, ``extra_params`` (what the method
    stores beside the N:M core: ARMOR's wrappers), ``relative_output_loss`` (``tr(E H Eᵀ)`` ÷ NoWag-P's)
    where the method measured it, and ``details``: anything else it says of the layer (ARMOR: its
    ``block_size`` and ``iterations``)."""

    name: str
    shape: Tuple[int, int]
    relative_proxy_loss: float
    seconds: float
    extra_params: int = 0
    relative_output_loss: Optional[float] = None
    details: Dict[str, Any] = field(default_factory=dict)


@dataclass
class PruneReport:
    """What :func:`prune` did, layer by layer.

    Attributes:
        method: ``"armor"``, ``"nowag"``, ``"sparsegpt"``, ``"wanda"`` or ``"magnitude"``.
        pattern: the sparsity pattern, e.g. ``"2:4"``.
        layers: one :class:`LayerResult` per pruned linear, in pruning order.
        seconds: total wall time of the pruning (per-layer times plus bookkeeping).
        settings: ``{"config": the method config as ``config_to_dict`` writes it, "sequential": bool}``.
        stages: what the method did besides solving each layer, by stage, as the method reports it
            (:meth:`stage_lines` says it in one line each). ARMOR's: ``"reconstruction"``:
            ``{"errors": {block: (before, after)}, "curves": {block: [(step, error), …]}}``, the held-out
            relative output error ``‖Y − Y_dense‖² / ‖Y_dense‖²`` of each block before and after block
            reconstruction and at each check; ``"distillation"``: its held-out KL ``before`` and ``after``,
            ``best_step``, the ``curve`` and its seconds, or ``{"skipped": why, "expected_cost": …}`` when
            the config asked for it and this run could not (too few windows, ``torchrun``).
        dense_weights: ``{name pattern: (count, why)}``: every weight the prune left dense (routers,
            embeddings, unselected layers, …; block index as ``*``), one entry per kind.
        unfit_layers: ``{layer: what was done}`` for every selected layer the settings did not fit
            (``"block size 8: …"``, its own smaller block size; ``"dense: …"``, left out), with why.
        uncalled_layers: ``{layer: why}`` for every selected linear calibration never called as a
            module (left dense): a weight a fused kernel reads directly (Mamba's ``dt_proj``), or a
            ``ModuleList`` expert no calibration token reached.
        expert_tokens: mixture-of-experts models: ``{f"{experts module}.{e}": routed calibration
            tokens}`` of each pruned expert (summed over the windows).
        rank, world_size: where this process stood in a ``torchrun`` job (not saved: every rank
            returns a report, rank 0 writes the model).
    """

    method: str
    pattern: str
    layers: List[LayerResult] = field(default_factory=list)
    seconds: float = 0.0
    settings: Dict[str, Any] = field(default_factory=dict)
    stages: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    dense_weights: Dict[str, Tuple[int, str]] = field(default_factory=dict)
    expert_tokens: Dict[str, int] = field(default_factory=dict)
    unfit_layers: Dict[str, str] = field(default_factory=dict)
    uncalled_layers: Dict[str, str] = field(default_factory=dict)

    @property
    def extra_params(self) -> int:
        return sum(layer.extra_params for layer in self.layers)

    @property
    def dense_params(self) -> int:
        return sum(layer.shape[0] * layer.shape[1] for layer in self.layers)

    @property
    def overhead(self) -> float:
        """Extra parameters ÷ dense parameters of the pruned linears (0 for the baselines)."""
        return self.extra_params / self.dense_params if self.dense_params else 0.0

    @property
    def mean_relative_proxy_loss(self) -> float:
        return sum(layer.relative_proxy_loss for layer in self.layers) / max(len(self.layers), 1)

    @property
    def mean_relative_output_loss(self) -> Optional[float]:
        """Mean over the layers refined in output space (``None`` if none was)."""
        values = [layer.relative_output_loss for layer in self.layers if layer.relative_output_loss is not None]
        return sum(values) / len(values) if values else None

    def final_loss(self) -> Tuple[str, float]:
        """``(what, mean)``: the per-layer loss the last per-layer stage minimised, relative to
        NoWag-P's (``1`` is NoWag-P, ``0`` the dense layer): ``"output"`` (``tr(E XᵀX Eᵀ)``) after
        output-space refinement or block reconstruction, else ``"proxy"`` (ARMOR's proxy, NoWag-P's
        objective)."""
        output = self.mean_relative_output_loss
        return ("output", output) if output is not None else ("proxy", self.mean_relative_proxy_loss)

    def loss_summary(self) -> str:
        """The final per-layer loss relative to NoWag-P and the share of NoWag-P's gap to the dense
        layer it closes, named for what it is; a baseline's proxy loss says it is not its objective.

            >>> PruneReport("armor", "2:4", [LayerResult("fc", (16, 32), 1.2, 1.0, relative_output_loss=0.25)]
            ...             ).loss_summary()
            "layer output loss 0.2500 × NoWag-P's: closes 75.0% of the gap from NoWag-P to the dense layers"
        """
        what, value = self.final_loss()
        gap = 1.0 - value
        closes = (f"closes {100 * gap:.1f}% of the gap from NoWag-P to the dense layers" if gap >= 0
                  else f"{100 * -gap:.1f}% above NoWag-P")
        if what == "output":
            return f"layer output loss {value:.4f} × NoWag-P's: {closes}"
        label = method_label(self.method)
        if method_named(self.method).minimises_proxy:
            return f"proxy loss {value:.4f} × NoWag-P's (the loss {label} minimised): {closes}"
        return (f"proxy loss {value:.4f} × NoWag-P's (NoWag-P's objective, not {label}'s: "
                "compare methods by perplexity)")

    def stage_lines(self) -> List[str]:
        """One line per stage of :attr:`stages`, as its method says it
        (:meth:`~torch_armor.engine.methods.Method.stage_lines`)."""
        return method_named(self.method).stage_lines(self.stages)

    def _final(self, layer: LayerResult) -> float:
        if self.final_loss()[0] == "output" and layer.relative_output_loss is not None:
            return layer.relative_output_loss
        return layer.relative_proxy_loss

    def to_dict(self, **extra: Any) -> Dict[str, Any]:
        """JSON-able summary plus one entry per layer; ``extra`` keys are added at the top."""
        out: Dict[str, Any] = dict(extra)
        out.update(
            method=self.method,
            pattern=self.pattern,
            settings=self.settings,
            num_layers=len(self.layers),
            seconds=self.seconds,
            extra_params=self.extra_params,
            dense_params=self.dense_params,
            overhead=self.overhead,
            mean_relative_proxy_loss=self.mean_relative_proxy_loss,
            mean_relative_output_loss=self.mean_relative_output_loss,
            dense_weights={k: {"count": c, "why": why} for k, (c, why) in self.dense_weights.items()},
            expert_tokens=dict(self.expert_tokens),
            unfit_layers=dict(self.unfit_layers),
            uncalled_layers=dict(self.uncalled_layers),
            stages=self.stages,
            layers=[{k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(layer).items()}
                    for layer in self.layers],
        )
        return out

    def save_json(self, path: Union[str, os.PathLike], **extra: Any) -> None:
        """Write :meth:`to_dict` to ``path``."""
        with open(path, "w") as fh:
            json.dump(self.to_dict(**extra), fh, indent=2, default=str)

    def save_plot(self, path: Union[str, os.PathLike], title: Optional[str] = None) -> None:
        """PNG: the final per-layer loss ÷ NoWag-P's (:meth:`final_loss`; coloured by linear type) and
        time per layer.

        Raises :class:`~torch_armor.errors.MissingExtraError` without matplotlib (the ``plot`` extra).
        """
        require_extra("matplotlib", "the prune report's plot")
        # the figure draws on its own Agg canvas: pyplot and the caller's backend are left alone
        from matplotlib import colormaps  # local: the plot extra is optional
        from matplotlib.backends.backend_agg import FigureCanvasAgg  # local: as above
        from matplotlib.figure import Figure  # local: as above

        kinds = [layer.name.rsplit(".", 1)[-1] for layer in self.layers]
        palette = colormaps["tab10"]
        colour = {k: palette(i % 10) for i, k in enumerate(dict.fromkeys(kinds))}
        xs = list(range(len(self.layers)))
        width = max(7.0, min(18.0, 0.06 * len(xs) + 6))
        fig = Figure(figsize=(width, 6.5))
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        for kind in colour:
            idx = [i for i, k in enumerate(kinds) if k == kind]
            ax1.scatter(idx, [self._final(self.layers[i]) for i in idx], s=14, color=colour[kind], label=kind)
            ax2.scatter(idx, [self.layers[i].seconds for i in idx], s=14, color=colour[kind])
        ax1.axhline(1.0, color="grey", lw=0.8, ls="--")
        what = self.final_loss()[0]
        ax1.set_ylabel(f"layer {what} loss ÷ NoWag-P's\n(1: NoWag-P, 0: dense)")
        ax1.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
        ax2.set_ylabel("time per layer (s)")
        # ticks at the first linear of each decoder block, labelled by the block index
        starts: Dict[int, int] = {}
        for i, layer in enumerate(self.layers):
            block = block_index(layer.name)
            if block is not None:
                starts.setdefault(block, i)
        if starts:
            step = max(1, math.ceil(len(starts) / 16))
            ticks = sorted(starts.items())[::step]
            ax2.set_xticks([i for _, i in ticks], [str(b) for b, _ in ticks])
            ax2.set_xlabel("decoder layer")
        else:
            ax2.set_xlabel("layer (pruning order)")
        label = method_label(self.method)
        ax1.set_title(title or f"{label} {self.pattern}, {len(xs)} linears, {self.seconds:.0f} s\n{self.loss_summary()}",
                      fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)

