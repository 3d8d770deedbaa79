"""Per-expert statistics of fused experts equal those computed by hand from the router's top-k
choices (an independent reference: the router's own outputs, explicit gate/up/down arithmetic)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from torch_armor.calibration.blocks import block_statistics, capture_block_inputs, decoder_blocks
from torch_armor.calibration.experts import ExpertsObserver, ExpertSlot, split_expert_name
from torch_armor.calibration.selection import prunable_names
from torch_armor.errors import ArmorInputError

E, H, I = 4, 32, 16  # noqa: E741  (experts, hidden, intermediate: the model config's letters)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=H, intermediate_size=64, moe_intermediate_size=I, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, num_experts=E, num_experts_per_tok=2,
                         vocab_size=50)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.normal_(0, 0.5)  # a router that actually spreads tokens
    return model


def _slots(model):
    experts = model.model.layers[0].mlp.experts
    prefix = "model.layers.0.mlp.experts"
    return {f"{prefix}.{a}.{e}": ExpertSlot(experts, a, e, f"{prefix}.{a}.{e}")
            for a in ("gate_up_proj", "down_proj") for e in range(E)}


def _by_hand(x, idx, experts, mode="routed"):
    """Σx², XᵀX and token count of each expert's gate_up and down inputs, from scratch."""
    out = {}
    for e in range(E):
        rows = x if mode == "all" else x[(idx == e).any(-1)]
        wg, wu = experts.gate_up_proj[e, :I], experts.gate_up_proj[e, I:]
        inter = F.silu(rows @ wg.T) * (rows @ wu.T)
        for attr, r in (("gate_up_proj", rows), ("down_proj", inter)):
            r = r.double()
            out[f"model.layers.0.mlp.experts.{attr}.{e}"] = (r.square().sum(0), r.T @ r, r.shape[0])
    return out


@pytest.mark.parametrize("mode", ["routed", "all"])
def test_block_statistics_of_each_expert_equal_the_routers_top_k_by_hand(mode):
    model = _model()
    _, blocks = decoder_blocks(model)
    batches = [torch.randint(0, 50, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    inputs = capture_block_inputs(model, blocks[0], batches)
    seen = []
    router = model.model.layers[0].mlp.gate
    handle = router.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), out[2].detach())))
    tokens = {}
    stats = block_statistics(blocks[0], _slots(model), inputs, device=torch.device("cpu"), track_xtx=True,
                             expert_calibration=mode, expert_tokens=tokens)
    handle.remove()
    x = torch.cat([s[0] for s in seen]).reshape(-1, H)
    idx = torch.cat([s[1] for s in seen])
    with torch.no_grad():
        ref = _by_hand(x, idx, model.model.layers[0].mlp.experts, mode)
    assert set(stats) == set(ref)
    for name, (sq, xtx, n) in ref.items():
        assert stats[name].num_tokens == n, name
        torch.testing.assert_close(stats[name].act_sq_norm.double(), sq, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(stats[name].xtx.double(), xtx, rtol=1e-4, atol=1e-5)
    assert tokens == {f"model.layers.0.mlp.experts.{e}": int((idx == e).any(-1).sum()) for e in range(E)}
    assert sum(tokens.values()) == 2 * x.shape[0]  # top-2: every token counted twice


def test_padding_is_left_out_of_expert_statistics():
    model = _model()
    _, blocks = decoder_blocks(model)
    ids = torch.randint(0, 50, (2, 10), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[1, 6:] = 0
    inputs = capture_block_inputs(model, blocks[0], [(ids, mask)])
    tokens = {}
    block_statistics(blocks[0], _slots(model), inputs, device=torch.device("cpu"), expert_tokens=tokens)
    assert sum(tokens.values()) == 2 * int(mask.sum())


def test_an_expert_with_no_routed_tokens_falls_back_to_all_tokens_with_one_warning():
    experts = _model().model.layers[0].mlp.experts
    x = torch.randn(20, H, generator=torch.Generator().manual_seed(1))
    idx = torch.stack([torch.arange(20) % 3, (torch.arange(20) + 1) % 3], dim=1)  # expert 3 is never chosen
    weights = torch.full((20, 2), 0.5)
    obs = ExpertsObserver(experts, "model.layers.0.mlp.experts", track_xtx=True, min_tokens=1)
    with torch.no_grad():
        experts(x, idx, weights)
    with pytest.warns(UserWarning, match=r"expert model\.layers\.0\.mlp\.experts\.3 received 0 routed") as caught:
        stats = obs.statistics()
    assert len([w for w in caught if "routed calibration tokens" in str(w.message)]) == 1
    with torch.no_grad():
        ref_all = _by_hand(x, idx, experts, "all")
        ref = _by_hand(x, idx, experts, "routed")
    for attr in ("gate_up_proj", "down_proj"):
        name = f"model.layers.0.mlp.experts.{attr}.3"
        assert stats[name].num_tokens == 20 and float(stats[name].act_sq_norm.sum()) > 0
        torch.testing.assert_close(stats[name].act_sq_norm.double(), ref_all[name][0], rtol=1e-4, atol=1e-5)
        name0 = f"model.layers.0.mlp.experts.{attr}.0"  # the others keep their routed statistics
        torch.testing.assert_close(stats[name0].act_sq_norm.double(), ref[name0][0], rtol=1e-4, atol=1e-5)


def test_names_routers_and_bad_options():
    model = _model()
    names = prunable_names(model)
    assert "model.layers.0.mlp.gate" not in names
    assert [n for n in names if "experts" in n] == [f"model.layers.0.mlp.experts.{a}.{e}"
                                                    for a in ("gate_up_proj", "down_proj") for e in range(E)]
    assert split_expert_name("model.layers.0.mlp.up_proj") is None
    with pytest.raises(ArmorInputError, match="expert_calibration"):
        ExpertsObserver(model.model.layers[0].mlp.experts, "x", mode="every")
