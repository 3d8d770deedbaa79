"""Plain PyTorch interop of :class:`~torch_armor.tensor.armor_tensor.ArmorTensor` weights.

* ``torch.save(model.state_dict())`` + ``torch.load(..., weights_only=True)``: ArmorTensor and its
  storage name are registered safe globals.
* ``load_state_dict`` between models with the same ArmorTensor layers copies part by part;
  loading an ARMOR state dict into a dense model (or the reverse) raises an error saying what to
  do instead of torchao's ``'Parameter' object has no attribute 'tensor_data_names'``.
* ``weight.requires_grad_(True)`` raises, pointing to :func:`torch_armor.enable_finetuning`
  (the ArmorTensor is a container: its gradient would never be computed).

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

import torch

from torch_armor.tensor.armor_tensor import ArmorTensor, StorageKind, implements, implements_torch_function
from torch_armor.tensor.file_checks import copy_mismatch

aten = torch.ops.aten


@implements_torch_function(torch.Tensor.requires_grad_)
def _(func, types, args, kwargs):
    w = args[0]
    flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
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


@implements(aten.copy_.default)
def _(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if not (isinstance(dst, ArmorTensor) and isinstance(src, ArmorTensor)):
        dense_into_armor = isinstance(dst, ArmorTensor)
        raise RuntimeError(
            ("a dense tensor cannot be copied into an ArmorTensor weight (W = A·core·B): load a dense state dict "
             "into a dense model, or prune it with torch_armor.prune_model"
             if dense_into_armor else
             "an ARMOR state dict (ArmorTensor weights, W = A·core·B) cannot be loaded into a dense model: "
             "load the saved directory with AutoModelForCausalLM.from_pretrained(directory) after import "
             "torch_armor (or torch_armor.load_pretrained), or load_state_dict(state, assign=True) to take the "
             "ArmorTensors as they are; for a dense weight use weight.dense_weight()")
        )
    names_dst, _ = dst.__tensor_flatten__()
    names_src, _ = src.__tensor_flatten__()
    if (tuple(dst.shape) != tuple(src.shape) or names_dst != names_src or dst.pattern != src.pattern
            or dst.storage != src.storage or dst.block_size != src.block_size):
        raise copy_mismatch(src, dst)
    for name in names_dst:
        getattr(dst, name).copy_(getattr(src, name))
    return dst


torch.serialization.add_safe_globals([ArmorTensor, StorageKind])
