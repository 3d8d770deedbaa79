"""ARMOR weights of fused mixture-of-experts parameters: ``(E, d_out, d_in)``, one ARMOR layer per expert.

transformers 5 stores a block's experts as 3-D parameters (``experts.gate_up_proj`` ``(E, 2·I, H)``,
``experts.down_proj`` ``(E, H, I)``). Expert ``e`` of such a parameter is one ARMOR layer named
``"{fqn}.{e}"`` (``gate_up_proj[e]`` is pruned as one ``(2·I) × H`` layer). An
:class:`ArmorExpertsTensor` stands in for the 3-D parameter: it holds every expert's parts stacked
along a leading expert dimension (``a_blocks (E, d_out/d_b, d_b, d_b)``, ``b_blocks (E, d_in/d_b,
d_b, d_b)`` and the core's tensors, ``(E, …)``), in the storage the policy of
:mod:`torch_armor.tensor.policy` picks for one expert (compact on CPU, 2:4 semi-structured on CUDA).
As for :class:`~torch_armor.tensor.armor_tensor.ArmorTensor`, each core storage has its own class
(``CompactArmorExpertsTensor``, ``DenseArmorExpertsTensor``, …), all subclasses of
:class:`ArmorExpertsTensor`.

``w[e]`` (an int or a 0-d tensor: what transformers' eager experts loop does,
``F.linear(x, self.gate_up_proj[expert_idx])``) and :meth:`ArmorExpertsTensor.expert` return
expert ``e``'s 2-D ArmorTensor, whose inner tensors are views of the stacked ones, so ``F.linear``
runs ARMOR's linear. ``w.view(E, d_out, d_in)`` is ``w`` itself and ``w.view(E, d_in, d_out)`` its
:class:`~torch_armor.tensor.transposed.ArmorTransposed` (how DBRX reads the experts it stores as
``(E·in, out)`` rows, ``w2.view(-1, I, H)[e]``; ``w1.view(-1, I, H)[e].T``), as is ``w.transpose(1, 2)``
(Inkling's shared experts: ``torch.bmm(x, w.transpose(1, 2))``). ``torch.bmm(x, w)`` is what a module storing its
experts ``(E, in, out)`` runs (Llama-4's): ``w`` stands for that parameter, each expert transposed, so it runs
``F.linear(x[e], w[e])`` for every expert. ``.to()`` / ``.half()`` move every
expert and choose the storage again; ``detach``/``clone``/``copy_`` work part by part; any other op raises, naming the op and what
to use instead (``experts_implementation="armor"``, ``dense_weight()``).

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
    >>> fs = [ArmorFactors(torch.eye(4)[None] * (e + 1), core, torch.eye(4)[None], core != 0, "2:4") for e in range(3)]
    >>> w = ArmorExpertsTensor.from_factors(fs)
    >>> w
    CompactArmorExpertsTensor(shape=(3, 4, 4), block_size=4, pattern=2:4, storage=compact, dtype=torch.float32, device=cpu)
    >>> type(w[2]).__name__, torch.equal(w[2].dense_weight(), 3 * core)
    ('CompactArmorTensor', True)
"""

from __future__ import annotations

import hashlib
import math
from typing import ClassVar, Dict, List, Optional, Sequence, Union

import torch
from torch import nn
from torchao.utils import TorchAOBaseTensor

from torch_armor.calibration.experts import flat_experts_count, out_in_shape, square_flat_experts
from torch_armor.core.factors import ArmorFactors
from torch_armor.errors import ArmorInputError
from torch_armor.tensor import interop  # noqa: F401  (ArmorTensor's handlers, some shared below)
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.experts_forward import prefer_armor_experts
from torch_armor.tensor.formats import CompactArmorTensor, DenseArmorTensor
from torch_armor.tensor.semi_structured import CusparseltArmorTensor, CutlassArmorTensor
from torch_armor.tensor.transposed import EXPERTS_HINT, ArmorTransposed, experts_linear

__all__ = ["ArmorExpertsTensor", "armor_experts_from_factors", "experts_class_of", "experts_from_parts", "stack_experts",
           "EXPERTS_HINT"]

