"""Mixture-of-experts models whose decoder layers take more than the hidden states, through prune_model.

Gemma-4 passes each layer its own slice of the per-layer embeddings (positionally) and the mask of its
layer type (sliding or full attention); Inkling-2 passes ``block_states``, the inputs of earlier
block-boundary layers. The engine calls each decoder block with what the model's own forward passes it
(captured by recorders standing in for the blocks): every routed expert is pruned to 2:4, the routers stay
dense and listed, the logits equal a slow reference built from the stored factors through the model's
own forward, ARMOR's experts beat magnitude 2:4 of the same experts, and save/load is bit-identical.
An argument computed from earlier layers' outputs (Inkling-2 with a block boundary after layer 0) and a
layer the forward calls twice (Inkling-2-Loop's looped layers) are refused up front, by layer and name."""

import copy

import pytest
import torch
from torch.utils._pytree import tree_leaves
from transformers import (Gemma4ForCausalLM, Gemma4TextConfig, Inkling2ForCausalLM, Inkling2LoopForCausalLM,
                          Inkling2LoopTextConfig, Inkling2TextConfig)

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.blocks import capture_block_inputs, decoder_blocks
from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.errors import ArmorInputError

from _tiny_moe import CALIB, IDS, install_stored_factors, logits_of, widened

E = 4


def _gemma4():
    cfg = Gemma4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=8,
                           max_position_embeddings=64, sliding_window=4,
                           layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=8,
                           vocab_size_per_layer_input=64, enable_moe_block=True, num_experts=E, top_k_experts=2,
                           moe_intermediate_size=16)
    return widened(Gemma4ForCausalLM, cfg)


def _inkling2(layers=2, per_block=6):
    cfg = Inkling2TextConfig(vocab_size=64, unpadded_vocab_size=64, hidden_size=32, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                             swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                             max_position_embeddings=64, moe_intermediate_size=16, n_routed_experts=E,
                             num_experts_per_tok=2, n_layers_per_attn_res_block=per_block)
    return widened(Inkling2ForCausalLM, cfg)


ARCHS = {"gemma4": (_gemma4, "model.layers.{i}.experts", "model.layers.*.router.proj.weight"),
         "inkling2": (_inkling2, "model.layers.{i}.mlp.experts", None)}


def _tensors(value):
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, torch.Tensor)]


def _logits(model):
    return logits_of(model, IDS)


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_routed_expert_is_2_4_equals_the_reference_and_round_trips(arch, tmp_path):
    build, experts, router = ARCHS[arch]
    model = build()
    reference = copy.deepcopy(model)
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path,
                                                                       min_expert_tokens=0))
    names = [r.name for r in report.layers]
    want = sorted(f"{experts.format(i=i)}.{a}.{e}" for i in range(2) for a in ("gate_up_proj", "down_proj")
                  for e in range(E))
    assert sorted(n for n in names if split_expert_name(n) is not None) == want
    assert sum(report.expert_tokens.values()) == 2 * 2 * CALIB.numel()  # top-2 in each of 2 blocks
    assert not any(".experts." in k for k in report.dense_weights), report.dense_weights
    routers = [k for k, (_, why) in report.dense_weights.items() if why.startswith("router")]
    assert routers, report.dense_weights
    if router is not None:
        assert router in routers
    params = dict(model.named_parameters())
    for n in (k.replace("*", str(i)) for k in routers for i in range(2)):  # the routers kept their weights
        if n in params:
            assert torch.equal(params[n], reference.get_parameter(n)), n

    install_stored_factors(reference, tmp_path, names)
    logits = _logits(model)
    torch.testing.assert_close(logits, _logits(reference), rtol=1e-4, atol=1e-5)
    save_pretrained(model, tmp_path / "saved")
    assert torch.equal(_logits(load_pretrained(tmp_path / "saved").eval()), logits)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts(arch):
    build = ARCHS[arch][0]
    want = _logits(build())
    errors = {}
    for method in ("magnitude", "armor"):
        model = build()
        config = _armor() if method == "armor" else config_for_method(method)
        prune_model(model, CALIB, config, layers="experts", options=PruneOptions(progress=False, min_expert_tokens=0))
        errors[method] = float((_logits(model) - want).pow(2).mean())
    assert errors["armor"] < errors["magnitude"], errors


