"""A tiny random Llama with a tokenizer trained here, saved as a Hugging Face directory.

Needs nothing outside the package's required dependencies (no GGUF, no text packages), so the
tests built on it run in an environment installed without extras.
"""

from __future__ import annotations

from pathlib import Path

TEXT = " ".join(f"the {w} of the state is strong and the people are {v}." for w in
                ("union", "economy", "army", "budget", "nation", "future") for v in ("free", "proud", "many"))


def save_tiny_model(folder: Path) -> Path:
    """Write the model and tokenizer to ``folder/model`` and a text file to ``folder/text.txt``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128)
    model_dir = folder / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    (folder / "text.txt").write_text(TEXT * 40)
    return model_dir


def fast_prune_args(folder: Path, method: str = "armor") -> list:
    """``torch-armor prune`` options that prune the model of :func:`save_tiny_model` in about a second: its
    text, 2 windows of 32 tokens, block size 16, 2 sweeps, no refinement or reconstruction, one thread,
    streamed block by block (what a checkpoint too large for memory gets; the tiny one would load whole)
    (for another ``method``, without the ARMOR options: the command line refuses them)."""
    from torch_armor.cli.flags import METHOD_FLAGS, applies_to

    armor = {"--block-size": "16", "--iters": "2", "--reconstruct-steps": "0", "--refine": "none"}
    given = [[flag, value] for flag, value in armor.items() if flag not in METHOD_FLAGS or method in applies_to(flag)]
    return ["--calib", str(folder / "text.txt"), "--n-calib", "2", "--seq-len", "32", *sum(given, []), "--threads",
            "1", "--no-progress", "--stream"]
