"""PruneReport (JSON, PNG) from a real prune_model run and wrapper_overhead of factors and models."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torch_armor import ArmorConfig, BcdConfig, PruneOptions
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.core.factors import ArmorFactors
from torch_armor.engine.report import wrapper_overhead
from torch_armor import prune_model


def test_prune_report_json_and_plot(tiny_llama, tmp_path):
    names = decoder_linear_names(tiny_llama)
    calib = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = prune_model(tiny_llama, calib, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1)), layers=names[:3], options=PruneOptions(progress=False))
    finally:
        torch.set_num_threads(threads)
    report.save_json(tmp_path / "r.json", model="tiny")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["model"] == "tiny" and data["method"] == "armor" and data["num_layers"] == 3
    assert [entry["name"] for entry in data["layers"]] == names[:3]
    assert set(data["layers"][0]) >= {"name", "shape", "relative_proxy_loss", "seconds", "block_size"}
    assert data["wrapper_overhead"] == pytest.approx(report.overhead)
    report.save_plot(tmp_path / "r.png")
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wrapper_overhead_of_factors():
    def factors(d_out, d_in, d_b):
        eye = torch.eye(d_b)
        return ArmorFactors(eye.repeat(d_out // d_b, 1, 1), torch.zeros(d_out, d_in), eye.repeat(d_in // d_b, 1, 1),
                            torch.zeros(d_out, d_in, dtype=torch.bool))

    fs = {"a": factors(576, 1536, 16), "b": factors(192, 576, 16)}
    want = (16 * (576 + 1536) + 16 * (192 + 576)) / (576 * 1536 + 192 * 576)
    assert wrapper_overhead(fs) == pytest.approx(want)
    assert wrapper_overhead(list(fs.values())) == pytest.approx(want)
    assert wrapper_overhead(nn.Linear(4, 4)) == 0.0
    with pytest.raises(ValueError, match="ArmorFactors"):
        wrapper_overhead([torch.zeros(2)])
