"""PruneReport (JSON, PNG) from a real prune_model run and wrapper_overhead of factors and models."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from torch_armor import ArmorConfig, PruneOptions
from torch_armor.config.armor import BcdConfig
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.core.factors import ArmorFactors
from torch_armor.armor.method import wrapper_overhead
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
    assert set(data["layers"][0]) >= {"name", "shape", "relative_proxy_loss", "seconds", "extra_params", "details"}
    assert data["layers"][0]["details"]["block_size"] == 16
    assert data["overhead"] == pytest.approx(report.overhead)
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


def _report(method, proxy, output=None):
    from torch_armor.engine.report import LayerResult, PruneReport

    return PruneReport(method, "2:4", [LayerResult(f"model.layers.{i}.fc", (16, 32), p, 1.0, relative_output_loss=o)
                                       for i, (p, o) in enumerate(zip(proxy, output or [None] * len(proxy)))])


def test_the_summary_names_the_loss_minimised_last_and_the_gap_it_closes():
    """After refinement the proxy rises above NoWag-P's while the output loss falls: the summary and
    the plot show the output loss (what was minimised), never the proxy as if ARMOR had lost."""
    refined = _report("armor", [1.2, 1.1], [0.3, 0.5])
    assert refined.final_loss() == ("output", pytest.approx(0.4))
    line = refined.loss_summary()
    assert line == "layer output loss 0.4000 × NoWag-P's: closes 60.0% of the gap from NoWag-P to the dense layers"
    assert "1.15" not in line and "proxy" not in line
    assert [refined._final(layer) for layer in refined.layers] == [0.3, 0.5]

    proxy_only = _report("armor", [0.8, 0.6])  # refine=None, reconstruct=None: the proxy is ARMOR's objective
    assert proxy_only.loss_summary().startswith("proxy loss 0.7000 × NoWag-P's (the loss ARMOR minimised): closes 30.0%")
    worse = _report("armor", [1.5])
    assert "50.0% above NoWag-P" in worse.loss_summary() and "closes" not in worse.loss_summary()
    baseline = _report("sparsegpt", [1.3])
    assert "not SparseGPT's" in baseline.loss_summary() and "closes" not in baseline.loss_summary()
    # NoWag-P minimises the proxy too: its report once said it was "NoWag-P's objective, not NoWag-P's"
    assert _report("nowag", [1.0]).loss_summary().startswith("proxy loss 1.0000 × NoWag-P's (the loss NoWag-P minimised)")


def test_the_summary_asks_the_method_what_it_minimised_not_its_name():
    """A method registered as minimising the proxy reads as such, whatever its name."""
    from torch_armor.engine.methods import METHODS, register_method

    class ProxyOnlyConfig:  # not a dataclass: nothing registers it as a serializable config
        pattern = "2:4"

    register_method(ProxyOnlyConfig, label="Proxy-only", minimises_proxy=True)(lambda w, s, c, n="": None)
    try:
        assert _report("proxyonly", [0.5]).loss_summary().startswith(
            "proxy loss 0.5000 × NoWag-P's (the loss Proxy-only minimised): closes 50.0%")
    finally:
        del METHODS[ProxyOnlyConfig]


def test_the_plot_axis_is_the_final_loss(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    plotted = []
    original = matplotlib.axes.Axes.scatter
    monkeypatch.setattr(matplotlib.axes.Axes, "scatter", lambda self, x, y, *a, **k: plotted.append(list(y))
                        or original(self, x, y, *a, **k))
    _report("armor", [1.2, 1.1], [0.3, 0.5]).save_plot(tmp_path / "r.png")
    assert plotted[0] == [0.3, 0.5]  # the output losses, not the proxy


def test_the_plot_leaves_the_callers_matplotlib_as_it_was(tmp_path):
    """save_plot draws on its own canvas: the caller's backend stays, and pyplot gains no figure."""
    matplotlib = pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    try:
        matplotlib.use("svg")  # not Agg, so switching to Agg would show
        figures = plt.get_fignums()
        _report("armor", [1.2, 1.1], [0.3, 0.5]).save_plot(tmp_path / "r.png")
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == figures
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:
        matplotlib.use(before)


def test_the_methods_stage_lines():
    """ARMOR says its stages; a baseline has none to say; the report itself names no stage."""
    report = _report("armor", [1.0], [0.5])
    assert report.stage_lines() == []
    report.stages["distillation"] = {"before": 0.5, "after": 0.25, "best_step": 12}
    assert report.stage_lines() == ["distillation: held-out KL to the dense model 0.5000 -> 0.2500 (kept step 12)"]
    report.stages["reconstruction"] = {"errors": {0: (0.4, 0.1), 1: (0.6, 0.4)},
                                       "curves": {0: [(0, 0.4), (4, 0.1)], 1: [(0, 0.6), (4, 0.4)]}}
    assert report.stage_lines()[0] == ("block reconstruction: held-out relative output error summed over 2 blocks "
                                       "1.0000 -> 0.5000 (50.0% lower); by step: 0: 1.0000, 4: 0.5000")
    assert json.loads(json.dumps(report.to_dict()))["stages"]["reconstruction"]["errors"] == {"0": [0.4, 0.1],
                                                                                              "1": [0.6, 0.4]}
    baseline = _report("sparsegpt", [1.3])
    baseline.stages["distillation"] = {"before": 0.5, "after": 0.25}
    assert baseline.stage_lines() == []
