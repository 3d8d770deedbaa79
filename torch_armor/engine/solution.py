"""What a method made of one layer (:class:`LayerSolution`) and how the run store keeps it
(:class:`StoredSolution`): the engine carries both and reads neither, the method that made them does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from torch import nn

__all__ = ["LayerSolution", "StoredSolution"]


@dataclass
class LayerSolution:
    """What a method made of one layer: its ``payload`` (opaque to the engine: a one-shot method's
    pruned dense weight, ARMOR's factors), the seconds it took, the keep-mask, and the
    :class:`~torch_armor.engine.methods.Method` that made it and reads the payload."""

    name: str
    method: Any
    payload: Any
    seconds: float = 0.0
    mask: Optional[torch.Tensor] = None

    def approximation(self) -> torch.Tensor:
        """The dense approximation of the weight (``A·core·B`` for ARMOR)."""
        return self.method.approximation(self.payload)

    def apply(self, module: nn.Linear, storage: str = "dense") -> None:
        """Write the result into ``module`` (``storage``: of an ARMOR weight's core)."""
        self.method.apply_solution(self, module, storage)


@dataclass(frozen=True)
class StoredSolution:
    """A solution as the run store writes it: its tensors, the text fields of the layer file's header
    that :meth:`~torch_armor.engine.methods.Method.from_store` reads back, and the JSON-able fields of
    the layer's manifest entry (for a reader of the manifest; ``device``: where its tensors are)."""

    tensors: Dict[str, torch.Tensor]
    header: Dict[str, str]
    summary: Dict[str, Any]
