"""Text sources and token windows for calibration and evaluation.

A *source* is one of:

* ``"sotu"`` / ``"wiki"``: the local calibration / held-out texts (:mod:`torch_armor.recipes.assets`);
* a path to a text file, a directory (all ``*.txt`` inside, sorted), or a glob pattern;
* a list of strings;
* a ``datasets.Dataset`` (its ``"text"`` column, or ``text_column``);
* any other string: a Hugging Face dataset name, loaded with ``datasets.load_dataset``
  (e.g. ``load_text("wikitext", config="wikitext-2-raw-v1", split="test")``; needs hub access);
* for the window functions only: an already tokenized 1-D integer tensor.

Pieces of text are joined by ``"\\n\\n"``.

Example::

    >>> from torch_armor.recipes.data import calibration_windows
    >>> ids = torch.arange(1000)
    >>> calibration_windows(ids, None, n_windows=4, seq_len=16).shape
    torch.Size([4, 16])
"""

from __future__ import annotations

import glob as _glob
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple, Union

import torch

from torch_armor.recipes.assets import sotu_text, wiki_text
from torch_armor.errors import ArmorInputError

__all__ = ["tokenize_text", "load_text", "check_window_memory", "calibration_windows", "eval_windows"]

TextSource = Union[str, "os.PathLike[str]", Sequence[str], Any]

_GLOB_CHARS = set("*?[")


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    try:
        out = tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)
    except TypeError:  # tokenizers whose __call__ has no `verbose`
        out = tokenizer(text, add_special_tokens=add_special_tokens)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out.input_ids
    return list(ids)


def _default_adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer's default encoding (special tokens on) starts with BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    probe = "Hello"
    with_special = _encode(tokenizer, probe, add_special_tokens=True)
    plain = _encode(tokenizer, probe, add_special_tokens=False)
    return bool(with_special) and with_special[0] == bos and (not plain or plain[0] != bos)


def tokenize_text(text: str, tokenizer: Any) -> torch.Tensor:
    """Tokenize ``text`` into a 1-D ``torch.long`` tensor, the quality-protocol way.

    Encodes with ``add_special_tokens=False`` (no EOS, no chat markers), then prepends the
    BOS token only if the tokenizer's default encoding starts with one (Llama-2 style
    tokenizers do; SmolLM2's does not).

    Example::

        >>> from torch_armor.recipes.assets import smollm2_tokenizer
        >>> tokenize_text("Hello world", smollm2_tokenizer()).tolist()
        [19556, 905]
    """
    if not isinstance(text, str):
        raise ArmorInputError(
            f"text must be a str, got {type(text).__name__}; use load_text(source) to turn "
            f"files, lists or datasets into one string"
        )
    if tokenizer is None or not callable(tokenizer):
        raise ArmorInputError(
            "tokenizer must be a Hugging Face tokenizer (callable like tokenizer(text)), "
            f"got {tokenizer!r}"
        )
    ids = _encode(tokenizer, text, add_special_tokens=False)
    if _default_adds_bos(tokenizer):
        ids = [tokenizer.bos_token_id] + ids
    return torch.tensor(ids, dtype=torch.long)


def _join(pieces: Sequence[Any], what: str) -> str:
    bad = [i for i, p in enumerate(pieces) if not isinstance(p, str)]
    if bad:
        raise ArmorInputError(
            f"{what} must contain only strings, but item {bad[0]} is "
            f"{type(pieces[bad[0]]).__name__}"
        )
    if not pieces:
        raise ArmorInputError(f"{what} is empty: give at least one piece of text")
    return "\n\n".join(pieces)


