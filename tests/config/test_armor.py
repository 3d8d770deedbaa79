import dataclasses

import pytest
import torch

from torch_armor import ArmorConfig, SparseGPTConfig
from torch_armor.config.armor import AdamConfig, BcdConfig, ReconstructConfig, RefineConfig
from torch_armor.errors import ArmorInputError
from torch_armor.core.pattern import parse_pattern


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


@pytest.mark.parametrize("bad", ["\u00b2:4", "\u0662:\u0664", "2:\uff14"])  # superscript, Arabic-Indic, full-width
def test_parse_takes_ascii_digits_only(bad):
    with pytest.raises(ArmorInputError, match="expected 'N:M' such as '2:4'"):
        parse_pattern(bad)


def test_sparsegpt_block_size_must_be_a_multiple_of_m():
    assert SparseGPTConfig(pattern="4:8", block_size=16).block_size == 16
    with pytest.raises(ArmorInputError, match=r"SparseGPTConfig.block_size=3 is not a multiple of M=4 of pattern "
                                              r"'2:4'.*use a multiple of 4"):
        SparseGPTConfig(block_size=3)
    assert SparseGPTConfig(pattern="unstructured:0.5", block_size=3).block_size == 3  # no groups to straddle


@pytest.mark.parametrize(
    "make",
    [
        lambda: ArmorConfig(block_size=0),
        lambda: ArmorConfig(block_size=30),  # not a multiple of M=4
        lambda: ArmorConfig(block_size=16, pattern="4:32"),
        lambda: ArmorConfig(optimizer=BcdConfig(iters=-1)),
        lambda: ArmorConfig(optimizer="sgd"),
        lambda: ArmorConfig(optimizer=AdamConfig(lr=0.0)),
        lambda: ArmorConfig(optimizer=AdamConfig(lr=float("nan"))),
        lambda: ArmorConfig(optimizer=BcdConfig(selection="best")),
        lambda: ArmorConfig(dtype=torch.float16),
        lambda: ArmorConfig(dtype=torch.int32),
        lambda: ArmorConfig(optimizer=BcdConfig(log_every=0)),
        lambda: ArmorConfig(block_size="big"),
        lambda: ArmorConfig(block_size=True),
        lambda: ArmorConfig(optimizer=BcdConfig(group_updates=-1)),
        lambda: ArmorConfig(max_overhead=0.0),
        lambda: ArmorConfig(max_overhead=True),
        lambda: ArmorConfig(refine=RefineConfig(damp=1.5)),
        lambda: ArmorConfig(reconstruct=ReconstructConfig(steps=0)),
        lambda: ArmorConfig(refine="full"),
    ],
)
def test_config_rejects(make):
    with pytest.raises(ValueError):
        make()


def per_sweep(cfg: ArmorConfig) -> int:
    return cfg.optimizer.group_updates_per_sweep(cfg.block_size)


def test_config_defaults():
    cfg = ArmorConfig()
    assert (cfg.block_size, cfg.pattern, cfg.optimizer.name, cfg.optimizer.selection_rule) == (16, "2:4", "bcd", "mixed")
    assert cfg.optimizer.iterations == 20 and per_sweep(cfg) == 8 and cfg.max_overhead == 0.05
    assert per_sweep(ArmorConfig(block_size=128)) == 64
    paper = ArmorConfig(optimizer=AdamConfig())
    assert (paper.optimizer.lr, paper.optimizer.iterations, paper.optimizer.selection_rule) == (1e-4, 1000, "l1-random")
    assert ArmorConfig(optimizer=AdamConfig(selection="mixed")).optimizer.selection_rule == "mixed"
    assert cfg.refine == RefineConfig(rounds=1) and cfg.reconstruct == ReconstructConfig(steps=64)
    assert (RefineConfig().rounds, ReconstructConfig().steps) == (3, 32)  # the lever configs alone


def test_config_is_frozen_and_keeps_what_was_given():
    cfg = ArmorConfig(pattern=" 2:4 ")
    assert (cfg.optimizer.group_updates, cfg.optimizer.selection) == (None, None)
    assert cfg.pattern == "2:4" and cfg.sparsity == parse_pattern("2:4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 32
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.sparsity = parse_pattern("4:8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.optimizer.iters = 3
    assert cfg == ArmorConfig() and hash(cfg) == hash(ArmorConfig())
    with pytest.raises(TypeError):
        ArmorConfig(16, "2:4")  # every field after block_size is keyword-only


def test_replace_rederives_defaults():
    base = ArmorConfig(block_size=16, optimizer=BcdConfig(time_budget_s=1.0))
    moved = dataclasses.replace(base, block_size=32)
    assert moved.block_size == 32 and moved.optimizer.time_budget_s == 1.0
    assert per_sweep(moved) == per_sweep(ArmorConfig(block_size=32)) == 16
    assert per_sweep(dataclasses.replace(ArmorConfig(block_size=16, optimizer=BcdConfig(group_updates=1)), block_size=32)) == 1
    assert dataclasses.replace(base, block_size=16) == base
    adam = dataclasses.replace(base, optimizer=AdamConfig())
    assert (adam.optimizer.iterations, adam.optimizer.selection_rule) == (1000, "l1-random")
    assert dataclasses.replace(base, refine=None).refine is None and base.refine is not None
    with pytest.raises(ValueError, match="multiple of M=4"):
        dataclasses.replace(base, block_size=30)


def test_for_layer_resolves_auto_and_checks_the_shape():
    cfg = ArmorConfig(block_size=16)
    assert cfg.for_layer(64, 32) is cfg
    auto = ArmorConfig(block_size="auto", optimizer=BcdConfig(iters=3))
    assert auto.block_size == "auto"
    with pytest.raises(ValueError, match="for_layer"):
        per_sweep(auto)
    q = auto.for_layer(576, 576, name="q_proj")
    assert (q.block_size, per_sweep(q), q.optimizer.iterations) == (12, 6, 3)
    assert auto.for_layer(4096, 4096).block_size == 64
    assert dataclasses.replace(auto, max_overhead=0.3).for_layer(64, 64).block_size == 8
    assert ArmorConfig(block_size="auto", pattern="unstructured:0.5", max_overhead=0.5).for_layer(6, 6).block_size == 1
    with pytest.raises(ValueError, match=r"layer 'fc': block_size=32 does not divide .* \[4, 8, 16\]"):
        ArmorConfig(block_size=32).for_layer(48, 32, name="fc")
    with pytest.raises(ValueError, match=r"layer 'tiny': no block size fits .* smallest valid one, 4"):
        auto.for_layer(8, 8, name="tiny")
    with pytest.raises(ValueError, match=r"layer 'odd': d_in=30 is not a multiple of M=4"):
        auto.for_layer(8, 30, name="odd")
