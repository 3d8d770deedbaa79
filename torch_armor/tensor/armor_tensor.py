"""ArmorTensor: a converted linear weight ``W_hat = A · core · B`` that never materializes ``W_hat``.

An :class:`ArmorTensor` stands in for ``module.weight`` of an ``nn.Linear``. It holds the
block-diagonal wrappers ``a_blocks (d_out/d_b, d_b, d_b)`` and ``b_blocks (d_in/d_b, d_b, d_b)``
and the N:M sparse core in one of three storages:

* ``"compact"``: kept values ``(d_out, d_in·N/M)`` + bit-packed in-group indices (see
  :func:`torch_armor.tensor.packing.pack_nm`): half the core bytes plus one bit per entry for 2:4.
  Any device and dtype; each linear call unpacks the core to dense (a cheap scatter), so
  it saves memory, not time.
* ``"dense"``: the core as a dense matrix with exact zeros (fastest on CPU; any pattern,
  including unstructured).
* ``"semi_structured"``: a :class:`torch.sparse.SparseSemiStructuredTensor` (CUDA,
  fp16/bf16, 2:4), backend chosen explicitly (cuSPARSELt when available, else CUTLASS).
  Shapes the kernel cannot take fall back to ``"dense"`` with a one-time warning.
* ``"quantized"``: a torchao quantized tensor (e.g. ``Int8Tensor``) built by
  :func:`torch_armor.tensor.quant.quantize_armor_core` / ``quantize_(model, ArmorCoreConfig(...))``;
  the core matmul is ``F.linear(x_b, core)``, so torchao's own dispatch does the int8 math.
  ``A`` and ``B`` stay in the weight's (activation) dtype; ``quant_config`` records the
  torchao config that built the core (used to save and reload it).

``F.linear(x, w, bias)`` computes ``y = ((x·Bᵀ) · coreᵀ) · Aᵀ + bias`` with two batched
block products around one (sparse) matmul; ``y`` matches ``x @ W_hat.T + bias`` within
floating-point tolerance.

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> d_b, d_out, d_in = 4, 8, 16
    >>> core = torch.tensor([1.0, 0.0, -2.0, 0.0]).repeat(d_out, d_in // 4)
    >>> factors = ArmorFactors(torch.randn(d_out // d_b, d_b, d_b), core,
    ...                        torch.randn(d_in // d_b, d_b, d_b), core != 0, "2:4")
    >>> w = ArmorTensor.from_factors(factors, storage="compact")
    >>> w
    ArmorTensor(shape=(8, 16), block_size=4, pattern=2:4, storage=compact, dtype=torch.float32, device=cpu)
    >>> x = torch.randn(3, d_in)
    >>> torch.allclose(torch.nn.functional.linear(x, w), x @ factors.dense().T, atol=1e-5)
    True
"""

from __future__ import annotations

import hashlib
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import return_and_correct_aliasing
from torchao.utils import TorchAOBaseTensor

from torch_armor.core.blockdiag import block_diag_left, block_diag_right
from torch_armor.core.pattern import parse_pattern
from torch_armor.core.factors import ArmorFactors
from torch_armor.tensor.packing import check_nm_mask, pack_nm, semi_structured_supported, to_semi_structured, unpack_nm

__all__ = ["ArmorTensor", "StorageKind", "armor_linear_from_factors", "STORAGES", "QUANTIZED"]

aten = torch.ops.aten

STORAGES = ("compact", "dense", "semi_structured")
#: storage kind of a core quantized by torch_armor.tensor.quant (not a target of ``with_storage``)
QUANTIZED = "quantized"
_HALF_DTYPES = (torch.float16, torch.bfloat16)


class StorageKind(str):
    """The name of an ArmorTensor's core storage (``"compact"``, ``"dense"``…): a ``str``.

    ``ArmorTensor.storage`` shadows ``torch.Tensor.storage()``; calling it (as
    ``safetensors.torch.save_model`` or a model's ``save_pretrained`` without the ARMOR quantizer
    do) raises an error that says how to save a converted model instead.
    """

    def __call__(self, *args, **kwargs):
        raise TypeError(
            "an ArmorTensor has no single storage: it holds W = A·core·B as separate tensors "
            f"(core storage: {str(self)!r}). Save a converted model with model.save_pretrained(directory) "
            "(after import torch_armor; for a model you converted by hand call "
            "torch_armor.attach_quantizer(model) first) or torch_armor.save_pretrained(model, directory)"
        )


