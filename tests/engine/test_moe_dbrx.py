"""DBRX through prune_model: its experts are flat (``ffn.experts.mlp``: ``w1``, ``v1``, ``w2`` each a 2-D
``(E·I, H)`` parameter that DBRX's forward views as ``(E, I, H)``; ``w1``/``v1`` are ``(out, in)`` and ``w2``
``(in, out)``). Every routed expert is pruned to 2:4 from the tokens routed to it, the router stays dense
and listed, DBRX's own forward runs the ARMOR experts and equals a reference built from the stored
factors, a save/load round trip is bit-identical, and ARMOR is closer to dense than a magnitude 2:4
prune of the same experts."""

import copy
import functools
import pytest
import torch
from transformers import DbrxConfig, DbrxForCausalLM

from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model

from _tiny_moe import (armor_and_magnitude_errors, assert_saves_and_loads_bit_identically, logits_of,
                       reconstruction_errors, stored_factors, widen)

E, HIDDEN, WIDTH = 4, 32, 16  # experts, d_model, ffn_hidden_size
CALIB = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
EXPERT_LAYERS = sorted(f"transformer.blocks.{i}.ffn.experts.mlp.{a}.{e}" for i in range(2) for a in ("w1", "v1", "w2")
                       for e in range(E))


def _dbrx(ffn_hidden_size=WIDTH):
    torch.manual_seed(0)
    return widen(DbrxForCausalLM(DbrxConfig(
        d_model=HIDDEN, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=64,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},  # clip_qkv=None fails in DBRX
        ffn_config={"ffn_hidden_size": ffn_hidden_size, "moe_num_experts": E, "moe_top_k": 2})))


def _logits(model):
    return logits_of(model, IDS)


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)


def _install_reference(reference, run_dir, names):
    """Every stored layer's ``A·core·B`` written into ``reference`` (checking its core is 2:4): expert ``e``
    of ``w1``/``v1`` as rows ``e·I … (e+1)·I``, of ``w2`` transposed into the same rows."""
    for n in names:
        f = stored_factors(run_dir, n)
        split = split_expert_name(n)
        if split is None:
            reference.get_submodule(n).weight.data = f.dense()
            continue
        fqn, e = split
        rows = slice(e * WIDTH, (e + 1) * WIDTH)
        dense = f.dense()
        reference.get_parameter(fqn).data[rows] = dense.T if fqn.endswith(".w2") else dense


def test_every_routed_expert_is_2_4_equals_the_reference_and_round_trips(tmp_path):
    model = _dbrx()
    reference = copy.deepcopy(model)
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".router." in n}
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path))

    names = [r.name for r in report.layers]
    assert sorted(n for n in names if split_expert_name(n) is not None) == EXPERT_LAYERS
    assert len(report.expert_tokens) == 2 * E and sum(report.expert_tokens.values()) == 2 * 2 * CALIB.numel()
    assert min(report.expert_tokens.values()) < max(report.expert_tokens.values())
    assert routers
    for n, p in routers.items():
        assert torch.equal(model.get_parameter(n), p), n
    assert report.dense_weights["transformer.blocks.*.ffn.router.layer.weight"] == (2, "router: routing-critical and tiny")
    assert not any(".experts." in k for k in report.dense_weights), report.dense_weights

    _install_reference(reference, tmp_path, names)
    torch.testing.assert_close(_logits(model), _logits(reference), rtol=1e-4, atol=1e-5)  # DBRX's own forward: w1.view(-1, I, H)[e].T, w2.view(-1, I, H)[e]
    assert_saves_and_loads_bit_identically(model, tmp_path / "saved", IDS)


def test_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts():
    errors = armor_and_magnitude_errors(_dbrx, CALIB, IDS, _armor(), EXPERT_LAYERS)
    assert errors["armor"] < errors["magnitude"], errors


@pytest.mark.parametrize("method", ["magnitude", "wanda"])
def test_a_baseline_prunes_each_expert_along_its_input_dimension(method):
    model = _dbrx()
    prune_model(model, CALIB, config_for_method(method), layers="experts", options=PruneOptions(progress=False))
    for i in range(2):
        mlp = model.transformer.blocks[i].ffn.experts.mlp
        for attr in ("w1", "v1", "w2"):
            w = getattr(mlp, attr).detach().reshape(E, WIDTH, HIDDEN)
            w = w.transpose(1, 2) if attr == "w2" else w  # each expert as (out, in)
            kept = (w != 0).reshape(E, w.shape[1], -1, 4).sum(-1)
            assert bool((kept == 2).all()), (method, attr)


def test_square_experts_stay_dense_with_their_reason():
    model = _dbrx(ffn_hidden_size=HIDDEN)
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False))
    assert not any(split_expert_name(r.name) for r in report.layers)
    count, why = report.dense_weights["transformer.blocks.*.ffn.experts.mlp.w1"]
    assert count == 2 and "cannot tell ARMOR's (E, H, I) experts from their transpose" in why


def test_block_reconstruction_builds_the_experts_in_dbrx_layout(monkeypatch):
    """Reconstruction runs the block with the experts' Ŵ put back as DBRX's flat (E·I, H) parameters
    (w2 transposed): the error it starts from is the pruned block's, far below that of the same Ŵ
    only reshaped into the parameters (w2's experts not transposed)."""
    import torch_armor.armor.reconstruct as reconstruct

    errors = reconstruction_errors(_dbrx(), CALIB)
    assert all(before < 0.5 for before, _ in errors.values()), errors

    def reshaped_only(block, groups):
        params = dict(block.named_parameters())
        return {p: functools.partial(torch.reshape, shape=params[p].shape) for p, members in groups.items()
                if p != f"{members[0]}.weight"}

    monkeypatch.setattr(reconstruct, "expert_layouts", reshaped_only)
    scrambled = reconstruction_errors(_dbrx(), CALIB)
    for i, (before, _) in errors.items():
        assert 2 * before < scrambled[i][0], (errors, scrambled)
