"""Experts modules whose forward takes no routing, through prune_model.

Llama-4's experts (``Llama4TextExperts``: transposed ``gate_up_proj`` ``(E, H, 2·I)`` and ``down_proj``
``(E, I, H)``, ``forward(hidden_states)`` with every token once per expert, scaled by the router's sigmoid
score, zero where the router did not pick that expert; ``torch.bmm``) and Inkling's shared experts
(``InklingSharedExperts``: ``gate_proj``/``up_proj``/``down_proj`` ``(E, out, in)``, ``forward(hidden_states,
gammas)``: every token through every shared expert, the intermediate scaled by ``gammas[:, e]``) are pruned to
ARMOR experts: every expert's core is 2:4, the router stays dense and listed, the model's own forward runs
the ARMOR experts and equals a reference built from the stored factors, save/load is bit-identical, ARMOR
is closer to dense than magnitude 2:4 of the same experts, block reconstruction and distillation run on
them, and the per-expert statistics equal a float64 gather by hand."""

import copy

import pytest
import torch
import torch.nn.functional as F
from transformers import InklingForCausalLM, InklingTextConfig, Llama4ForCausalLM, Llama4TextConfig

from torch_armor.calibration.experts import ExpertsObserver, expert_params, split_expert_name, unsupported_experts
from torch_armor.calibration.observer import token_mask
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.config.levers import DistillConfig
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.tensor.armor_tensor import ArmorTensor

from _tiny_moe import (CALIB, IDS, armor_and_magnitude_errors, assert_saves_and_loads_bit_identically,
                       install_stored_factors, logits_of, reconstruction_errors, widened)

E, SHARED = 4, 2  # Llama-4's experts, Inkling's shared experts


def _inkling():
    cfg = InklingTextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                            swa_head_dim=8, sliding_window_size=4, max_position_embeddings=64, intermediate_size=64,
                            moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=2,
                            n_shared_experts=SHARED, mlp_layer_types=["sparse", "sparse"])
    return widened(InklingForCausalLM, cfg)


def _llama4():
    cfg = Llama4TextConfig(vocab_size=64, hidden_size=32, intermediate_size=16, intermediate_size_mlp=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           num_local_experts=E, num_experts_per_tok=2, max_position_embeddings=64,
                           attention_chunk_size=4)
    return widened(Llama4ForCausalLM, cfg)


#: arch: (model, its unrouted experts module in block i, their parameters, their count, stored (E, in, out), router)
ARCHS = {
    "llama4": (_llama4, "model.layers.{i}.feed_forward.experts", ("gate_up_proj", "down_proj"), E, True,
               "model.layers.*.feed_forward.router.weight"),
    "inkling": (_inkling, "model.layers.{i}.mlp.shared_experts", ("gate_proj", "up_proj", "down_proj"), SHARED, False,
                "model.layers.*.mlp.gate.weight"),
}


def _layers(arch):
    _, module, attrs, count, _, _ = ARCHS[arch]
    return sorted(f"{module.format(i=i)}.{a}.{e}" for i in range(2) for a in attrs for e in range(count))


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), reconstruct=None, refine=None, distill=None)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_expert_is_2_4_the_router_dense_and_listed_and_the_model_equals_the_reference(arch, tmp_path):
    make, module, _, count, transposed, router = ARCHS[arch]
    model = make()
    reference = copy.deepcopy(model)
    report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, run_dir=tmp_path,
                                                                       min_expert_tokens=0))
    names = [r.name for r in report.layers]
    assert set(_layers(arch)) <= set(names)
    assert not any(".experts." in k or "shared_experts" in k for k in report.dense_weights), report.dense_weights
    assert report.dense_weights[router] == (2, "router: routing-critical and tiny")
    tokens = {(i, e): report.expert_tokens[f"{module.format(i=i)}.{e}"] for i in range(2) for e in range(count)}
    if arch == "llama4":  # each token's top-2 rows are the non-zero ones: 2 per token and block
        assert sum(tokens.values()) == 2 * 2 * CALIB.numel() and min(tokens.values()) < max(tokens.values()), tokens
    else:  # every token reaches every shared expert
        assert set(tokens.values()) == {CALIB.numel()}, tokens
    install_stored_factors(reference, tmp_path, names, transposed=transposed)  # checks every core is 2:4
    logits = logits_of(model, IDS)
    torch.testing.assert_close(logits, logits_of(reference, IDS), rtol=1e-4, atol=1e-5)
    assert_saves_and_loads_bit_identically(model, tmp_path / "saved", IDS)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_armor_experts_are_closer_to_dense_than_magnitude_2_4_of_the_same_experts(arch):
    errors = armor_and_magnitude_errors(ARCHS[arch][0], CALIB, IDS, _armor(), _layers(arch))
    assert errors["armor"] < errors["magnitude"], errors


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_block_reconstruction_builds_the_experts_in_their_module_layout(arch):
    """Reconstruction hands the module its experts' Ŵ in its own layout (Llama-4: (E, in, out)); the error it
    starts from is the pruned block's, small against the block's output."""
    make, module, attrs, _, _, _ = ARCHS[arch]
    model = make()
    errors = reconstruction_errors(model, CALIB)
    assert all(before < 0.5 for before, _ in errors.values()), errors
    for i in range(2):
        for attr in attrs:
            w = model.get_parameter(f"{module.format(i=i)}.{attr}")
            assert isinstance(w, ArmorTensor) and w.num_experts is not None


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_distillation_trains_the_experts_wrappers(arch):
    make, module, attrs, count, _, _ = ARCHS[arch]
    distill = DistillConfig(steps=4, lr=1e-2, windows_per_step=2, held_out=3, top_k=64, eval_every=1)
    pruned = {}
    for steps in (None, distill):
        model = make()
        config = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None, distill=steps)
        report = prune_model(model, CALIB, config, layers=_layers(arch), options=PruneOptions(progress=False))
        pruned[steps is not None] = model
    assert report.stages["distillation"]["after"] < report.stages["distillation"]["before"], report.stages["distillation"]
    for i in range(2):
        for attr in attrs:
            name = f"{module.format(i=i)}.{attr}"
            before, after = (pruned[d].get_parameter(name) for d in (False, True))
            assert isinstance(after, ArmorTensor) and after.num_experts is not None and after.shape[0] == count
            assert not torch.equal(after.a_blocks, before.a_blocks), name
            for e in range(count):  # the masks stay
                assert torch.equal(after.expert(e).core_dense() != 0, before.expert(e).core_dense() != 0)