def _read_utf8(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ArmorInputError(f"{path} is not UTF-8 text (byte 0x{err.object[err.start]:02x} at offset {err.start}); "
                              "give a text file, or convert it to UTF-8") from None


def _read_files(paths: Sequence[str], what: str) -> str:
    files = sorted(p for p in paths if os.path.isfile(p))
    if not files:
        raise ArmorInputError(f"no text files found for {what}; check the path or pattern")
    return "\n\n".join(_read_utf8(p) for p in files)


def _dataset_text(dataset: Any, text_column: str) -> str:
    columns = list(getattr(dataset, "column_names", None) or [])
    if text_column not in columns:
        raise ArmorInputError(
            f"the dataset has no column {text_column!r} (columns: {columns}); "
            f"pass text_column=<the column holding the text>"
        )
    return _join(list(dataset[text_column]), f"column {text_column!r} of the dataset")


def _is_dataset(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")  # a Dataset object means datasets is imported
    return datasets is not None and isinstance(obj, datasets.Dataset)


def _is_dataset_dict(obj: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(obj, (datasets.DatasetDict, datasets.IterableDatasetDict))


def load_text(
    source: TextSource,
    *,
    text_column: str = "text",
    config: Optional[str] = None,
    split: str = "train",
) -> str:
    """Turn a text source into one string (pieces joined by ``"\\n\\n"``).

    Args:
        source: ``"sotu"``, ``"wiki"``, a file / directory / glob path, a list of strings,
            a ``datasets.Dataset``, or a Hugging Face dataset name (see the module docstring).
        text_column: column holding the text, for datasets.
        config: dataset configuration, for Hugging Face dataset names (e.g.
            ``"wikitext-2-raw-v1"``).
        split: dataset split, for Hugging Face dataset names.

    Example::

        >>> load_text(["first document", "second document"])
        'first document\\n\\nsecond document'
    """
    if isinstance(source, (list, tuple)):
        return _join(list(source), "the list of texts")
    if _is_dataset(source):
        return _dataset_text(source, text_column)
    if _is_dataset_dict(source):
        raise ArmorInputError(
            f"got a DatasetDict with splits {list(source.keys())}; pick one split, "
            f"e.g. load_text(ds['test'])"
        )
    if isinstance(source, os.PathLike):
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"text source {str(path)!r} does not exist")
        source = str(path)
    if not isinstance(source, str):
        raise TypeError(
            f"cannot read text from a {type(source).__name__}; give 'sotu', 'wiki', a path, "
            f"a glob, a list of strings, a datasets.Dataset or a Hugging Face dataset name"
        )
    if source == "sotu":
        return sotu_text()
    if source == "wiki":
        return wiki_text()
    if os.path.isfile(source):
        return _read_utf8(source)
    if os.path.isdir(source):
        return _read_files(_glob.glob(os.path.join(_glob.escape(source), "*.txt")), f"directory {source!r} (*.txt)")
    if _GLOB_CHARS & set(source):
        return _read_files(_glob.glob(source, recursive=True), f"glob {source!r}")
    if not source.strip():
        raise ArmorInputError("the text source is an empty string; give a path, 'sotu', 'wiki' or a dataset name")
    return _load_hub_dataset(source, config=config, split=split, text_column=text_column)


def _load_hub_dataset(name: str, *, config: Optional[str], split: str, text_column: str) -> str:
    import datasets  # optional dependency: only for Hugging Face dataset names

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # network, unknown name, bad config: say what was tried
        raise ArmorInputError(
            f"{name!r} is not a local file, directory or glob, and loading it as a Hugging Face "
            f"dataset (config={config!r}, split={split!r}) failed: {exc}"
        ) from exc
    return _dataset_text(dataset, text_column)


def _token_ids(source: Any, tokenizer: Any, **load_kwargs: Any) -> torch.Tensor:
    if isinstance(source, torch.Tensor):
        if source.dim() != 1 or source.dtype.is_floating_point or source.dtype.is_complex:
            raise ArmorInputError(
                f"a tensor source must be 1-D integer token ids, got shape {tuple(source.shape)} "
                f"and dtype {source.dtype}"
            )
        return source.long()
    return tokenize_text(load_text(source, **load_kwargs), tokenizer)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ArmorInputError(f"{name} must be a positive integer, got {value!r}")


def check_window_memory(n_windows: int, seq_len: int, names: Tuple[str, str] = ("n_windows", "seq_len")) -> None:
    """Refuse ``n_windows`` windows of ``seq_len`` tokens whose token ids alone (8 bytes each) exceed
    this machine's memory (``names``: how the two counts are called in the message, e.g. CLI flags)."""
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):  # no sysconf (Windows): torch's index limit at least
        memory = 2**63 - 1
    if n_windows * seq_len * 8 > memory:
        raise ArmorInputError(
            f"{names[0]} {n_windows} × {names[1]} {seq_len} = {n_windows * seq_len:,} token ids, "
            f"{n_windows * seq_len * 8 / 2**30:,.0f} GiB, more than this machine's {memory / 2**30:,.0f} GiB of "
            f"memory; ask for fewer windows (e.g. {names[0]} 64)")


def calibration_windows(
    source: TextSource,
    tokenizer: Any,
    n_windows: int = 64,
    seq_len: int = 512,
    seed: int = 0,
    **load_kwargs: Any,
) -> torch.Tensor:
    """Random calibration windows, shape ``(n_windows, seq_len)``, dtype ``torch.long``.

    The text is tokenized once (:func:`tokenize_text`) into ``N`` tokens; window ``i`` starts
    at ``starts[i]`` with ``starts = torch.randint(0, N - seq_len + 1, (n_windows,),
    generator=torch.Generator().manual_seed(seed))`` (windows may overlap). Extra keyword
    arguments (``text_column``, ``config``, ``split``) go to :func:`load_text`.

    Example::

        >>> w = calibration_windows(torch.arange(100), None, n_windows=3, seq_len=10, seed=1)
        >>> bool((w[:, 1:] - w[:, :-1] == 1).all())   # each row is a contiguous slice
        True
    """
    _check_positive(n_windows=n_windows, seq_len=seq_len)
    check_window_memory(n_windows, seq_len)
    ids = _token_ids(source, tokenizer, **load_kwargs)
    n_tokens = ids.numel()
    if n_tokens < seq_len:
        raise ArmorInputError(
            f"the calibration text has {n_tokens} tokens but one window needs {seq_len}; "
            f"give more text or a smaller seq_len"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ArmorInputError(f"seed must be an integer in [0, 2**63 - 1], got {seed!r}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, n_tokens - seq_len + 1, (n_windows,), generator=generator)
    return ids[starts[:, None] + torch.arange(seq_len)]


def eval_windows(
    source: TextSource,
    tokenizer: Any,
    n_windows: int = 64,
    seq_len: int = 512,
    **load_kwargs: Any,
) -> torch.Tensor:
    """The first ``n_windows`` non-overlapping windows of the tokenized text.

    Returns shape ``(n_windows, seq_len)``, dtype ``torch.long``: row ``i`` is tokens
    ``[i*seq_len, (i+1)*seq_len)``. Extra keyword arguments go to :func:`load_text`.

    Example::

        >>> eval_windows(torch.arange(10), None, n_windows=2, seq_len=4).tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    _check_positive(n_windows=n_windows, seq_len=seq_len)
    ids = _token_ids(source, tokenizer, **load_kwargs)
    needed = n_windows * seq_len
    if ids.numel() < needed:
        raise ArmorInputError(
            f"the evaluation text has {ids.numel()} tokens but {n_windows} windows of {seq_len} "
            f"need {needed}; give more text or fewer/shorter windows "
            f"(at most {ids.numel() // seq_len} windows of {seq_len} fit)"
        )
    return ids[:needed].reshape(n_windows, seq_len).clone()
