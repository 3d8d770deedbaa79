"""ArmorTensor: a converted linear weight ``W_hat = A · core · B`` that never materializes ``W_hat``.

An :class:`ArmorTensor` stands in for ``module.weight`` of an ``nn.Linear``. It holds the
block-diagonal wrappers ``a_blocks (d_out/d_b, d_b, d_b)`` and ``b_blocks (d_in/d_b, d_b, d_b)``
and the N:M sparse core. As in torchao (``Int4Tensor``, ``Int4PreshuffledTensor``), each storage
format of the core is its own class, chosen once when the weight is built, with its own inner
tensors (its flatten/unflatten) and its own linear:

* :class:`~torch_armor.tensor.formats.DenseArmorTensor` (``"dense"``): the core as a dense matrix
  with exact zeros; any device, any pattern (unstructured included).
* :class:`~torch_armor.tensor.formats.CompactArmorTensor` (``"compact"``): kept values
  ``(d_out, d_in·N/M)`` + bit-packed in-group positions (:func:`~torch_armor.tensor.packing.pack_nm`):
  half the core bytes plus one bit per entry for 2:4; for CPU and disk (each call unpacks it).
* :class:`~torch_armor.tensor.semi_structured.CusparseltArmorTensor` /
  :class:`~torch_armor.tensor.semi_structured.CutlassArmorTensor` (``"semi_structured"``): the CUDA
  2:4 core as the kernel's own packed buffers, run through ``torch._cslt_sparse_mm`` /
  ``torch._sparse_semi_structured_mm`` between two wrapper kernels, no activation copied.
* :class:`~torch_armor.tensor.quant.QuantizedArmorTensor` (``"quantized"``): a torchao quantized
  core (e.g. ``Int8Tensor``), built by ``quantize_(model, ArmorCoreConfig(...))``.

Which one a weight gets is :func:`torch_armor.tensor.policy.choose_storage`'s answer for its
device, dtype and shape — at conversion (``storage="auto"``) and again on every ``.to()``,
``.half()``, ``.bfloat16()`` — unless a storage is asked for by name. ``weight.storage_format``
names it (``weight.storage()`` stays the ``torch.Tensor`` method).

Fused experts are the same classes: inner tensors with a leading expert dimension make an
``(E, d_out, d_in)`` weight (``w.num_experts``, ``w.expert(e)``, :func:`stack_experts`; its ops are in
:mod:`torch_armor.tensor.experts`).

``F.linear(x, w, bias)`` computes ``y = ((x·Bᵀ) · coreᵀ) · Aᵀ + bias`` with two batched block
products around one (sparse) matmul; ``y`` matches ``x @ W_hat.T + bias`` within floating-point
tolerance.

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> d_b, d_out, d_in = 4, 8, 16
    >>> core = torch.tensor([1.0, 0.0, -2.0, 0.0]).repeat(d_out, d_in // 4)
    >>> factors = ArmorFactors(torch.randn(d_out // d_b, d_b, d_b), core,
    ...                        torch.randn(d_in // d_b, d_b, d_b), core != 0, "2:4")
    >>> w = ArmorTensor.from_factors(factors, storage="compact")
    >>> w
    CompactArmorTensor(shape=(8, 16), block_size=4, pattern=2:4, storage=compact, dtype=torch.float32, device=cpu)
    >>> x = torch.randn(3, d_in)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ factors.dense().T, atol=1e-5)
    True
"""

from __future__ import annotations

import hashlib
import warnings
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn
from torchao.utils import TorchAOBaseTensor

from torch_armor.core.pattern import SparsityPattern, parse_pattern
from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.factors import ArmorFactors
from torch_armor.tensor import policy
from torch_armor.tensor.packing import check_nm_mask
from torch_armor.tensor.policy import QUANTIZED, STORAGES, KernelRefused, StorageChoice
from torch_armor.tensor.transposed import EXPERTS_HINT
from torch_armor.errors import ArmorInputError

