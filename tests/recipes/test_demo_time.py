"""The demo's estimate: the recorded run it scales, the clock that refines it, the forward-pass unit."""

import time
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torch_armor.cli.parser import build_parser
from torch_armor.config.armor import ArmorConfig
from torch_armor.cli.commands import demo_protocol
from torch_armor.cli.flags import config_from_flags
from torch_armor.cli.names import DEMO_METHODS, QUICK_PROTOCOL
from torch_armor.recipes.demo_record import DEMO_RECORD
from torch_armor.recipes.demo_time import DemoClock, forward_seconds, matches_record, row_work


def quick_demo_args():
    args = build_parser().parse_args(["demo"])
    demo_protocol(args)
    return args


def test_the_record_was_measured_with_todays_quick_demo():
    """A changed default (protocol, ArmorConfig, methods) must be re-measured: benchmarks/demo_time.py --record."""
    args = quick_demo_args()
    settings = DEMO_RECORD["settings"]
    assert (settings["n_calib"], settings["n_eval"], settings["seq_len"]) == (
        QUICK_PROTOCOL["n_calib"], QUICK_PROTOCOL["n_eval"], args.seq_len)
    assert settings["armor"] == repr(config_from_flags(args, ArmorConfig))
    assert set(DEMO_RECORD["rows"]) == set(DEMO_METHODS)
    assert matches_record(args.methods, n_calib=args.n_calib, n_eval=args.n_eval, seq_len=args.seq_len,
                          armor_config=repr(config_from_flags(args, ArmorConfig)))


def test_the_full_demo_is_not_taken_for_the_recorded_run():
    args = build_parser().parse_args(["demo", "--full"])
    demo_protocol(args)
    assert not matches_record(args.methods, n_calib=args.n_calib, n_eval=args.n_eval, seq_len=args.seq_len,
                              armor_config=repr(config_from_flags(args, ArmorConfig)))


def test_row_work_is_the_recorded_cpu_time_in_forward_passes_scaled_by_windows_and_tokens():
    """A row that took 108 CPU-s (100 s pruning, 8 s evaluating, by the wall clock) where a forward pass
    took 0.25 CPU-s: 432 passes, 400 of them pruning."""
    record = {"forward_cpu_s": 0.25, "settings": {"n_calib": 16, "n_eval": 16, "seq_len": 512},
              "rows": {"armor": {"cpu_s": 108.0, "prune_s": 100.0, "eval_s": 8.0}}}
    assert row_work("armor", n_calib=16, n_eval=16, seq_len=512, record=record) == pytest.approx((400.0, 32.0))
    assert row_work("armor", n_calib=64, n_eval=8, seq_len=256, record=record) == pytest.approx((800.0, 8.0))


works = st.dictionaries(st.sampled_from(DEMO_METHODS),
                        st.tuples(st.floats(0, 1e4), st.floats(0.1, 1e3)), min_size=1)


@settings(max_examples=50, deadline=None)
@given(works, st.floats(0.01, 10))
def test_clock_on_schedule_counts_down_by_each_rows_estimate(work, forward_s):
    clock = DemoClock(work, forward_s)
    total = sum(p + e for p, e in work.values()) * forward_s
    assert clock.left_s() == pytest.approx(total)
    for name, (prune, evaluate) in work.items():
        before = clock.left_s()
        clock.finished(name, (prune + evaluate) * forward_s)
        assert clock.speed() == pytest.approx(1.0)
        assert clock.left_s() == pytest.approx(before - (prune + evaluate) * forward_s, abs=1e-6 * total)
    assert clock.left_s() == 0


@settings(max_examples=50, deadline=None)
@given(works, st.floats(0.01, 10), st.floats(0.1, 10))
def test_clock_scales_what_is_left_by_how_slow_the_finished_rows_were(work, forward_s, slower):
    names = list(work)
    clock = DemoClock(work, forward_s)
    first = names[0]
    clock.finished(first, slower * sum(work[first]) * forward_s)
    rest = sum(sum(work[n]) for n in names[1:]) * forward_s
    assert clock.left_s() == pytest.approx(slower * rest)


class SleepsPerWindow(torch.nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, ids):
        time.sleep(self.seconds * ids.shape[0])
        return ids


class SleepsInTurn(torch.nn.Module):
    """Each pass sleeps the next of ``seconds`` and records whether it was asked to keep a KV cache."""

    def __init__(self, seconds) -> None:
        super().__init__()
        self.seconds, self.use_cache = list(seconds), []
        self.config = types.SimpleNamespace(use_cache=True)

    def forward(self, ids, use_cache=True):
        self.use_cache.append(use_cache)
        time.sleep(self.seconds.pop(0))
        return ids


def test_forward_seconds_takes_the_fastest_pass_without_a_kv_cache():
    """Warm-up 0.3 s, then passes of 0.08, 0.02, 0.06, 0.04 s over two windows: the fastest is 0.01 s
    a window (the median would be 0.025, the mean 0.025, the warm-up 0.15)."""
    model = SleepsInTurn([0.3, 0.08, 0.02, 0.06, 0.04])
    wall, _ = forward_seconds(model, torch.zeros(5, 8, dtype=torch.long))
    assert 0.01 <= wall < 0.02
    assert model.use_cache == [False] * 5 and not model.seconds


def test_forward_seconds_is_per_window_and_leaves_the_mode_alone():
    """Sleeping takes wall-clock time, not CPU time."""
    model = SleepsPerWindow(0.02).train()
    wall, cpu = forward_seconds(model, torch.zeros(5, 8, dtype=torch.long))
    assert 0.02 <= wall < 0.2  # sleeping is never shorter, and 10x longer would be per batch
    assert cpu < 0.01
    assert model.training
