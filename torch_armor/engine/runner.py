"""The one per-layer runner: a method registry and what each method does to one linear.

Every front end — :func:`torch_armor.prune_model` (block by block), the ``torch.ao``-style
sparsifiers and the command line — solves a layer with :func:`solve_layer` and writes the
result into the module with :meth:`LayerSolution.apply`. ARMOR returns
:class:`~torch_armor.core.factors.ArmorFactors`; the baselines return the pruned dense weight.

Example::

    >>> import torch
    >>> g = torch.Generator().manual_seed(0)
    >>> w, h = torch.randn(16, 32, generator=g), torch.rand(32, generator=g) + 0.1
    >>> stats = LayerStatistics(h, num_tokens=8)
    >>> sol = solve_layer("wanda", w, stats, BaselineConfig())
    >>> float((sol.approximation() == 0).float().mean())
    0.5
    >>> round(relative_proxy_loss(w, sol.approximation(), h, "2:4") , 3) >= 1.0   # Wanda vs NoWag-P's optimum
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import nn

from torch_armor.calibration.observer import LayerStatistics
from torch_armor.config import ArmorConfig, parse_pattern
from torch_armor.core import baselines
from torch_armor.core.factorize import factorize
from torch_armor.core.factors import ArmorFactors
from torch_armor.core.proxy import check_layer_shape, nowag_prune, relative_proxy_loss

__all__ = [
    "BaselineConfig",
    "LayerSolution",
    "Method",
    "METHODS",
    "method_config",
    "solve_layer",
    "layer_config",
    "ProxyReference",
]


@dataclass(frozen=True)
class BaselineConfig:
    """Settings of the baseline methods (magnitude, Wanda, NoWag-P, SparseGPT).

    Args:
        pattern: ``"2:4"``, any ``"N:M"`` or ``"unstructured:F"``.
        block_size: SparseGPT's lazy-batch width.
        damp: SparseGPT's dampening (fraction of the mean Hessian diagonal).

    Example::

        >>> BaselineConfig(pattern="4:8").pattern
        '4:8'
    """

    pattern: str = "2:4"
    block_size: int = 128
    damp: float = 0.01

    def __post_init__(self) -> None:
        object.__setattr__(self, "pattern", str(parse_pattern(self.pattern)))
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"BaselineConfig.block_size must be a positive integer, got {self.block_size!r}")
        if not (isinstance(self.damp, (int, float)) and 0.0 <= self.damp < 1.0):
            raise ValueError(f"BaselineConfig.damp must be in [0, 1), got {self.damp!r}")


@dataclass(frozen=True)
class Method:
    """One pruning method: its label, what it needs from calibration (``needs_xtx(config)``:
    whether its settings need ``XᵀX``), and which :class:`BaselineConfig` fields besides
    ``pattern`` it reads (``options``)."""

    name: str
    label: str
    needs_statistics: bool
    needs_xtx: Callable[[Any], bool]
    solve: Callable[[torch.Tensor, Optional[LayerStatistics], Any],
                    Union[ArmorFactors, Tuple[torch.Tensor, torch.Tensor]]]
    options: Tuple[str, ...] = ()


Statistics = Union[LayerStatistics, torch.Tensor]  # or just the act_sq_norm tensor (Σx² per input channel)


def _h(stats: Statistics, weight: torch.Tensor) -> torch.Tensor:
    h = stats if isinstance(stats, torch.Tensor) else stats.act_sq_norm
    return h.to(weight.device)


def _armor(weight: torch.Tensor, stats: Statistics, cfg: ArmorConfig, name: str = "") -> ArmorFactors:
    xtx = getattr(stats, "xtx", None)  # a bare act_sq_norm tensor: the diagonal proxy only
    if cfg.refine == "output" and xtx is None and isinstance(stats, LayerStatistics):
        raise ValueError(f"layer {name!r}: refine='output' needs XᵀX statistics (calibrate with track_xtx=True), "
                         "or set ArmorConfig(refine=None)")
    return factorize(weight, _h(stats, weight), cfg, xtx=xtx, name=name or None)


def _magnitude(weight, stats, cfg, name=""):
    return baselines.magnitude_prune(weight, cfg.pattern)


def _wanda(weight, stats, cfg, name=""):
    return baselines.wanda_prune(weight, stats.act_sq_norm.to(weight.device), cfg.pattern)


def _nowag(weight, stats, cfg, name=""):
    return nowag_prune(weight, stats.act_sq_norm.to(weight.device), cfg.pattern)


def _sparsegpt(weight, stats, cfg, name=""):
    if getattr(stats, "xtx", None) is None:
        raise ValueError(f"layer {name!r}: SparseGPT needs XᵀX statistics (calibrate with track_xtx=True)")
    return baselines.sparsegpt_prune(weight, stats.xtx.to(weight.device), cfg.pattern,
                                     block_size=cfg.block_size, damp=cfg.damp)


def _armor_needs_xtx(config: Any) -> bool:
    """Refinement fits to ``XᵀX``; block reconstruction reports each layer's output loss with it."""
    return getattr(config, "refine", None) == "output" or getattr(config, "reconstruct_steps", 0) > 0


def _never(config: Any) -> bool:
    return False


def _always(config: Any) -> bool:
    return True


#: The method registry: every front end reads this one table.
METHODS: Dict[str, Method] = {
    m.name: m
    for m in (
        Method("magnitude", "magnitude", False, _never, _magnitude),
        Method("wanda", "Wanda", True, _never, _wanda),
        Method("sparsegpt", "SparseGPT", True, _always, _sparsegpt, options=("block_size", "damp")),
        Method("nowag", "NoWag-P", True, _never, _nowag),
        Method("armor", "ARMOR", True, _armor_needs_xtx, _armor),
    )
}