def _statistics_of(rows):
    """``(Σx², XᵀX, row count)`` of ``rows`` (float64)."""
    return rows.pow(2).sum(0), rows.T @ rows, rows.shape[0]


def _assert_statistics(got, want):
    for name, (sq, xtx, count) in want.items():
        assert got[name].num_tokens == count, name
        torch.testing.assert_close(got[name].act_sq_norm.double(), sq, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[name].xtx.double(), xtx, rtol=1e-5, atol=1e-5)


def test_llama4_statistics_are_each_experts_router_scaled_tokens_by_hand():
    """Expert e's rows are the tokens whose top-2 router logits hold e, scaled by the sigmoid of that logit
    (computed here from the block's input and the router weight), padding left out; down_proj's are
    ``up · silu(gate)`` of them through expert e's stored ``(H, 2·I)`` weight."""
    model = _llama4()
    moe = model.model.layers[0].feed_forward
    seen = []
    moe.register_forward_pre_hook(lambda _m, args: seen.append(args[0].detach()))
    observer = ExpertsObserver(moe.experts, "experts", track_xtx=True)
    mask = torch.ones(IDS.shape, dtype=torch.bool)
    mask[0, -3:] = False
    with torch.no_grad(), token_mask(mask):
        model(IDS)
    got = observer.statistics()

    x = seen[0].reshape(-1, 32)[mask.reshape(-1)].double()
    logits = x.float() @ moe.router.weight.detach().T  # the top-2 choice as the model makes it, in float32
    top = logits.topk(2, dim=-1).indices
    gate_up, down = (getattr(moe.experts, a).detach().double() for a in ("gate_up_proj", "down_proj"))
    want = {}
    for e in range(E):
        picked = (top == e).any(dim=-1)
        rows = x[picked] * torch.sigmoid(logits[picked, e].double())[:, None]
        gate, up = (rows @ gate_up[e]).chunk(2, dim=-1)
        want[f"experts.gate_up_proj.{e}"] = _statistics_of(rows)
        want[f"experts.down_proj.{e}"] = _statistics_of(up * F.silu(gate))
        assert rows.shape[1] == down.shape[2]
    assert len({c for _, _, c in want.values()}) > 1  # the experts' counts differ: the order is tested
    _assert_statistics(got, want)


def test_inkling_shared_statistics_are_every_token_and_the_gamma_scaled_intermediate_by_hand():
    model = _inkling()
    shared = model.model.layers[0].mlp.shared_experts
    seen = []
    shared.register_forward_pre_hook(lambda _m, args, kwargs: seen.append((args[0].detach(), kwargs["gammas"].detach())),
                                     with_kwargs=True)
    observer = ExpertsObserver(shared, "shared", track_xtx=True)
    mask = torch.ones(IDS.shape, dtype=torch.bool)
    mask[1, :4] = False
    with torch.no_grad(), token_mask(mask):
        model(IDS)
    got = observer.statistics()

    hidden, gammas = seen[0]
    keep = mask.reshape(-1)
    x, gammas = hidden.reshape(-1, 32)[keep].double(), gammas.reshape(-1, SHARED)[keep].double()
    assert not torch.allclose(gammas[:, 0], gammas[:, 1])  # the shared experts' scales differ: the order is tested
    w = {a: getattr(shared, a).detach().double() for a in ("gate_proj", "up_proj", "down_proj")}
    want = {}
    for e in range(SHARED):
        for a in ("gate_proj", "up_proj"):
            want[f"shared.{a}.{e}"] = _statistics_of(x)
        intermediate = F.silu(x @ w["gate_proj"][e].T) * (x @ w["up_proj"][e].T) * gammas[:, e:e + 1]
        want[f"shared.down_proj.{e}"] = _statistics_of(intermediate)
    _assert_statistics(got, want)


def test_an_experts_layer_name_of_inkling_names_its_shared_expert():
    assert split_expert_name("model.layers.0.mlp.shared_experts.gate_proj.1") == (
        "model.layers.0.mlp.shared_experts.gate_proj", 1)


def test_experts_with_another_forward_that_takes_no_routing_stay_dense_with_the_reason():
    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(E, 32, 16))
            self.down_proj = torch.nn.Parameter(torch.zeros(E, 16, 16))

        def forward(self, hidden_states, scores):  # neither Llama-4's nor Inkling's
            return hidden_states

    holder = torch.nn.Module()
    holder.experts = Experts()
    assert expert_params(holder) == []
    assert "takes neither (hidden_states, top_k_index, top_k_weights)" in unsupported_experts(holder)["experts"]
