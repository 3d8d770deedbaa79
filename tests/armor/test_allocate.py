"""The model-wide block-size allocation against brute force."""

import itertools

import pytest
from hypothesis import given, settings, strategies as st

from torch_armor.armor.allocate import (allocate_block_sizes, candidate_block_sizes, layer_kind, loss_curves,
                                         overhead_of)

SHAPES = [(64, 64), (32, 64), (128, 64), (64, 128)]


@st.composite
def problems(draw):
    n = draw(st.integers(1, 5))
    shapes = {f"m.layers.{i}.lin": draw(st.sampled_from(SHAPES)) for i in range(n)}
    curves = {}
    for name, (d_out, d_in) in shapes.items():
        sizes = draw(st.lists(st.sampled_from(candidate_block_sizes(d_out, d_in, 4, lo=4, hi=32)), min_size=1,
                              max_size=4, unique=True))
        curves[name] = {b: draw(st.floats(0, 1, allow_nan=False)) for b in sizes}
    return curves, shapes, draw(st.floats(0.02, 0.6))


def brute_force(curves, shapes, max_overhead):
    names = list(curves)
    budget = max_overhead * sum(a * b for a, b in shapes.values())
    best = None
    for combo in itertools.product(*(sorted(curves[n]) for n in names)):
        cost = sum(b * sum(shapes[n]) for n, b in zip(names, combo))
        if cost <= budget + 1e-9:
            loss = sum(curves[n][b] for n, b in zip(names, combo))
            if best is None or loss < best - 1e-12:
                best = loss
    return best


@settings(max_examples=150, deadline=None)
@given(problems())
def test_allocation_is_optimal_and_within_budget(problem):
    curves, shapes, max_overhead = problem
    optimum = brute_force(curves, shapes, max_overhead)
    if optimum is None:
        with pytest.raises(ValueError, match="below the smallest wrapper overhead"):
            allocate_block_sizes(curves, shapes, max_overhead)
        return
    chosen = allocate_block_sizes(curves, shapes, max_overhead)
    assert set(chosen) == set(curves) and all(chosen[n] in curves[n] for n in chosen)
    assert overhead_of(chosen, shapes) <= max_overhead + 1e-12
    assert sum(curves[n][chosen[n]] for n in chosen) == pytest.approx(optimum, abs=1e-9)


def test_coarse_units_still_respect_the_budget(monkeypatch):
    import torch_armor.armor.allocate as allocate

    monkeypatch.setattr(allocate, "MAX_UNITS", 7)
    shapes = {f"m.layers.{i}.lin": s for i, s in enumerate(SHAPES)}
    curves = {n: {4: 1.0, 8: 0.5, 16: 0.1} for n in shapes}
    chosen = allocate.allocate_block_sizes(curves, shapes, 0.2)
    assert overhead_of(chosen, shapes) <= 0.2


def test_kinds_share_the_mean_curve():
    measured = {"m.layers.0.q": {8: 0.4, 16: 0.2}, "m.layers.2.q": {8: 0.6, 16: 0.4, 32: 0.1}}
    curves = loss_curves(measured, ["m.layers.1.q"])
    assert curves == {"m.layers.1.q": {8: pytest.approx(0.5), 16: pytest.approx(0.3)}}
    assert layer_kind("model.layers.12.mlp.up_proj") == "model.layers.*.mlp.up_proj"
    with pytest.raises(ValueError, match="'m.layers.1.k'.*no measured loss curve"):
        loss_curves(measured, ["m.layers.1.k"])