def test_each_block_gets_the_arguments_the_models_forward_passes_it():
    """Independent reference: forward pre-hooks on the real layers during an ordinary forward."""
    model = _gemma4()
    prefix, blocks = decoder_blocks(model)
    seen = []
    handles = [b.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args, kwargs)), with_kwargs=True)
               for b in blocks]
    with torch.no_grad():
        model(CALIB[:2], use_cache=False)
    for h in handles:
        h.remove()
    (inp,) = capture_block_inputs(model, blocks[0], [CALIB[:2]], blocks=blocks, blocks_prefix=prefix)
    assert torch.equal(inp.hidden, seen[0][0][0])
    for index, (args, kwargs) in enumerate(seen):
        inp.enter_block(index)
        assert torch.equal(inp.kwargs["per_layer_input"], args[1])  # passed positionally, captured by name
        assert sorted(inp.kwargs) == sorted(["per_layer_input", *kwargs])
        for key, value in kwargs.items():
            got, want = _tensors(inp.kwargs[key]), _tensors(value)
            assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want)), (index, key)
    # sliding attention (window 4) over 16 tokens needs a mask, full causal attention does not
    masks = [inp.layer_kwargs[i]["attention_mask"] for i in range(2)]
    assert masks[0] is not None and masks[1] is None


def test_an_argument_computed_from_earlier_layers_outputs_is_refused_by_name():
    model = _inkling2(layers=3, per_block=1)  # layer 2's block_states holds layer 1's input: layer 0's output
    with pytest.raises(ArmorInputError, match=r"'model\.layers\.2' \(Inkling2\w+DecoderLayer\) is called with "
                                              r"'block_states'.*earlier layers' outputs"):
        prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))


def test_a_layer_called_twice_in_one_forward_is_refused_by_name():
    cfg = Inkling2LoopTextConfig(vocab_size=64, unpadded_vocab_size=64, hidden_size=32, num_hidden_layers=3,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4,
                                 swa_num_key_value_heads=2, swa_head_dim=8, sliding_window_size=4,
                                 max_position_embeddings=64, moe_intermediate_size=16, n_routed_experts=E,
                                 num_experts_per_tok=2, n_layers_per_attn_res_block=1, loop_layer_index_start=1,
                                 loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=8)
    model = widened(Inkling2LoopForCausalLM, cfg)  # layers 0, 1, 1, 2: the loop runs layer 1 twice
    with pytest.raises(ArmorInputError, match=r"'model\.layers\.1' \(Inkling2Loop\w+\) is called more than once"):
        prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))


def test_layers_that_return_a_tuple_are_followed_whatever_the_batch_size():
    """GLM-MoE-DSA's layers return ``(hidden, top-k indices)``, unpacked by the model: a recorder's bare
    tensor of batch 2 would unpack into two wrong halves (and its top-k would look like carried state)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("moe_table", Path(__file__).resolve().parents[2] / "tools" / "moe_table.py")
    moe_table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(moe_table)
    model = moe_table.tiny_model("glm_moe_dsa")
    prefix, blocks = decoder_blocks(model)
    (inp,) = capture_block_inputs(model, blocks[0], [CALIB[:2]], blocks=blocks, blocks_prefix=prefix)
    assert inp.hidden.shape == (2, 16, 32)
    assert [kw["prev_topk_indices"] for kw in inp.layer_kwargs] == [None, None]
    assert inp.layer_kwargs[1] is not inp.layer_kwargs[0]  # block 1's own call was recorded, not block 0's reused
    report = prune_model(model, CALIB[:6], _armor(), options=PruneOptions(progress=False, batch_size=2,
                                                                          min_expert_tokens=0))
    assert sum(split_expert_name(r.name) is not None for r in report.layers) == 2 * 2 * E
