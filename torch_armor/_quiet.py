"""Known import noise of our dependencies, dropped only while torch_armor itself imports them:
torchao logs a warning per CUDA/MX extension it cannot load on a CPU-only build, and torch warns
that torchao registers Enum pytree constants (once per process, at the import). Only those two
messages, only from those two loggers, only inside :func:`import_torchao_quietly`; the loggers are
left exactly as they were found, and nothing is filtered once it returns."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

__all__ = ["import_torchao_quietly", "known_import_noise_dropped"]

#: (logger, fragments): a record of that logger is dropped when its message holds every fragment.
KNOWN_IMPORT_NOISE = (
    ("torchao", ("Failed to load ", "torchao", "_C_")),
    ("torch.utils._pytree", ("is an Enum subclass", "register_constant() on Enum")),
)


class _DropMessage(logging.Filter):
    """Drops the records whose message contains every one of ``fragments``."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(fragment in message for fragment in self.fragments)


@contextlib.contextmanager
def known_import_noise_dropped() -> Iterator[None]:
    """Within the block, the :data:`KNOWN_IMPORT_NOISE` records are dropped; on leaving it (an
    exception included, which passes through) each logger has the filters it had before."""
    added = [(logging.getLogger(name), _DropMessage(*fragments)) for name, fragments in KNOWN_IMPORT_NOISE]
    for logger, drop in added:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in added:
            logger.removeFilter(drop)


def import_torchao_quietly() -> None:
    """Import torchao, its quantization workflows and transformers' quantizer registry (which imports
    torchao's MX formats) with the known noise dropped: the Enum registrations warn once per
    process, at these imports, so later imports of the same modules are quiet without a filter."""
    with known_import_noise_dropped():
        import torchao.quantization  # noqa: F401  (local: inside the filters' scope)
        import transformers.quantizers.auto  # noqa: F401  (local: inside the filters' scope)
