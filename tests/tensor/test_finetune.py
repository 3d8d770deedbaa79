"""Tests for torch_armor.tensor.finetune: training A, B and the kept core values; honest sizes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from _helpers import block_diag_dense, random_pattern_factors
from conftest import make_tiny_llama
from torch_armor import ArmorConfig, enable_finetuning, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig
from torch_armor.tensor.finetune import model_size
from torch_armor.tensor.armor_tensor import ArmorTensor, armor_linear_from_factors
from torch_armor.tensor.finetune import trainable_parts


@pytest.mark.parametrize("storage", ["compact", "dense"])
def test_gradients_match_dense_weight_autograd(storage):
    """float64: the gradients of A, B and the kept values equal those of W = blockdiag(A)·(mask ⊙ core)·blockdiag(B)."""
    d_out, d_in, d_b = 16, 32, 8
    f = random_pattern_factors(d_out, d_in, d_b, seed=3, dtype=torch.float64)
    lin = nn.Linear(d_in, d_out, dtype=torch.float64)
    armor_linear_from_factors(lin, f, storage=storage)
    enable_finetuning(lin)
    x = torch.randn(2, 5, d_in, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    target = torch.randn(2, 5, d_out, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (lin(x) - target).pow(3).sum().backward()

    a = f.a_blocks.clone().requires_grad_()
    b = f.b_blocks.clone().requires_grad_()
    kept = f.core[f.mask].clone().requires_grad_()  # row-major kept entries
    bias = lin.bias.detach().clone().requires_grad_()
    core = torch.zeros(d_out, d_in, dtype=torch.float64).masked_scatter(f.mask, kept)
    w = block_diag_dense(a) @ core @ block_diag_dense(b)
    (x @ w.T + bias - target).pow(3).sum().backward()

    torch.testing.assert_close(lin.weight_a_blocks.grad, a.grad, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(lin.weight_b_blocks.grad, b.grad, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(lin.weight_values.grad.reshape(-1), kept.grad, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(lin.bias.grad, bias.grad, rtol=1e-12, atol=1e-10)
    assert lin.weight.storage_format == "compact" and lin.weight.grad is None


def test_requires_grad_on_the_weight_says_how():
    """Before: requires_grad_(True) answered True and .grad stayed None after backward."""
    lin = nn.Linear(16, 8)
    armor_linear_from_factors(lin, random_pattern_factors(8, 16, 4), storage="compact")
    with pytest.raises(RuntimeError, match="enable_finetuning"):
        lin.weight.requires_grad_(True)
    assert not lin.weight.requires_grad
    enable_finetuning(lin)
    lin.requires_grad_(True)  # fine once the parts are parameters: the container stays grad-free
    assert not lin.weight.requires_grad and lin.weight_values.requires_grad


def test_any_optimizer_over_model_parameters_trains_the_parts(tmp_path, one_thread):
    """Before: an optimizer over model.parameters() changed nothing."""
    model = make_tiny_llama()
    windows = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    prune_model(model, windows, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    keys_before = sorted(model.state_dict())
    q = model.model.layers[0].self_attn.q_proj
    indices, values = q.weight.with_storage("compact").indices.clone(), None
    enable_finetuning(model)
    values = q.weight_values.detach().clone()
    assert len(trainable_parts(model)) == 3 * 14
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    batch = torch.randint(0, 128, (4, 12), generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(5):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(q.weight_values, values) and torch.equal(q.weight.indices, indices)  # mask fixed
    assert sorted(model.state_dict()) == keys_before  # the registered parts are not saved twice
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(batch).logits, model(batch).logits)


def test_model_size_counts_parts_not_dense(one_thread):
    model = make_tiny_llama()
    dense_params = sum(p.numel() for p in model.parameters())
    windows = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
    prune_model(model, windows, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    for m in model.modules():
        if isinstance(getattr(m, "weight", None), ArmorTensor):
            m.weight = nn.Parameter(m.weight.with_storage("compact"), requires_grad=False)
    # independent count from the shapes: per linear d_out·d_b + d_in·d_b + d_out·d_in/2 (2:4)
    expected = dense_params
    packed_bytes = 0
    for m in model.modules():
        if isinstance(getattr(m, "weight", None), ArmorTensor):
            d_out, d_in = m.weight.shape
            expected += d_out * 16 + d_in * 16 + d_out * d_in // 2 - d_out * d_in
            packed_bytes += d_out * d_in // 2 // 4  # 2 bits per kept value (2:4)
    size = model_size(model)
    assert size.parameters == expected
    assert size.parameter_bytes == 4 * expected + packed_bytes
    assert size.dense_parameters == dense_parameters_of(model) == model.num_parameters()  # HF counts dense
    assert size.buffer_bytes == sum(b.numel() * b.element_size() for b in model.buffers())
    enable_finetuning(model)
    assert model_size(model).parameters == expected  # shared parts counted once


def dense_parameters_of(model):
    return sum(p.numel() for p in model.parameters())
