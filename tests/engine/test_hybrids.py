"""Hybrid (Mamba/SSM + attention) models through prune_model: a selected linear calibration never
calls is left dense and listed, never "saw no calibration data".

The rule: a selected ``nn.Linear`` whose forward hook never fired while its block ran on every
calibration batch stays dense, named in ``PruneReport.uncalled_layers`` and ``dense_weights`` and in
one warning, with why: its weight read directly by the block's forward (Jamba's ``dt_proj``: the scan
computes ``dt_proj.weight @ x``) or not at all (an expert no token reached). A linear that was
called, even with all-zero inputs, is pruned or refused as before.
"""

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from transformers import (AutoModelForCausalLM, BambaConfig, BambaForCausalLM, FalconMambaConfig,
                          FalconMambaForCausalLM, JambaConfig, JambaForCausalLM, MambaConfig, MambaForCausalLM)

from torch_armor import load_pretrained, save_pretrained
from torch_armor.calibration.blocks import NEVER_REACHED, READ_BY_KERNEL, BlockInput, block_statistics
from torch_armor.config.armor import ArmorConfig, BcdConfig
from torch_armor.engine.prune import PruneOptions, prune_model
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor

from _helpers import check_mask

pytestmark = pytest.mark.usefixtures("one_thread")
CALIB = torch.randint(0, 64, (6, 16), generator=torch.Generator().manual_seed(0))
IDS = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(7))
MAMBA = "model.layers.0.mamba"


def _jamba():
    """Layer 0: Mamba mixer, layer 1: attention; both with 4 routed experts (top-2). ``dt_proj``
    (64, 8) and ``x_proj`` (40, 64) are shapes block size 8 fits: only the rule keeps ``dt_proj`` dense."""
    torch.manual_seed(0)
    cfg = JambaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=4, num_experts_per_tok=2, expert_layer_period=1,
                      expert_layer_offset=0, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=16,
                      mamba_dt_rank=8, mamba_expand=2, use_mamba_kernels=False)
    model = JambaForCausalLM(cfg)
    with torch.no_grad():  # the default init (std 0.02) routes and predicts almost uniformly
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "A_log" not in name:
                p.normal_(0.0, 0.3)
    return model.eval()


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def _armor():
    return ArmorConfig(block_size=8, optimizer=BcdConfig(iters=1), refine=None, reconstruct=None, distill=None)


def _prune(model, **options):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = prune_model(model, CALIB, _armor(), options=PruneOptions(progress=False, **options))
    return report, [str(w.message) for w in caught]


def test_jamba_prunes_experts_and_called_mamba_projections_and_keeps_dt_proj_dense_and_listed(tmp_path):
    model = _jamba()
    dt_proj = model.get_submodule(f"{MAMBA}.dt_proj").weight.detach().clone()
    report, caught = _prune(model)

    for i in range(2):
        for attr in ("gate_up_proj", "down_proj"):
            w = model.get_parameter(f"model.layers.{i}.feed_forward.experts.{attr}")
            assert isinstance(w, ArmorTensor) and w.num_experts is not None
            assert all(check_mask(expert.core_dense() != 0, "2:4") for expert in w.experts())
    for proj in ("in_proj", "out_proj", "x_proj"):  # called as nn.Linear: pruned like attention's
        w = model.get_submodule(f"{MAMBA}.{proj}").weight
        assert isinstance(w, ArmorTensor) and check_mask(w.core_dense() != 0, "2:4"), proj
    assert torch.equal(model.get_submodule(f"{MAMBA}.dt_proj").weight, dt_proj)
    assert report.uncalled_layers == {f"{MAMBA}.dt_proj": READ_BY_KERNEL}
    assert report.dense_weights["model.layers.*.mamba.dt_proj.weight"] == (1, READ_BY_KERNEL)
    conv_why = report.dense_weights["model.layers.*.mamba.conv1d.weight"][1]
    assert conv_why.startswith("not a linear's weight (Conv1d.weight)")
    assert f"{MAMBA}.dt_proj" not in {r.name for r in report.layers}
    assert not any("no calibration data" in m for m in caught)
    about = [m for m in caught if "never called as a module" in m]
    assert len(about) == 1 and "model.layers.*.mamba.dt_proj (1)" in about[0], caught

    logits = _logits(model)
    save_pretrained(model, tmp_path / "saved")
    assert torch.equal(_logits(load_pretrained(tmp_path / "saved").eval()), logits)
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()), logits)


