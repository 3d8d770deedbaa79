"""The block shards of a streamed prune, checked and staged for assembly.

Assembly moves files into the output; :func:`staged_block_shards` moves hard links (copies where
links are not possible) instead, so the run directory keeps every block until the whole command
has finished: a failure while saving, or after it, is resumed by the same command.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import List

from torch_armor.errors import ArmorInputError

__all__ = ["staged_block_shards"]


def staged_block_shards(directory: Path, n_blocks: int) -> List[Path]:
    """One staged file per block ``0 .. n_blocks-1`` of ``directory``; an error if any block has none."""
    missing = [i for i in range(n_blocks) if not (directory / f"block-{i:05d}.safetensors").is_file()]
    if missing:
        raise ArmorInputError(
            f"run directory {directory.parent}: block(s) {missing[:8]} of {n_blocks} have no shard in {directory} "
            "(removed by another process?); delete the run directory and rerun the prune")
    staged = []
    for i in range(n_blocks):
        src = directory / f"block-{i:05d}.safetensors"
        dst = directory / f"staged-{i:05d}.safetensors"
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        staged.append(dst)
    return staged
