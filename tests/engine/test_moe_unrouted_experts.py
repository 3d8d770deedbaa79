"""Experts modules whose forward takes no routing, through prune_model.

Inkling's shared experts (3-D ``gate_proj``/``up_proj``/``down_proj``, ``forward(hidden_states, gammas)``:
every token) sit beside its routed experts; Llama-4's experts (transposed ``gate_up_proj`` ``(E, H, 2·I)``,
``forward(hidden_states)``: every token through every expert, its input scaled by the router's score) are
the only ones. Neither is taken for routed experts: they stay dense and the report names the module and
why, while Inkling's routed experts are pruned to 2:4 (reference logits, ARMOR beats magnitude 2:4 of the
same experts) and everything else of Llama-4 (attention, its shared expert) is pruned; save/load is
bit-identical."""

import copy

import torch
from transformers import InklingForCausalLM, InklingTextConfig, Llama4ForCausalLM, Llama4TextConfig

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.experts import split_expert_name
from torch_armor.core.config import ArmorConfig, BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model

from _tiny_moe import CALIB, IDS, install_stored_factors, logits_of, widened

E = 4


def _inkling():
    cfg = InklingTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                            swa_head_dim=8, sliding_window_size=4, max_position_embeddings=64, intermediate_size=64,
                            moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=2, n_shared_experts=1,
                            mlp_layer_types=["sparse", "sparse"])
    return widened(InklingForCausalLM, cfg)


def _llama4():
    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64,
                           attention_chunk_size=4)
    return widened(Llama4ForCausalLM, cfg)


def _logits(model):
    return logits_of(model, IDS)


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)


def test_inkling_prunes_its_routed_experts_and_keeps_its_shared_experts_dense_with_the_reason(tmp_path):
    model = _inkling()
    reference = copy.deepcopy(model)
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path,
                                                                       min_expert_tokens=0))
    names = [r.name for r in report.layers]
    assert sorted(n for n in names if split_expert_name(n) is not None) == sorted(
        f"model.layers.{i}.mlp.experts.{a}.{e}" for i in range(2) for a in ("gate_up_proj", "down_proj")
        for e in range(E))
    assert report.dense_weights["model.layers.*.mlp.gate.weight"] == (2, "router: routing-critical and tiny")
    for attr in ("gate_proj", "up_proj", "down_proj"):
        count, why = report.dense_weights[f"model.layers.*.mlp.shared_experts.{attr}"]
        assert count == 2 and "InklingSharedExperts.forward takes no (top_k_index, top_k_weights)" in why
        for i in range(2):
            name = f"model.layers.{i}.mlp.shared_experts.{attr}"
            assert torch.equal(model.get_parameter(name), reference.get_parameter(name))
    install_stored_factors(reference, tmp_path, names)
    logits = _logits(model)
    torch.testing.assert_close(logits, _logits(reference), rtol=1e-4, atol=1e-5)
    save_pretrained(model, tmp_path / "saved")
    assert torch.equal(_logits(load_pretrained(tmp_path / "saved").eval()), logits)


def test_inkling_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts():
    want = _logits(_inkling())
    errors = {}
    for method in ("magnitude", "armor"):
        model = _inkling()
        config = _armor() if method == "armor" else config_for_method(method)
        report = prune_model(model, CALIB, config, layers="experts",
                             options=PruneOptions(progress=False, min_expert_tokens=0))
        assert all(".mlp.experts." in r.name for r in report.layers)
        errors[method] = float((_logits(model) - want).pow(2).mean())
    assert errors["armor"] < errors["magnitude"], errors


def test_llama4_keeps_its_experts_dense_with_the_reason_and_prunes_the_rest(tmp_path):
    model = _llama4()
    reference = copy.deepcopy(model)
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path))
    names = [r.name for r in report.layers]
    assert not any(split_expert_name(n) for n in names)
    for i in range(2):
        for part in ("self_attn.q_proj", "self_attn.o_proj", "feed_forward.shared_expert.down_proj"):
            assert f"model.layers.{i}.{part}" in names
    for attr in ("gate_up_proj", "down_proj"):
        count, why = report.dense_weights[f"model.layers.*.feed_forward.experts.{attr}"]
        assert count == 2 and "Llama4TextExperts.forward takes no (top_k_index, top_k_weights)" in why
        for i in range(2):
            name = f"model.layers.{i}.feed_forward.experts.{attr}"
            assert torch.equal(model.get_parameter(name), reference.get_parameter(name))
    assert report.dense_weights["model.layers.*.feed_forward.router.weight"] == (2, "router: routing-critical and tiny")
    install_stored_factors(reference, tmp_path, names)
    logits = _logits(model)
    torch.testing.assert_close(logits, _logits(reference), rtol=1e-4, atol=1e-5)
    save_pretrained(model, tmp_path / "saved")
    assert torch.equal(_logits(load_pretrained(tmp_path / "saved").eval()), logits)
