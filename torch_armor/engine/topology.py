"""Where this process stands in a ``torchrun`` job: :class:`Topology`, :func:`init_distributed`,
:func:`launched_world_size`, :func:`launched_rank`.

Without ``torchrun`` (no ``WORLD_SIZE``) everything runs in one process; with it, the process group is
created from the environment (CPU: gloo; CUDA: NCCL, one GPU per rank).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.distributed as dist

from torch_armor.errors import ArmorInputError

__all__ = ["Topology", "init_distributed", "launched_world_size", "launched_rank", "DEFAULT_TIMEOUT"]

#: Process-group timeout when this module creates the group: ranks wait at the final
#: collective while the slowest rank finishes its share, which can take hours.
DEFAULT_TIMEOUT = datetime.timedelta(hours=24)


@dataclass(frozen=True)
class Topology:
    """Where this process stands: ``rank`` of ``world_size`` (``local_rank`` on its node);
    ``initialized_here``: :func:`init_distributed` created the process group."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    initialized_here: bool = False


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ArmorInputError(f"environment variable {name}={value!r} is not an integer") from None


def launched_world_size() -> int:
    """How many ranks this process belongs to: the process group's size, else ``$WORLD_SIZE``
    (set by ``torchrun``), else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return max(1, _env_int("WORLD_SIZE", 1))


def launched_rank() -> int:
    """This process's rank: the process group's, else ``$RANK`` (set by ``torchrun``), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return max(0, _env_int("RANK", 0))
    except ValueError:
        return 0


def init_distributed(
    backend: Optional[str] = None,
    *,
    device: Optional[Union[str, torch.device]] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> Topology:
    """Join the process group ``torchrun`` describes, or report a single process.

    An initialized group is used as is. Otherwise, if ``WORLD_SIZE > 1`` (set by ``torchrun``),
    a group is created from the environment (``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):
    ``backend`` ``None`` picks NCCL when ``device`` is a CUDA device (each rank then uses GPU
    ``LOCAL_RANK``) and gloo otherwise.

    Example::

        >>> init_distributed()  # a plain process
        Topology(rank=0, world_size=1, local_rank=0, initialized_here=False)
    """
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank()
        return Topology(rank, dist.get_world_size(), _env_int("LOCAL_RANK", rank), False)
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return Topology()
    if not dist.is_available():
        raise ArmorInputError(f"WORLD_SIZE={world} but this PyTorch build has no torch.distributed; run one process")
    rank, local = _env_int("RANK", -1), _env_int("LOCAL_RANK", -1)
    if rank < 0 or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        raise ArmorInputError(
            f"WORLD_SIZE={world} is set but RANK, MASTER_ADDR or MASTER_PORT is not: launch with "
            "`torchrun --nproc-per-node N ...`, or unset WORLD_SIZE to run one process"
        )
    local = rank if local < 0 else local
    on_cuda = device is not None and torch.device(device).type == "cuda"
    if backend is None:
        backend = "nccl" if on_cuda and torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise ArmorInputError("backend 'nccl' needs CUDA; use backend='gloo' on CPU")
        torch.cuda.set_device(local % torch.cuda.device_count())
    dist.init_process_group(backend=backend, timeout=timeout)
    return Topology(rank, world, local, True)
