"""Training an ARMOR model with the Hugging Face stack: PEFT LoRA adapters and ``transformers.Trainer``."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM

from conftest import make_tiny_llama
from torch_armor import ArmorConfig, ArmorTensor, PruneOptions, enable_finetuning, prune_model
from torch_armor.config.armor import BcdConfig
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.finetune import trainable_parts

peft = pytest.importorskip("peft", reason="pip install 'torch_armor[test]' (peft)")

TARGETS = ["q_proj", "v_proj"]


def pruned_llama():
    model = make_tiny_llama()
    prune_model(model, torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1)),
                ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(progress=False))
    return model


def batch():
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(2))


def lora(model):
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(model, config)


def train(model, ids, steps=5, lr=1e-2):
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.eval(), losses


def test_lora_layer_on_armor_weight_adds_the_low_rank_update(one_thread):
    model = lora(pruned_llama())
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    base = layer.get_base_layer()
    assert isinstance(base.weight, ArmorTensor)
    x = torch.randn(3, 64, dtype=torch.float64)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    w = base.weight.dense_weight(torch.float64) + layer.scaling["default"] * (b.double() @ a.double())
    # reference: the dense matrix the layer stands for, in float64
    torch.testing.assert_close(layer(x.float()).double(), x @ w.T, rtol=1e-5, atol=1e-5)


def test_lora_trains_saves_and_reloads_to_identical_logits(tmp_path, one_thread):
    model = pruned_llama()
    model.save_pretrained(tmp_path / "base")
    frozen = {n: p.detach().dense_weight() for n, p in model.named_parameters() if isinstance(p, ArmorTensor)}
    ids = batch()
    model = lora(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) == 2 * 2 * len(TARGETS)  # lora_A and lora_B of q_proj, v_proj in 2 layers
    model, losses = train(model, ids)
    assert losses[-1] < 0.8 * losses[0], losses
    after = {n.replace("base_model.model.", "").replace(".base_layer", ""): p.detach().dense_weight()
             for n, p in model.named_parameters() if isinstance(p, ArmorTensor)}
    assert after.keys() == frozen.keys() and all(torch.equal(after[n], frozen[n]) for n in frozen)
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    assert isinstance(reloaded.base_model.model.model.layers[1].self_attn.v_proj.get_base_layer().weight, ArmorTensor)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, trained)


def test_lora_merge_refuses_and_leaves_the_model_as_it_was(one_thread):
    model = lora(pruned_llama()).eval()
    ids = batch()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    with pytest.raises((ArmorInputError, NotImplementedError), match="dequantiz|cannot absorb"):
        model.merge_and_unload()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, before)
    with pytest.raises(ArmorInputError, match=r"2:4 core is fixed\); keep the adapters unmerged"):
        model.base_model.model.hf_quantizer.quantization_config.get_apply_tensor_subclass()


class Windows(Dataset):
    def __init__(self, ids):
        self.ids = ids

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer(model, tmp_path, steps=6):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=steps, per_device_train_batch_size=4,
                             learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, seed=0)
    return Trainer(model=model, args=args, train_dataset=Windows(batch()))


def losses_of(trainer_):
    return [h["loss"] for h in trainer_.state.log_history if "loss" in h]


def test_trainer_refuses_frozen_armor_model_naming_enable_finetuning(tmp_path, one_thread):
    model = pruned_llama()
    model.save_pretrained(tmp_path / "base")
    for m in (model, AutoModelForCausalLM.from_pretrained(tmp_path / "base")):
        with pytest.raises(ArmorInputError, match=r"14 ARMOR weights .* torch_armor.enable_finetuning\(model\)"):
            trainer(m, tmp_path)


def test_trainer_trains_what_enable_finetuning_makes_trainable(tmp_path, one_thread):
    model = pruned_llama()
    model.save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    enable_finetuning(model)
    for p in model.parameters():  # train the ARMOR parts only
        p.requires_grad_(False)
    parts = trainable_parts(model)
    for p in parts.values():
        p.requires_grad_(True)
    before = {n: p.detach().clone() for n, p in parts.items()}
    masks = {n: p.detach().core_dense() != 0 for n, p in model.named_parameters() if isinstance(p, ArmorTensor)}
    t = trainer(model, tmp_path)
    t.train()
    losses = losses_of(t)
    assert len(losses) == 6 and losses[-1] < 0.8 * losses[0], losses
    assert len(parts) == 3 * 14 and all(not torch.equal(before[n], p) for n, p in parts.items())
    after = {n: p.detach().core_dense() != 0 for n, p in model.named_parameters() if isinstance(p, ArmorTensor)}
    assert after.keys() == masks.keys() and all(torch.equal(after[n], masks[n]) for n in masks)  # 2:4 mask fixed

    model.eval().save_pretrained(tmp_path / "tuned")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tuned").eval()
    ids = batch()
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_trainer_trains_lora_adapters_of_an_armor_model(tmp_path, one_thread):
    model = lora(pruned_llama())
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad
              and not isinstance(p, ArmorTensor)}
    t = trainer(model, tmp_path)
    t.train()
    losses = losses_of(t)
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if n in frozen)


def test_quantizer_follows_copies_and_pickling_of_its_model(tmp_path, one_thread):
    import copy
    import io

    model = pruned_llama()
    copied = copy.deepcopy(model)
    enable_finetuning(copied)  # the copy's quantizer judges the copy, not the original
    trainer(copied, tmp_path)
    with pytest.raises(ArmorInputError, match="enable_finetuning"):
        trainer(model, tmp_path)
    buffer = io.BytesIO()
    torch.save(model, buffer)  # whole-model pickling keeps working
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    ids = batch()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
