"""Block reconstruction's trainable tensors and the weights built from them.

Each linear's factors become three leaves: ``A``'s blocks, the *kept* core values (a 1-D tensor,
half the core for 2:4 — the dropped values never get a gradient, an Adam state or a copy) and
``B``'s blocks. An ``nn.Linear`` with factors runs ``F.linear(x, Ŵ, bias)``, ``Ŵ = A · scatter(mask,
values) · B``, as one checkpointed function (:class:`FactoredLinears`): the graph keeps the input
and the leaves, and ``Ŵ`` is rebuilt in the backward pass (torch's non-reentrant checkpoint stops
recomputing once ``Ŵ`` exists, before the matmul), so no weight-sized tensor of any linear waits
there. Other weights (fused experts) are built as tensors for ``functional_call``
(:func:`build_weights`), checkpointed so the graph keeps ``Ŵ`` and not the products that build it.

Names: a factor named ``f"{P}.{e}"`` where ``P`` is a fused experts parameter of the block (3-D, or
DBRX's flat 2-D ``w1``/``v1``/``w2``) is expert ``e``'s ``(out, in)`` layer of ``P``, and ``P`` is built as
the stack of the experts' ``Ŵ``, put in the module's own layout (:func:`expert_layouts`: transposed for
gpt-oss and DBRX's ``w2``, flattened to ``(E·rows, cols)`` for DBRX); any other factor ``n`` gives ``n.weight``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torch_armor.calibration.experts import flat_experts_count, out_in_shape, stores_in_by_out
from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.packing import scatter_groups

__all__ = ["FactorLeaves", "FactoredLinears", "weight_names", "build_weights", "expert_layouts", "kept_index",
           "scatter_core"]


def kept_index(mask: torch.Tensor) -> torch.Tensor:
    """Where a core's kept entries are, in row-major order (the order of ``masked_select``):
    ``uint8 (rows, groups, n)`` positions within each group of ``m`` columns when every group keeps
    ``n`` (an ``n:m`` mask: a byte per kept entry), else their flat indices (int32 where they fit)."""
    rows, cols = mask.shape
    for m in (4, 2, 8, 16, 32):
        if cols % m == 0:
            counts = mask.reshape(rows, cols // m, m).sum(-1)
            n = int(counts.reshape(-1)[0]) if counts.numel() else 0
            if n and bool((counts == n).all()):
                return mask.reshape(rows, cols // m, m).nonzero()[:, 2].to(torch.uint8).reshape(rows, cols // m, n)
    flat = mask.reshape(-1).nonzero().squeeze(1)
    return flat.to(torch.int32) if mask.numel() <= torch.iinfo(torch.int32).max else flat


def scatter_core(values: torch.Tensor, index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The core of ``shape`` with ``values`` at :func:`kept_index`'s places and zeros elsewhere: the
    bits of ``masked_scatter`` (and of ``masked_select`` for the gradient), several times faster on a CPU."""
    if index.dtype == torch.uint8:
        return scatter_groups(values, index.long(), shape[-1] // index.shape[1])
    return values.new_zeros(shape.numel()).scatter(0, index.long(), values).reshape(shape)


def _product(a: torch.Tensor, values: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
             shape: torch.Size) -> torch.Tensor:
    return block_diag_right(block_diag_left(a, scatter_core(values, index, shape)), b)


def _linear(x: torch.Tensor, a: torch.Tensor, values: torch.Tensor, b: torch.Tensor, index: torch.Tensor,
            shape: torch.Size, bias: Optional[torch.Tensor]) -> torch.Tensor:
    return F.linear(x, _product(a, values, b, index, shape), bias)


class FactorLeaves:
    """One linear's trainable tensors (fp32, contiguous, on ``device``) and its fixed mask, kept as
    :func:`kept_index` (for 2:4, a byte per kept entry)."""

    def __init__(self, factors: ArmorFactors, device: torch.device) -> None:
        mask = factors.mask.to(device=device, dtype=torch.bool)
        self.shape = mask.shape
        self.index = kept_index(mask)
        # contiguous copies: factors fresh from the optimizer may be views (e.g. transposed), and the
        # strides pick the kernels — a resumed run reads contiguous copies and must get the same bits
        core = factors.core.detach().to(device=device, dtype=torch.float32)
        self.tensors = [factors.a_blocks.detach().to(device=device, dtype=torch.float32)
                        .clone(memory_format=torch.contiguous_format),
                        core.masked_select(mask),
                        factors.b_blocks.detach().to(device=device, dtype=torch.float32)
                        .clone(memory_format=torch.contiguous_format)]
        for t in self.tensors:
            t.requires_grad_(True)

    def weight(self, grad: bool) -> torch.Tensor:
        """``Ŵ`` (checkpointed when ``grad``; a plain tensor without a graph otherwise)."""
        a, values, b = self.tensors
        if not grad:
            with torch.no_grad():
                return _product(a, values, b, self.index, self.shape)
        return checkpoint(_product, a, values, b, self.index, self.shape, use_reentrant=False)

    def linear(self, x: torch.Tensor, bias: Optional[torch.Tensor], train: bool) -> torch.Tensor:
        """``F.linear(x, Ŵ, bias)``; where autograd records, one checkpointed function whose graph
        keeps ``x`` and the leaves (``Ŵ`` is rebuilt in the backward pass). ``train``: whether the
        leaves get gradients (the input always does)."""
        a, values, b = self.tensors if train else [t.detach() for t in self.tensors]
        if not torch.is_grad_enabled():
            return _linear(x, a, values, b, self.index, self.shape, bias)
        return checkpoint(_linear, x, a, values, b, self.index, self.shape, bias, use_reentrant=False)

    @property
    def mask(self) -> torch.Tensor:
        """The kept entries, as a boolean tensor of the core's shape."""
        return scatter_core(torch.ones(self.tensors[1].shape, device=self.index.device), self.index,
                            self.shape).bool()

    def snapshot(self) -> List[torch.Tensor]:
        return [t.detach().clone() for t in self.tensors]

    def factors(self, like: ArmorFactors, values: Optional[List[torch.Tensor]] = None) -> ArmorFactors:
        """``like`` with these leaves (or the snapshot ``values``) as its ``A``, core and ``B``."""
        a, kept, b = values if values is not None else [t.detach() for t in self.tensors]
        core = scatter_core(kept, self.index, self.shape)
        return dataclasses.replace(like, a_blocks=a.to(like.a_blocks.device, like.a_blocks.dtype),
                                   core=core.to(like.core.device, like.core.dtype),
                                   b_blocks=b.to(like.b_blocks.device, like.b_blocks.dtype))


def weight_names(block: nn.Module, names: Mapping[str, object]) -> Dict[str, List[str]]:
    """``{parameter of block: the factor names that build it, in order}``: ``P`` from
    ``P.0 … P.{E-1}`` for a 3-D parameter ``P`` (every expert must be there), ``n.weight`` from ``n``."""
    params = dict(block.named_parameters())
    out: Dict[str, List[str]] = {}
    experts: Dict[str, Dict[int, str]] = {}
    for name in names:
        head, _, tail = name.rpartition(".")
        if tail.isdigit() and head in params and (params[head].dim() == 3 or flat_experts_count(
                block.get_submodule(head.rpartition(".")[0])) is not None):
            experts.setdefault(head, {})[int(tail)] = name
        else:
            out[f"{name}.weight"] = [name]
    for head, by_index in experts.items():
        module_name, _, attr = head.rpartition(".")
        count = out_in_shape(block.get_submodule(module_name), attr)[0]
        if sorted(by_index) != list(range(count)):
            missing = sorted(set(range(count)) - set(by_index))
            raise ArmorInputError(f"block reconstruction: fused expert parameter {head!r} has {count} experts but "
                                  f"no factors for experts {missing}; prune all of its experts or none")
        out[head] = [by_index[e] for e in range(count)]
    return out


def _in_module_layout(stack: torch.Tensor, in_by_out: bool, shape: Tuple[int, ...]) -> torch.Tensor:
    return (stack.transpose(-2, -1) if in_by_out else stack).reshape(shape)


def expert_layouts(block: nn.Module, groups: Mapping[str, List[str]]
                   ) -> Dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """``{parameter: stack -> parameter}`` for the experts parameters of ``groups`` (:func:`weight_names`)
    that the module does not store as the ``(E, out, in)`` stack of its experts: ``(E, in, out)``
    (gpt-oss, DBRX's ``w2``), or flat ``(E·rows, cols)`` (DBRX)."""
    out = {}
    for param, members in groups.items():
        if param == f"{members[0]}.weight":
            continue
        module_name, _, attr = param.rpartition(".")
        module = block.get_submodule(module_name)
        in_by_out, shape = stores_in_by_out(module, attr), tuple(getattr(module, attr).shape)
        if in_by_out or len(shape) != 3:
            out[param] = functools.partial(_in_module_layout, in_by_out=in_by_out, shape=shape)
    return out


def build_weights(groups: Mapping[str, List[str]], leaves: Mapping[str, FactorLeaves],
                  trainable: Optional[set] = None, frozen: Optional[Dict[str, torch.Tensor]] = None,
                  layouts: Optional[Mapping[str, Callable[[torch.Tensor], torch.Tensor]]] = None
                  ) -> Dict[str, torch.Tensor]:
    """The block's weights for :func:`torch.func.functional_call`: a group whose factors are all
    outside ``trainable`` (``None``: all trainable) is taken from ``frozen`` when given there; an
    experts parameter in ``layouts`` (:func:`expert_layouts`) is put in its module's layout."""
    out = {}
    for param, members in groups.items():
        if frozen is not None and param in frozen:
            out[param] = frozen[param]
            continue
        grad = trainable is None or any(m in trainable for m in members)
        built = [leaves[m].weight(grad) for m in members]
        if param == f"{members[0]}.weight":
            out[param] = built[0]
        else:
            stack = torch.stack(built)
            out[param] = layouts[param](stack) if layouts and param in layouts else stack
    return out


class FactoredLinears:
    """A context in which every plain ``nn.Linear`` of ``block`` that has factors in ``groups``
    runs through its leaves (:meth:`FactorLeaves.linear`) instead of its weight; the linears named
    in :attr:`trainable` get gradients. :attr:`params` are the weights it covers: the rest go to
    :func:`build_weights`. The block's modules are restored on exit."""

    def __init__(self, block: nn.Module, groups: Mapping[str, List[str]], leaves: Mapping[str, FactorLeaves]) -> None:
        self.leaves = leaves
        self.trainable: Set[str] = set()
        self._modules: Dict[str, nn.Linear] = {}
        for param, members in groups.items():
            if param != f"{members[0]}.weight":
                continue
            module = block.get_submodule(members[0])
            # a subclass or a forward already replaced on the instance (hooks of other libraries) keeps its weight path
            if type(module) is nn.Linear and "forward" not in module.__dict__:
                self._modules[members[0]] = module
        self.params = {f"{name}.weight" for name in self._modules}

    def _forward(self, name: str, module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return self.leaves[name].linear(x, module.bias, name in self.trainable)

    def __enter__(self) -> "FactoredLinears":
        for name, module in self._modules.items():
            module.forward = functools.partial(self._forward, name, module)
        return self

    def __exit__(self, *exc) -> None:
        for module in self._modules.values():
            module.__dict__.pop("forward", None)
