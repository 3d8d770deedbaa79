"""The one per-layer runner: a config's method (:mod:`torch_armor.engine.methods`) on one linear.

Every front end — :func:`torch_armor.prune_model` (block by block), the ``torch.ao``-style
sparsifiers and the command line — solves a layer with :func:`solve_layer` and writes the
result into the module with :meth:`LayerSolution.apply`. The solution's payload is ARMOR's
:class:`~torch_armor.core.factors.ArmorFactors`, a baseline's pruned dense weight; the engine
reads neither, the method's hooks do.

Example::

    >>> import torch
    >>> from torch_armor.config.methods import WandaConfig
    >>> g = torch.Generator().manual_seed(0)
    >>> w, h = torch.randn(16, 32, generator=g), torch.rand(32, generator=g) + 0.1
    >>> stats = LayerStatistics(h, num_tokens=8)
    >>> sol = solve_layer(w, stats, WandaConfig())
    >>> float((sol.approximation() == 0).float().mean())
    0.5
    >>> round(relative_proxy_loss(w, sol.approximation(), h, "2:4") , 3) >= 1.0   # Wanda vs NoWag-P's optimum
    True
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch

from torch_armor.calibration.observer import LayerStatistics
from torch_armor.core.proxy import normalize_weight, nowag_prune, proxy_loss, relative_proxy_loss  # noqa: F401  (doctest)
from torch_armor.engine.methods import method_for
from torch_armor.engine.solution import LayerSolution

__all__ = ["LayerSolution", "Statistics", "solve_layer", "ProxyReference"]

#: A layer's calibration statistics, or just its ``act_sq_norm`` tensor (``Σx²`` per input channel).
Statistics = Union[LayerStatistics, torch.Tensor]


def solve_layer(weight: torch.Tensor, stats: Optional[Statistics], config: Any, name: str = "") -> LayerSolution:
    """Run ``config``'s method on one weight with its input statistics (a :class:`LayerStatistics`,
    or just the ``act_sq_norm`` tensor where ``XᵀX`` is not needed — for ARMOR that skips the
    output-space refinement) and (per-layer) settings.

    Raises:
        ArmorInputError: the method needs statistics and none (or no tokens) were given; errors
            of the method itself name the layer.
    """
    return method_for(config).solve_layer(weight, stats, config, name)


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
