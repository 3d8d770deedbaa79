"""JetMoE through prune_model: its experts are grouped (``JetMoeParallelExperts``: one ``(E, out, in)``
``weight`` called with the rows already grouped by expert and each expert's row count), in the MLP
(``mlp.input_linear``/``output_linear``) and in the attention (``self_attention.experts``, the MoA's
query and output projections). Every routed expert is pruned to 2:4 from the rows routed to it, both
routers stay dense and listed, the logits equal a reference built from the stored factors through
JetMoE's own forward, a save/load round trip is bit-identical, and ARMOR is closer to dense than a
magnitude 2:4 prune of the same experts."""

import copy

import pytest

import torch
from transformers import JetMoeConfig, JetMoeForCausalLM

from torch_armor.calibration.experts import GroupedExpertsObserver, split_expert_name
from torch_armor.calibration.observer import token_mask
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.prune import PruneOptions, prune_model

from _tiny_moe import (armor_and_magnitude_errors, assert_saves_and_loads_bit_identically, install_stored_factors,
                       logits_of, reconstruction_errors, widen)

E = 4
CALIB = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
GROUPED = ("mlp.input_linear", "mlp.output_linear", "self_attention.experts.input_linear",
           "self_attention.experts.output_linear")
EXPERT_LAYERS = sorted(f"model.layers.{i}.{m}.weight.{e}" for i in range(2) for m in GROUPED for e in range(E))


def _jetmoe():
    torch.manual_seed(0)
    return widen(JetMoeForCausalLM(JetMoeConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_key_value_heads=4, kv_channels=8, intermediate_size=16,
        num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64)))


def _logits(model):
    return logits_of(model, IDS)


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)


def test_every_routed_expert_is_2_4_equals_the_reference_and_round_trips(tmp_path):
    model = _jetmoe()
    reference = copy.deepcopy(model)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." in n}
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path))

    names = [r.name for r in report.layers]
    assert sorted(n for n in names if split_expert_name(n) is not None) == EXPERT_LAYERS
    # routed statistics: each token reaches its top-2 experts of each grouped module of the 2 blocks
    assert len(report.expert_tokens) == 2 * len(GROUPED) * E
    assert sum(report.expert_tokens.values()) == 2 * len(GROUPED) * 2 * CALIB.numel()
    assert min(report.expert_tokens.values()) < max(report.expert_tokens.values())
    for n, p in routers.items():
        assert torch.equal(model.get_parameter(n), p), n
    router = (2, "router: routing-critical and tiny")
    assert report.dense_weights["model.layers.*.mlp.router.layer.weight"] == router
    assert report.dense_weights["model.layers.*.self_attention.experts.router.layer.weight"] == router
    assert not any(k.endswith(("input_linear.weight", "output_linear.weight")) for k in report.dense_weights)
    assert "model.layers.0.self_attention.kv_proj" in names  # an ordinary linear, not a router

    install_stored_factors(reference, tmp_path, names)  # asserts every stored core is 2:4
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-5)
    assert_saves_and_loads_bit_identically(model, tmp_path / "saved", IDS)


def test_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts():
    errors = armor_and_magnitude_errors(_jetmoe, CALIB, IDS, _armor(), EXPERT_LAYERS)
    assert errors["armor"] < errors["magnitude"], errors


def test_padding_is_left_out_of_the_grouped_statistics():
    block = _jetmoe().model.layers[0].mlp
    x = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    stats = {}
    for padded in (True, False):
        obs = {m: GroupedExpertsObserver(getattr(block, m), m, parent=block) for m in ("input_linear", "output_linear")}
        with torch.no_grad():
            if padded:
                with token_mask(mask):
                    block(x)
            else:  # only the real tokens, as one sequence: routing is per token, so each expert sees the same rows
                block(x[mask][None])
        stats[padded] = {n: s for o in obs.values() for n, s in o.statistics().items()}
        stats[padded]["tokens"] = {m: o.routed_tokens for m, o in obs.items()}
    assert stats[True]["tokens"] == stats[False]["tokens"]
    assert sum(stats[True]["tokens"]["input_linear"].values()) == 2 * int(mask.sum())
    for name in (n for n in stats[False] if n != "tokens"):
        torch.testing.assert_close(stats[True][name].act_sq_norm, stats[False][name].act_sq_norm)


def test_all_mode_and_the_fallback_take_every_row_of_the_module():
    block = _jetmoe().model.layers[0].mlp
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(2))
    rows = {}
    block.input_linear.register_forward_pre_hook(lambda _m, args: rows.update(x=args[0].detach()))
    every = {"all": dict(mode="all"), "fallback": dict(min_tokens=10 ** 6)}
    for what, kw in every.items():
        obs = GroupedExpertsObserver(block.input_linear, "input_linear", parent=block, **kw)
        with torch.no_grad():
            block(x)
        if what == "fallback":
            with pytest.warns(UserWarning, match="min_expert_tokens"):
                stats = obs.statistics()
        else:
            stats = obs.statistics()
        assert sum(obs.routed_tokens.values()) == 2 * 6  # top-2 of 6 tokens, whatever the statistics
        for e in range(E):
            torch.testing.assert_close(stats[f"input_linear.weight.{e}"].act_sq_norm, rows["x"].square().sum(0))


def test_block_reconstruction_runs_the_grouped_experts():
    errors = reconstruction_errors(_jetmoe(), CALIB)
    assert all(before < 0.5 for before, _ in errors.values()), errors
