"""Pipeline: layer selection, shared statistics, prune() for every method,
weight restore, overhead, the quality table and run_quality on a tiny random Llama."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from torch_armor import ArmorConfig
from torch_armor.recipes.evaluate import perplexity
from torch_armor.core.factors import ArmorFactors
from torch_armor.calibration.observer import collect_statistics, decoder_linear_names
from torch_armor.core.proxy import auto_block_size, relative_proxy_loss
from torch_armor.recipes.pipeline import (
    METHODS,
    armor_layer_configs,
    PruneReport,
    QualityRow,
    calibration_statistics,
    prune,
    quality_table,
    restore_weights,
    run_quality,
    select_layers,
    snapshot_weights,
    wrapper_overhead,
)
from torch_armor.tensor.armor_tensor import ArmorTensor

FAST_ARMOR = ArmorConfig(block_size=16, optimizer="bcd", num_iters=1)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: threads only add synchronization (badly so on a shared machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------- layer selection


def test_select_layers(tiny_llama):
    names = decoder_linear_names(tiny_llama)
    assert select_layers(tiny_llama) == names and len(names) == 14
    assert select_layers(tiny_llama, "1") == [n for n in names if ".layers.1." in n]
    assert select_layers(tiny_llama, "0-1") == names
    assert select_layers(tiny_llama, "0, 1") == names
    assert select_layers(tiny_llama, r"mlp\.(up|down)_proj") == [n for n in names if "up_proj" in n or "down_proj" in n]
    with pytest.raises(ValueError, match="selects none"):
        select_layers(tiny_llama, "5-6")
    with pytest.raises(ValueError, match="empty"):
        select_layers(tiny_llama, "1-0")
    with pytest.raises(ValueError, match="regular expression"):
        select_layers(tiny_llama, "(")


# ------------------------------------------------------------------------ statistics


def test_calibration_statistics_share_inputs_and_match_collect(tiny_llama):
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(0))
    stats = calibration_statistics(tiny_llama, ids, track_xtx=True, progress=False)
    ref = collect_statistics(tiny_llama, decoder_linear_names(tiny_llama), ids, track_xtx=True, progress=False)
    assert set(stats) == set(ref)
    for name in ref:
        assert stats[name].num_tokens == ref[name].num_tokens == 60
        torch.testing.assert_close(stats[name].act_sq_norm, ref[name].act_sq_norm, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(stats[name].xtx, ref[name].xtx, rtol=1e-5, atol=1e-4)
    attn = "model.layers.0.self_attn."
    assert stats[attn + "q_proj"] is stats[attn + "k_proj"] is stats[attn + "v_proj"]
    assert stats[attn + "o_proj"] is not stats[attn + "q_proj"]
    assert stats["model.layers.0.mlp.gate_proj"] is stats["model.layers.0.mlp.up_proj"]


# ----------------------------------------------------------------------------- prune


@pytest.fixture
def calibrated(tiny_llama):
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(1))
    names = decoder_linear_names(tiny_llama)
    stats = calibration_statistics(tiny_llama, ids, names, track_xtx=True, progress=False)
    return tiny_llama, names, stats


@pytest.mark.parametrize("method", METHODS)
def test_prune_every_method_gives_pattern_and_report(calibrated, method):
    model, names, stats = calibrated
    dense = {k: v.detach() for k, v in snapshot_weights(model, names).items()}
    report = prune(model, method, stats, names, "2:4", FAST_ARMOR, progress=False)
    assert isinstance(report, PruneReport) and report.method == method and report.pattern == "2:4"
    assert [layer.name for layer in report.layers] == names
    for layer in report.layers:
        module = model.get_submodule(layer.name)
        assert layer.shape == tuple(module.weight.shape)
        assert math.isfinite(layer.relative_proxy_loss) and layer.relative_proxy_loss > 0
        assert layer.seconds >= 0
        approx = module.weight.dense_weight() if method == "armor" else module.weight.detach()
        want = relative_proxy_loss(dense[layer.name], approx, stats[layer.name].act_sq_norm, "2:4")
        assert layer.relative_proxy_loss == pytest.approx(want, rel=1e-5)
        if method == "armor":
            assert isinstance(module.weight, ArmorTensor)
            core = module.weight.core_dense()
            assert int((core.reshape(core.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
            assert layer.relative_proxy_loss <= 1.0 + 1e-6
            assert layer.block_size == 16 and layer.wrapper_params == 16 * sum(layer.shape)
        else:
            w = module.weight.detach()
            assert type(module.weight) is nn.Parameter
            # at most 2 nonzeros in every group of 4, exactly half the weights zero
            assert int((w.reshape(w.shape[0], -1, 4) != 0).sum(-1).max()) <= 2
            assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=1e-3)
            assert layer.wrapper_params == 0 and layer.block_size is None
            if method == "nowag":
                assert layer.relative_proxy_loss == pytest.approx(1.0)
            if method == "magnitude":
                assert torch.equal(w != 0, _magnitude_keep(dense[layer.name]))
    if method == "armor":
        assert report.overhead == pytest.approx(wrapper_overhead(model))
        want = sum(16 * sum(layer.shape) for layer in report.layers) / sum(a * b for a, b in (l.shape for l in report.layers))
        assert report.overhead == pytest.approx(want)
    else:
        assert report.overhead == 0.0 and wrapper_overhead(model) == 0.0


def _magnitude_keep(w):
    groups = w.abs().reshape(w.shape[0], -1, 4)
    idx = groups.topk(2, dim=-1).indices
    return torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, idx, True).reshape(w.shape)


def test_armor_beats_nowag_in_proxy_loss_and_restore_undoes_prune(calibrated):
    model, names, stats = calibrated
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(x).logits
    dense = snapshot_weights(model, names)
    report = prune(model, "armor", stats, names, armor_config=ArmorConfig(block_size=16, optimizer="bcd",
                                                                           num_iters=3), progress=False)
    assert report.mean_relative_proxy_loss < 1.0
    restore_weights(model, dense)
    for name in names:
        w = model.get_submodule(name).weight
        assert type(w) is nn.Parameter and torch.equal(w.detach(), dense[name].detach())
    with torch.no_grad():
        assert torch.equal(model(x).logits, before)


def test_proxy_cache_is_reused_and_checked(calibrated):
    model, names, stats = calibrated
    dense = snapshot_weights(model, names)
    cache = {}
    first = prune(model, "nowag", stats, names, proxy_cache=cache, progress=False)
    assert set(cache) == set(names)
    refs = dict(cache)
    restore_weights(model, dense)
    second = prune(model, "wanda", stats, names, proxy_cache=cache, progress=False)
    assert all(cache[n] is refs[n] for n in names)  # reused
    assert [layer.relative_proxy_loss for layer in first.layers] == pytest.approx([1.0] * len(names))
    restore_weights(model, dense)
    with torch.no_grad():  # other weights: the stale entry is recomputed, not trusted
        model.get_submodule(names[0]).weight.mul_(2.0)
    prune(model, "magnitude", stats, names[:1], proxy_cache=cache, progress=False)
    assert cache[names[0]] is not refs[names[0]]
    assert second.mean_relative_proxy_loss > 0


def test_prune_block_size_auto_and_errors(calibrated):
    model, names, stats = calibrated
    dense = snapshot_weights(model, names)
    report = prune(model, "armor", stats, names, armor_config=FAST_ARMOR, block_size="auto",
                   max_overhead=0.3, progress=False)
    for layer in report.layers:
        assert layer.block_size == auto_block_size(*layer.shape, 0.3, 4)
    restore_weights(model, dense)
    with pytest.raises(ValueError, match="does not divide"):
        prune(model, "armor", stats, names, armor_config=FAST_ARMOR, block_size=24, progress=False)
    with pytest.raises(ValueError, match="no block size fits"):
        prune(model, "armor", stats, names, armor_config=FAST_ARMOR, block_size="auto", max_overhead=0.01,
              progress=False)
    with pytest.raises(ValueError, match="method must be one of"):
        prune(model, "dense", stats, names, progress=False)
    no_xtx = calibration_statistics(model, torch.randint(0, 128, (1, 8)), names, progress=False)
    with pytest.raises(ValueError, match="track_xtx=True"):
        prune(model, "sparsegpt", no_xtx, names, progress=False)
    with pytest.raises(ValueError, match="no calibration statistics"):
        prune(model, "wanda", {}, names, progress=False)
    # nothing was touched by the failed calls
    for name in names:
        assert torch.equal(model.get_submodule(name).weight.detach(), dense[name])


def test_prune_report_json_and_plot(calibrated, tmp_path):
    model, names, stats = calibrated
    report = prune(model, "armor", stats, names[:3], armor_config=FAST_ARMOR, progress=False)
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


# ---------------------------------------------------------------------- quality table


def test_quality_table_formatting():
    rows = [
        QualityRow("dense", 10.0),
        QualityRow("magnitude", 100.0, prune_s=0.5, eval_s=30.0),
        QualityRow("nowag", 20.0, mean_relative_proxy_loss=1.0, prune_s=1.0, eval_s=90.0),
        {"method": "armor", "ppl": 12.5, "settings": "d_b=16, bcd", "overhead": 0.0463,
         "mean_relative_proxy_loss": 0.61234, "prune_s": 525.0, "eval_s": 95.0},
    ]
    lines = quality_table(rows).splitlines()
    assert lines[0].startswith("| method | settings | ppl | gap closed vs NoWag-P | overhead |")
    assert lines[1].startswith("|---|---|---:|")
    assert len(lines) == 6 and all(line.count("|") == 9 for line in lines)
    assert lines[2] == "| dense |  | 10.00 | 100.0% | – | – | – | – |"
    assert lines[3] == "| magnitude |  | 100.00 | -800.0% | – | – | 0.5 s | 30.0 s |"
    assert lines[4] == "| NoWag-P |  | 20.00 | 0.0% | – | 1.000 | 1.0 s | 1.5 min |"
    assert lines[5] == "| ARMOR | d_b=16, bcd | 12.50 | 75.0% | 4.63% | 0.612 | 8.8 min | 1.6 min |"
    # without a dense or NoWag-P row there is no gap
    assert "| – |" in quality_table([QualityRow("armor", 12.0)]).splitlines()[2]


def test_default_armor_config_is_load_independent_and_bounded():
    """The shipped default must give the same factors however busy the machine is (no wall-time
    budget decides where it stops) and do a bounded amount of work."""
    from torch_armor import factorize

    cfg = ArmorConfig()
    g = torch.Generator().manual_seed(3)
    w, h = torch.randn(64, 96, generator=g), torch.rand(96, generator=g) + 0.1
    first, second = factorize(w, h, cfg), factorize(w, h, cfg)
    assert torch.equal(first.core, second.core) and torch.equal(first.a_blocks, second.a_blocks)
    assert int(first.history_iters[-1]) == cfg.iterations < 200
    assert first.relative_loss < 1.0


# ------------------------------------------------------------------------ run_quality


def test_run_quality_on_tiny_llama(tiny_llama):
    g = torch.Generator().manual_seed(2)
    calib_ids = torch.randint(0, 128, (400,), generator=g)
    eval_ids = torch.randint(0, 128, (400,), generator=g)
    names = decoder_linear_names(tiny_llama)
    dense = snapshot_weights(tiny_llama, names)
    eval_windows = eval_ids[:96].reshape(3, 32)
    dense_ppl = perplexity(tiny_llama, eval_windows, progress=False)
    lines = []
    configs = [FAST_ARMOR, ArmorConfig(block_size=32, optimizer="bcd", num_iters=2)]
    result = run_quality(tiny_llama, tokenizer=object(), armor_configs=configs, calib=calib_ids, n_calib=4, eval_data=eval_ids, n_eval=3, seq_len=32, progress=False,
                         log=lines.append)
    assert [r.method for r in result.rows] == ["dense", "magnitude", "wanda", "sparsegpt", "nowag", "armor", "armor"]
    assert result.rows[0].ppl == pytest.approx(dense_ppl, rel=1e-9)
    assert [r.name for r in result.rows[-2:]] == ["ARMOR #1", "ARMOR #2"]
    assert all(math.isfinite(r.ppl) for r in result.rows)
    assert result.rows[-1].overhead == pytest.approx(2 * result.rows[-2].overhead)
    assert set(result.reports) == {"magnitude", "Wanda", "SparseGPT", "NoWag-P", "ARMOR #1", "ARMOR #2"}
    assert "total" in result.timings and len(lines) >= 8
    table = result.table()
    assert "| NoWag-P |" in table and "0.0%" in table
    json.dumps(result.to_dict(), default=str)
    for name in names:  # the model is dense again
        assert torch.equal(tiny_llama.get_submodule(name).weight.detach(), dense[name])
    # ARMOR through the ArmorTensor weights: the same perplexity as materialized
    tensor = run_quality(tiny_llama, tokenizer=object(), methods=["armor"], armor_configs=configs[:1], calib=calib_ids,
                         n_calib=4, eval_data=eval_ids, n_eval=3, seq_len=32, armor_eval="tensor", progress=False)
    assert tensor.rows[0].ppl == pytest.approx(result.rows[-2].ppl, rel=1e-5)
    with pytest.raises(ValueError, match="armor_eval"):
        run_quality(tiny_llama, tokenizer=object(), armor_eval="fast", calib=calib_ids, eval_data=eval_ids)
    with pytest.raises(ValueError, match="unknown methods"):
        run_quality(tiny_llama, tokenizer=object(), methods=["dense", "foo"], calib=calib_ids, eval_data=eval_ids)


def test_load_model_dispatch(monkeypatch, tmp_path):
    """Local directories and hub ids go to transformers with gguf_file and dtype; errors are clear."""
    import transformers

    from torch_armor.recipes.pipeline import load_model

    calls = []

    class FakeModel(nn.Module):
        def __init__(self, dtype):
            super().__init__()
            self.lin = nn.Linear(2, 2).to(dtype)

    def fake_model(name, **kwargs):
        calls.append(("model", name, kwargs))
        return FakeModel(kwargs["dtype"])

    def fake_tokenizer(name, **kwargs):
        calls.append(("tokenizer", name, kwargs))
        return "tok"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(fake_model))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(fake_tokenizer))
    model, tok = load_model(str(tmp_path), gguf_file="m.gguf", dtype="bf16")
    assert tok == "tok" and not model.training and model.lin.weight.dtype == torch.bfloat16
    assert calls == [("tokenizer", str(tmp_path), {"gguf_file": "m.gguf"}),
                     ("model", str(tmp_path), {"gguf_file": "m.gguf", "dtype": torch.bfloat16})]
    calls.clear()
    load_model("org/some-model")
    assert calls[1] == ("model", "org/some-model", {"dtype": torch.float32})

    def failing(name, **kwargs):
        raise OSError("offline")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(failing))
    with pytest.raises(ValueError, match="hub id .*offline"):
        load_model("org/some-model")
    with pytest.raises(ValueError, match="no such model directory"):
        load_model(str(tmp_path / "missing"))
    (tmp_path / "weights.gguf").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        load_model(str(tmp_path / "weights.gguf"))
    with pytest.raises(ValueError, match="unknown dtype"):
        load_model(str(tmp_path), dtype="int3")


def test_prune_refuses_offloaded_weights_naming_the_layer(tmp_path, tiny_llama_factory):
    accelerate = pytest.importorskip("accelerate")
    model = tiny_llama_factory()
    stats = calibration_statistics(model, torch.randint(0, 128, (2, 8)), progress=False)
    accelerate.cpu_offload(model, execution_device="cpu")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj.*meta device.*reload the model"):
        prune(model, "armor", stats, progress=False)


def test_armor_layer_configs_resolve_block_sizes_and_check_shapes():
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(30, 8))
    cfgs = armor_layer_configs(model, ["0", "1"], ArmorConfig(block_size=16, optimizer="bcd"), "2:4")
    assert [c.block_size for c in cfgs.values()] == [16, 16]
    auto = armor_layer_configs(model, ["0", "1"], block_size="auto", max_overhead=0.5)
    for name, cfg in auto.items():
        d_out, d_in = model.get_submodule(name).weight.shape
        assert d_out % cfg.block_size == 0 and d_in % cfg.block_size == 0
        assert cfg.block_size * (d_out + d_in) <= 0.5 * d_out * d_in
    with pytest.raises(ValueError, match="'2'"):
        armor_layer_configs(model, ["2"], block_size=16)


def test_prune_with_given_factors_converts_without_factorizing(monkeypatch, tiny_llama_factory):
    import importlib

    from torch_armor import factorize

    factorize_module = importlib.import_module("torch_armor.core.factorize")  # the function shadows the module name

    model = tiny_llama_factory()
    names = ["model.layers.0.mlp.up_proj"]
    stats = calibration_statistics(model, torch.randint(0, 128, (2, 8)), names, progress=False)
    cfg = ArmorConfig(block_size=16, optimizer="bcd", num_iters=2)
    layer = model.get_submodule(names[0])
    given = {names[0]: factorize(layer.weight.detach(), stats[names[0]].act_sq_norm, cfg)}
    fresh = prune(tiny_llama_factory(), "armor", stats, names, armor_config=cfg, progress=False)
    monkeypatch.setattr(factorize_module, "factorize", lambda *a, **k: pytest.fail("factorized again"))
    report = prune(model, "armor", stats, names, armor_config=cfg, progress=False, factors=given)
    assert report.layers[0].relative_proxy_loss == fresh.layers[0].relative_proxy_loss
    torch.testing.assert_close(model.get_submodule(names[0]).weight.dense_weight(), given[names[0]].dense())
    with pytest.raises(ValueError, match="block size 16 .* asks for 32"):
        prune(tiny_llama_factory(), "armor", stats, names, armor_config=ArmorConfig(block_size=32, num_iters=2),
              progress=False, factors=given)