def _blockwise_right_t(x2d: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``x2d @ blockdiag(blocks)ᵀ`` for ``x2d (T, n·d_b)``, one bmm over the ``n`` blocks."""
    n, d_b, _ = blocks.shape
    t = x2d.shape[0]
    out = torch.bmm(x2d.reshape(t, n, d_b).transpose(0, 1), blocks.transpose(1, 2))  # (n, T, d_b)
    return out.transpose(0, 1).reshape(t, n * d_b)


class ArmorTensor(TorchAOBaseTensor):
    """The weight ``W_hat = blockdiag(a_blocks) · core · blockdiag(b_blocks)`` of one linear layer.

    Build it with :meth:`from_factors` (or :func:`armor_linear_from_factors` to swap it into an
    ``nn.Linear``). Logical shape ``(d_out, d_in)`` and dtype are those of ``W_hat``.

    Tensor data: ``a_blocks``, ``b_blocks`` (always), and for the core either ``core``
    (``"dense"``: a dense matrix; ``"semi_structured"``: a SparseSemiStructuredTensor;
    ``"quantized"``: a torchao quantized tensor) or ``values`` + ``indices`` (``"compact"``).

    Attributes: ``pattern`` (``"N:M"`` or ``"unstructured:F"``), ``storage``, ``dtype``, and
    ``quant_config`` (the torchao config of a ``"quantized"`` core, else ``None``).

    Only ``F.linear``, device/dtype moves, ``detach``/``clone`` and the like are supported:
    other ops (``view``, ``abs``, ``t``...) raise ``NotImplementedError`` saying what to use
    instead (``dense_weight()``, or ``ArmorCoreConfig`` to quantize with torchao).

    ``.to(device)``, ``.to(dtype)``, ``.half()``, ``.bfloat16()`` really convert the inner tensors
    (indices stay ``uint8``). A semi-structured core moved off CUDA or to fp32 becomes compact;
    use :meth:`with_storage` to pick a storage explicitly.

    Example::

        >>> d_b = 4
        >>> core = torch.tensor([0.0, 3.0, 0.0, 1.0]).repeat(8, 2)
        >>> f = ArmorFactors(torch.eye(d_b).repeat(2, 1, 1), core, torch.eye(d_b).repeat(2, 1, 1),
        ...                  core != 0, "2:4")
        >>> w = ArmorTensor.from_factors(f, storage="dense").bfloat16()
        >>> w.dtype, w.core.dtype, w.storage
        (torch.bfloat16, torch.bfloat16, 'dense')
        >>> torch.equal(w.dense_weight().float(), core)
        True
    """

    tensor_data_names = ["a_blocks", "b_blocks"]
    tensor_attribute_names = ["pattern", "storage", "dtype"]
    optional_tensor_data_names = ["core", "values", "indices"]
    optional_tensor_attribute_names = ["quant_config"]

    def __new__(
        cls,
        a_blocks: torch.Tensor,
        b_blocks: torch.Tensor,
        pattern: str,
        storage: str,
        dtype: torch.dtype,
        core: Optional[torch.Tensor] = None,
        values: Optional[torch.Tensor] = None,
        indices: Optional[torch.Tensor] = None,
        quant_config: Optional[object] = None,
    ):
        shape = (a_blocks.shape[0] * a_blocks.shape[1], b_blocks.shape[0] * b_blocks.shape[1])
        return torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=a_blocks.device, requires_grad=False
        )

    def __init__(
        self,
        a_blocks: torch.Tensor,
        b_blocks: torch.Tensor,
        pattern: str,
        storage: str,
        dtype: torch.dtype,
        core: Optional[torch.Tensor] = None,
        values: Optional[torch.Tensor] = None,
        indices: Optional[torch.Tensor] = None,
        quant_config: Optional[object] = None,
    ):
        super().__init__()
        self.a_blocks = a_blocks
        self.b_blocks = b_blocks
        self.pattern = pattern
        self.storage = StorageKind(storage)
        # dtype is set by _make_wrapper_subclass in __new__
        self.core = core
        self.values = values
        self.indices = indices
        self.quant_config = quant_config

    # ------------------------------------------------------------------ properties

    @property
    def block_size(self) -> int:
        """Size ``d_b`` of the diagonal blocks of ``A`` and ``B``."""
        return self.a_blocks.shape[-1]

    @property
    def nm(self) -> tuple[int, int]:
        """``(N, M)`` of the pattern; ``(0, 0)`` for unstructured."""
        p = parse_pattern(self.pattern)
        return p.n, p.m

    def core_dense(self) -> torch.Tensor:
        """The core ``W' ⊙ M`` as a dense ``(d_out, d_in)`` matrix in the weight's dtype.

        For ``"compact"`` storage this unpacks (exactly); ``"dense"`` returns the stored tensor;
        ``"quantized"`` dequantizes (the values the quantized matmul effectively uses).
        """
        if self.storage == QUANTIZED:
            dequantize = getattr(self.core, "dequantize", None)
            if dequantize is None:
                raise NotImplementedError(
                    f"the quantized core is a {type(self.core).__name__} without dequantize(); "
                    "it can run F.linear but cannot be materialized"
                )
            return dequantize().to(self.dtype)
        if self.storage == "compact":
            n, m = self.nm
            return unpack_nm(self.values, self.indices, n, m, self.shape[1])
        if self.storage == "semi_structured":
            return self.core.to_dense()
        return self.core

    def dense_weight(self, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """Materialize ``W_hat = A · core · B`` as a plain ``(d_out, d_in)`` tensor (for squash/export).

        Example::

            >>> f = ArmorFactors(torch.eye(4)[None], torch.eye(4) * 2, torch.eye(4)[None],
            ...                  torch.eye(4, dtype=torch.bool), "1:4")
            >>> ArmorTensor.from_factors(f).dense_weight()[0]
            tensor([2., 0., 0., 0.])
        """
        dtype = dtype or self.dtype
        a, core, b = (t.to(dtype) for t in (self.a_blocks, self.core_dense(), self.b_blocks))
        return block_diag_right(block_diag_left(a, core), b)

    def _stable_hash_for_caching(self) -> str:
        """Process-independent key of this weight's metadata, for torch.compile's AOT cache."""
        names, _ = self.__tensor_flatten__()
        parts = [type(self).__qualname__, str(tuple(self.shape)), str(self.requires_grad),
                 self.pattern, self.storage, str(self.dtype), repr(self.quant_config)]
        for name in names:
            t = getattr(self, name)
            parts.append(f"{name}:{type(t).__qualname__}:{tuple(t.shape)}:{tuple(t.stride())}:{t.dtype}:{t.device.type}")
        return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()

    def __repr__(self) -> str:
        d_out, d_in = self.shape
        return (
            f"{self.__class__.__name__}(shape=({d_out}, {d_in}), block_size={self.block_size}, "
            f"pattern={self.pattern}, storage={self.storage}, dtype={self.dtype}, device={self.device})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        """Run the ops registered with ``implements``; explain what to do for any other op."""
        kwargs = {} if kwargs is None else kwargs
        table = getattr(cls, "_ATEN_OP_TABLE", {}).get(cls, {})
        if func in table:
            return table[func](func, types, args, kwargs)
        raise NotImplementedError(
            f"ArmorTensor does not support {func}: it stores W = A·core·B in factored form and "
            "only runs F.linear, device/dtype moves, detach and clone. To quantize a converted "
            "model with torchao, wrap the config: quantize_(model, "
            "torch_armor.tensor.quant.ArmorCoreConfig(Int8WeightOnlyConfig())) quantizes the core; for the "
            "materialized matrix use weight.dense_weight()"
        )

    # ---------------------------------------------------------------- constructors

    @classmethod
    def from_factors(
        cls,
        factors: ArmorFactors,
        storage: str = "auto",
        dtype: Optional[torch.dtype] = None,
        device: Optional[Union[str, torch.device]] = None,
        backend: Optional[str] = None,
    ) -> "ArmorTensor":
        """Build the weight from :class:`~torch_armor.core.factors.ArmorFactors`.

        Args:
            factors: ``a_blocks``, ``core`` (zero off ``mask``), ``b_blocks``, ``mask``, ``pattern``.
            storage: ``"compact"``, ``"dense"``, ``"semi_structured"`` or ``"auto"``:
                semi-structured on CUDA for fp16/bf16 2:4 cores the kernel can take, dense for
                other CUDA cores and for unstructured patterns, compact otherwise (CPU N:M).
            dtype: floating dtype of all inner tensors (default: the core's dtype).
            device: where to put it (default: the core's device).
            backend: semi-structured backend (``"cusparselt"``/``"cutlass"``; default: automatic).

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
            raise ValueError(f"expected ArmorFactors, got {type(factors).__name__}")
        a, core, b, mask = factors.a_blocks, factors.core, factors.b_blocks, factors.mask
        if core.dim() != 2:
            raise ValueError(f"factors.core must be 2-D (d_out, d_in), got shape {tuple(core.shape)}")
        d_out, d_in = core.shape
        if a.dim() != 3 or a.shape[1] != a.shape[2] or a.shape[0] * a.shape[1] != d_out:
            raise ValueError(
                f"factors.a_blocks must be (d_out/d_b, d_b, d_b) with d_out={d_out}, got {tuple(a.shape)}"
            )
        if b.dim() != 3 or b.shape[1] != b.shape[2] or b.shape[0] * b.shape[1] != d_in:
            raise ValueError(
                f"factors.b_blocks must be (d_in/d_b, d_b, d_b) with d_in={d_in}, got {tuple(b.shape)}"
            )
        if a.shape[-1] != b.shape[-1]:
            raise ValueError(f"a_blocks and b_blocks disagree on the block size: {a.shape[-1]} vs {b.shape[-1]}")
        if mask is not None and mask.shape != core.shape:
            raise ValueError(f"factors.mask has shape {tuple(mask.shape)}, the core {tuple(core.shape)}")
        pattern = parse_pattern(factors.pattern)
        dtype = dtype or (core.dtype if core.is_floating_point() else torch.float32)
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating dtype, got {dtype}")
        device = torch.device(device) if device is not None else core.device
        a = a.to(device=device, dtype=dtype).contiguous()
        b = b.to(device=device, dtype=dtype).contiguous()
        core = core.to(device=device, dtype=dtype).contiguous()
        mask = mask.to(device=device, dtype=torch.bool) if mask is not None else core != 0
        off = (core != 0) & ~mask
        if bool(off.any()):
            raise ValueError(
                f"factors.core has {int(off.sum())} nonzero entries outside factors.mask; "
                "the core must be exactly zero off its mask (core * mask)"
            )
        if pattern.structured:
            check_nm_mask(mask, pattern.n, pattern.m)

        storage = cls._resolve_storage(storage, str(pattern), core, backend)
        if storage == "compact":
            values, indices = pack_nm(core, pattern.n, pattern.m, mask=mask)
            return cls(a, b, str(pattern), "compact", dtype, values=values, indices=indices)
        if storage == "semi_structured":
            sparse = to_semi_structured(core, backend)
            kind = "semi_structured" if sparse is not core else "dense"
            return cls(a, b, str(pattern), kind, dtype, core=sparse)
        return cls(a, b, str(pattern), "dense", dtype, core=core)

    @staticmethod
    def _resolve_storage(storage: str, pattern: str, core: torch.Tensor, backend: Optional[str]) -> str:
        p = parse_pattern(pattern)
        if storage == "auto":
            if not p.structured:
                return "dense"
            if core.is_cuda:
                if (p.n, p.m) == (2, 4) and semi_structured_supported(core, backend):
                    return "semi_structured"
                return "dense"
            return "compact"
        if storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES + ('auto',)}, got {storage!r}")
        if storage in ("compact", "semi_structured") and not p.structured:
            raise ValueError(
                f"storage={storage!r} needs an N:M pattern, the factors are {pattern!r}; use storage='dense'"
            )
        if storage == "semi_structured":
            if (p.n, p.m) != (2, 4):
                raise ValueError(
                    f"semi-structured kernels take 2:4 only, the factors are {pattern}; use 'compact' or 'dense'"
                )
            if not core.is_cuda or core.dtype not in _HALF_DTYPES:
                raise ValueError(
                    "storage='semi_structured' needs a CUDA float16/bfloat16 core, got "
                    f"{core.device} {core.dtype}; pass device='cuda' and dtype=torch.float16, "
                    "or use storage='compact'/'dense'"
                )
        return storage

    def with_storage(self, storage: str, backend: Optional[str] = None) -> "ArmorTensor":
        """The same weight with its core re-stored (``"compact"``, ``"dense"``, ``"semi_structured"``, ``"auto"``).

        Exact: the core's values are unchanged (a semi-structured request the kernel cannot
        take gives ``"dense"``, with a one-time warning).

        Raises:
            ValueError: the core is ``"quantized"`` (re-storing it would silently dequantize);
                use :func:`torch_armor.tensor.quant.dequantize_armor_core` first if that is what you want.

        Example::

            >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
            >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4")
            >>> ArmorTensor.from_factors(f, storage="compact").with_storage("dense").storage
            'dense'
        """
        if self.storage == QUANTIZED:
            if storage == QUANTIZED:
                return self
            raise ValueError(
                f"this ArmorTensor's core is quantized ({type(self.core).__name__}); re-storing it as "
                f"{storage!r} would dequantize it. Call torch_armor.tensor.quant.dequantize_armor_core(weight) "
                "first to get a floating-point core, then with_storage()"
            )
        core = self.core_dense()
        target = self._resolve_storage(storage, self.pattern, core, backend)
        if target == self.storage:
            return self
        a, b, dtype = self.a_blocks, self.b_blocks, self.dtype
        if target == "compact":
            n, m = self.nm
            values, indices = pack_nm(core, n, m)
            return self.__class__(a, b, self.pattern, "compact", dtype, values=values, indices=indices)
        if target == "semi_structured":
            sparse = to_semi_structured(core, backend)
            kind = "semi_structured" if sparse is not core else "dense"
            return self.__class__(a, b, self.pattern, kind, dtype, core=sparse)
        return self.__class__(a, b, self.pattern, "dense", dtype, core=core)

    def _converted(
        self, device: torch.device, dtype: torch.dtype, non_blocking: bool = False
    ) -> "ArmorTensor":
        """Copy with every floating inner tensor moved to ``device`` and cast to ``dtype``."""
        if not dtype.is_floating_point:
            raise ValueError(
                f"ArmorTensor holds floating-point factors and cannot be cast to {dtype}; "
                "quantize the core with torch_armor's quantization helpers instead"
            )
        device = torch.device(device)

        def move(t: Optional[torch.Tensor], cast: bool = True) -> Optional[torch.Tensor]:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if cast else t.dtype, non_blocking=non_blocking)

        a, b = move(self.a_blocks), move(self.b_blocks)
        if self.storage == QUANTIZED:
            # torchao quantized tensors keep their own (integer) data and scales: move, don't cast
            core = self.core.to(device=device, non_blocking=non_blocking)
            return self.__class__(a, b, self.pattern, QUANTIZED, dtype, core=core, quant_config=self.quant_config)
        if self.storage == "compact":
            return self.__class__(
                a, b, self.pattern, "compact", dtype, values=move(self.values), indices=move(self.indices, False)
            )
        if self.storage == "semi_structured":
            here = self.core.device
            same = device.type == here.type and device.index in (None, here.index) and dtype == self.dtype
            if same:
                return self.__class__(a, b, self.pattern, "semi_structured", dtype, core=self.core)
            core = move(self.core_dense())
            if device.type == "cuda" and dtype in _HALF_DTYPES:
                sparse = to_semi_structured(core, getattr(self.core, "BACKEND", None))
                kind = "semi_structured" if sparse is not core else "dense"
                return self.__class__(a, b, self.pattern, kind, dtype, core=sparse)
            n, m = self.nm
            values, indices = pack_nm(core, n, m)
            return self.__class__(a, b, self.pattern, "compact", dtype, values=values, indices=indices)
        return self.__class__(a, b, self.pattern, "dense", dtype, core=move(self.core))


implements = ArmorTensor.implements
implements_torch_function = ArmorTensor.implements_torch_function


def _armor_linear(x: torch.Tensor, w: ArmorTensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """``x @ W_hatᵀ + bias`` as ``((x · Bᵀ) · coreᵀ) · Aᵀ + bias``, computed in ``x``'s dtype."""
    d_out, d_in = w.shape
    if x.shape[-1] != d_in:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features in its last dimension, the ArmorTensor weight "
            f"expects d_in={d_in} (weight shape {(d_out, d_in)})"
        )
    lead = x.shape[:-1]
    dtype = x.dtype
    x2d = x.reshape(-1, d_in)
    h = _blockwise_right_t(x2d, w.b_blocks.to(dtype))
    if w.storage == QUANTIZED:
        h = F.linear(h, w.core)  # torchao's dispatch (int8 weight-only / dynamic activation ...)
    elif w.storage == "semi_structured" and dtype == w.dtype:
        h = F.linear(h, w.core)
    else:
        core = w.core_dense()
        h = torch.mm(h, core.to(dtype).t())
    y = _blockwise_right_t(h, w.a_blocks.to(dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, d_out)


@implements(aten.linear.default)
@implements_torch_function(F.linear)
def _(func, types, args, kwargs):
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if not isinstance(w, ArmorTensor):
        raise NotImplementedError("ArmorTensor linear: only the weight may be an ArmorTensor")
    return _armor_linear(x, w, bias)


@implements(aten.t.default)
def _(func, types, args, kwargs):
    raise NotImplementedError(
        "ArmorTensor does not support transposition (.t()); use F.linear(x, weight) or "
        "weight.dense_weight().t() if you need the materialized matrix"
    )


@implements(aten._to_copy.default)
def _(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device") or self.device
    dtype = kwargs.get("dtype") or self.dtype
    out = self._converted(device, dtype, kwargs.get("non_blocking", False) or False)
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.to.dtype_layout)
def _(func, types, args, kwargs):
    self = args[0]
    device = kwargs.get("device") or self.device
    dtype = kwargs.get("dtype") or self.dtype
    if torch.device(device) == self.device and dtype == self.dtype:
        return self
    return self._converted(device, dtype)


def armor_linear_from_factors(
    linear: nn.Linear, factors: ArmorFactors, storage: str = "auto", backend: Optional[str] = None
) -> nn.Linear:
    """Replace ``linear.weight`` in place by an :class:`ArmorTensor` built from ``factors``.

    The weight keeps the module's current device and dtype; ``bias`` is untouched. The new
    weight is ``nn.Parameter(ArmorTensor, requires_grad=False)``, as torchao swaps weights.

    Raises:
        ValueError: ``linear`` is not an ``nn.Linear`` or its shape differs from the factors'.

    Example::

        >>> lin = nn.Linear(8, 4)
        >>> core = torch.tensor([[0.0, 1.0, 0.0, 1.0]] * 4).repeat(1, 2)
        >>> f = ArmorFactors(torch.eye(4)[None], core, torch.eye(4).repeat(2, 1, 1), core != 0, "2:4")
        >>> type(armor_linear_from_factors(lin, f).weight).__name__
        'ArmorTensor'
    """
    if not isinstance(linear, nn.Linear):
        raise ValueError(f"expected an nn.Linear, got {type(linear).__name__}")
    if tuple(factors.core.shape) != (linear.out_features, linear.in_features):
        raise ValueError(
            f"factors are for a {tuple(factors.core.shape)} weight, the linear's weight is "
            f"({linear.out_features}, {linear.in_features})"
        )
    weight = linear.weight
    dtype = weight.dtype
    device = weight.device if weight.device.type != "meta" else factors.core.device
    new = ArmorTensor.from_factors(factors, storage=storage, dtype=dtype, device=device, backend=backend)
    linear.weight = nn.Parameter(new, requires_grad=False)
    return linear

