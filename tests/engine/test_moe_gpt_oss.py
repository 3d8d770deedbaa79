"""gpt-oss through prune_model: its experts are stored transposed (``gate_up_proj`` ``(E, H, 2·I)``,
``down_proj`` ``(E, I, H)``) with ``(E, out)`` biases and an interleaved gate/up. Every routed expert is
pruned to 2:4 from the tokens routed to it, the router stays dense and listed, the logits equal a slow
reference built from the stored factors through gpt-oss's own eager forward, and a save/load round trip
is bit-identical."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, GptOssConfig, GptOssForCausalLM

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model

from _tiny_moe import (armor_and_magnitude_errors, install_stored_factors, logits_of, reconstruction_errors,
                       widen)

E = 4
CALIB = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
EXPERT_LAYERS = sorted(f"model.layers.{i}.mlp.experts.{a}.{e}" for i in range(2) for a in ("gate_up_proj", "down_proj")
                       for e in range(E))


def _gpt_oss():
    torch.manual_seed(0)
    cfg = GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=E, num_experts_per_tok=2,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    return widen(GptOssForCausalLM(cfg))


def _logits(model):
    return logits_of(model, IDS)


def _armor(**kw):
    return ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None, **kw)


def test_every_routed_expert_is_2_4_from_its_routed_tokens_and_equals_the_eager_reference(tmp_path):
    model = _gpt_oss()
    reference = copy.deepcopy(model)
    router = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." in n}
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path))

    names = [r.name for r in report.layers]
    assert sorted(n for n in names if split_expert_name(n) is not None) == EXPERT_LAYERS
    # routed statistics: each token reaches its top-2 experts of each of the 2 blocks
    assert len(report.expert_tokens) == 2 * E and sum(report.expert_tokens.values()) == 2 * 2 * CALIB.numel()
    assert min(report.expert_tokens.values()) < max(report.expert_tokens.values())
    for n, p in router.items():
        assert torch.equal(model.get_parameter(n), p), n
    assert report.dense_weights["model.layers.*.mlp.router.weight"] == (2, "router: routing-critical and tiny")
    assert not any(".experts." in k for k in report.dense_weights), report.dense_weights

    install_stored_factors(reference, tmp_path, names, transposed=True)  # gpt-oss stores expert e as (in, out)
    reference.set_experts_implementation("eager")  # gpt-oss's own loop: x @ gate_up_proj[e] + bias, its gate
    logits = _logits(model)
    torch.testing.assert_close(logits, _logits(reference), rtol=1e-4, atol=1e-5)

    save_pretrained(model, tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved").eval()
    assert loaded.config._experts_implementation == "armor"
    assert torch.equal(_logits(loaded), logits)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()), logits)


def test_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts():
    errors = armor_and_magnitude_errors(_gpt_oss, CALIB, IDS, _armor(), "experts")
    assert errors["armor"] < errors["magnitude"], errors


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_a_baseline_prunes_each_transposed_expert_along_its_input_dimension(method):
    model = _gpt_oss()
    report = prune_model(model, CALIB, config_for_method(method), layers="experts", options=PruneOptions(progress=False))
    assert sorted(r.name for r in report.layers) == EXPERT_LAYERS
    for i in range(2):
        for attr in ("gate_up_proj", "down_proj"):
            w = model.get_parameter(f"model.layers.{i}.mlp.experts.{attr}").transpose(1, 2)  # (E, out, in)
            kept = (w != 0).reshape(E, w.shape[1], -1, 4).sum(-1)
            assert bool((kept == 2).all()), (method, attr)


def test_block_reconstruction_builds_the_transposed_experts():
    """Reconstruction hands gpt-oss its experts' Ŵ as (E, in, out) (it failed on the (E, out, in) stack)."""
    errors = reconstruction_errors(_gpt_oss(), CALIB)
    assert all(before < 0.5 for before, _ in errors.values()), errors
