"""Block reconstruction's data: held-out/training split, row slicing, the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from torch_armor.calibration.blocks import BlockInput
from torch_armor.armor.reconstruct_data import Unit, lr_factor, split_windows, take_rows
from torch_armor.errors import ArmorInputError


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), held=st.integers(1, 8),
       micro=st.one_of(st.none(), st.integers(1, 4)), seed=st.integers(0, 1000))
def test_split_partitions_the_windows(sizes, held, micro, seed):
    held_units, train = split_windows(sizes, held, micro, seed)
    total = sum(sizes)
    held_w = [(u.batch, r) for u in held_units for r in u.rows]
    train_w = [(u.batch, r) for u in train for r in u.rows]
    assert len(held_w) == (min(held, total - 1) or 1)
    if total > 1:  # disjoint, and together every window once
        assert sorted(held_w + train_w) == [(j, r) for j, s in enumerate(sizes) for r in range(s)]
    else:  # the only window is both
        assert held_w == train_w == [(0, 0)]
    for u in train:
        assert u.rows and (micro is None or len(u.rows) <= micro)
        assert all(0 <= r < sizes[u.batch] for r in u.rows)
    assert split_windows(sizes, held, micro, seed) == (held_units, train)  # seeded


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6), held=st.integers(1, 8),
       micro=st.one_of(st.none(), st.integers(1, 4)), seed=st.integers(0, 1000), data=st.data())
def test_held_out_windows_come_from_held_out_from_on(sizes, held, micro, seed, data):
    flat = [(j, r) for j, s in enumerate(sizes) for r in range(s)]
    start = data.draw(st.integers(0, len(flat) - 1))
    held_units, train = split_windows(sizes, held, micro, seed, held_out_from=start)
    held_w = [(u.batch, r) for u in held_units for r in u.rows]
    train_w = [(u.batch, r) for u in train for r in u.rows]
    assert set(held_w) <= set(flat[start:])
    assert len(held_w) == (min(held, len(flat) - 1, len(flat) - start) or 1)
    if len(flat) > 1:
        assert sorted(held_w + train_w) == flat
    assert set(flat[:start]) <= set(train_w)  # the leading windows are always trained on


def test_held_out_from_zero_is_the_split_over_every_window():
    assert split_windows([4, 4, 3], 3, 2, 7, held_out_from=0) == split_windows([4, 4, 3], 3, 2, 7)


@pytest.mark.parametrize("start", [-1, 11])
def test_held_out_from_outside_the_windows_is_named(start):
    with pytest.raises(ArmorInputError, match=f"from window {start} on, but only 11 windows"):
        split_windows([4, 4, 3], 3, 2, 7, held_out_from=start)


def test_take_rows_slices_per_row_tensors_and_keeps_shared_ones():
    hidden = torch.randn(4, 3, 2)
    target = torch.randn(4, 3, 2)
    mask = torch.randn(4, 1, 3, 3)
    shared = torch.randn(1, 3, 5)
    positions = torch.arange(4)  # 1-D, length 4 by coincidence: not a per-row tensor
    inp = BlockInput(hidden, {"attention_mask": mask, "position_embeddings": (shared, mask[:, 0]),
                              "cache_position": positions, "flag": True})
    sub, t = take_rows(inp, target, Unit(0, (1, 3)))
    assert torch.equal(sub.hidden, hidden[[1, 3]]) and torch.equal(t, target[[1, 3]])
    assert torch.equal(sub.kwargs["attention_mask"], mask[[1, 3]])
    assert sub.kwargs["position_embeddings"][0] is shared
    assert torch.equal(sub.kwargs["position_embeddings"][1], mask[[1, 3], 0])
    assert sub.kwargs["cache_position"] is positions and sub.kwargs["flag"] is True


def _hand(step, steps, warm, decay):
    """The schedule written out from its definition."""
    if step <= warm:
        return step / warm
    p = (step - warm - 1) / (steps - warm)
    return {"cosine": (1 + math.cos(math.pi * p)) / 2, "linear": 1 - p, "constant": 1.0}[decay]


@settings(max_examples=80, deadline=None)
@given(steps=st.integers(1, 300), frac=st.floats(0, 0.99), decay=st.sampled_from(["cosine", "linear", "constant"]))
def test_schedule_matches_the_formula_and_never_stops(steps, frac, decay):
    warm = round(frac * steps)
    values = [lr_factor(s, steps, warm, decay) for s in range(1, steps + 1)]
    assert values == pytest.approx([_hand(s, steps, warm, decay) for s in range(1, steps + 1)])
    assert all(0 < v <= 1 for v in values)
    assert max(values) == pytest.approx(1.0)
    after = values[warm:]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:]))  # non-increasing after the warm-up
