"""The quality table's formatting, the shipped default config, and run_quality end to end on a
tiny random Llama (every method pruned through prune_model, sequential and one-shot rows)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from torch_armor import ArmorConfig, NoWagConfig, PruneOptions
from torch_armor.config.armor import BcdConfig
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.recipes.data import calibration_windows
from torch_armor.recipes.evaluate import perplexity
from torch_armor import prune_model
from torch_armor.recipes.quality import DEMO_METHODS, QualityRow, quality_table, run_quality

FAST_ARMOR = ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1))


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny tensors, no thread sync


def test_quality_table_formatting():
    rows = [
        QualityRow("dense", 10.0),
        QualityRow("magnitude", 100.0, prune_s=0.5, eval_s=30.0),
        QualityRow("nowag", 20.0, mean_relative_proxy_loss=1.0, prune_s=1.0, eval_s=90.0),
        {"method": "armor", "ppl": 12.5, "settings": "d_b=16, bcd", "overhead": 0.0463,
         "mean_relative_proxy_loss": 0.61234, "mean_relative_output_loss": 0.3214, "prune_s": 525.0, "eval_s": 95.0},
    ]
    lines = quality_table(rows).splitlines()
    assert lines[0].startswith("| method | settings | ppl | gap closed vs NoWag-P | overhead |")
    assert lines[1].startswith("|---|---|---:|")
    assert len(lines) == 6 and all(line.count("|") == 10 for line in lines)
    assert lines[2] == "| dense |  | 10.00 | 100.0% | – | – | – | – | – |"
    assert lines[3] == "| magnitude |  | 100.00 | -800.0% | – | – | – | 0.5 s | 30.0 s |"
    assert lines[4] == "| NoWag-P |  | 20.00 | 0.0% | – | 1.000 | – | 1.0 s | 1.5 min |"
    # refined in output space: the output loss only (the proxy is no longer what ARMOR minimised)
    assert lines[5] == "| ARMOR | d_b=16, bcd | 12.50 | 75.0% | 4.63% | – | 0.321 | 8.8 min | 1.6 min |"
    # without a dense or NoWag-P row there is no gap
    assert "| – |" in quality_table([QualityRow("armor", 12.0)]).splitlines()[2]


def test_default_armor_config_is_load_independent_and_bounded():
    """The shipped default must give the same factors however busy the machine is (no wall-time
    budget decides where it stops) and do a bounded amount of work."""
    from torch_armor.core.factorize import factorize

    cfg = ArmorConfig()
    g = torch.Generator().manual_seed(3)
    w, h = torch.randn(64, 96, generator=g), torch.rand(96, generator=g) + 0.1
    first, second = factorize(w, h, cfg), factorize(w, h, cfg)
    assert torch.equal(first.core, second.core) and torch.equal(first.a_blocks, second.a_blocks)
    assert int(first.history_iters[-1]) == cfg.optimizer.iterations < 200
    assert first.relative_loss < 1.0


def _token_streams():
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, 128, (400,), generator=g), torch.randint(0, 128, (400,), generator=g)


def test_run_quality_on_tiny_llama(tiny_llama):
    calib_ids, eval_ids = _token_streams()
    names = decoder_linear_names(tiny_llama)
    dense = {n: tiny_llama.get_submodule(n).weight for n in names}
    dense_values = {n: w.detach().clone() for n, w in dense.items()}
    eval_windows = eval_ids[:96].reshape(3, 32)
    dense_ppl = perplexity(tiny_llama, eval_windows, progress=False)
    x = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = tiny_llama(x).logits
    lines = []
    configs = [FAST_ARMOR, ArmorConfig(block_size=32, optimizer=BcdConfig(iters=2))]
    result = run_quality(tiny_llama, tokenizer=object(), configs=configs, calib=calib_ids, n_calib=4,
                         eval_data=eval_ids, n_eval=3, seq_len=32, progress=False, log=lines.append)
    assert [r.method for r in result.rows] == ["dense", "magnitude", "wanda", "sparsegpt", "nowag", "armor", "armor"]
    assert result.rows[0].ppl == pytest.approx(dense_ppl, rel=1e-9)
    assert [r.name for r in result.rows] == ["dense", "magnitude", "Wanda", "SparseGPT", "NoWag-P", "ARMOR #1",
                                             "ARMOR #2"]
    # every pruned row is calibrated sequentially by default, and says so
    assert [r.settings for r in result.rows] == ["", "sequential", "sequential", "block 128, damp 0.01, sequential",
                                                 "sequential",
                                                 "d_b=16, bcd, ≤1 it, output refine ×1, block reconstruction 64 steps, "
                                                 "sequential",
                                                 "d_b=32, bcd, ≤2 it, output refine ×1, block reconstruction 64 steps, "
                                                 "sequential"]
    assert result.settings["sequential"] == {m: [True] for m in DEMO_METHODS if m != "dense"}
    assert all(math.isfinite(r.ppl) for r in result.rows)
    assert result.rows[-1].overhead == pytest.approx(2 * result.rows[-2].overhead)
    assert result.rows[4].mean_relative_proxy_loss == pytest.approx(1.0)
    assert set(result.reports) == {"magnitude", "Wanda", "SparseGPT", "NoWag-P", "ARMOR #1", "ARMOR #2"}
    assert "total" in result.timings and len(lines) >= 8
    table = result.table()
    assert "| NoWag-P | sequential |" in table and "0.0%" in table
    json.dumps(result.to_dict(), default=str)
    for name in names:  # the model is dense again: the very same weights, the same logits
        weight = tiny_llama.get_submodule(name).weight
        assert weight is dense[name] and torch.equal(weight.detach(), dense_values[name])
    with torch.no_grad():
        assert torch.equal(tiny_llama(x).logits, before)
    # ARMOR through the ArmorTensor weights: the same perplexity as materialized
    tensor = run_quality(tiny_llama, tokenizer=object(), methods=["armor"], configs=configs[:1], calib=calib_ids,
                         n_calib=4, eval_data=eval_ids, n_eval=3, seq_len=32, armor_eval="tensor", progress=False)
    assert tensor.rows[0].ppl == pytest.approx(result.rows[-2].ppl, rel=1e-5)
    with pytest.raises(ValueError, match="armor_eval"):
        run_quality(tiny_llama, tokenizer=object(), armor_eval="fast", calib=calib_ids, eval_data=eval_ids)
    with pytest.raises(ValueError, match="unknown methods"):
        run_quality(tiny_llama, tokenizer=object(), methods=["dense", "foo"], calib=calib_ids, eval_data=eval_ids)


def test_run_quality_sequential_and_one_shot_rows(tiny_llama_factory):
    calib_ids, eval_ids = _token_streams()
    model = tiny_llama_factory()
    result = run_quality(model, tokenizer=object(), methods=["dense", "nowag", "armor"], configs=[FAST_ARMOR],
                         sequential={"nowag": (True, False)}, calib=calib_ids, n_calib=4, eval_data=eval_ids,
                         n_eval=3, seq_len=32, progress=False)
    assert [r.name for r in result.rows] == ["dense", "NoWag-P sequential", "NoWag-P one-shot", "ARMOR"]
    assert [r.settings for r in result.rows] == ["", "sequential", "one-shot",
                                                 "d_b=16, bcd, ≤1 it, output refine ×1, block reconstruction 64 steps, "
                                                 "sequential"]
    assert set(result.reports) == {"NoWag-P sequential", "NoWag-P one-shot", "ARMOR"}
    assert result.reports["NoWag-P one-shot"].settings["sequential"] is False
    assert result.settings["sequential"] == {"nowag": [True, False], "armor": [True]}
    assert result.rows[1].ppl != result.rows[2].ppl
    # the one-shot row is prune_model(sequential=False) on the same windows
    reference = tiny_llama_factory()
    calib = calibration_windows(calib_ids, object(), n_windows=4, seq_len=32, seed=0)
    prune_model(reference, calib, NoWagConfig(), options=PruneOptions(sequential=False, batch_size=4, progress=False))
    assert result.rows[2].ppl == pytest.approx(perplexity(reference, eval_ids[:96].reshape(3, 32), progress=False),
                                               rel=1e-9)