def test_a_resumed_jamba_run_replays_the_dense_layers_it_left(tmp_path):
    first = _jamba()
    report, _ = _prune(first, run_dir=tmp_path / "run")
    second = _jamba()
    again, caught = _prune(second, run_dir=tmp_path / "run")  # every block finished: replayed from the store
    assert again.uncalled_layers == report.uncalled_layers
    assert [r.name for r in again.layers] == [r.name for r in report.layers]
    assert torch.equal(_logits(second), _logits(first))
    assert sum("never called as a module" in m for m in caught) == 1


class _Block(nn.Module):
    """A block with a linear it calls, one whose weight it reads directly, one it never touches."""

    def __init__(self) -> None:
        super().__init__()
        self.called, self.read, self.idle = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.called(x) + x @ self.read.weight.T


def test_the_rule_names_a_weight_read_directly_and_a_linear_never_reached_but_not_a_called_one():
    block = _Block()
    layers = dict(block.named_children())
    found = {}
    stats = block_statistics(block, layers, [BlockInput(torch.zeros(2, 3, 4))], device=torch.device("cpu"),
                             uncalled=found)
    assert found == {"read": READ_BY_KERNEL, "idle": NEVER_REACHED}
    assert stats["called"].num_tokens == 6 and not bool(stats["called"].act_sq_norm.any())


def test_a_called_linear_with_all_zero_inputs_is_still_refused():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=50)).eval()
    target = copy.deepcopy(model.model.layers[0].mlp.down_proj)
    with torch.no_grad():  # up_proj's output is all zero: down_proj is called with zeros
        model.model.layers[0].mlp.up_proj.weight.zero_()
    with pytest.raises(ArmorInputError, match="down_proj.*all zero"):
        prune_model(model, CALIB % 50, _armor(), layers=["model.layers.0.mlp.down_proj"],
                    options=PruneOptions(progress=False))
    assert torch.equal(model.model.layers[0].mlp.down_proj.weight, target.weight)


_SMALL = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2)
#: other SSM and hybrid models: (model, the layers the rule leaves dense). Mamba's and Falcon-Mamba's
#: mixers read dt_proj.weight directly as Jamba's do; Bamba's Mamba-2 mixer calls all its linears.
OTHERS = {
    "mamba": (lambda: MambaForCausalLM(MambaConfig(**_SMALL, state_size=16, expand=2, time_step_rank=8)),
              {f"backbone.layers.{i}.mixer.dt_proj": READ_BY_KERNEL for i in range(2)}),
    "falcon_mamba": (lambda: FalconMambaForCausalLM(FalconMambaConfig(**_SMALL, state_size=16, expand=2,
                                                                      time_step_rank=8)),
                     {f"backbone.layers.{i}.mixer.dt_proj": READ_BY_KERNEL for i in range(2)}),
    "bamba": (lambda: BambaForCausalLM(BambaConfig(**_SMALL, intermediate_size=64, num_attention_heads=4,
                                                   num_key_value_heads=4, mamba_n_heads=4, mamba_d_head=16,
                                                   mamba_d_state=16, mamba_n_groups=1, mamba_expand=2,
                                                   attn_layer_indices=[1])),
              {}),
}


@pytest.mark.parametrize("arch", sorted(OTHERS))
def test_other_ssm_and_hybrid_models_prune_every_linear_or_list_it_with_a_reason(arch):
    build, uncalled = OTHERS[arch]
    torch.manual_seed(0)
    model = build().eval()
    report, caught = _prune(model)
    assert report.uncalled_layers == uncalled
    assert sum("never called as a module" in m for m in caught) == (1 if uncalled else 0)
    pruned = left = 0
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and ".layers." in name:
            if isinstance(m.weight, ArmorTensor):
                pruned += 1
                continue
            left += 1
            why = report.dense_weights[re.sub(r"\.\d+\.", ".*.", f"{name}.weight", count=1)][1]
            assert why and why != "not selected", (name, why)
    assert pruned > left
