"""End-to-end check of an installed torch_armor wheel without extras (run by .ci/wheel_check.sh).

Saves a tiny random Llama and a tokenizer trained here (no hub), prunes it with the ``torch-armor``
command, loads the output with ``from_pretrained``, generates, and evaluates it with
``torch-armor eval``. Every step's exit code is checked; a failing step prints its stderr.
"""

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

TEXT = " ".join(f"the {w} of the state is strong and the people are {v}." for w in
                ("union", "economy", "army", "budget", "nation", "future") for v in ("free", "proud", "many"))


def run(*args: str) -> str:
    proc = subprocess.run(["torch-armor", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"FAIL: torch-armor {' '.join(args)} exited {proc.returncode}\n{proc.stderr}")
    return proc.stdout


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="wheel_smoke_"))
    text = work / "text.txt"
    text.write_text(TEXT * 40)
    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.train_from_iterator([TEXT], trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=128)
    dense, out = work / "dense", work / "pruned"
    LlamaForCausalLM(config).save_pretrained(dense)
    tokenizer.save_pretrained(dense)

    run("prune", str(dense), "--out", str(out), "--calib", str(text), "--n-calib", "4", "--seq-len", "32",
        "--iters", "2", "--reconstruct-steps", "1")
    assert (out / "prune_report.json").is_file(), "prune wrote no prune_report.json"

    import torch_armor  # noqa: F401  (registers the "armor" quantization method with transformers)

    model = AutoModelForCausalLM.from_pretrained(out)
    ids = tokenizer("the union of the state", return_tensors="pt").input_ids
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, ids.shape[1] + 4), generated.shape

    line = run("eval", str(out), "--data", str(text), "--n-eval", "2", "--seq-len", "32")
    assert line.startswith("perplexity: "), line
    print(f"wheel smoke: prune, from_pretrained, generate and eval passed ({line.strip()})")


if __name__ == "__main__":
    main()
