"""Tutorial 2: fine-tune the ARMOR wrappers of a pruned model, then save and reload it with transformers.

After pruning, every decoder linear holds ``W = A · (2:4 core) · B``. The sparsity mask is what
makes the model fast and small; ``A``, ``B`` and the kept core values are free to adapt. This
tutorial trains them with an ordinary PyTorch loop — nothing ARMOR-specific but one call:

    python tutorials/02_finetune_wrappers.py [--steps 30]

1. ``prune_model`` a tiny random Llama (random calibration ids; nothing to download).
2. ``torch_armor.enable_finetuning(model)`` registers, on every converted linear, ``A``, ``B`` and
   the kept core values as trainable ``nn.Parameter``\\ s (``weight_a_blocks``, ``weight_b_blocks``,
   ``weight_values``); the 2:4 mask stays fixed. Here the other parameters (embeddings, norms)
   are frozen, so only the ARMOR parts learn.
3. Check, in float64, that autograd through the ARMOR layers gives exactly the gradients of the
   same loss computed with dense weights ``W = blockdiag(A) · core(values) · blockdiag(B)``.
4. Train with ``torch.optim.AdamW(model.parameters())``: the loss goes down, the mask does not move.
5. ``model.save_pretrained(dir)`` → ``AutoModelForCausalLM.from_pretrained(dir)``: bit-identical.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# torch_armor first: it keeps torchao's and torch's import-time warnings about CUDA-only
# extensions (irrelevant on a CPU build) out of your output
import torch_armor
from torch_armor import ArmorConfig, ArmorTensor, enable_finetuning, prune_model, PruneOptions
from torch_armor.config.armor import BcdConfig
from torch_armor.tensor.finetune import model_size
from torch_armor.tensor.finetune import trainable_parts
from torch_armor.tensor.packing import unpack_nm

import torch  # noqa: E402
from torch.func import functional_call  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama (hidden 64, 2 layers, vocab 256): stands in for your pretrained model."""
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # widen the tiny default init so there is something to learn
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    return model


def dense_reference_gradients(model: LlamaForCausalLM, ids: torch.Tensor) -> Dict[str, torch.Tensor]:
    """Gradients of the LM loss w.r.t. A, B and the kept values, through *dense* weights.

    A dense copy of the model runs with every converted weight materialized as
    ``blockdiag(A) @ scatter(values, mask) @ blockdiag(B)`` from leaf tensors; plain autograd
    differentiates that. Independent of the ArmorTensor forward.
    """
    dense = LlamaForCausalLM(model.config).to(torch.float64).eval()
    params: Dict[str, torch.Tensor] = {}
    leaves: Dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.rpartition(".")[2] in ("weight_a_blocks", "weight_b_blocks", "weight_values"):
            continue
        if isinstance(p, ArmorTensor):
            w = p.with_storage("compact")
            a = w.a_blocks.detach().clone().requires_grad_()
            b = w.b_blocks.detach().clone().requires_grad_()
            v = w.values.detach().clone().requires_grad_()
            n, m = w.nm
            core = unpack_nm(v, w.indices, n, m, w.shape[1])
            params[name] = torch.block_diag(*a.unbind(0)) @ core @ torch.block_diag(*b.unbind(0))
            module = name.removesuffix(".weight")
            leaves.update({f"{module}.weight_a_blocks": a, f"{module}.weight_b_blocks": b, f"{module}.weight_values": v})
        else:
            params[name] = p.detach()
    loss = functional_call(dense, params, (ids,), {"labels": ids}).loss
    loss.backward()
    return {name: t.grad for name, t in leaves.items()}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run every step, print what happens, and return the measurements (used by the tests).

    Returns ``converted_layers``, ``trainable_tensors``, ``grad_max_rel_diff`` (float64, ARMOR
    autograd vs dense reference), ``losses`` (one per step), ``mask_unchanged``,
    ``loaded_bit_identical`` and ``stored_parameters`` / ``dense_parameters``.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args([] if argv is None else list(argv))
    results: Dict[str, Any] = {}

    # 1. prune ------------------------------------------------------------------------------------
    model = build_model()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    calibration = torch.randint(0, vocab, (8, 32), generator=gen)
    prune_model(model, calibration, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5)), options=PruneOptions(progress=False))
    converted = [n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), ArmorTensor)]
    results["converted_layers"] = len(converted)
    size = model_size(model)
    results["stored_parameters"], results["dense_parameters"] = size.parameters, size.dense_parameters
    print(f"pruned {len(converted)} linears; stored parameters {size.parameters:,} "
          f"(num_parameters() counts them dense: {model.num_parameters():,})")

    # 2. make A, B and the kept values trainable ----------------------------------------------------
    enable_finetuning(model)
    parts = trainable_parts(model)
    for p in model.parameters():  # train only the ARMOR parts here (embeddings and norms frozen)
        if not any(p is q for q in parts.values()):
            p.requires_grad_(False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    results["trainable_tensors"] = len(trainable)
    print(f"{len(trainable)} trainable tensors, e.g. {[n for n in trainable if 'q_proj' in n][:3]}")

    # 3. gradients: ARMOR autograd == dense-weight autograd (float64) --------------------------------
    batch = torch.randint(0, vocab, (4, 24), generator=gen)
    model64 = copy.deepcopy(model).to(torch.float64)
    enable_finetuning(model64)  # re-binds the parts of the float64 copy
    model64(batch, labels=batch).loss.backward()
    reference = dense_reference_gradients(model64, batch)
    got = dict(model64.named_parameters())
    rel = max(float((got[k].grad - g).abs().max() / g.abs().max().clamp_min(1e-300)) for k, g in reference.items())
    results["grad_max_rel_diff"] = rel
    print(f"float64 gradients of {len(reference)} parts vs the dense-weight reference: max rel diff {rel:.1e}")

    # 4. train with any optimizer over model.parameters() ---------------------------------------------
    indices_before = model.get_submodule(converted[0]).weight.indices.clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(args.steps):
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {losses[-1]:.4f}")
    model.eval()
    results["losses"] = losses
    results["mask_unchanged"] = bool(torch.equal(model.get_submodule(converted[0]).weight.indices, indices_before))

    # 5. save with transformers, load with transformers ------------------------------------------------
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        loaded = AutoModelForCausalLM.from_pretrained(tmp)
    with torch.no_grad():
        results["loaded_bit_identical"] = bool(torch.equal(loaded(ids).logits, model(ids).logits))
    print(f"reloaded with AutoModelForCausalLM.from_pretrained, bit-identical: {results['loaded_bit_identical']}")
    assert torch_armor  # the import registers the quantizer that from_pretrained uses
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
