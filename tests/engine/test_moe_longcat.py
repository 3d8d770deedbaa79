"""LongCat-Flash through prune_model: its experts module is not decorated by transformers (no
``_apply_gate``) and its ``gate_up_proj`` holds rows for the "zero" (identity) experts too. Every
routed expert is pruned to 2:4, the logits equal a slow reference built from the stored factors
through LongCat's own forward, and a save/load round trip is bit-identical."""

import copy

import torch
from transformers import LongcatFlashConfig, LongcatFlashForCausalLM

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.experts import split_expert_name
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.prune import PruneOptions, prune_model

from _tiny_moe import install_stored_factors

ROUTED, ZERO = 4, 2


def _longcat():
    torch.manual_seed(0)
    cfg = LongcatFlashConfig(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             ffn_hidden_size=64, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                             head_dim=8, v_head_dim=8, qk_head_dim=16, moe_topk=2, n_routed_experts=ROUTED,
                             zero_expert_num=ZERO, expert_ffn_hidden_size=16, max_position_embeddings=64)
    model = LongcatFlashForCausalLM(cfg)
    with torch.no_grad():  # the default init (std 0.02) routes almost uniformly
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    return model.eval()


def test_every_routed_expert_is_2_4_equals_the_reference_and_round_trips(tmp_path):
    model = _longcat()
    reference = copy.deepcopy(model)
    calib = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(0))
    cfg = ArmorConfig(block_size=8, optimizer=BcdConfig(iters=2), refine=None, reconstruct=None, distill=None)
    report = prune_model(model, calib, cfg, options=PruneOptions(progress=False, run_dir=tmp_path, min_expert_tokens=0))
    experts = [r.name for r in report.layers if split_expert_name(r.name) is not None]
    for i in range(2):
        for attr, count in (("gate_up_proj", ROUTED + ZERO), ("down_proj", ROUTED)):
            assert sum(n.startswith(f"model.layers.{i}.mlp.experts.{attr}.") for n in experts) == count
    assert report.dense_weights["model.layers.*.mlp.router.classifier.weight"][1] == "router: routing-critical and tiny"
    install_stored_factors(reference, tmp_path, [r.name for r in report.layers])
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits, want = model(ids).logits, reference(ids).logits
        # two orders of float32 sums: the absolute error follows the logits' scale, not 1
        torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    save_pretrained(model, tmp_path / "saved")
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "saved").eval()(ids).logits, logits)
