"""ARMOR weights of fused mixture-of-experts parameters: ``(E, d_out, d_in)``, one ARMOR layer per expert.

transformers 5 stores a block's experts as 3-D parameters (``experts.gate_up_proj`` ``(E, 2·I, H)``,
``experts.down_proj`` ``(E, H, I)``). Expert ``e`` of such a parameter is one ARMOR layer named
``"{fqn}.{e}"`` (``gate_up_proj[e]`` is pruned as one ``(2·I) × H`` layer). The parameter becomes an
ArmorTensor of the same storage class as a linear's weight (:class:`~torch_armor.tensor.formats.CompactArmorTensor`,
:class:`~torch_armor.tensor.formats.DenseArmorTensor`, the semi-structured ones), whose inner tensors carry a
leading expert dimension (``a_blocks (E, d_out/d_b, d_b, d_b)``, ``b_blocks (E, d_in/d_b, d_b, d_b)`` and the
core's tensors, ``(E, …)``), in the storage the policy of :mod:`torch_armor.tensor.policy` picks for one
expert (compact on CPU, 2:4 semi-structured on CUDA); ``w.num_experts`` is ``E`` (``None`` for a linear's weight).

``w[e]`` (an int or a 0-d tensor: what transformers' eager experts loop does,
``F.linear(x, self.gate_up_proj[expert_idx])``) and :meth:`~torch_armor.tensor.armor_tensor.ArmorTensor.expert`
return expert ``e``'s 2-D ArmorTensor, whose inner tensors are views of the stacked ones, so ``F.linear``
runs ARMOR's linear. ``w.view(E, d_out, d_in)`` is ``w`` itself and ``w.view(E, d_in, d_out)`` its
:class:`~torch_armor.tensor.transposed.ArmorTransposed` (how DBRX reads the experts it stores as
``(E·in, out)`` rows, ``w2.view(-1, I, H)[e]``; ``w1.view(-1, I, H)[e].T``), as is ``w.transpose(1, 2)``
(Inkling's shared experts: ``torch.bmm(x, w.transpose(1, 2))``). ``torch.bmm(x, w)`` is what a module storing its
experts ``(E, in, out)`` runs (Llama-4's): ``w`` stands for that parameter, each expert transposed, so it runs
``F.linear(x[e], w[e])`` for every expert. ``.to()`` / ``.half()`` move every
expert and choose the storage again; ``detach``/``clone``/``copy_`` work part by part; any other op raises, naming the op and what
to use instead (``experts_implementation="armor"``, ``dense_weight()``). These ops are registered with
``ArmorTensor.implements`` here, before any storage class copies ``ArmorTensor``'s tables
(:mod:`torch_armor.tensor` imports this module right after ``interop``).

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
    >>> fs = [ArmorFactors(torch.eye(4)[None] * (e + 1), core, torch.eye(4)[None], core != 0, "2:4") for e in range(3)]
    >>> w = experts_from_factors(fs)
    >>> w
    CompactArmorTensor(shape=(3, 4, 4), block_size=4, pattern=2:4, storage=compact, dtype=torch.float32, device=cpu)
    >>> type(w[2]).__name__, w[2].shape, torch.equal(w[2].dense_weight(), 3 * core)
    ('CompactArmorTensor', torch.Size([4, 4]), True)
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import torch
from torch import nn

from torch_armor.calibration.experts import flat_experts_count, out_in_shape, square_flat_experts
from torch_armor.core.factors import ArmorFactors
from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor, stack_experts, unsupported
from torch_armor.tensor.experts_forward import prefer_armor_experts
from torch_armor.tensor.transposed import EXPERTS_HINT, ArmorTransposed, experts_linear

__all__ = ["armor_experts_from_factors", "experts_from_factors", "EXPERTS_HINT"]

aten = torch.ops.aten
implements = ArmorTensor.implements
implements_torch_function = ArmorTensor.implements_torch_function


def experts_from_factors(factors: Sequence[ArmorFactors], *, storage: str = "auto",
                         dtype: Optional[torch.dtype] = None, device: Optional[Union[str, torch.device]] = None,
                         backend: Optional[str] = None, name: str = "") -> ArmorTensor:
    """The ``(E, d_out, d_in)`` experts weight from one :class:`ArmorFactors` per expert (same shape, block size,
    pattern).

    ``storage``/``dtype``/``device``/``backend`` as in :meth:`ArmorTensor.from_factors`, for every
    expert; ``name`` is the 3-D parameter's path (expert ``e`` is named ``f"{name}.{e}"`` in warnings).

    Raises:
        ArmorInputError: no factors, or experts that differ in shape, block size or pattern.
    """
    factors = list(factors)
    if not factors:
        raise ArmorInputError(f"{name or 'experts'}: experts_from_factors needs one ArmorFactors per expert, got none")
    experts = [ArmorTensor.from_factors(f, storage=storage, dtype=dtype, device=device, backend=backend,
                                        name=f"{name}.{e}" if name else None)
               for e, f in enumerate(factors)]
    return stack_experts(experts, name=name or None)


def armor_experts_from_factors(module: nn.Module, param_name: str, factors: Sequence[ArmorFactors], *,
                               storage: str = "auto", name: str = "", backend: Optional[str] = None) -> None:
    """Swap ``module.<param_name>`` (a 3-D ``(E, d_out, d_in)`` parameter, or ``(E, d_in, d_out)`` in a
    transposed experts module) for an ``(E, d_out, d_in)`` ArmorTensor parameter.

    The new parameter keeps the old one's dtype and device (a meta parameter: the factors' device)
    and does not require grad. A module whose config asks for ``"grouped_mm"``/``"batched_mm"``
    (which need dense 3-D weights) is switched to the ``"armor"`` experts implementation, with one warning. ``name`` is the parameter's path (e.g.
    ``"model.layers.0.mlp.experts.gate_up_proj"``), for errors and warnings.

    Raises:
        ArmorInputError: ``module`` has no such 3-D parameter, or the factors' count or any expert's
            shape differs from it (the message names the layer).
    """
    where = name or f"{type(module).__name__}.{param_name}"
    old = module._parameters.get(param_name) if isinstance(module, nn.Module) else None
    if old is None or (old.dim() != 3 and flat_experts_count(module) is None):
        raise ArmorInputError(f"{where}: expected a 3-D (experts, d_out, d_in) parameter {param_name!r} on "
                              f"{type(module).__name__}, found {None if old is None else tuple(old.shape)}")
    if square_flat_experts(module):
        raise ArmorInputError(f"{where}: DBRX-style flat experts with ffn_hidden_size == hidden_size cannot hold ARMOR "
                              "experts (its forward's w2 view could not tell them from their transpose); keep them dense")
    factors = list(factors)
    e_count, d_out, d_in = out_in_shape(module, param_name)
    if len(factors) != e_count:
        raise ArmorInputError(f"{where}: {len(factors)} ArmorFactors for {e_count} experts; give one per expert")
    for e, f in enumerate(factors):
        if not isinstance(f, ArmorFactors) or tuple(f.core.shape) != (d_out, d_in):
            got = tuple(f.core.shape) if isinstance(f, ArmorFactors) else type(f).__name__
            raise ArmorInputError(f"{where}.{e}: factors are for a {got} weight, the expert is ({d_out}, {d_in})")
    device = old.device if old.device.type != "meta" else factors[0].core.device
    new = experts_from_factors(factors, storage=storage, dtype=old.dtype, device=device, backend=backend, name=name)
    module._parameters[param_name] = nn.Parameter(new, requires_grad=False)
    prefer_armor_experts(module, name or None)


# ------------------------------------------------------------------ ops (on 2-D weights: as any other op)


def _index(self: ArmorTensor, index) -> ArmorTensor:
    if isinstance(index, torch.Tensor):
        if index.dim() != 0 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise NotImplementedError(
                f"ARMOR experts can be indexed by one expert (an int or a 0-d integer tensor), not by a "
                f"{index.dtype} tensor of shape {tuple(index.shape)} (what the 'batched_mm' experts implementation "
                f"does); {EXPERTS_HINT}")
    return self.expert(int(index))


@implements(aten.select.int)
def _select(func, types, args, kwargs):
    self, dim, index = args[0], args[1], args[2]
    if self.num_experts is None:
        raise unsupported(func, args)
    if dim not in (0, -3):
        raise NotImplementedError(f"ARMOR experts: select along dim {dim}; only the expert dim 0 is supported; "
                                  f"{EXPERTS_HINT}")
    return self.expert(index)


@implements(aten.index.Tensor)
def _index_tensor(func, types, args, kwargs):
    self, indices = args[0], args[1]
    if self.num_experts is None:
        raise unsupported(func, args)
    if len(indices) != 1 or indices[0] is None:
        raise NotImplementedError(f"ARMOR experts: advanced indexing {func}; {EXPERTS_HINT}")
    return _index(self, indices[0])


def _plain(func, args, kwargs):
    """What torch does with a 2-D weight (its aten op then raises, saying what to use)."""
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


@implements_torch_function(torch.Tensor.view)
def _view(func, types, args, kwargs):
    self, shape = args[0], args[1:]
    if self.num_experts is None:
        return _plain(func, args, kwargs)
    if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
        shape = tuple(shape[0])
    shape = tuple(kwargs.get("size", shape))
    known = math.prod(s for s in shape if s != -1) if all(isinstance(s, int) for s in shape) else 0
    resolved = tuple(math.prod(self.shape) // known if s == -1 else s for s in shape) if known else shape
    e_count, d_out, d_in = self.shape
    if resolved == tuple(self.shape):
        return self
    if resolved == (e_count, d_in, d_out):  # a module storing its experts (in, out) (DBRX's w2) reads them so
        return ArmorTransposed(self)
    raise NotImplementedError(f"{self.layer_name or 'ARMOR experts'} {tuple(self.shape)} do not support "
                              f"aten.view to {shape}: only to its own shape or its transpose (E, in, out); {EXPERTS_HINT}")


@implements_torch_function([torch.Tensor.transpose, torch.transpose])
def _transpose(func, types, args, kwargs):
    self = args[0]
    if self.num_experts is None:
        return _plain(func, args, kwargs)
    dims = tuple(d % 3 for d in (args[1:] or (kwargs.get("dim0"), kwargs.get("dim1"))))
    if sorted(dims) != [1, 2]:
        raise NotImplementedError(f"{self.layer_name or 'ARMOR experts'}: transpose{dims}; only the last two "
                                  f"dims (each expert's transpose) are supported; {EXPERTS_HINT}")
    return ArmorTransposed(self)


@implements_torch_function([torch.bmm, torch.Tensor.bmm])
def _bmm(func, types, args, kwargs):
    """``torch.bmm(x, P)`` by a module that stores its experts ``(E, in, out)`` (Llama-4's): ARMOR experts
    replacing ``P`` are its experts transposed (``(E, out, in)``), so the product is each expert's linear."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("mat2")
    if not (isinstance(w, ArmorTensor) and w.num_experts is not None) or isinstance(x, ArmorTensor):
        if any(isinstance(t, ArmorTensor) and t.num_experts is not None for t in (x, w)):
            raise NotImplementedError(f"torch.bmm with ARMOR experts as its first operand; {EXPERTS_HINT}")
        return _plain(func, args, kwargs)
    return experts_linear(x, w)
