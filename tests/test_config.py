import pytest
import torch

from torch_armor import ArmorConfig, parse_pattern


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
    ],
)
def test_config_rejects(kwargs):
    with pytest.raises(ValueError):
        ArmorConfig(**kwargs)


def test_config_defaults():
    cfg = ArmorConfig()
    assert (cfg.block_size, cfg.pattern, cfg.optimizer, cfg.selection) == (128, "2:4", "bcd", "mixed")
    assert cfg.num_iters == 200 and cfg.group_updates == 64
    paper = ArmorConfig(optimizer="adam")
    assert (paper.lr, paper.num_iters, paper.selection) == (1e-4, 1000, "l1-random")
    assert ArmorConfig(optimizer="adam", selection="mixed").selection == "mixed"
