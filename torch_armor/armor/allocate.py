"""One wrapper-overhead budget for the whole model: which block size each layer gets.

ARMOR's wrappers cost ``d_b·(d_out + d_in)`` parameters per layer. Spending a model-wide budget
(``max_overhead`` of all the pruned weights) unevenly — larger blocks where they lower the loss
most per parameter — beats one block size everywhere. :func:`allocate_block_sizes` solves that
choice exactly (a multiple-choice knapsack, by dynamic programming over the budget);
:func:`loss_curves` turns measured per-layer losses into a curve per layer *kind* (the layer's
name without its block index), so a few sampled blocks stand for all of them.

Example::

    >>> shapes = {"l0.q": (64, 64), "l0.up": (128, 64)}
    >>> curves = {"l0.q": {8: 0.5, 16: 0.3}, "l0.up": {8: 0.6, 16: 0.55}}
    >>> allocate_block_sizes(curves, shapes, max_overhead=0.3)   # 16·128 + 8·192 ≤ 0.3·12288
    {'l0.q': 16, 'l0.up': 8}
"""

from __future__ import annotations

import math
import re
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np

from torch_armor.core.pattern import candidate_block_sizes  # noqa: F401  (the candidates this module chooses from)
from torch_armor.errors import ArmorInputError

__all__ = ["allocate_block_sizes", "candidate_block_sizes", "layer_kind", "loss_curves", "overhead_of"]

#: The DP works in integer cost units; above this many it coarsens them (costs rounded up, so the
#: budget still holds).
MAX_UNITS = 200_000


def overhead_of(block_sizes: Mapping[str, int], shapes: Mapping[str, Tuple[int, int]]) -> float:
    """Wrapper parameters ``Σ d_b·(d_out + d_in)`` as a fraction of ``Σ d_out·d_in``."""
    extra = sum(block_sizes[n] * (shapes[n][0] + shapes[n][1]) for n in block_sizes)
    return extra / sum(shapes[n][0] * shapes[n][1] for n in block_sizes)


def layer_kind(name: str) -> str:
    """A layer's name with the decoder block index removed: its kind across blocks.

    Example::

        >>> layer_kind("model.layers.17.self_attn.q_proj")
        'model.layers.*.self_attn.q_proj'
    """
    return re.sub(r"\.\d+\.", ".*.", name, count=1)


def loss_curves(measured: Mapping[str, Mapping[int, float]], names: Iterable[str]) -> Dict[str, Dict[int, float]]:
    """Each layer of ``names`` gets the mean measured curve of its kind (:func:`layer_kind`).

    Raises:
        ValueError: a layer whose kind was never measured (the message names it).
    """
    by_kind: Dict[str, List[Mapping[int, float]]] = {}
    for name, curve in measured.items():
        by_kind.setdefault(layer_kind(name), []).append(curve)
    out: Dict[str, Dict[int, float]] = {}
    for name in names:
        curves = by_kind.get(layer_kind(name))
        if not curves:
            raise ArmorInputError(f"layer {name!r}: no measured loss curve for its kind {layer_kind(name)!r}")
        sizes = sorted(set.intersection(*(set(c) for c in curves)))
        out[name] = {b: float(np.mean([c[b] for c in curves])) for b in sizes}
    return out


def allocate_block_sizes(curves: Mapping[str, Mapping[int, float]], shapes: Mapping[str, Tuple[int, int]],
                         max_overhead: float) -> Dict[str, int]:
    """The block size of every layer minimizing ``Σ curves[layer][d_b]`` subject to
    ``Σ d_b·(d_out + d_in) ≤ max_overhead · Σ d_out·d_in`` — exact (ties: the smaller total
    cost), unless the budget has more than :data:`MAX_UNITS` cost units, where costs are
    rounded up to coarser units (still within the budget, possibly slightly sub-optimal).

    Args:
        curves: ``{layer: {block size: loss}}`` (any loss that adds up across layers).
        shapes: ``{layer: (d_out, d_in)}``.
        max_overhead: the model-wide budget as a fraction (0.05 = 5%).

    Raises:
        ValueError: empty or inconsistent inputs, or a budget below the cheapest choice (the
            message gives the smallest overhead that fits).
    """
    names = list(curves)
    if not names:
        raise ArmorInputError("allocate_block_sizes: no layers")
    if set(names) != set(shapes):
        raise ArmorInputError(f"allocate_block_sizes: curves and shapes name different layers: "
                         f"{sorted(set(names) ^ set(shapes))[:5]}")
    if not max_overhead > 0:
        raise ArmorInputError(f"max_overhead must be a positive fraction, got {max_overhead!r}")
    options: List[Sequence[Tuple[int, int, float]]] = []
    for n in names:
        if not curves[n]:
            raise ArmorInputError(f"layer {n!r}: no candidate block sizes")
        d_out, d_in = shapes[n]
        options.append([(b, b * (d_out + d_in), float(loss)) for b, loss in sorted(curves[n].items())])
    budget = math.floor(max_overhead * sum(d_out * d_in for d_out, d_in in shapes.values()) + 1e-9)
    cheapest = sum(min(c for _, c, _ in opts) for opts in options)
    if cheapest > budget:
        total = sum(d_out * d_in for d_out, d_in in shapes.values())
        raise ArmorInputError(f"max_overhead={max_overhead:g} is below the smallest wrapper overhead these layers can "
                         f"have ({cheapest / total:.2%}, every layer at its smallest block size): raise it")
    unit = math.gcd(*(c for opts in options for _, c, _ in opts))
    if budget // unit > MAX_UNITS:
        unit = math.ceil(budget / MAX_UNITS)
    units = budget // unit
    # best[u]: least loss with total cost ≤ u·unit over the layers so far; choice[i][u]: the option taken
    best = np.zeros(units + 1)
    choice = np.zeros((len(names), units + 1), dtype=np.int16)
    for i, opts in enumerate(options):
        new = np.full(units + 1, np.inf)
        for k, (_, cost, loss) in enumerate(opts):
            c = -(-cost // unit)
            if c > units:
                continue
            cand = np.full(units + 1, np.inf)
            cand[c:] = best[: units + 1 - c] + loss
            better = cand < new
            new[better] = cand[better]
            choice[i, better] = k
        best = new
    u = int(np.argmin(best))  # the cheapest of the optimal totals
    out: Dict[str, int] = {}
    for i in range(len(names) - 1, -1, -1):
        b, cost, _ = options[i][choice[i, u]]
        out[names[i]] = b
        u -= -(-cost // unit)
    return {n: out[n] for n in names}
