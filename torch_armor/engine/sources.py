"""Where the engine's decoder blocks come from and where finished ones go.

:class:`BlockSource` is what :class:`~torch_armor.engine.blocks.BlockPipeline` reads blocks from:
:class:`InMemory` (a model already in memory, pruned in place) or :class:`Streamed` (a local
checkpoint built on the meta device, one block materialized at a time). :class:`BlockSink` is
where finished blocks go: :class:`ShardWriter` writes each streamed block to its own safetensors
shard and assembles the checkpoint at the end.

Example::

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 4))
    >>> source = InMemory(model)
    >>> source.load_block("0") is model[0], isinstance(source, BlockSource)
    (True, True)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, List, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import nn

from torch_armor.engine.shard_files import staged_block_shards
from torch_armor.engine import memory
from torch_armor.engine.checkpoint import LazyCheckpoint
from torch_armor.engine.identity import hash_model
from torch_armor.errors import ArmorInputError
from torch_armor.format.serialization import (ARMOR_CONFIG_NAME, assemble_checkpoint, has_armor_quantization_config,
                                              save_shard)

__all__ = ["BlockSource", "BlockSink", "InMemory", "Streamed", "ShardWriter", "is_streamable_checkpoint",
           "group_keys", "REST_SHARD_BYTES"]

PathLike = Union[str, "os.PathLike[str]"]

#: The weights outside the decoder blocks are written in shards of at most this many bytes
#: (one larger tensor — embeddings, lm_head — alone in its own).
REST_SHARD_BYTES = 64 << 20


@runtime_checkable
class BlockSource(Protocol):
    """A model whose decoder blocks the engine loads one at a time."""

    model: nn.Module

    def prepare_inputs(self) -> None:
        """Make what runs before the first block (embeddings, rotary tables) usable."""

    def release_inputs(self) -> None:
        """Free what :meth:`prepare_inputs` loaded."""

    def load_block(self, prefix: str) -> nn.Module:
        """The decoder block ``prefix`` (e.g. ``"model.layers.3"``) with its weights."""

    def release_block(self, prefix: str) -> None:
        """Free a finished block's weights (if they can be read again)."""

    def content_hash(self) -> str:
        """A hash of every weight: a run directory of other weights is refused."""


@runtime_checkable
class BlockSink(Protocol):
    """Where finished decoder blocks go (rank 0 only)."""

    def write(self, index: int, prefix: str, block: nn.Module) -> None:
        """Keep finished block ``index``."""

    def done(self, index: int) -> bool:
        """Whether block ``index`` was kept by an earlier, interrupted run."""


class InMemory:
    """A model already in memory: every block is there; pruned in place, and each block goes back to
    the device it was on (pruning on a GPU returns a CPU model on the CPU)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.homes: dict = {}

    def prepare_inputs(self) -> None:
        pass

    def release_inputs(self) -> None:
        pass

    def load_block(self, prefix: str) -> nn.Module:
        block = self.model.get_submodule(prefix)
        self.homes[prefix] = next((p.device for p in block.parameters() if p.device.type != "meta"), None)
        return block

    def release_block(self, prefix: str) -> None:
        home = self.homes.pop(prefix, None)
        if home is not None:
            self.model.get_submodule(prefix).to(home)

    def content_hash(self) -> str:
        return hash_model(self.model)


class Streamed:
    """A local checkpoint built on the meta device; one block materialized at a time.

    Args:
        path: a local Hugging Face directory (``config.json`` and safetensors weights; not one
            torch_armor pruned: refused). Otherwise :class:`~torch_armor.engine.checkpoint.LazyCheckpoint`
            says what is missing.
        dtype: load the weights in this dtype (default: as stored).
    """

    def __init__(self, path: PathLike, dtype: Optional[torch.dtype] = None) -> None:
        p = Path(path)
        if (p / ARMOR_CONFIG_NAME).exists() or has_armor_quantization_config(p):
            raise ArmorInputError(f"{p} is already pruned by torch_armor; prune the original dense checkpoint")
        self.checkpoint = LazyCheckpoint(path, dtype=dtype)
        stored = sum(self.checkpoint.nbytes(key) for key in self.checkpoint.keys())
        if memory.pin_needed(stored, memory.available_memory()):  # process-wide: freed blocks go back at once
            memory.fix_mmap_threshold()
        memory.trim()  # e.g. the tokenizer's temporaries
        self.model = self.checkpoint.model

    def prepare_inputs(self) -> None:
        self.checkpoint.materialize_non_decoder()

    def release_inputs(self) -> None:
        self.checkpoint.release_non_decoder()

    def load_block(self, prefix: str) -> nn.Module:
        return self.checkpoint.materialize(prefix)

    def release_block(self, prefix: str) -> None:
        self.checkpoint.release(prefix)
        memory.trim()

    def content_hash(self) -> str:
        return self.checkpoint.content_hash()


def is_streamable_checkpoint(path: PathLike) -> bool:
    """A local Hugging Face directory with ``config.json`` and safetensors weights (not an ARMOR one)."""
    p = Path(path)
    return (p.is_dir() and (p / "config.json").is_file() and not (p / ARMOR_CONFIG_NAME).exists()
            and not has_armor_quantization_config(p) and any(p.glob("*.safetensors")))


class ShardWriter:
    """Finished blocks of a streamed model, one safetensors shard each, assembled at the end."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def path(self, index: int) -> Path:
        return self.directory / f"block-{index:05d}.safetensors"

    def write(self, index: int, prefix: str, block: nn.Module) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        save_shard(self.path(index), block, prefix=prefix + ".")

    def done(self, index: int) -> bool:
        return self.path(index).is_file()

    def finish(self, source: Streamed, blocks_prefix: str, out: Path) -> None:
        """Write the weights outside the blocks and move every shard into the checkpoint ``out``."""
        checkpoint = source.checkpoint
        rest_keys = [k for k in checkpoint.keys() if not k.startswith(blocks_prefix + ".")]
        rest = []  # one shard per large tensor (embeddings, lm_head): never two of them in memory
        for j, keys in enumerate(group_keys(rest_keys, checkpoint.nbytes, REST_SHARD_BYTES)):
            rest.append(self.directory / f"rest-{j:05d}.safetensors")
            save_shard(rest[-1], checkpoint.read_tensors(keys))
        # every block index needs its own file: a missing one is an error, never a silently random block
        shards = staged_block_shards(self.directory, len(checkpoint.model.get_submodule(blocks_prefix))) + rest
        model = checkpoint.model
        assemble_checkpoint(out, shards, hf_config=getattr(model, "config", None),
                            model_class=f"{type(model).__module__}.{type(model).__qualname__}")


def group_keys(keys: Sequence[str], nbytes: Callable[[str], int], limit: int) -> List[List[str]]:
    """Consecutive keys in groups of at most ``limit`` bytes (a larger tensor alone in its group).

    Example::

        >>> group_keys(["a", "b", "c", "d"], {"a": 1, "b": 9, "c": 1, "d": 1}.get, 4)
        [['a'], ['b'], ['c', 'd']]
    """
    groups: List[List[str]] = []
    size = limit + 1
    for k in keys:
        n = nbytes(k)
        if size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += n
    return groups
