"""Routers are found by what they do (their output selects the experts), whatever they are called:
one tiny random model per naming style transformers 5.24 ships, each router kept out of the pruned
layers and listed as dense with its reason, and a model whose names lie about their roles."""

import pytest
import torch
import transformers
from torch import nn

from torch_armor.calibration.routers import router_names
from torch_armor.calibration.selection import prunable_names
from torch_armor.engine.experts import dense_weights
from torch_armor.engine.methods import config_for_method
from torch_armor.engine.prune import PruneOptions, prune_model

SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)


def _dbrx():
    return transformers.DbrxConfig(d_model=32, n_heads=4, n_layers=2, max_seq_len=64, vocab_size=64,
                                   attn_config={"kv_n_heads": 2, "rope_theta": 10000.0},
                                   ffn_config={"ffn_hidden_size": 16, "moe_num_experts": 4, "moe_top_k": 2})


def _gemma4():
    return transformers.Gemma4TextConfig(**SMALL, intermediate_size=64, head_dim=8, hidden_size_per_layer_input=8,
                                         vocab_size_per_layer_input=64, enable_moe_block=True, num_experts=4,
                                         top_k_experts=2, moe_intermediate_size=16, sliding_window=16)


CASES = {  # model type: (config, the routers of block 1 (relative to it), its prefix)
    "dbrx": (_dbrx, ["ffn.router.layer"], "transformer.blocks"),
    "hunyuan_v1_moe": (lambda: transformers.HunYuanMoEV1Config(**SMALL, intermediate_size=16, num_experts=4,
                                                               moe_topk=2, head_dim=8), ["mlp.gate.wg"], "model.layers"),
    "afmoe": (lambda: transformers.AfmoeConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                               num_experts_per_tok=2, head_dim=8, num_dense_layers=1),
              ["mlp.router.gate"], "model.layers"),
    "gemma4_text": (_gemma4, ["router.proj"], "model.layers"),
    "jetmoe": (lambda: transformers.JetMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                 num_key_value_heads=2, kv_channels=8, intermediate_size=16,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 max_position_embeddings=64),
               ["mlp.router.layer", "self_attention.experts.router.layer"], "model.layers"),
    "zaya": (lambda: transformers.ZayaConfig(**SMALL, intermediate_size=64, moe_intermediate_size=16, num_experts=4,
                                             num_experts_per_tok=1, head_dim=8),  # ZAYA: top-1 only
             ["mlp.gate.down_proj", "mlp.gate.router_mlp.fc1", "mlp.gate.router_mlp.fc2",
              "mlp.gate.router_mlp.out_proj"], "model.layers"),
}


def _model(model_type):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(CASES[model_type][0]()).eval()


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_the_router_is_what_selects_the_experts_kept_dense_and_listed(model_type):
    model = _model(model_type)
    _, routers, prefix = CASES[model_type]
    found = router_names(model)
    assert [n for n in found if n.startswith(f"{prefix}.1.")] == [f"{prefix}.1.{r}" for r in routers]
    prunable = prunable_names(model)
    assert not set(found) & set(prunable)
    dense = dense_weights(model, prunable, prefix)
    for r in routers:
        assert dense[f"{prefix}.*.{r}.weight"][1] == "router: routing-critical and tiny", (r, dense)
    assert not any("router" in why for key, (_, why) in dense.items()
                   if not any(key.startswith(f"{prefix}.*.{r}.") for r in routers))


def test_jetmoe_attention_kv_proj_is_pruned_not_labelled_a_router():
    model = _model("jetmoe")
    assert "model.layers.0.self_attention.kv_proj" in prunable_names(model)
    assert "model.layers.0.self_attention.kv_proj" not in router_names(model)


def test_a_prune_leaves_the_routers_untouched_and_reports_them():
    model = _model("zaya")
    routers = {n: p.detach().clone() for n, p in model.named_parameters() if ".mlp.gate." in n}
    calib = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    report = prune_model(model, calib, config_for_method("magnitude"), options=PruneOptions(progress=False))
    assert not any(".mlp.gate." in r.name for r in report.layers)
    assert any(".experts." in r.name for r in report.layers)
    for n, p in routers.items():
        assert torch.equal(model.get_parameter(n), p), n
    assert report.dense_weights["model.layers.*.mlp.gate.router_mlp.out_proj.weight"] == (
        2, "router: routing-critical and tiny")


class _MisnamedMoe(nn.Module):
    """``gate`` is an ordinary projection into the experts; the scores that pick them come from ``scorer.lin``."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 16, bias=False)
        self.scorer = nn.Sequential()
        self.scorer.add_module("lin", nn.Linear(16, 4, bias=False))
        self.experts = nn.ModuleList(nn.Linear(16, 16, bias=False) for _ in range(4))

    def forward(self, x):
        h = self.gate(x)
        _, chosen = torch.topk(self.scorer(x).softmax(-1), 2, dim=-1)
        return sum(torch.where((chosen == e).any(-1, keepdim=True), expert(h), 0) for e, expert in enumerate(self.experts))


def test_names_do_not_matter_only_what_feeds_the_top_k():
    model = nn.Sequential()
    model.add_module("moe", _MisnamedMoe())
    assert router_names(model) == ["moe.scorer.lin"]
    model.to("meta")  # a streamed model's skeleton: the probe runs on shapes alone
    assert router_names(model) == ["moe.scorer.lin"]
