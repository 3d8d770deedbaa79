"""The baselines as methods of the engine: magnitude, Wanda, SparseGPT and NoWag-P, each one layer's
code registered with its config type (:func:`~torch_armor.engine.methods.register_method`); the engine's
default hooks (every layer solved on its own) are all they need.

Example::

    >>> from torch_armor.engine.methods import method_for
    >>> method_for(WandaConfig()).label, method_for(SparseGPTConfig()).needs_xtx(SparseGPTConfig())
    ('Wanda', True)
"""

from __future__ import annotations

from typing import Any

import torch

from torch_armor.core import baselines
from torch_armor.config.methods import MagnitudeConfig, NoWagConfig, SparseGPTConfig, WandaConfig
from torch_armor.core.proxy import nowag_prune
from torch_armor.engine.methods import Result, act_sq_norm_for, register_method, xtx_of
from torch_armor.errors import ArmorInputError

__all__: list = []  # nothing to import: the registrations are the module's work


@register_method(MagnitudeConfig, needs_statistics=False)
def _magnitude(weight: torch.Tensor, stats: Any, config: MagnitudeConfig, name: str = "") -> Result:
    return baselines.magnitude_prune(weight, config.pattern)


@register_method(WandaConfig, label="Wanda")
def _wanda(weight: torch.Tensor, stats: Any, config: WandaConfig, name: str = "") -> Result:
    return baselines.wanda_prune(weight, act_sq_norm_for(stats, weight), config.pattern)


@register_method(SparseGPTConfig, label="SparseGPT", needs_xtx=True,
                 describe=lambda config: f"block {config.block_size}, damp {config.damp:g}")
def _sparsegpt(weight: torch.Tensor, stats: Any, config: SparseGPTConfig, name: str = "") -> Result:
    xtx = xtx_of(stats)
    if xtx is None:
        raise ArmorInputError(f"layer {name!r}: SparseGPT needs XᵀX statistics (calibrate with track_xtx=True)")
    return baselines.sparsegpt_prune(weight, xtx.to(weight.device), config.pattern, block_size=config.block_size,
                                     damp=config.damp)


@register_method(NoWagConfig, label="NoWag-P", minimises_proxy=True)
def _nowag(weight: torch.Tensor, stats: Any, config: NoWagConfig, name: str = "") -> Result:
    return nowag_prune(weight, act_sq_norm_for(stats, weight), config.pattern)
