"""The ``"armor"`` experts implementation of transformers (``ExpertsInterface``) for ARMOR experts.

transformers 5 decorates fused experts modules (``Qwen3MoeExperts``, ``MixtralExperts``, …) with
``use_experts_implementation``: their forward is looked up by ``config._experts_implementation``
(``"eager"``, ``"batched_mm"``, ``"grouped_mm"`` — the default —, …) in ``ExpertsInterface``.
``"grouped_mm"`` and ``"batched_mm"`` need the dense 3-D weight (they transpose it or gather one
copy per token), which ARMOR experts (an ``(E, out, in)`` ArmorTensor) never
materializes. Importing this module registers :func:`armor_experts_forward` as ``"armor"``: tokens
are sorted by expert once, and each expert that received tokens runs its own ARMOR factors
(``F.linear(x_e, w[e])``: ARMOR's linear, compact on CPU, 2:4 on CUDA) on exactly those tokens.
``"eager"`` runs ARMOR experts too (slower: one mask scan per expert).

:func:`prefer_armor_experts` switches a module's config to ``"armor"`` (one warning naming the
previous implementation) when ARMOR experts are installed or loaded; a model later set back to
``"grouped_mm"``/``"batched_mm"`` fails on the first forward with one line naming the fix.

Under ``torch.compile`` the per-expert loop (data-dependent token counts) runs outside the graph
(``torch.compiler.disable``); the router, attention and everything else compile. ``fullgraph=True``
is therefore not available for models with ARMOR experts.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.moe import ExpertsInterface

from torch_armor.calibration.experts import stores_in_by_out, transposed_experts

__all__ = ["ARMOR_EXPERTS", "armor_experts_forward", "prefer_armor_experts", "RUNS_ARMOR_EXPERTS"]

ARMOR_EXPERTS = "armor"
#: experts implementations that run ARMOR experts (the others need the dense 3-D weight)
RUNS_ARMOR_EXPERTS = (ARMOR_EXPERTS, "eager")
_WARNED: set = set()


def _project(self: nn.Module, x: torch.Tensor, e: int, name: str) -> torch.Tensor:
    w = getattr(self, name)[e]
    y = x @ w if stores_in_by_out(self, name) else F.linear(x, w)
    if getattr(self, "has_bias", False):
        y = y + getattr(self, f"{name}_bias")[e]
    return y


@torch.compiler.disable
def _run_experts(self: nn.Module, x_sorted: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``(S, hidden)`` outputs of every (token, expert) pair, ``x_sorted`` grouped by expert (``counts`` each)."""
    up = "gate_up_proj" if getattr(self, "has_gate", True) else "up_proj"
    out = x_sorted.new_zeros(x_sorted.shape)  # experts map hidden -> hidden
    start = 0
    for e, n in enumerate(counts.tolist()):  # one device sync for the whole loop
        if n == 0:
            continue
        h = _project(self, x_sorted.narrow(0, start, n), e, up)
        h = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
        h = _project(self, h, e, "down_proj")
        if getattr(self, "has_post_expert_norm", False):
            h = self.post_expert_norm(h)
        out[start:start + n] = h.to(out.dtype)
        start += n
    return out


def armor_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """Experts forward that runs each hit expert's weights (ARMOR or dense) on its routed tokens only.

    Same contract as transformers' experts forwards: ``hidden_states (T, hidden)``, ``top_k_index`` /
    ``top_k_weights (T, k)``; returns ``(T, hidden)``. Expert-parallel sentinels (ids ``>= E``) are dropped. ARMOR experts are ``(E, out, in)``; a
    transposed module's dense ones (gpt-oss) ``(E, in, out)``.
    """
    num_experts = self.down_proj.shape[0]
    num_top_k = top_k_index.shape[-1]
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)
    token_of = order // num_top_k
    valid = expert_ids[order] < num_experts
    ones = torch.ones_like(expert_ids)  # scatter_add, not bincount: a static (E + 1,) shape for torch.compile
    counts = expert_ids.new_zeros(num_experts + 1).scatter_add_(0, expert_ids.clamp(max=num_experts), ones)[:num_experts]
    outputs = _run_experts(self, hidden_states[token_of], counts)
    weights = top_k_weights.reshape(-1)[order].masked_fill(~valid, 0).unsqueeze(-1)
    final = torch.zeros_like(hidden_states)
    return final.index_add_(0, token_of, (outputs * weights).to(final.dtype))


def prefer_armor_experts(module: nn.Module, name: Optional[str] = None, quiet_default: bool = False) -> None:
    """Set ``module.config._experts_implementation`` to ``"armor"`` unless it already runs ARMOR experts
    (``"armor"``; ``"eager"`` except in a transposed module such as gpt-oss's), with one warning per previous implementation (none for transformers'
    default ``"grouped_mm"`` when ``quiet_default``: loading an ARMOR checkpoint). No-op without a config."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_experts_implementation"):
        return
    current = config._experts_implementation
    # a transposed module's own eager forward computes x @ w[e], which an ARMOR expert does not run
    if current == ARMOR_EXPERTS or (current == "eager" and not transposed_experts(module)):
        return
    config._experts_implementation = ARMOR_EXPERTS
    if current not in _WARNED and not (quiet_default and current in (None, "grouped_mm")):
        _WARNED.add(current)
        warnings.warn(
            f"{name or type(module).__name__}: experts_implementation {current!r} needs dense 3-D expert weights; "
            f"switched the model to {ARMOR_EXPERTS!r} (each expert's ARMOR factors on its routed tokens). "
            "Pass experts_implementation='armor' yourself to silence this", UserWarning, stacklevel=3)


ExpertsInterface.register(ARMOR_EXPERTS, armor_experts_forward)
