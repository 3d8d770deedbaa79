"""Fine-tuning the ARMOR factors of a converted model, and its honest size.

:func:`enable_finetuning` registers, on every linear whose weight is an
:class:`~torch_armor.tensor.armor_tensor.ArmorTensor`, the weight's parts as leaf
``nn.Parameter``\\ s — ``weight_a_blocks`` (``A``), ``weight_b_blocks`` (``B``) and
``weight_values`` (the kept core values; the N:M mask is fixed) — shared with the ArmorTensor, so
``F.linear`` differentiates through them and any optimizer over ``model.parameters()`` trains
them (the ArmorTensor ``weight`` itself stays a ``requires_grad=False`` container and gets no
gradient). The extra names are left out of ``state_dict()``: saving is unchanged.

:func:`model_size` counts what is stored: ArmorTensor weights by their parts (compact core:
kept values + packed indices), every other parameter and buffer as is — unlike
``num_parameters()`` / ``get_memory_footprint()``, which see each ArmorTensor as the dense
``(d_out, d_in)`` matrix it stands for.

Example::

    >>> import torch
    >>> from torch import nn
    >>> from torch_armor.core.factors import ArmorFactors
    >>> from torch_armor.tensor.armor_tensor import armor_linear_from_factors
    >>> lin = nn.Linear(8, 4, bias=False)
    >>> core = torch.tensor([[1.0, 0.0, 0.0, 2.0]] * 4).repeat(1, 2)
    >>> _ = armor_linear_from_factors(lin, ArmorFactors(torch.eye(4)[None], core, torch.eye(4).repeat(2, 1, 1),
    ...                                                 core != 0, "2:4"), storage="compact")
    >>> model_size(lin).parameters      # A 16 + B 32 + 16 kept values (not 4·8 = 32 dense)
    64
    >>> sorted(n for n, p in enable_finetuning(lin).named_parameters() if p.requires_grad)
    ['weight_a_blocks', 'weight_b_blocks', 'weight_values']
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

import torch
from torch import nn

from torch_armor.tensor.armor_tensor import QUANTIZED, ArmorTensor
from torch_armor.errors import ArmorInputError

__all__ = ["enable_finetuning", "trainable_parts", "model_size", "checkpoint_size", "ModelSize", "PART_NAMES"]

#: ArmorTensor inner tensor -> name of the nn.Parameter registered on the module
PART_NAMES = {"a_blocks": "weight_a_blocks", "b_blocks": "weight_b_blocks", "values": "weight_values"}


def _drop_parts_from_state_dict(module: nn.Module, state: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name in PART_NAMES.values():
        state.pop(prefix + name, None)


def _ignore_missing_parts(module: nn.Module, incompatible: Any) -> None:
    parts = set(PART_NAMES.values())
    for key in list(incompatible.missing_keys):
        if key.rpartition(".")[2] in parts:
            incompatible.missing_keys.remove(key)


def _bind_parts(module: nn.Module, args: Any) -> None:
    """Forward pre-hook: the weight computes with the registered parts (also after ``.to()`` or a
    ``load_state_dict(assign=True)`` replaced the ArmorTensor)."""
    w = module._parameters.get("weight")
    if not isinstance(w, ArmorTensor):
        return
    for inner, pname in PART_NAMES.items():
        param = module._parameters.get(pname)
        if param is not None and getattr(w, inner) is not param:
            if getattr(w, inner).shape != param.shape:
                raise RuntimeError(f"the ArmorTensor weight's {inner} no longer matches {pname}; re-run enable_finetuning")
            setattr(w, inner, param)
    w._parts_trainable = True


def enable_finetuning(model: nn.Module, *, wrappers: bool = True, core: bool = True) -> nn.Module:
    """Make ``A``, ``B`` (``wrappers``) and the kept core values (``core``) of every ArmorTensor
    weight trainable leaf ``nn.Parameter``\\ s of its module; returns ``model`` (changed in place).

    Cores are re-stored compact first (exact: the kept values and the fixed mask). Calling it again
    is a no-op for layers already enabled.

    Raises:
        ValueError: a quantized core (train before quantizing, or dequantize it), or a core with
            an unstructured pattern (no compact form: the mask could not stay fixed).
    """
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if not isinstance(w, ArmorTensor) or getattr(w, "_parts_trainable", False):
            continue
        if w.storage_format == QUANTIZED:
            raise ArmorInputError(
                f"{name}: the core is quantized; fine-tune before quantizing, or "
                "torch_armor.tensor.quant.dequantize_armor_core(weight) first"
            )
        if w.storage_format != "compact":
            w = w.with_storage("compact")  # raises for unstructured patterns, saying so
            module._parameters["weight"] = nn.Parameter(w, requires_grad=False)
        for inner, pname in PART_NAMES.items():
            if (inner == "values" and not core) or (inner != "values" and not wrappers):
                continue
            param = nn.Parameter(getattr(w, inner).detach(), requires_grad=True)
            setattr(w, inner, param)  # the ArmorTensor computes with the registered leaf itself
            module.register_parameter(pname, param)
        w._parts_trainable = True
        if not getattr(module, "_armor_parts_hooked", False):
            module._register_state_dict_hook(_drop_parts_from_state_dict)
            module.register_load_state_dict_post_hook(_ignore_missing_parts)
            module.register_forward_pre_hook(_bind_parts)
            module._armor_parts_hooked = True
    return model


def trainable_parts(model: nn.Module) -> Dict[str, nn.Parameter]:
    """``{name: parameter}`` of the ARMOR parts registered by :func:`enable_finetuning`."""
    parts = set(PART_NAMES.values())
    return {n: p for n, p in model.named_parameters() if n.rpartition(".")[2] in parts}


@dataclass(frozen=True)
class ModelSize:
    """What a model stores: ``parameters`` (elements), ``parameter_bytes``, ``buffer_bytes``,
    ``bytes`` (their sum), and what the same model would hold with dense weights
    (``dense_parameters``, ``dense_parameter_bytes``)."""

    parameters: int
    parameter_bytes: int
    buffer_bytes: int
    dense_parameters: int
    dense_parameter_bytes: int

    @property
    def bytes(self) -> int:
        return self.parameter_bytes + self.buffer_bytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _armor_parts(w: ArmorTensor):
    names, _ = w.__tensor_flatten__()
    for name in names:
        t = getattr(w, name)
        if isinstance(t, ArmorTensor):  # pragma: no cover - never nested
            yield from _armor_parts(t)
        elif type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
            inner, _ = t.__tensor_flatten__()  # torchao quantized core (int8 data + scales)
            for sub in inner:
                yield name, getattr(t, sub)
        else:
            yield name, t


def model_size(model: nn.Module) -> ModelSize:
    """Stored parameters and bytes of ``model``, counting each ArmorTensor by its parts.

    ``parameters`` counts ``A``, ``B`` and the kept core values (for a ``"dense"`` core its
    nonzeros); the bytes are what the storage holds (a compact core's packed indices count as
    bytes only, a dense core's zeros too). Shared tensors (tied
    embeddings) and the parts registered by :func:`enable_finetuning` are counted once.
    """
    seen: set = set()
    params = pbytes = dense = dense_bytes = 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if isinstance(p, ArmorTensor):
            dense += p.numel()
            dense_bytes += p.numel() * p.element_size()
            params += p.stored_parameters()
            for _, t in _armor_parts(p):
                seen.add(id(t))
                pbytes += _nbytes(t)
            continue
        params += p.numel()
        pbytes += _nbytes(p)
        dense += p.numel()
        dense_bytes += _nbytes(p)
    bbytes = sum(_nbytes(b) for b in model.buffers())
    return ModelSize(params, pbytes, bbytes, dense, dense_bytes)


def checkpoint_size(directory: Any) -> ModelSize:
    """:class:`ModelSize` of a saved directory (``save_pretrained`` of either kind), read from the
    safetensors headers without loading a tensor: stored elements (packed indices count as bytes
    only) and bytes, against the dense model it stands for (``buffer_bytes`` is 0: non-persistent
    buffers are not saved).
    """
    import json  # local: only this function needs it
    from pathlib import Path  # local: only this function needs it

    from safetensors import safe_open  # local: only this function needs it

    from torch_armor.format.armor_format import part_key  # local: armor_format imports this package's armor_tensor

    path = Path(directory)
    quant = json.loads((path / "config.json").read_text()).get("quantization_config") or {} \
        if (path / "config.json").is_file() else {}
    layers = quant.get("layers") if isinstance(quant, dict) else None
    if not layers and (path / "armor_config.json").is_file():
        layers = json.loads((path / "armor_config.json").read_text()).get("layers")
    layers = layers or {}
    owner = {part_key(fqn, name): fqn for fqn, layer in layers.items() for name in layer["tensors"]}
    params = pbytes = dense = dense_bytes = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                numel = 1
                for d in sl.get_shape():
                    numel *= int(d)
                size = _ST_BYTES.get(sl.get_dtype(), 1)
                pbytes += numel * size
                if not key.endswith("indices"):
                    params += numel
                if key not in owner:
                    dense += numel
                    dense_bytes += numel * size
    for layer in layers.values():
        numel = 1
        for v in layer["shape"]:  # (d_out, d_in), or (E, d_out, d_in) for fused experts
            numel *= int(v)
        dense += numel
        dense_bytes += numel * torch.empty((), dtype=getattr(torch, layer["dtype"])).element_size()
    return ModelSize(params, pbytes, 0, dense, dense_bytes)


_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
