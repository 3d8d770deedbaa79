import dataclasses

import pytest
import torch

from torch_armor import ArmorConfig
from torch_armor.config import parse_pattern


@pytest.mark.parametrize("text,n,m", [("2:4", 2, 4), ("4:8", 4, 8), (" 1:2 ", 1, 2), ("5:8", 5, 8)])
def test_parse_nm(text, n, m):
    pat = parse_pattern(text)
    assert (pat.n, pat.m, pat.structured) == (n, m, True)
    assert pat.sparsity == pytest.approx(1 - n / m)


def test_parse_unstructured():
    pat = parse_pattern("unstructured:0.6")
    assert not pat.structured and pat.sparsity == pytest.approx(0.6)
    assert str(pat) == "unstructured:0.6"


@pytest.mark.parametrize("bad", ["4:2", "0:4", "2:2", "2-4", "unstructured:1.5", "unstructured:x", "2:40", 24])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_pattern(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": 30},  # not a multiple of M=4
        {"block_size": 16, "pattern": "4:32"},
        {"num_iters": -1},
        {"optimizer": "sgd"},
        {"lr": 0.0},
        {"lr": float("nan")},
        {"selection": "best"},
        {"dtype": torch.float16},
        {"dtype": torch.int32},
        {"log_every": 0},
        {"block_size": "big"},
        {"block_size": True},
        {"group_updates": -1},
        {"max_overhead": 0.0},
        {"max_overhead": True},
    ],
)
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        ArmorConfig(**kwargs)


def test_config_defaults():
    cfg = ArmorConfig()
    assert (cfg.block_size, cfg.pattern, cfg.optimizer, cfg.selection_rule) == (16, "2:4", "bcd", "mixed")
    assert cfg.iterations == 30 and cfg.group_updates_per_sweep == 8 and cfg.max_overhead == 0.05
    assert ArmorConfig(block_size=128).group_updates_per_sweep == 64
    paper = ArmorConfig(optimizer="adam")
    assert (paper.lr, paper.iterations, paper.selection_rule) == (1e-4, 1000, "l1-random")
    assert ArmorConfig(optimizer="adam", selection="mixed").selection_rule == "mixed"


def test_config_is_frozen_and_keeps_what_was_given():
    cfg = ArmorConfig(pattern=" 2:4 ")
    assert (cfg.num_iters, cfg.group_updates, cfg.selection) == (None, None, None)
    assert cfg.pattern == "2:4" and cfg.sparsity == parse_pattern("2:4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sparsity = parse_pattern("4:8")
    assert cfg == ArmorConfig() and hash(cfg) == hash(ArmorConfig())


def test_replace_rederives_defaults():
    base = ArmorConfig(block_size=16, optimizer="bcd", time_budget_s=1.0)
    moved = dataclasses.replace(base, block_size=32)
    assert moved.block_size == 32 and moved.time_budget_s == 1.0
    assert moved.group_updates_per_sweep == ArmorConfig(block_size=32).group_updates_per_sweep == 16
    assert dataclasses.replace(ArmorConfig(block_size=16, group_updates=1), block_size=32).group_updates_per_sweep == 1
    assert dataclasses.replace(base, block_size=16) == base
    adam = dataclasses.replace(base, optimizer="adam")
    assert (adam.iterations, adam.selection_rule) == (1000, "l1-random")
    assert dataclasses.replace(ArmorConfig(num_iters=7), optimizer="adam").iterations == 7
    with pytest.raises(ValueError, match="multiple of M=4"):
        dataclasses.replace(base, block_size=30)


def test_for_layer_resolves_auto_and_checks_the_shape():
    cfg = ArmorConfig(block_size=16)
    assert cfg.for_layer(64, 32) is cfg
    auto = ArmorConfig(block_size="auto", num_iters=3)
    assert auto.block_size == "auto"
    with pytest.raises(ValueError, match="for_layer"):
        auto.group_updates_per_sweep
    q = auto.for_layer(576, 576, name="q_proj")
    assert (q.block_size, q.group_updates_per_sweep, q.iterations) == (12, 6, 3)
    assert auto.for_layer(4096, 4096).block_size == 64
    assert dataclasses.replace(auto, max_overhead=0.3).for_layer(64, 64).block_size == 8
    assert ArmorConfig(block_size="auto", pattern="unstructured:0.5", max_overhead=0.5).for_layer(6, 6).block_size == 1
    with pytest.raises(ValueError, match=r"layer 'fc': block_size=32 does not divide .* \[4, 8, 16\]"):
        ArmorConfig(block_size=32).for_layer(48, 32, name="fc")
    with pytest.raises(ValueError, match=r"layer 'tiny': no block size fits .* smallest valid one, 4"):
        auto.for_layer(8, 8, name="tiny")
    with pytest.raises(ValueError, match=r"layer 'odd': d_in=30 is not a multiple of M=4"):
        auto.for_layer(8, 30, name="odd")
