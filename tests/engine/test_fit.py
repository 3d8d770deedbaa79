"""A layer the block size does not fit does not stop the run: it gets the largest block size that
divides it within the overhead budget, or stays dense — named in the report and in one warning —;
``strict`` keeps the refusal."""

import warnings

import pytest
import torch

from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.errors import ArmorInputError

from _helpers import FIT_CALIB, fit_config, fit_llama

CALIB, CONFIG = FIT_CALIB, fit_config()


def test_unfit_layers_get_a_smaller_block_size_or_stay_dense_with_one_warning():
    model = fit_llama()
    kv = {n: p.detach().clone() for n, p in model.named_parameters() if ".k_proj." in n or ".v_proj." in n}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_model(model, CALIB, CONFIG, options=PruneOptions(progress=False))
    about = [str(w.message) for w in caught if "settings do not fit" in str(w.message)]
    assert len(about) == 1 and "k_proj" in about[0] and "down_proj" in about[0] and "strict=True" in about[0], about
    blocks = {r.name.split(".", 3)[3]: r.details["block_size"] for r in report.layers}
    assert blocks == {"self_attn.q_proj": 16, "self_attn.o_proj": 16, "mlp.gate_proj": 8, "mlp.up_proj": 8,
                      "mlp.down_proj": 8}
    for i in range(2):
        assert report.unfit_layers[f"model.layers.{i}.mlp.down_proj"].startswith("block size 8: block_size=16 does")
        assert report.unfit_layers[f"model.layers.{i}.self_attn.k_proj"].startswith("dense: block_size=16 does not")
    for n, p in kv.items():  # dense, untouched, and the report says why
        assert torch.equal(model.get_parameter(n), p), n
    assert report.dense_weights["model.layers.*.self_attn.k_proj.weight"][1].startswith("dense: block_size=16")
    assert "unfit_layers" in report.to_dict()


def test_strict_refuses_before_anything_is_pruned():
    model = fit_llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ArmorInputError, match=r"layer 'model.layers.0.self_attn.k_proj': block_size=16 does not divide"):
        prune_model(model, CALIB, CONFIG, options=PruneOptions(progress=False, strict=True))
    assert all(torch.equal(model.get_parameter(n), p) for n, p in before.items())


def test_a_selection_that_nothing_fits_is_refused():
    with pytest.raises(ArmorInputError, match="fit none of the 2 selected layers"):
        prune_model(fit_llama(), CALIB, CONFIG, layers="k_proj", options=PruneOptions(progress=False))


def test_a_linear_outside_the_decoder_blocks_stays_dense_unless_named():
    """Gemma-4's per_layer_model_projection, Qwen4-exp's hyper-connection mixer: linears of the model
    outside its decoder blocks; the default selection leaves them dense, naming them, not the run."""
    model = fit_llama()
    model.model.mixer = torch.nn.Linear(32, 32, bias=False)
    report = prune_model(model, CALIB, CONFIG, layers=None, options=PruneOptions(progress=False))
    assert not any(r.name == "model.mixer" for r in report.layers) and len(report.layers) == 10
    assert report.dense_weights["model.mixer.weight"] == (1, "outside the decoder blocks")
    named = fit_llama()
    named.model.mixer = torch.nn.Linear(32, 32, bias=False)
    with pytest.raises(ArmorInputError, match="'model.mixer' is not inside a decoder block"):
        prune_model(named, CALIB, CONFIG, layers=["model.mixer"], options=PruneOptions(progress=False))
