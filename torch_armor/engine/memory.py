"""Keep the C heap from growing while a checkpoint is streamed block by block (glibc only).

glibc's ``malloc`` raises its mmap threshold every time a large mmapped chunk is freed (up to
32 MiB on 64-bit): after the first block is released, later tensors of that size (a 2048×2048 fp32
projection, a batch of hidden states) come from the heap instead, and freed heap memory is rarely
returned to the system. Streaming a 22-block model then grew the resident set by about two such
tensors per block (+0.7 GB at the end). :func:`fix_mmap_threshold` pins the threshold (large
tensors are always mmapped, so ``free`` gives them back at once) and :func:`trim` returns free heap
pages (e.g. the tokenizer's temporaries). Elsewhere (other C libraries, other systems) both do
nothing.

Pinning has a price: every large tensor then arrives as fresh pages, each zeroed by the kernel on its
first touch. Streaming SmolLM2-135M, that was 37% more CPU time (sys 56 s against 11 s for two
blocks; ``benchmarks/stream_cost.py``), while what the heap keeps (about 15% of the checkpoint above)
matters only when the checkpoint is a real share of the memory. :func:`pin_needed` says when.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Optional

__all__ = ["fix_mmap_threshold", "trim", "pin_needed", "available_memory", "PIN_SHARE"]

_M_MMAP_THRESHOLD = -3  # mallopt parameter number in glibc's malloc.h
MMAP_THRESHOLD = 1 << 20
PIN_SHARE = 0.1  # pin when the checkpoint is more than this share of the available memory


@functools.lru_cache(maxsize=1)
def _glibc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None  # glibc has both


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> bool:
    """Serve every allocation of ``nbytes`` or more by its own mmap (and stop glibc from raising
    that threshold); returns whether it was applied."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, int(nbytes)))


def trim() -> bool:
    """Give free heap memory back to the system (``malloc_trim(0)``); returns whether any was."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


def pin_needed(checkpoint_bytes: int, available_bytes: Optional[int]) -> bool:
    """Whether a streamed run should pin the mmap threshold (:func:`fix_mmap_threshold`): when the
    checkpoint is more than :data:`PIN_SHARE` of the available memory, or that is unknown. Below it,
    what the heap keeps is at most a few percent of the memory, not worth the page faults.

    Example::

        >>> pin_needed(538_000_000, 22_000_000_000), pin_needed(4_700_000_000, 22_000_000_000)
        (False, True)
    """
    return available_bytes is None or checkpoint_bytes > PIN_SHARE * available_bytes


def available_memory() -> Optional[int]:
    """The system's ``MemAvailable`` in bytes (Linux); ``None`` where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