__all__ = [
    "ArmorTensor",
    "armor_linear_from_factors",
    "from_parts",
    "stack_experts",
    "restore_storage",
    "register_format",
    "format_class",
    "STORAGES",
    "QUANTIZED",
    "PartSpecs",
]

aten = torch.ops.aten

#: ``{inner tensor name: (shape, dtype)}`` of a weight's stored parts (:meth:`ArmorTensor.part_specs`)
PartSpecs = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]

#: ``(storage, backend)`` -> ArmorTensor class, filled by :func:`register_format`
_FORMATS: Dict[Tuple[str, Optional[str]], type] = {}


def register_format(cls: type) -> type:
    """Class decorator: ``cls`` is the ArmorTensor class of ``(cls.storage_format, cls.backend)``."""
    _FORMATS[(cls.storage_format, cls.backend)] = cls
    return cls


def format_class(storage: str, backend: Optional[str] = None) -> type:
    """The ArmorTensor class registered for ``storage`` (and ``backend``): the one registry of formats."""
    return _FORMATS[(storage, backend)]


def _format_class(choice: StorageChoice) -> type:
    return format_class(choice.storage, choice.backend)


class ArmorTensor(TorchAOBaseTensor):
    """The weight ``W_hat = blockdiag(a_blocks) · core · blockdiag(b_blocks)`` of one linear layer.

    The base of one class per core storage (see the module docstring). Build it with
    :meth:`from_factors` (or :func:`armor_linear_from_factors` to swap it into an ``nn.Linear``).
    Logical shape ``(d_out, d_in)`` and dtype are those of ``W_hat`` (``(E, d_out, d_in)`` for E fused experts).

    Attributes: ``a_blocks``, ``b_blocks``, the core's own tensors, ``pattern`` (``"N:M"`` or
    ``"unstructured:F"``), ``storage_format``, ``backend`` (semi-structured only) and ``layer_name``
    (the module path, when known: fallback warnings name it).

    Only ``F.linear``, device/dtype moves, ``detach``/``clone``/``copy_`` and the like are
    supported: other ops (``view``, ``abs``, ``t``...) raise ``NotImplementedError`` saying what
    to use instead (``dense_weight()``, or ``ArmorCoreConfig`` to quantize with torchao).

    ``.to(device)``, ``.to(dtype)``, ``.half()``, ``.bfloat16()`` really convert the inner tensors
    and re-choose the storage for the new device and dtype (a CUDA bf16/fp16 2:4 core becomes
    semi-structured, a core moved off CUDA compact); :meth:`with_storage` picks one by name.

    Example::

        >>> d_b = 4
        >>> core = torch.tensor([0.0, 3.0, 0.0, 1.0]).repeat(8, 2)
        >>> f = ArmorFactors(torch.eye(d_b).repeat(2, 1, 1), core, torch.eye(d_b).repeat(2, 1, 1),
        ...                  core != 0, "2:4")
        >>> w = ArmorTensor.from_factors(f, storage="dense").bfloat16()
        >>> w.dtype, w.core.dtype, w.storage_format
        (torch.bfloat16, torch.bfloat16, 'dense')
        >>> torch.equal(w.dense_weight().float(), core)
        True
    """

    storage_format: ClassVar[str] = ""
    backend: ClassVar[Optional[str]] = None
    tensor_attribute_names = ["pattern", "dtype"]
    layer_name: Optional[str] = None

    # Each storage class takes its inner tensors and attributes by name, in the order torchao's
    # ``__tensor_unflatten__`` passes them (``tensor_data_names``, then ``pattern, dtype``, then the
    # optional attributes), e.g. ``DenseArmorTensor(a_blocks, b_blocks, core, pattern, dtype)``; its
    # ``__new__`` is :meth:`_wrapper` and its ``__init__`` stores its own tensors after this one's.
    # The inner tensors of fused experts carry a leading ``E`` dimension (``a_blocks (E, d_out/d_b, d_b,
    # d_b)``, ``core (E, d_out, d_in)``...): the same class then stands for an ``(E, d_out, d_in)`` parameter.
    @classmethod
    def _wrapper(cls, a_blocks: torch.Tensor, b_blocks: torch.Tensor, dtype: torch.dtype) -> "ArmorTensor":
        """The empty ``(d_out, d_in)`` (or ``(E, d_out, d_in)``) wrapper of ``dtype`` on ``a_blocks``' device
        that ``__new__`` returns."""
        shape = (*a_blocks.shape[:-3], a_blocks.shape[-3] * a_blocks.shape[-2], b_blocks.shape[-3] * b_blocks.shape[-2])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=a_blocks.device,
                                                   requires_grad=False)

    def __init__(self, a_blocks: torch.Tensor, b_blocks: torch.Tensor, pattern: str,
                 layer_name: Optional[str] = None):
        super().__init__()
        self.a_blocks, self.b_blocks, self.pattern, self.layer_name = a_blocks, b_blocks, pattern, layer_name

    # ------------------------------------------------------------------ what each format provides

    @classmethod
    def core_specs(cls, d_out: int, d_in: int, pattern: SparsityPattern, dtype: torch.dtype) -> PartSpecs:
        """Shape and dtype of each of this format's core tensors for one ``(d_out, d_in)`` weight of ``dtype``."""
        raise NotImplementedError(f"{cls.__name__} is never stored (a checkpoint holds its compact form)")

    @classmethod
    def from_core(cls, a: torch.Tensor, b: torch.Tensor, core: torch.Tensor, pattern: str, dtype: torch.dtype,
                  mask: Optional[torch.Tensor] = None) -> "ArmorTensor":
        """This format built from a dense core already on its device and dtype (checked by the caller);
        ``mask``, when given, is the support (a kept entry may be exactly zero)."""
        raise NotImplementedError

    def core_dense(self) -> torch.Tensor:
        """The core ``W' ⊙ M`` as a dense ``(d_out, d_in)`` matrix (exact; a quantized core dequantized)."""
        raise NotImplementedError

    def _linear(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def _movable(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether moving/casting the inner tensors one by one gives this format on ``device``/``dtype``."""
        return True

    def _parts_to(self, device: torch.device, dtype: torch.dtype, non_blocking: bool) -> "ArmorTensor":
        """This weight with every inner tensor moved (floating ones cast), same format."""
        return self._apply_fn_to_data(lambda t: _move(t, device, dtype, non_blocking))._with_dtype(dtype)

    def _with_dtype(self, dtype: torch.dtype) -> "ArmorTensor":
        if dtype == self.dtype:
            return self
        names, attrs = self.__tensor_flatten__()
        return type(self).__tensor_unflatten__({n: getattr(self, n) for n in names}, dict(attrs, dtype=dtype),
                                               None, None)

    def stored_parameters(self) -> int:
        """Elements that are parameters: ``A``, ``B`` and the kept core values (not positions, not zeros)."""
        if self.num_experts is not None:
            return sum(w.stored_parameters() for w in self.experts())
        n, m = self.nm
        kept = self.shape[0] * self.shape[1] * n // m if m else int((self.core_dense() != 0).sum())
        return self.a_blocks.numel() + self.b_blocks.numel() + kept

    @classmethod
    def part_specs(cls, shape: Sequence[int], block_size: int, pattern: SparsityPattern,
                   dtype: torch.dtype) -> PartSpecs:
        """Shape and dtype of each inner tensor, in ``tensor_data_names`` order, of a weight of this format
        with logical ``shape`` (``(d_out, d_in)``, or ``(E, d_out, d_in)`` for E fused experts: every part
        then leads with ``E``), ``block_size`` dividing ``d_out`` and ``d_in``, and ``pattern`` (its M
        dividing ``d_in`` for the packed formats): what its ``__tensor_flatten__`` holds, without building it.
        A torchao quantized core is left out (its own class describes its tensors).

        Example::

            >>> specs = format_class("compact").part_specs((3, 8, 16), 4, parse_pattern("2:4"), torch.float16)
            >>> specs["a_blocks"], specs["indices"]
            (((3, 2, 4, 4), torch.float16), ((3, 8, 2), torch.uint8))
        """
        *lead, d_out, d_in = (int(d) for d in shape)
        parts = {
            "a_blocks": ((d_out // block_size, block_size, block_size), dtype),
            "b_blocks": ((d_in // block_size, block_size, block_size), dtype),
            **cls.core_specs(d_out, d_in, pattern, dtype),
        }
        return {name: ((*lead, *part_shape), part_dtype) for name, (part_shape, part_dtype) in parts.items()}

    # ------------------------------------------------------------------ properties

    @property
    def num_experts(self) -> Optional[int]:
        """``E`` of fused experts ``(E, d_out, d_in)``; ``None`` for one linear's ``(d_out, d_in)`` weight."""
        return self.shape[0] if self.dim() == 3 else None

    def expert(self, e: int) -> "ArmorTensor":
        """Expert ``e`` of fused experts: a 2-D weight of the same class whose inner tensors are views of these."""
        e = int(e)
        if self.num_experts is None:
            raise IndexError(f"{self.layer_name or 'this ArmorTensor'} is one linear's weight, not fused experts")
        if not -self.num_experts <= e < self.num_experts:
            raise IndexError(f"{self.layer_name or 'ARMOR experts'}: expert {e} out of range for "
                             f"{self.num_experts} experts")
        names, attributes = self.__tensor_flatten__()
        name = f"{self.layer_name}.{e % self.num_experts}" if self.layer_name else None
        return type(self)(**{n: getattr(self, n).select(0, e) for n in names}, **attributes, layer_name=name)

    def experts(self) -> List["ArmorTensor"]:
        """Every expert's 2-D weight, in order (see :meth:`expert`)."""
        return [self.expert(e) for e in range(self.num_experts or 0)]

    @property
    def block_size(self) -> int:
        """Size ``d_b`` of the diagonal blocks of ``A`` and ``B``."""
        return self.a_blocks.shape[-1]

    @property
    def nm(self) -> Tuple[int, int]:
        """``(N, M)`` of the pattern; ``(0, 0)`` for unstructured."""
        p = parse_pattern(self.pattern)
        return p.n, p.m

    def dense_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialize ``W_hat = A · core · B`` as a plain ``(d_out, d_in)`` tensor (for squash/export).

        Example::

            >>> f = ArmorFactors(torch.eye(4)[None], torch.eye(4) * 2, torch.eye(4)[None],
            ...                  torch.eye(4, dtype=torch.bool), "1:4")
            >>> ArmorTensor.from_factors(f).dense_weight()[0]
            tensor([2., 0., 0., 0.])
        """
        if self.num_experts is not None:
            return torch.stack([w.dense_weight(dtype) for w in self.experts()])
        dtype = dtype or self.dtype
        a, core, b = (t.to(dtype) for t in (self.a_blocks, self.core_dense(), self.b_blocks))
        return block_diag_right(block_diag_left(a, core), b)

    def _stable_hash_for_caching(self) -> str:
        """Process-independent key of this weight's metadata, for torch.compile's AOT cache."""
        names, attrs = self.__tensor_flatten__()
        parts = [type(self).__qualname__, str(tuple(self.shape)), str(self.requires_grad),
                 *(f"{k}={v!r}" for k, v in sorted(attrs.items()))]
        for name in names:
            t = getattr(self, name)
            parts.append(f"{name}:{type(t).__qualname__}:{tuple(t.shape)}:{tuple(t.stride())}:{t.dtype}:{t.device.type}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def __repr__(self) -> str:
        backend = f", backend={self.backend}" if self.backend else ""
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, block_size={self.block_size}, "
            f"pattern={self.pattern}, storage={self.storage_format}{backend}, dtype={self.dtype}, device={self.device})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """The base class's dispatch (``cls._ATEN_OP_TABLE[cls]``, filled by ``ArmorTensor.implements`` and
        inherited by each storage class when it is defined); an op no handler takes raises here, saying
        what to do instead (``TorchAOBaseTensor``'s own message only names the op)."""
        if func not in cls._ATEN_OP_TABLE[cls]:
            raise unsupported(func, args)
        return super().__torch_dispatch__(func, types, args, kwargs or {})

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_factors(
        cls,
        factors: ArmorFactors,
        storage: str = "auto",
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        backend: Optional[str] = None,
        *,
        name: Optional[str] = None,
    ) -> "ArmorTensor":
        """Build the weight from :class:`~torch_armor.core.factors.ArmorFactors`.

        Args:
            factors: ``a_blocks``, ``core`` (zero off ``mask``), ``b_blocks``, ``mask``, ``pattern``.
            storage: ``"compact"``, ``"dense"``, ``"semi_structured"`` or ``"auto"`` (the storage
                policy, :func:`~torch_armor.tensor.policy.choose_storage`: 2:4 kernels on CUDA for
                fp16/bf16 2:4 cores they take, dense for other CUDA cores and for unstructured
                patterns, compact otherwise).
            dtype: floating dtype of all inner tensors (default: the core's dtype).
            device: where to put it (default: the core's device).
            backend: semi-structured backend (``"cusparselt"``/``"cutlass"``; default: the best available).
            name: the layer's module path, for warnings.

        Raises:
            ValueError: inconsistent shapes, a mask that breaks the pattern, a core nonzero off
                its mask, compact/semi-structured storage with an unstructured pattern, or
                semi-structured storage off CUDA / not fp16-bf16 / not 2:4.

        Example::

            >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
            >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
            >>> ArmorTensor.from_factors(f, storage="compact").values.shape
            torch.Size([4, 2])
        """
        if not isinstance(factors, ArmorFactors):
            raise ArmorInputError(f"expected ArmorFactors, got {type(factors).__name__}")
        a, core, b, mask = factors.a_blocks, factors.core, factors.b_blocks, factors.mask
        if core.dim() != 2:
            raise ArmorInputError(f"factors.core must be 2-D (d_out, d_in), got shape {tuple(core.shape)}")
        d_out, d_in = core.shape
        if a.dim() != 3 or a.shape[1] != a.shape[2] or a.shape[0] * a.shape[1] != d_out:
            raise ArmorInputError(
                f"factors.a_blocks must be (d_out/d_b, d_b, d_b) with d_out={d_out}, got {tuple(a.shape)}"
            )
        if b.dim() != 3 or b.shape[1] != b.shape[2] or b.shape[0] * b.shape[1] != d_in:
            raise ArmorInputError(
                f"factors.b_blocks must be (d_in/d_b, d_b, d_b) with d_in={d_in}, got {tuple(b.shape)}"
            )
        if a.shape[-1] != b.shape[-1]:
            raise ArmorInputError(f"a_blocks and b_blocks disagree on the block size: {a.shape[-1]} vs {b.shape[-1]}")
        if mask is not None and mask.shape != core.shape:
            raise ArmorInputError(f"factors.mask has shape {tuple(mask.shape)}, the core {tuple(core.shape)}")
        pattern = parse_pattern(factors.pattern)
        dtype = dtype or (core.dtype if core.is_floating_point() else torch.float32)
        if not dtype.is_floating_point:
            raise ArmorInputError(f"dtype must be a floating dtype, got {dtype}")
        device = torch.device(device) if device is not None else core.device
        choice = policy.choose_storage(policy.device_info(device), dtype, (d_out, d_in), pattern, storage,
                                       backend=backend)
        a = a.to(device=device, dtype=dtype).contiguous()
        b = b.to(device=device, dtype=dtype).contiguous()
        core = core.to(device=device, dtype=dtype).contiguous()
        mask = mask.to(device=device, dtype=torch.bool) if mask is not None else core != 0
        off = (core != 0) & ~mask
        if bool(off.any()):
            raise ArmorInputError(
                f"factors.core has {int(off.sum())} nonzero entries outside factors.mask; "
                "the core must be exactly zero off its mask (core * mask)"
            )
        if pattern.structured:
            check_nm_mask(mask, pattern.n, pattern.m)
        return _build(choice, a, b, core, str(pattern), dtype, name, mask)

    def with_storage(self, storage: str, backend: Optional[str] = None) -> "ArmorTensor":
        """The same weight with its core re-stored (``"compact"``, ``"dense"``, ``"semi_structured"``, ``"auto"``).

        Exact: the core's values are unchanged (a semi-structured request the kernel cannot
        take gives ``"dense"``, with a warning).

        Raises:
            ValueError: the core is ``"quantized"`` (re-storing it would silently dequantize);
                use :func:`torch_armor.tensor.quant.dequantize_armor_core` first if that is what you want.

        Example::

            >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
            >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
            >>> ArmorTensor.from_factors(f, storage="compact").with_storage("dense").storage_format
            'dense'
        """
        if self.num_experts is not None:
            first = self.expert(0)
            if first.with_storage(storage, backend) is first:  # the same class: no copy of the stack
                return self
            return stack_experts([w.with_storage(storage, backend) for w in self.experts()], self.layer_name)
        choice = policy.choose_storage(policy.device_info(self.device), self.dtype, tuple(self.shape),
                                       self.pattern, storage, backend=backend)
        if _format_class(choice) is type(self):
            return self
        return _build(choice, self.a_blocks, self.b_blocks, self.core_dense(), self.pattern, self.dtype,
                      self.layer_name)

    def moved(self, device: Union[str, torch.device], dtype: torch.dtype,
               non_blocking: bool = False) -> "ArmorTensor":
        """``.to(device, dtype)``: inner tensors moved and cast, the storage chosen again for the target."""
        if not dtype.is_floating_point:
            raise ArmorInputError(
                f"ArmorTensor holds floating-point factors and cannot be cast to {dtype}; "
                "quantize the core with torch_armor's quantization helpers instead"
            )
        if self.num_experts is not None:
            return stack_experts([w.moved(device, dtype, non_blocking) for w in self.experts()], self.layer_name)
        device = torch.device(device)
        choice = policy.choose_storage(policy.device_info(device), dtype, tuple(self.shape), self.pattern,
                                       current=self.storage_format)
        if _format_class(choice) is type(self) and self._movable(device, dtype):
            out = self._parts_to(device, dtype, non_blocking)
            out.layer_name = self.layer_name
            policy.warn_fallback(self.layer_name, tuple(self.shape), choice)
            return out
        a, b, core = (_move(t, device, dtype, non_blocking) for t in (self.a_blocks, self.b_blocks, self.core_dense()))
        return _build(choice, a, b, core, self.pattern, dtype, self.layer_name)


def _move(t: torch.Tensor, device: torch.device, dtype: torch.dtype, non_blocking: bool = False) -> torch.Tensor:
    """``t`` on ``device``, cast to ``dtype`` if floating (itself when nothing changes). The aten op, not
    ``Tensor.to``: the storage policy has already queried (and so initialized) the target device."""
    dtype = dtype if t.is_floating_point() else t.dtype
    if t.device == device and t.dtype == dtype:
        return t
    return torch.ops.aten._to_copy.default(t, device=device, dtype=dtype, non_blocking=non_blocking)


def unsupported(func, args) -> NotImplementedError:
    """The error for an op no handler takes: what an ArmorTensor runs, and what to use instead."""
    if any(isinstance(a, ArmorTensor) and a.num_experts is not None for a in args):
        return NotImplementedError(f"ARMOR experts (E factored layers, an (E, d_out, d_in) ArmorTensor) do not "
                                   f"support {func}; {EXPERTS_HINT}")
    return NotImplementedError(
        f"ArmorTensor does not support {func}: it stores W = A·core·B in factored form and only runs "
        "F.linear, device/dtype moves, detach, clone and copy_. To save a converted model use "
        "torch_armor.save_pretrained(model, directory); to "
        "quantize it with torchao, quantize_(model, torch_armor.tensor.quant.ArmorCoreConfig("
        "Int8WeightOnlyConfig())); for the materialized matrix use weight.dense_weight()"
    )


def stack_experts(experts: Sequence[ArmorTensor], name: Optional[str] = None) -> ArmorTensor:
    """One ``(E, d_out, d_in)`` weight of the experts' class from E 2-D ArmorTensors of the same class, shape,
    block size, pattern, dtype and device: every inner tensor stacked along a new leading dimension.

    Raises:
        ArmorInputError: no experts, a non-ArmorTensor, experts that differ, or 8-bit / quantized cores.
    """
    where = name or "experts"
    if not experts:
        raise ArmorInputError(f"{where}: stacking experts needs one ArmorTensor per expert, got none")
    first = experts[0]
    for e, w in enumerate(experts):
        if not isinstance(w, ArmorTensor) or w.num_experts is not None:
            shape = tuple(getattr(w, "shape", ()))
            raise ArmorInputError(f"{where}: expert {e} is a {type(w).__name__} {shape}, not an ArmorTensor of one expert (2-D)")
        same = (type(w), tuple(w.shape), w.block_size, w.pattern, w.dtype, w.device)
        want = (type(first), tuple(first.shape), first.block_size, first.pattern, first.dtype, first.device)
        if same != want:
            raise ArmorInputError(
                f"{where}: expert {e} is a {same[0].__name__} {same[1]} with block size {same[2]}, pattern {same[3]}, "
                f"{same[4]} on {same[5]}, expert 0 a {want[0].__name__} {want[1]} with block size {want[2]}, pattern "
                f"{want[3]}, {want[4]} on {want[5]}; the experts of one parameter must share them (give every "
                f"'{where}.<e>' the same block size and pattern)")
    if first.storage_format not in STORAGES:
        raise ArmorInputError(
            f"{where}: experts with {type(first).__name__} cores cannot be stacked: quantized (8-bit, torchao) expert "
            "cores are not supported yet; keep the experts' cores floating (quantize_ skips them) or dequantize first")
    names, attributes = first.__tensor_flatten__()
    return type(first)(**{n: torch.stack([getattr(w, n) for w in experts]) for n in names}, **attributes,
                       layer_name=name)


def _build(choice: StorageChoice, a: torch.Tensor, b: torch.Tensor, core: torch.Tensor, pattern: str,
           dtype: torch.dtype, name: Optional[str], mask: Optional[torch.Tensor] = None) -> ArmorTensor:
    """The weight in ``choice``'s format (dense, with the kernel's reason, where the kernel refuses the core)."""
    try:
        w = _format_class(choice).from_core(a, b, core, pattern, dtype, mask)
    except KernelRefused as err:
        choice = StorageChoice("dense", reason=str(err))
        w = _format_class(choice).from_core(a, b, core, pattern, dtype, mask)
    policy.warn_fallback(name, tuple(core.shape), choice)
    w.layer_name = name
    return w


def from_parts(storage: str, a_blocks: torch.Tensor, b_blocks: torch.Tensor, pattern: str, dtype: torch.dtype,
               backend: Optional[str] = None, **parts) -> ArmorTensor:
    """The ArmorTensor of ``storage`` (and ``backend``) from its inner tensors, as they were saved
    (``core=`` for dense, ``values=``/``indices=`` for compact...; ``quant_config=`` for quantized)."""
    cls = _FORMATS.get((storage, backend))
    if cls is None:
        raise ArmorInputError(f"no ArmorTensor storage {storage!r} (backend {backend!r}); expected one of "
                              f"{sorted(set(s for s, _ in _FORMATS))}")
    unknown = sorted(set(parts) - set(cls.tensor_data_names) - set(getattr(cls, "optional_tensor_attribute_names", ())))
    if unknown:
        raise ArmorInputError(f"{storage} ArmorTensor has no inner tensors {unknown}")
    return cls(a_blocks=a_blocks, b_blocks=b_blocks, pattern=pattern, dtype=dtype, **parts)


def restore_storage(w: ArmorTensor, saved: str, requested: Optional[str] = None,
                    name: Optional[str] = None) -> ArmorTensor:
    """The storage a loaded weight gets: ``requested`` if given; on CUDA the policy's choice for its
    dtype and shape (a checkpoint pruned on CPU or in fp32 still gets 2:4 cores on a GPU); elsewhere
    the storage it was saved with (a semi-structured one becomes compact). Quantized cores stay."""
    w.layer_name = name if name is not None else w.layer_name
    if w.storage_format == QUANTIZED:
        return w
    cuda = w.device.type == "cuda"
    if requested is None:
        requested = "auto" if cuda else ("compact" if saved == "semi_structured" else saved)
    elif requested == "semi_structured" and not (cuda and w.dtype in policy.HALF_DTYPES):
        fallback = "auto" if cuda else "compact"  # no 2:4 kernel here: the best this device has
        warnings.warn(f"{name or w.layer_name or 'an ARMOR layer'}: storage='semi_structured' needs a CUDA GPU and "
                      f"float16/bfloat16 (this weight: {w.device.type}, {w.dtype}); loaded with "
                      f"storage={fallback!r}", policy.ArmorStorageWarning, stacklevel=2)
        requested = fallback
    return w.with_storage(requested)


@ArmorTensor.implements(aten.linear.default)
@ArmorTensor.implements_torch_function(F.linear)
def _(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(w, ArmorTensor):
        raise NotImplementedError("ArmorTensor linear: only the weight may be an ArmorTensor")
    if w.num_experts is not None:
        raise unsupported(func, args)
    d_out, d_in = w.shape
    if x.shape[-1] != d_in:
        raise ArmorInputError(
            f"linear: input has {x.shape[-1]} features in its last dimension, the ArmorTensor weight "
            f"expects d_in={d_in} (weight shape {(d_out, d_in)})"
        )
    return w._linear(x, bias)


def armor_linear_from_factors(
    linear: nn.Linear, factors: ArmorFactors, storage: str = "auto", backend: Optional[str] = None,
    *, name: Optional[str] = None,
) -> nn.Linear:
    """Replace ``linear.weight`` in place by an :class:`ArmorTensor` built from ``factors``.

    The weight keeps the module's current device and dtype; ``bias`` is untouched. The new
    weight is ``nn.Parameter(ArmorTensor, requires_grad=False)``, as torchao swaps weights.
    ``name`` (the module path) names the layer in storage warnings.

    Raises:
        ValueError: ``linear`` is not an ``nn.Linear`` or its shape differs from the factors'.

    Example::

        >>> lin = nn.Linear(8, 4)
        >>> core = torch.tensor([[0.0, 1.0, 0.0, 1.0]] * 4).repeat(1, 2)
        >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4).repeat(2, 1, 1), core != 0, "2:4")
        >>> type(armor_linear_from_factors(lin, f).weight).__name__
        'CompactArmorTensor'
    """
    if not isinstance(linear, nn.Linear):
        raise ArmorInputError(f"expected an nn.Linear, got {type(linear).__name__}")
    if tuple(factors.core.shape) != (linear.out_features, linear.in_features):
        raise ArmorInputError(
            f"factors are for a {tuple(factors.core.shape)} weight, the linear's weight is "
            f"({linear.out_features}, {linear.in_features})"
        )
    weight = linear.weight
    dtype = weight.dtype
    device = weight.device if weight.device.type != "meta" else factors.core.device
    new = ArmorTensor.from_factors(factors, storage=storage, dtype=dtype, device=device, backend=backend, name=name)
    linear.weight = nn.Parameter(new, requires_grad=False)
    return linear
