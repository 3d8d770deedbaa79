"""Known import noise of our dependencies, silenced narrowly: torchao logs a warning per CUDA/MX
extension it cannot load on a CPU-only build, and torch warns that torchao registers Enum pytree
constants. Only those two messages, only from those two loggers; everything else they log shows.
Importing this module installs the filters (idempotent)."""

from __future__ import annotations

import importlib
import logging

__all__ = ["import_torchao_quietly"]


class _DropMessage(logging.Filter):
    """Drops the records of one logger whose message contains every one of ``fragments``."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(fragment in message for fragment in self.fragments)


def _quiet_known_noise() -> None:
    # torchao logs a warning per CUDA/MX extension it cannot load on a CPU-only build, and torch
    # warns that torchao registers Enum pytree constants: noise for our users, whenever torchao
    # (or transformers, which imports it) is imported after torch_armor. Only these two messages,
    # only from these two loggers; everything else they log still shows.
    for logger, fragments in (("torchao", ("Failed to load ", "torchao", "_C_")),
                              ("torch.utils._pytree", ("is an Enum subclass", "register_constant() on Enum"))):
        target = logging.getLogger(logger)
        if not any(isinstance(f, _DropMessage) and f.fragments == fragments for f in target.filters):
            target.addFilter(_DropMessage(*fragments))


def import_torchao_quietly() -> None:
    """torchao, its quantization workflows and transformers' quantizer registry, imported with the
    filters in place (the Enum registrations warn once per process: take that once, quietly)."""
    _quiet_known_noise()
    import torchao  # noqa: F401  (local: only once the filters above are in place)
    import torchao.quantization  # noqa: F401  (local, as above)

    import transformers.quantizers.auto  # noqa: F401  (local, as above)

    # transformers imports these from its torchao integration; import them now, while our
    # filters are in place, so that they register once, quietly
    for extra in ("torchao.prototype.mx_formats", "torchao.quantization.quantize_.common"):
        try:
            importlib.import_module(extra)
        except Exception:  # noqa: BLE001 - optional parts of torchao
            pass


_quiet_known_noise()
