"""Plain PyTorch interop of :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weights.

* ``.to()``, ``.cuda()``, ``.half()``, ``module.to(...)``: every inner tensor is moved and cast and the
  storage is chosen again for the target (:meth:`ArmorTensor.moved`); ``detach``/``clone``/``alias``
  apply to every inner tensor; ``w.T`` / ``w.t()`` give :class:`~torch_armor.tensor.transposed.ArmorTransposed`
  (``x.matmul(w.T)`` runs ``F.linear(x, w)``); other ops on the factored matrix raise, saying what to use.
* ``torch.save(model.state_dict())`` + ``torch.load(..., weights_only=True)``: every format class
  registers itself as a safe global (each in its own module).
* ``load_state_dict`` between models with ArmorTensor layers copies part by part (``copy_``); a
  source in another format, device or dtype is first converted to the destination's (a CPU
  checkpoint with compact cores loads into a GPU model with 2:4 cores). Loading an ARMOR state
  dict into a dense model (or the reverse) raises an error saying what to do instead.
* ``weight.storage()`` (``torch.Tensor.storage``, which ``safetensors.torch.save_model`` and a model's
  ``save_pretrained`` without the ARMOR quantizer reach) raises an error that says how to save a
  converted model: an ArmorTensor has no single storage.
* ``weight.requires_grad_(True)`` raises, pointing to :func:`torch_armor.enable_finetuning`
  (the ArmorTensor is a container: its gradient would never be computed).

The handlers go into ``ArmorTensor``'s own op tables (``ArmorTensor.implements``); a storage class
copies its parent's tables when it is defined, so :mod:`torch_armor.tensor` (its ``__init__``, which
runs before any of its modules) imports this module right after ``armor_tensor`` and before every
storage class.

Example::

    >>> import torch
    >>> from torch_armor.core.factors import ArmorFactors
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4)
    >>> w = ArmorTensor.from_factors(ArmorFactors(torch.eye(4)[None], core, torch.eye(4)[None], core != 0, "2:4"))
    >>> w.requires_grad_(True)
    Traceback (most recent call last):
    ...
    RuntimeError: an ArmorTensor weight cannot require grad itself: ...
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch.utils._python_dispatch import return_and_correct_aliasing

from torch_armor.errors import ArmorInputError
from torch_armor.tensor.armor_tensor import ArmorTensor
from torch_armor.tensor.transposed import ArmorTransposed

aten = torch.ops.aten
implements = ArmorTensor.implements
implements_torch_function = ArmorTensor.implements_torch_function


def _moved_kwargs(self: ArmorTensor, kwargs: dict) -> Tuple[torch.device, torch.dtype]:
    return torch.device(kwargs.get("device") or self.device), kwargs.get("dtype") or self.dtype


@implements(aten._to_copy.default)
def _(func, types, args, kwargs):
    self = args[0]
    device, dtype = _moved_kwargs(self, kwargs)
    out = self.moved(device, dtype, kwargs.get("non_blocking", False) or False)
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.to.dtype_layout)
def _(func, types, args, kwargs):
    self = args[0]
    device, dtype = _moved_kwargs(self, kwargs)
    if device == self.device and dtype == self.dtype:
        return self
    return self.moved(device, dtype)


@implements_torch_function(torch.Tensor.to)
def _(func, types, args, kwargs):
    self = args[0]
    kwargs = dict(kwargs)
    copy = kwargs.pop("copy", False)
    device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    device = torch.device(device) if device is not None else self.device
    dtype = dtype or self.dtype
    if device == self.device and dtype == self.dtype and not copy:
        return self
    return self.moved(device, dtype, non_blocking)


@implements([aten.detach.default, aten.clone.default, aten.alias.default, aten.contiguous.default])
def _(func, types, args, kwargs):
    self = args[0]
    out = self._apply_fn_to_data(lambda t: func(t, *args[1:], **kwargs))
    out.layer_name = self.layer_name
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.t.default)
def _(func, types, args, kwargs):
    raise NotImplementedError(
        "ArmorTensor does not support transposition (.t()); use F.linear(x, weight) or "
        "weight.dense_weight().t() if you need the materialized matrix"
    )


@implements_torch_function([torch.Tensor.T.__get__, torch.Tensor.t])
def _(func, types, args, kwargs):
    if args[0].num_experts is not None:  # aten.t of a 3-D tensor: the error below
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    return ArmorTransposed(args[0])


@implements_torch_function(torch._has_compatible_shallow_copy_type)
def _(func, types, args, kwargs):
    return type(args[0]) is type(args[1]) and args[0].shape == args[1].shape


@implements_torch_function(torch.Tensor.contiguous)
def _(func, types, args, kwargs):
    return args[0]


@implements_torch_function(torch.Tensor.storage)
def _(func, types, args, kwargs):
    if args[0].num_experts is not None:
        raise TypeError(
            "ARMOR experts (an (E, d_out, d_in) ArmorTensor) have no single storage: they hold E ARMOR experts as "
            "separate stacked tensors. Save the model with torch_armor.save_pretrained(model, directory) (the "
            "Hugging Face format: AutoModelForCausalLM.from_pretrained reads it after import torch_armor)")
    raise TypeError(
        "an ArmorTensor has no single storage: it holds W = A·core·B as separate tensors "
        f"({args[0].storage_format} core). Save a converted model with torch_armor.save_pretrained(model, directory) "
        "(the Hugging Face format: AutoModelForCausalLM.from_pretrained reads it after import torch_armor)"
    )


@implements_torch_function(torch.Tensor.requires_grad_)
def _(func, types, args, kwargs):
    w = args[0]
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
    if flag and w.num_experts is not None:
        raise RuntimeError("ARMOR experts cannot be fine-tuned yet: an (E, d_out, d_in) ArmorTensor is a frozen "
                           "container of E factored experts; keep requires_grad=False (or dequantize the model to "
                           "train it)")
    if flag and not getattr(w, "_parts_trainable", False):
        raise RuntimeError(
            "an ArmorTensor weight cannot require grad itself: its values live in A, B and the kept core "
            "values. Call torch_armor.enable_finetuning(model) to register them as trainable nn.Parameters "
            "of each layer (weight_a_blocks, weight_b_blocks, weight_values; the 2:4 mask stays fixed), then "
            "train with any optimizer over model.parameters()"
        )
    if flag:  # parts already trainable: the wrapper itself stays a non-grad container
        return w
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _as_destination(dst: ArmorTensor, src: ArmorTensor) -> ArmorTensor:
    """``src`` converted to ``dst``'s device, dtype and format (exact where the formats are)."""
    if type(src) is type(dst) and src.device == dst.device and src.dtype == dst.dtype:
        return src
    if (dst.storage_format == "quantized") != (src.storage_format == "quantized"):
        raise RuntimeError(
            f"cannot copy {src!r} into {dst!r}: one core is quantized and the other not; quantize (or "
            "dequantize) the model the same way first, or use load_state_dict(..., assign=True)"
        )
    if src.device != dst.device or src.dtype != dst.dtype:
        src = src.moved(dst.device, dst.dtype)
    if type(src) is not type(dst):
        src = src.with_storage(dst.storage_format, backend=dst.backend)
    return src


