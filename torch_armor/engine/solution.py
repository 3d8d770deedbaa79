"""What a method made of one layer (:class:`LayerSolution`), and how it is written into the module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from torch_armor.core.factors import ArmorFactors
from torch_armor.tensor.armor_tensor import armor_linear_from_factors

__all__ = ["LayerSolution"]


@dataclass
class LayerSolution:
    """What a method made of one layer: ARMOR factors, or a pruned dense weight and its mask."""

    name: str
    method: str
    factors: Optional[ArmorFactors] = None
    pruned: Optional[torch.Tensor] = None
    seconds: float = 0.0
    mask: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        if self.mask is None and self.factors is not None:
            self.mask = self.factors.mask

    def approximation(self) -> torch.Tensor:
        """The dense approximation of the weight (``A·core·B`` for ARMOR)."""
        return self.factors.dense() if self.factors is not None else self.pruned

    def apply(self, module: nn.Linear, storage: str = "dense") -> None:
        """Write the result into ``module``: an ArmorTensor weight for ARMOR (``storage`` of its
        core), the pruned weight (same dtype, device and ``requires_grad``) otherwise."""
        if self.factors is not None:
            armor_linear_from_factors(module, self.factors, storage=storage, name=self.name)
            return
        old = module.weight
        module.weight = nn.Parameter(self.pruned.to(device=old.device, dtype=old.dtype),
                                     requires_grad=old.requires_grad)
