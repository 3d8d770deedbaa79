"""The MoE architectures issue 48 named that have no test file of their own (slow): on the tiny random
model of tools/moe_table.py, an ARMOR prune of the routed experts alone makes every expert's core 2:4,
keeps each router dense and lists it, and is closer to the dense model's logits than a magnitude 2:4
prune of the same experts. (The table's slow test checks their save/load round trip; gpt-oss, DBRX,
JetMoE, Gemma-4, Inkling-2, Llama-4, Inkling and Zamba have files of their own.)"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from _tiny_moe import moe_table_tool
from torch_armor.calibration.experts import expert_layer_names
from torch_armor.calibration.routers import router_names
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.config.methods import MagnitudeConfig
from torch_armor.engine.prune import PruneOptions, prune_model

ARCHITECTURES = ["afmoe", "aria_text", "deepseek_v4", "hunyuan_v1_moe", "jamba", "laguna", "longcat_flash",
                 "qwen4_exp_text", "zaya"]


def _tiny(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return moe_table_tool().tiny_model(model_type)


def _logits(model, ids):
    with torch.no_grad():
        return model(ids, use_cache=False).logits.float()


def _is_2_4(core: torch.Tensor) -> bool:
    groups = (core != 0).reshape(*core.shape[:-1], -1, 4).sum(-1)
    return bool((groups <= 2).all())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_routed_experts_are_2_4_routers_dense_and_armor_closer_than_magnitude(model_type):
    dense = _tiny(model_type)
    vocab = int(dense.get_input_embeddings().weight.shape[0])
    calib = torch.randint(0, vocab, (8, 16), generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(2))
    want = _logits(dense, ids)
    experts = expert_layer_names(dense)
    routers = router_names(dense)
    assert experts and routers
    errors = {}
    for config in (MagnitudeConfig(), ArmorConfig(block_size=8, optimizer=BcdConfig(iters=3), refine=None,
                                                   reconstruct=None, distill=None)):
        model = _tiny(model_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = prune_model(model, calib, config, layers=experts, options=PruneOptions(progress=False))
        assert sorted(r.name for r in report.layers) == sorted(experts)
        errors[type(config).__name__] = float((_logits(model, ids) - want).pow(2).mean())
    for router in routers:  # dense, and listed with its reason
        assert not hasattr(type(model.get_submodule(router).weight), "__tensor_flatten__"), router
        assert any(re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), f"{router}.weight")
                   and why.startswith("router") for pattern, (_, why) in report.dense_weights.items()), router
    fused = {name.rpartition(".")[0] for name in experts}
    for param in fused:
        weight = model.get_parameter(param)
        assert hasattr(type(weight), "__tensor_flatten__"), param
        cores = weight.__tensor_flatten__()[0]
        core = next(getattr(weight, c) for c in cores if "core" in c)
        assert _is_2_4(core.float()), param
    assert errors["ArmorConfig"] < errors["MagnitudeConfig"], errors