def _copy_mismatch(src: ArmorTensor, dst: ArmorTensor) -> ArmorInputError:
    """The error for copying one ArmorTensor into another of a different layout: both layouts named.
    (``load_state_dict`` adds the parameter's name in front of it.)"""
    def layout(t: ArmorTensor) -> str:
        return (f"shape {tuple(t.shape)}, block size {t.block_size}, pattern {t.pattern}, storage {t.storage_format}, "
                f"dtype {str(t.dtype).removeprefix('torch.')}")

    return ArmorInputError(f"cannot copy an ArmorTensor of {layout(src)} into one of {layout(dst)} (shapes, pattern or "
                           "block size differ): rebuild the "
                           "model with the saved block sizes (torch_armor.load_pretrained does), or "
                           "load_state_dict(..., assign=True) to replace the weight")


@implements(aten.copy_.default)
def _(func, types, args, kwargs):
    dst, src = args[0], args[1]
    experts = any(isinstance(t, ArmorTensor) and t.num_experts is not None for t in (dst, src))
    if experts and not (isinstance(dst, ArmorTensor) and isinstance(src, ArmorTensor)):
        raise RuntimeError(
            "a dense 3-D experts tensor and ARMOR experts (E factored layers) cannot be copied into each other: "
            "load an ARMOR checkpoint with from_pretrained(directory) after import torch_armor (or "
            "torch_armor.load_pretrained), or load_state_dict(state, assign=True); for dense experts use "
            "weight.dense_weight()")
    if not (isinstance(dst, ArmorTensor) and isinstance(src, ArmorTensor)):
        dense_into_armor = isinstance(dst, ArmorTensor)
        raise RuntimeError(
            ("a dense tensor cannot be copied into an ArmorTensor weight (W = A·core·B): load a dense state dict "
             "into a dense model, or prune it with torch_armor.prune_model"
             if dense_into_armor else
             "an ARMOR state dict (ArmorTensor weights, W = A·core·B) cannot be loaded into a dense model: "
             "load the saved directory with torch_armor.load_pretrained(directory), or "
             "load_state_dict(state, assign=True) to take the "
             "ArmorTensors as they are; for a dense weight use weight.dense_weight()")
        )
    if tuple(dst.shape) != tuple(src.shape) or dst.pattern != src.pattern or dst.block_size != src.block_size:
        raise _copy_mismatch(src, dst)
    src = _as_destination(dst, src)
    names, _ = dst.__tensor_flatten__()
    if names != src.__tensor_flatten__()[0] or any(getattr(dst, n).shape != getattr(src, n).shape for n in names):
        raise RuntimeError(f"cannot copy {src!r} into {dst!r}: their inner tensors differ; "
                           "use load_state_dict(..., assign=True) to replace the weight")
    for name in names:
        getattr(dst, name).copy_(getattr(src, name))
    return dst
