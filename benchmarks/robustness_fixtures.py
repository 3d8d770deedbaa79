"""Shared fixtures of issue #25's robustness cases (``robustness_untrusted.py``, ``robustness_runs.py``):
tiny random Llamas saved in the formats a user meets, crafted copies of them, subprocess helpers."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
STATE: dict = {}


def tmp_dir() -> Path:
    if "tmp" not in STATE:
        STATE["tmp"] = Path(tempfile.mkdtemp(prefix="armor_i25_"))
    return Path(tempfile.mkdtemp(dir=STATE["tmp"]))


def tree_hash(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def calib_ids(vocab: int = 128, n: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab, (n, 16), generator=torch.Generator().manual_seed(0))


def armor_cfg():
    from torch_armor import ArmorConfig
    from torch_armor.config.armor import BcdConfig

    return ArmorConfig(block_size=16, optimizer=BcdConfig(iters=1))


def pruned_model():
    from conftest import make_tiny_llama
    from torch_armor import PruneOptions, prune_model

    model = make_tiny_llama()
    prune_model(model, calib_ids(), armor_cfg(), options=PruneOptions(progress=False))
    return model


def hf_dir() -> Path:
    """A pruned tiny Llama written by transformers' ``model.save_pretrained`` (a fresh copy per call)."""
    if "hf" not in STATE:
        d = tmp_dir() / "hf"
        pruned_model().save_pretrained(d)
        STATE["hf"] = d
    dst = tmp_dir() / "m"
    shutil.copytree(STATE["hf"], dst)
    return dst


def dense_dir(shards: bool = False) -> Path:
    from conftest import make_tiny_llama

    d = tmp_dir() / "dense"
    make_tiny_llama().save_pretrained(d, max_shard_size="60KB" if shards else "1GB")
    return d


def edit_qc(d: Path, fn) -> Path:
    from _helpers import edit_checkpoint  # tests/_helpers.py

    return edit_checkpoint(d, quantization_config=fn)


def first_layer(q: dict) -> str:
    return sorted(q["layers"])[0]


def edit_tensors(d: Path, fn) -> Path:
    from _helpers import edit_checkpoint  # tests/_helpers.py

    return edit_checkpoint(d, tensors=fn)


def load_checked(d: Path, **kwargs):
    """load_pretrained, then the case's own check: every weight finite and equal to the saved model's."""
    from torch_armor import load_pretrained

    return load_pretrained(d, **kwargs)


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12)[None] % 128).logits


def reference_logits() -> torch.Tensor:
    if "ref" not in STATE:
        from torch_armor import load_pretrained

        hf_dir()
        STATE["ref"] = logits_of(load_pretrained(STATE["hf"]))
    return STATE["ref"]


def loads_wrong(d: Path, check, **kwargs) -> None:
    """Load a damaged directory; if it loads, the logits must equal the undamaged model's (else silent wrong)."""
    ref = reference_logits()
    model = load_checked(d, **kwargs)
    got = logits_of(model)
    check(bool(torch.isfinite(got).all()) and torch.allclose(got, ref, atol=1e-4), "loaded, logits differ from the saved model")


def index_edit(d: Path, name) -> Path:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    index["weight_map"][key] = name
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def stream(d: Path, check, check_kept):
    from torch_armor import MagnitudeConfig, PruneOptions, prune_model

    out = d.parent / "out"
    prune_model(str(d), calib_ids(), MagnitudeConfig(), options=PruneOptions(out=out, progress=False))
    check(False, "a damaged checkpoint was pruned")


def subprocess_env(code: Path) -> dict:
    return dict(os.environ, PYTHONPATH=f"{code}{os.pathsep}{ROOT / 'tests'}", OMP_NUM_THREADS="1")


PRUNE_SCRIPT = """
import sys, torch
torch.set_num_threads(1)
from torch_armor import ArmorConfig, PruneOptions, prune_model
from torch_armor.config.armor import BcdConfig
model, run_dir, out = sys.argv[1:4]
calib = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(0))
prune_model(model, calib, ArmorConfig(block_size=16, optimizer=BcdConfig(iters=2)), options=PruneOptions(run_dir=None if run_dir == "-" else run_dir,
            out=out, progress=False))
"""


def wait_for(pred, proc, timeout=300.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        if proc.poll() is not None:
            return pred()
        time.sleep(0.02)
    return False


def torch_save_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.randn(2, 2)}, buf)
    return buf.getvalue()


def past_end(data: bytes) -> bytes:
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    key = next(k for k in sorted(header) if k != "__metadata__")
    header[key]["data_offsets"][1] += 1 << 20
    text = json.dumps(header).encode()
    text += b" " * ((-len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data[8 + n:]


def pruned_mlp_template():
    return pruned_model().model.layers[0].mlp


def tokenizer_dir() -> Path:
    if "tok" not in STATE:
        from torch_armor.recipes.assets import smollm2_tokenizer

        d = tmp_dir() / "tok"
        smollm2_tokenizer().save_pretrained(str(d))
        STATE["tok"] = d
    return STATE["tok"]


def text_file() -> Path:
    if "text" not in STATE:
        p = tmp_dir() / "calib.txt"
        p.write_text(" ".join(f"Line {i} about the weather, the harvest and the budget." for i in range(300)))
        STATE["text"] = p
    return STATE["text"]


def tokenized_model(layers: int) -> Path:
    """A random Llama with SmolLM2's vocabulary and tokenizer, ``layers`` blocks (fresh directory)."""
    key = f"model{layers}"
    if key not in STATE:
        from transformers import LlamaConfig, LlamaForCausalLM

        from torch_armor.recipes.assets import smollm2_tokenizer

        tok = smollm2_tokenizer()
        cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256)
        torch.manual_seed(0)
        d = tmp_dir() / "model"
        LlamaForCausalLM(cfg).save_pretrained(str(d))
        shutil.copytree(tokenizer_dir(), d, dirs_exist_ok=True)
        STATE[key] = d
    dst = tmp_dir() / "model"
    shutil.copytree(STATE[key], dst)
    return dst


def cleanup() -> None:
    if "tmp" in STATE:
        shutil.rmtree(STATE["tmp"], ignore_errors=True)