aten = torch.ops.aten

_CLASSES: Dict[type, type] = {}  # 2-D format class -> its experts class


class ArmorExpertsTensor(TorchAOBaseTensor):
    """The ``(E, d_out, d_in)`` weight of E ARMOR experts, their parts stacked along dim 0.

    Build it with :meth:`from_factors` (or :func:`armor_experts_from_factors` to swap it into a
    module). ``expert_class`` is the 2-D :class:`ArmorTensor` class every expert has; the inner
    tensors are that class's, each with a leading ``E`` dimension.
    """

    expert_class: ClassVar[type] = ArmorTensor
    storage_format: ClassVar[str] = ""
    backend: ClassVar[Optional[str]] = None
    tensor_attribute_names = ["pattern", "dtype"]
    layer_name: Optional[str] = None

    def __new__(cls, *parts, **attributes):
        a_blocks, b_blocks, dtype = parts[0], parts[1], parts[len(cls.tensor_data_names) + 1]
        shape = (a_blocks.shape[0], a_blocks.shape[1] * a_blocks.shape[2], b_blocks.shape[1] * b_blocks.shape[2])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=a_blocks.device,
                                                   requires_grad=False)

    def __init__(self, *parts, **attributes):
        super().__init__()
        names = self.tensor_data_names
        for name, t in zip(names, parts):
            setattr(self, name, t)
        self.pattern = parts[len(names)]

    # ------------------------------------------------------------------ experts

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @property
    def block_size(self) -> int:
        return self.a_blocks.shape[-1]

    def expert(self, e: int) -> ArmorTensor:
        """Expert ``e``'s 2-D ArmorTensor; its inner tensors are views of this tensor's (no copy)."""
        e = int(e)
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"{self.layer_name or 'ArmorExpertsTensor'}: expert {e} out of range for "
                             f"{self.num_experts} experts")
        w = self.expert_class(*(getattr(self, n).select(0, e) for n in self.tensor_data_names), self.pattern, self.dtype)
        w.layer_name = f"{self.layer_name}.{e % self.num_experts}" if self.layer_name else None
        return w

    def experts(self) -> List[ArmorTensor]:
        """Every expert's 2-D ArmorTensor, in order."""
        return [self.expert(e) for e in range(self.num_experts)]

    def dense_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialize ``(E, d_out, d_in)``: ``A·core·B`` of every expert (for export, or a slow reference)."""
        return torch.stack([w.dense_weight(dtype) for w in self.experts()])

    def stored_parameters(self) -> int:
        """``A``, ``B`` and the kept core values of every expert."""
        return sum(w.stored_parameters() for w in self.experts())

    def with_storage(self, storage: str, backend: Optional[str] = None) -> "ArmorExpertsTensor":
        """Every expert re-stored (see :meth:`ArmorTensor.with_storage`); itself when that changes nothing."""
        first = self.expert(0)
        if first.with_storage(storage, backend) is first:  # the same format: no copy of the stack
            return self
        return _restacked(self, [w.with_storage(storage, backend) for w in self.experts()])

    def moved(self, device: Union[str, torch.device], dtype: torch.dtype,
              non_blocking: bool = False) -> "ArmorExpertsTensor":
        """``.to(device, dtype)``: every expert moved, its storage chosen again for the target."""
        return _restacked(self, [w.moved(device, dtype, non_blocking) for w in self.experts()])

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_factors(cls, factors: Sequence[ArmorFactors], *, storage: str = "auto",
                     dtype: Optional[torch.dtype] = None, device: Optional[Union[str, torch.device]] = None,
                     backend: Optional[str] = None, name: str = "") -> "ArmorExpertsTensor":
        """Build the experts weight from one :class:`ArmorFactors` per expert (same shape, block size, pattern).

        ``storage``/``dtype``/``device``/``backend`` as in :meth:`ArmorTensor.from_factors`, for every
        expert; ``name`` is the 3-D parameter's path (expert ``e`` is named ``f"{name}.{e}"`` in warnings).

        Raises:
            ArmorInputError: no factors, or experts that differ in shape, block size or pattern.
        """
        factors = list(factors)
        if not factors:
            raise ArmorInputError(f"{name or 'experts'}: from_factors needs one ArmorFactors per expert, got none")
        experts = [ArmorTensor.from_factors(f, storage=storage, dtype=dtype, device=device, backend=backend,
                                            name=f"{name}.{e}" if name else None)
                   for e, f in enumerate(factors)]
        return stack_experts(experts, name=name)

    def _stable_hash_for_caching(self) -> str:
        """Process-independent key of this weight's metadata, for torch.compile's AOT cache."""
        parts = [type(self).__qualname__, str(tuple(self.shape)), self.pattern, str(self.dtype)]
        for name in self.tensor_data_names:
            t = getattr(self, name)
            parts.append(f"{name}:{tuple(t.shape)}:{tuple(t.stride())}:{t.dtype}:{t.device.type}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def __repr__(self) -> str:
        backend = f", backend={self.backend}" if self.backend else ""
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, block_size={self.block_size}, "
                f"pattern={self.pattern}, storage={self.storage_format}{backend}, dtype={self.dtype}, "
                f"device={self.device})")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """The base class's dispatch (``cls._ATEN_OP_TABLE[cls]``); an op no handler takes raises here,
        saying what to use instead (``TorchAOBaseTensor``'s own message only names the op)."""
        if func not in cls._ATEN_OP_TABLE[cls]:
            raise NotImplementedError(
                f"ArmorExpertsTensor (E ARMOR experts in factored form) does not support {func}; {EXPERTS_HINT}")
        return super().__torch_dispatch__(func, types, args, kwargs or {})


def _experts_class_for(fmt: type) -> type:
    name = fmt.__name__.replace("ArmorTensor", "ArmorExpertsTensor")
    cls = type(name, (ArmorExpertsTensor,), {
        "__module__": __name__, "__qualname__": name, "expert_class": fmt,
        "storage_format": fmt.storage_format, "backend": fmt.backend,
        "tensor_data_names": list(fmt.tensor_data_names),
        "__doc__": f"E ARMOR experts whose cores are {fmt.__name__} ({fmt.storage_format}), parts stacked on dim 0.",
    })
    globals()[name] = cls
    __all__.append(name)
    return cls


def experts_class_of(fmt: type) -> type:
    """The :class:`ArmorExpertsTensor` class whose experts are ``fmt`` ArmorTensors."""
    if fmt not in _CLASSES:
        raise ArmorInputError(
            f"experts with {fmt.__name__} cores cannot be stacked: quantized (int8) expert cores are not "
            "supported yet; keep the experts' cores floating (quantize_ skips them) or dequantize first")
    return _CLASSES[fmt]


def stack_experts(experts: Sequence[ArmorTensor], name: str = "") -> ArmorExpertsTensor:
    """One :class:`ArmorExpertsTensor` from E 2-D ArmorTensors of the same class, shape, block size and pattern."""
    where = name or "experts"
    first = experts[0]
    for e, w in enumerate(experts):
        if not isinstance(w, ArmorTensor):
            raise ArmorInputError(f"{where}: expert {e} is a {type(w).__name__}, not an ArmorTensor")
        same = (type(w), tuple(w.shape), w.block_size, w.pattern, w.dtype, w.device)
        want = (type(first), tuple(first.shape), first.block_size, first.pattern, first.dtype, first.device)
        if same != want:
            raise ArmorInputError(
                f"{where}: expert {e} is a {same[0].__name__} {same[1]} with block size {same[2]}, pattern {same[3]}, "
                f"{same[4]} on {same[5]}, expert 0 a {want[0].__name__} {want[1]} with block size {want[2]}, pattern "
                f"{want[3]}, {want[4]} on {want[5]}; the experts of one parameter must share them (give every "
                f"'{where}.<e>' the same block size and pattern)")
    cls = experts_class_of(type(first))
    parts = [torch.stack([getattr(w, n) for w in experts]) for n in cls.tensor_data_names]
    out = cls(*parts, first.pattern, first.dtype)
    out.layer_name = name or None
    return out


def experts_from_parts(storage: str, a_blocks: torch.Tensor, b_blocks: torch.Tensor, pattern: str,
                       dtype: torch.dtype, backend: Optional[str] = None, **parts) -> ArmorExpertsTensor:
    """The ArmorExpertsTensor of ``storage`` from its stacked inner tensors, as saved (``values=``/``indices=``
    for compact, ``core=`` for dense), like :func:`~torch_armor.tensor.armor_tensor.from_parts` for one layer."""
    cls = next((c for c in _CLASSES.values() if (c.storage_format, c.backend) == (storage, backend)), None)
    if cls is None:
        raise ArmorInputError(f"no ARMOR experts storage {storage!r} (backend {backend!r}); "
                              "expected one of compact, dense, semi_structured")
    inner = [parts.pop(n) for n in cls.tensor_data_names[2:]]
    if parts:
        raise ArmorInputError(f"{storage} ArmorExpertsTensor has no inner tensors {sorted(parts)}")
    return cls(a_blocks, b_blocks, *inner, pattern, dtype)


def _restacked(like: ArmorExpertsTensor, experts: Sequence[ArmorTensor]) -> ArmorExpertsTensor:
    return stack_experts(experts, name=like.layer_name or "")


def armor_experts_from_factors(module: nn.Module, param_name: str, factors: Sequence[ArmorFactors], *,
                               storage: str = "auto", name: str = "", backend: Optional[str] = None) -> None:
    """Swap ``module.<param_name>`` (a 3-D ``(E, d_out, d_in)`` parameter, or ``(E, d_in, d_out)`` in a
    transposed experts module) for an ``(E, d_out, d_in)`` ArmorExpertsTensor parameter.

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
    new = ArmorExpertsTensor.from_factors(factors, storage=storage, dtype=old.dtype, device=device,
                                          backend=backend, name=name)
    module._parameters[param_name] = nn.Parameter(new, requires_grad=False)
    prefer_armor_experts(module, name or None)


# ------------------------------------------------------------------ ops


def _index(self: ArmorExpertsTensor, index) -> ArmorTensor:
    if isinstance(index, torch.Tensor):
        if index.dim() != 0 or index.dtype.is_floating_point or index.dtype == torch.bool:
            raise NotImplementedError(
                f"ArmorExpertsTensor can be indexed by one expert (an int or a 0-d integer tensor), not by a "
                f"{index.dtype} tensor of shape {tuple(index.shape)} (what the 'batched_mm' experts implementation "
                f"does); {EXPERTS_HINT}")
    return self.expert(int(index))


def _select(func, types, args, kwargs):
    self, dim, index = args[0], args[1], args[2]
    if dim not in (0, -3):
        raise NotImplementedError(f"ArmorExpertsTensor: select along dim {dim}; only the expert dim 0 is supported; "
                                  f"{EXPERTS_HINT}")
    return self.expert(index)


def _index_tensor(func, types, args, kwargs):
    self, indices = args[0], args[1]
    if len(indices) != 1 or indices[0] is None:
        raise NotImplementedError(f"ArmorExpertsTensor: advanced indexing {func}; {EXPERTS_HINT}")
    return _index(self, indices[0])


def _copy(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not (isinstance(dst, ArmorExpertsTensor) and isinstance(src, ArmorExpertsTensor)):
        raise RuntimeError(
            "a dense 3-D experts tensor and ARMOR experts (E factored layers) cannot be copied into each other: "
            "load an ARMOR checkpoint with from_pretrained(directory) after import torch_armor (or "
            "torch_armor.load_pretrained), or load_state_dict(state, assign=True); for dense experts use "
            "weight.dense_weight()")
    if tuple(dst.shape) != tuple(src.shape) or dst.pattern != src.pattern or dst.block_size != src.block_size:
        raise RuntimeError(f"cannot copy {src!r} into {dst!r}: shape, pattern or block size differ; "
                           "use load_state_dict(..., assign=True) to replace the weight")
    if type(src) is not type(dst) or src.device != dst.device or src.dtype != dst.dtype:
        src = src.moved(dst.device, dst.dtype)
        if type(src) is not type(dst):
            src = src.with_storage(dst.storage_format, backend=dst.backend)
    for name in dst.tensor_data_names:
        getattr(dst, name).copy_(getattr(src, name))
    return dst


def _storage(func, types, args, kwargs):
    raise TypeError(
        "an ArmorExpertsTensor has no single storage: it holds E ARMOR experts as separate stacked tensors. Save "
        "the model with torch_armor.save_pretrained(model, directory) (the Hugging Face format: "
        "AutoModelForCausalLM.from_pretrained reads it after import torch_armor)")


def _requires_grad(func, types, args, kwargs):
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if flag:
        raise RuntimeError("ARMOR experts cannot be fine-tuned yet: an ArmorExpertsTensor is a frozen container "
                           "of E factored experts; keep requires_grad=False (or dequantize the model to train it)")
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _view(func, types, args, kwargs):
    self, shape = args[0], args[1:]
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
    raise NotImplementedError(f"{self.layer_name or 'ArmorExpertsTensor'} {tuple(self.shape)} does not support "
                              f"aten.view to {shape}: only to its own shape or its transpose (E, in, out); {EXPERTS_HINT}")


def _transpose(func, types, args, kwargs):
    self = args[0]
    dims = tuple(d % 3 for d in (args[1:] or (kwargs.get("dim0"), kwargs.get("dim1"))))
    if sorted(dims) != [1, 2]:
        raise NotImplementedError(f"{self.layer_name or 'ArmorExpertsTensor'}: transpose{dims}; only the last two "
                                  f"dims (each expert's transpose) are supported; {EXPERTS_HINT}")
    return ArmorTransposed(self)


def _bmm(func, types, args, kwargs):
    """``torch.bmm(x, P)`` by a module that stores its experts ``(E, in, out)`` (Llama-4's): ARMOR experts
    replacing ``P`` are its experts transposed (``(E, out, in)``), so the product is each expert's linear."""
    x = args[0] if args else kwargs.get("input")
    w = args[1] if len(args) > 1 else kwargs.get("mat2")
    if not isinstance(w, ArmorExpertsTensor) or isinstance(x, ArmorExpertsTensor):
        raise NotImplementedError(f"torch.bmm with ARMOR experts as its first operand; {EXPERTS_HINT}")
    return experts_linear(x, w)


# ArmorTensor's handlers of these ops already do right for any stack of inner tensors (``moved``,
# ``_apply_fn_to_data``); the other ops are the experts' own
for _op in (aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default,
            aten._to_copy.default, aten.to.dtype_layout):
    ArmorExpertsTensor.implements(_op)(ArmorTensor._ATEN_OP_TABLE[ArmorTensor][_op])
for _fn in (torch.Tensor.to, torch._has_compatible_shallow_copy_type, torch.Tensor.contiguous):
    ArmorExpertsTensor.implements_torch_function(_fn)(ArmorTensor._TORCH_FN_TABLE[ArmorTensor][_fn])
ArmorExpertsTensor.implements(aten.select.int)(_select)
ArmorExpertsTensor.implements(aten.index.Tensor)(_index_tensor)
ArmorExpertsTensor.implements(aten.copy_.default)(_copy)
ArmorExpertsTensor.implements_torch_function(torch.Tensor.storage)(_storage)
ArmorExpertsTensor.implements_torch_function(torch.Tensor.requires_grad_)(_requires_grad)
ArmorExpertsTensor.implements_torch_function(torch.Tensor.view)(_view)
ArmorExpertsTensor.implements_torch_function([torch.Tensor.transpose, torch.transpose])(_transpose)
ArmorExpertsTensor.implements_torch_function([torch.bmm, torch.Tensor.bmm])(_bmm)

# one class per storage, created once its parent's op tables are filled (each copies them when defined)
for _fmt in (DenseArmorTensor, CompactArmorTensor, CusparseltArmorTensor, CutlassArmorTensor):
    _CLASSES[_fmt] = _experts_class_for(_fmt)
torch.serialization.add_safe_globals(list(_CLASSES.values()))