def _method(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]


def method_config(method: str, config: Any = None, pattern: Optional[str] = None) -> Any:
    """The settings object of ``method``: ``config`` checked (an :class:`ArmorConfig` for ARMOR, a
    :class:`BaselineConfig` otherwise), the default if ``None``; ``pattern`` overrides its pattern.

    Example::

        >>> method_config("armor").block_size, method_config("sparsegpt", pattern="4:8").pattern
        (16, '4:8')
    """
    kind = ArmorConfig if _method(method).name == "armor" else BaselineConfig
    if config is None:
        config = kind()
    if not isinstance(config, kind):
        raise ValueError(f"method {method!r} takes a {kind.__name__}, got {type(config).__name__}")
    if pattern is not None and str(parse_pattern(pattern)) != config.pattern:
        config = dataclasses.replace(config, pattern=str(parse_pattern(pattern)))
    return config


def layer_config(method: str, config: Any, shape: Tuple[int, int], name: str) -> Any:
    """The settings of one layer: ARMOR's block size resolved for its shape (``"auto"`` included)
    and every method's pattern checked against it; errors name the layer."""
    if method == "armor":
        return config.for_layer(shape[0], shape[1], name=name)
    check_layer_shape(shape[0], shape[1], parse_pattern(config.pattern), None, name=name)
    return config


@dataclass
class LayerSolution:
    """What a method made of one layer: ARMOR factors, or a pruned dense weight and its mask."""

    name: str
    method: str
    factors: Optional[ArmorFactors] = None
    pruned: Optional[torch.Tensor] = None
    seconds: float = 0.0
    mask: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.mask is None and self.factors is not None:
            self.mask = self.factors.mask

    def approximation(self) -> torch.Tensor:
        """The dense approximation of the weight (``A·core·B`` for ARMOR)."""
        return self.factors.dense() if self.factors is not None else self.pruned

    def apply(self, module: nn.Linear, storage: str = "dense") -> None:
        """Write the result into ``module``: an ArmorTensor weight for ARMOR (``storage`` of its
        core), the pruned weight (same dtype, device and ``requires_grad``) otherwise."""
        from torch_armor.tensor.armor_tensor import armor_linear_from_factors

        if self.factors is not None:
            armor_linear_from_factors(module, self.factors, storage=storage, name=self.name)
            return
        old = module.weight
        module.weight = nn.Parameter(self.pruned.to(device=old.device, dtype=old.dtype),
                                     requires_grad=old.requires_grad)


def solve_layer(method: str, weight: torch.Tensor, stats: Optional[Statistics], config: Any,
                name: str = "") -> LayerSolution:
    """Run ``method`` on one weight with its input statistics (a :class:`LayerStatistics`, or just
    the ``act_sq_norm`` tensor where ``XᵀX`` is not needed — for ARMOR that skips the
    output-space refinement) and (per-layer) settings.

    Raises:
        ValueError: the method needs statistics and none (or no tokens) were given; errors of
            the method itself name the layer.
    """
    m = _method(method)
    if m.needs_statistics and (stats is None or getattr(stats, "num_tokens", None) == 0):
        raise ValueError(
            f"layer {name!r} saw no calibration data: run forward passes on calibration inputs before solving it"
        )
    start = time.perf_counter()
    with torch.no_grad():
        try:
            result = m.solve(weight.detach(), stats, config, name)
        except ValueError as err:
            if name and name not in str(err):
                raise ValueError(f"layer {name!r}: {err}") from err
            raise
    seconds = time.perf_counter() - start
    if isinstance(result, ArmorFactors):
        return LayerSolution(name, method, factors=result, seconds=seconds)
    mask, pruned = result
    return LayerSolution(name, method, pruned=pruned, seconds=seconds, mask=mask)


class ProxyReference:
    """The NoWag-P denominator of a layer's relative proxy loss, computed once.

    ``relative(approx)`` equals :func:`torch_armor.core.proxy.relative_proxy_loss` but needs only
    one subtraction and one matrix-vector product per call:
    ``Σ_ij (W − Ŵ)_ij² h_j / (r_i² c_j²) = (1/r²)ᵀ · (W − Ŵ)^∘2 · (h/c²)``.

    Example::

        >>> w, h = torch.randn(8, 16), torch.rand(16) + 0.1
        >>> _, pruned = nowag_prune(w, h, "2:4")
        >>> round(ProxyReference(w, h, "2:4").relative(w, pruned), 6)
        1.0
    """

    def __init__(self, weight: torch.Tensor, h: torch.Tensor, pattern: Any) -> None:
        from torch_armor.core.proxy import normalize_weight, proxy_loss

        w = weight.detach()
        h = h.to(w.device)
        _, row_norm, col_norm = normalize_weight(w.double())
        self.row_weight = row_norm.square().reciprocal()
        self.col_weight = (h.double() / col_norm.square()).to(torch.float32)
        _, pruned = nowag_prune(w, h, pattern)
        self.base = float(proxy_loss(w, pruned, h))

    def relative(self, weight: torch.Tensor, approx: torch.Tensor) -> float:
        diff = (weight.float() - approx.to(weight.device).float()).square_()
        loss = float(self.row_weight @ (diff @ self.col_weight).double())
        if self.base == 0.0:
            return 0.0 if loss == 0.0 else math.inf
        return loss / self.base
