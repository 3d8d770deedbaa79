"""Tutorial 3: LoRA adapters (PEFT) and ``transformers.Trainer`` on a pruned ARMOR model.

A pruned model's linears hold ``W = A · (2:4 core) · B`` as ArmorTensor weights. PEFT attaches
LoRA adapters to them like to any linear: the layer computes ``W x + (α/r) · B_lora A_lora x``,
the ARMOR weight stays frozen and sparse, and only the small adapters train. Needs
``pip install peft`` (or ``pip install 'torch_armor[peft]'``):

    python tutorials/03_lora_on_armor.py [--steps 20]

1. ``prune_model`` a tiny random Llama and ``save_pretrained`` it (the base ARMOR checkpoint).
2. ``peft.get_peft_model(model, LoraConfig(target_modules=["q_proj", "v_proj"]))``.
3. Train the adapters with ``transformers.Trainer``: the loss goes down, the ARMOR weights do not move.
4. ``model.save_pretrained(adapter_dir)`` writes only the adapters; ``AutoModelForCausalLM
   .from_pretrained(base_dir)`` + ``PeftModel.from_pretrained(base, adapter_dir)`` gives the same logits.
5. ``Trainer`` on the ARMOR model *without* adapters refuses, naming
   ``torch_armor.enable_finetuning`` — which makes ``A``, ``B`` and the kept core values
   trainable (tutorial 2), after which the same ``Trainer`` trains them.

Merging the adapters into the weights (``merge_and_unload``) refuses: a dense update would
break the 2:4 core. Keep them unmerged (they cost ``2·r·d`` per layer).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Sequence

if importlib.util.find_spec("torch_armor") is None:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch.utils.data import Dataset

from torch_armor import ArmorConfig, ArmorTensor, PruneOptions, enable_finetuning, prune_model  # first: quiets torchao's import
from torch_armor.config.armor import BcdConfig

from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402
from transformers.trainer_callback import PrinterCallback  # noqa: E402

try:
    from peft import LoraConfig, PeftModel, get_peft_model
except ImportError:  # pragma: no cover - the tutorial needs the peft extra
    sys.exit("this tutorial needs PEFT: pip install peft (or pip install 'torch_armor[peft]')")


@contextlib.contextmanager
def peft_calls() -> Iterator[None]:
    """Around PEFT's ``get_peft_model`` and ``PeftModel.from_pretrained``: PEFT (0.21.2, the newest
    release) reads ``model.is_gradient_checkpointing``, an alias transformers 5 deprecated, so each call
    raised a FutureWarning that is PEFT's to fix, not the reader's. Only that warning, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def build_model(seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama (hidden 64, 2 layers, vocab 256): stands in for your pretrained model.
    ``initializer_range=0.2`` (ten times the default) so its logits are far from uniform."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                        initializer_range=0.2)).eval()


class Windows(Dataset):
    """Language-modelling examples (here random token windows: use your tokenized text)."""

    def __init__(self, ids: torch.Tensor) -> None:
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def make_trainer(model: torch.nn.Module, data: Dataset, output_dir: str, steps: int, lr: float) -> Trainer:
    """A plain ``transformers.Trainer`` (loss logged every step, not printed: read ``state.log_history``)."""
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=lr, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    return trainer


def armor_weights(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Every ArmorTensor weight as the dense matrix it stands for, by module path."""
    return {n.replace("base_model.model.", "").replace(".base_layer", ""): p.detach().dense_weight()
            for n, p in model.named_parameters() if isinstance(p, ArmorTensor)}


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Run every step, print what happens, and return the measurements (used by the tests).

    Returns ``converted_layers``, ``lora_layers``, ``trainable_parameters``, ``losses`` (LoRA, one
    per step), ``armor_unchanged``, ``reloaded_identical``, ``merge_refused``,
    ``trainer_refusal`` (the message) and ``finetune_losses`` (Trainer after ``enable_finetuning``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args([] if argv is None else list(argv))
    results: Dict[str, Any] = {}
    gen = torch.Generator().manual_seed(0)

    with tempfile.TemporaryDirectory() as tmp:
        base_dir, adapter_dir = f"{tmp}/armor-base", f"{tmp}/lora-adapters"

        # 1. prune and save the base ARMOR checkpoint ---------------------------------------------------
        model = build_model()
        vocab = model.config.vocab_size
        # a quick ARMOR (no refinement or block reconstruction): the adapters are the subject here
        prune_model(model, torch.randint(0, vocab, (8, 32), generator=gen),
                    ArmorConfig(block_size=16, optimizer=BcdConfig(iters=5), refine=None, reconstruct=None),
                    options=PruneOptions(progress=False))
        results["converted_layers"] = len(armor_weights(model))
        model.save_pretrained(base_dir)
        before = armor_weights(model)
        print(f"pruned {results['converted_layers']} linears; base checkpoint saved")

        # 2. attach LoRA adapters ------------------------------------------------------------------------
        with peft_calls():
            model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                     lora_dropout=0.0))
        lora_layers = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
        results["lora_layers"] = len(lora_layers)
        results["trainable_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"LoRA on {len(lora_layers)} ARMOR linears, {results['trainable_parameters']:,} trainable parameters")

        # 3. train the adapters with transformers.Trainer ------------------------------------------------
        data = Windows(torch.randint(0, vocab, (8, 24), generator=gen))
        trainer = make_trainer(model, data, f"{tmp}/trainer", args.steps, args.lr)
        trainer.train()
        results["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"LoRA loss {results['losses'][0]:.4f} -> {results['losses'][-1]:.4f} in {args.steps} steps")
        after = armor_weights(model)
        results["armor_unchanged"] = after.keys() == before.keys() and all(torch.equal(after[k], before[k])
                                                                             for k in before)

        # 4. save the adapters, reload them onto the base checkpoint -------------------------------------
        model.eval()
        ids = torch.randint(0, vocab, (2, 16), generator=gen)
        with torch.no_grad():
            trained = model(input_ids=ids).logits
        model.save_pretrained(adapter_dir)
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        with peft_calls():
            reloaded = PeftModel.from_pretrained(base, adapter_dir).eval()
        with torch.no_grad():
            results["reloaded_identical"] = bool(torch.equal(reloaded(input_ids=ids).logits, trained))
        print(f"base + adapters reloaded, identical logits: {results['reloaded_identical']}")
        try:
            reloaded.merge_and_unload()
            results["merge_refused"] = False
        except (ValueError, NotImplementedError) as err:
            results["merge_refused"] = True
            print(f"merge_and_unload refuses: {err}")

        # 5. Trainer without adapters: refused, then enable_finetuning ----------------------------------
        plain = AutoModelForCausalLM.from_pretrained(base_dir)
        try:
            make_trainer(plain, data, f"{tmp}/trainer2", args.steps, args.lr)
            results["trainer_refusal"] = None
        except ValueError as err:
            results["trainer_refusal"] = str(err)
            print(f"Trainer on the frozen ARMOR model refuses: {err}")
        enable_finetuning(plain)
        trainer = make_trainer(plain, data, f"{tmp}/trainer2", args.steps, args.lr / 3)
        trainer.train()
        results["finetune_losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print(f"after enable_finetuning, Trainer trains A, B and the kept values: loss "
              f"{results['finetune_losses'][0]:.4f} -> {results['finetune_losses'][-1]:.4f}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
