"""Which linears to prune: every decoder linear (:func:`~torch_armor.calibration.observer.decoder_linear_names`),
or a selection of them by names, decoder-block indices, a regular expression or a predicate.

Example::

    >>> names = [f"model.layers.{i}.mlp.{p}" for i in range(3) for p in ("up_proj", "down_proj")]
    >>> select_layers(names, "1-2")
    ['model.layers.1.mlp.up_proj', 'model.layers.1.mlp.down_proj', 'model.layers.2.mlp.up_proj', 'model.layers.2.mlp.down_proj']
    >>> select_layers(names, "0.*down")
    ['model.layers.0.mlp.down_proj']
"""

from __future__ import annotations

import re
from typing import Callable, Dict, List, Optional, Sequence, Set, Union

from torch import nn

from torch_armor.calibration.experts import expert_layer_names
from torch_armor.calibration.routers import router_names
from torch_armor.calibration.observer import decoder_linear_names
from torch_armor.errors import ArmorInputError

__all__ = ["block_index", "select_layers", "prunable_names", "shared_across_blocks", "LayerSelection"]

#: What to prune: ``None`` (every decoder linear), names, a selection string (``"0-3"``, a regular
#: expression) or a predicate ``(name, module) -> bool``.
LayerSelection = Union[None, str, Sequence[str], Callable[[str, nn.Module], bool]]

_INDEX_SPEC = re.compile(r"^\s*\d+\s*(-\s*\d+\s*)?(,\s*\d+\s*(-\s*\d+\s*)?)*$")


def block_index(name: str) -> Optional[int]:
    """The first all-digit component of a dotted module name (the decoder layer index).

    Example::

        >>> block_index("model.layers.17.self_attn.q_proj"), block_index("lm_head")
        (17, None)
    """
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def prunable_names(model: nn.Module) -> List[str]:
    """Every decoder linear except the routers of mixture-of-experts blocks, then every expert layer
    of the fused expert parameters (``f"{param}.{e}"``), in decoder-block order."""
    routers = set(router_names(model))
    names = [n for n in decoder_linear_names(model) if n not in routers]
    experts = expert_layer_names(model)
    if not experts:
        return names
    return sorted(names + experts, key=lambda n: (block_index(n) is not None, block_index(n) or 0))


def _module_of(model: nn.Module, name: str) -> nn.Module:
    """The linear, or for an expert layer ``<experts>.<param>.<e>`` its experts module."""
    try:
        return model.get_submodule(name)
    except AttributeError:
        return model.get_submodule(name.rsplit(".", 2)[0])


def select_layers(model: Union[nn.Module, Sequence[str]], layers: LayerSelection = None) -> List[str]:
    """Names of the linears to prune: :func:`~torch_armor.calibration.observer.decoder_linear_names`,
    optionally restricted.

    Args:
        model: the model, or a list of candidate linear names.
        layers: ``None`` — all; decoder layer indices such as ``"0-1"`` or ``"0,5,10-12"``
            (matched against the first numeric component of each name, e.g. ``model.layers.3.…``);
            any other string is a regular expression searched in each name (``"mlp"``, ``"q_proj$"``);
            a list of names is taken as is; a callable ``(name, module) -> bool`` keeps the
            decoder linears it accepts (``model`` must then be the model).

    Raises:
        ArmorInputError: the restriction selects nothing, or the regular expression is invalid.
    """
    if layers is not None and not isinstance(layers, str) and not callable(layers):
        chosen = list(layers)
        if not chosen:
            raise ArmorInputError("layers is an empty list: no layers to prune")
        odd = [n for n in chosen if not isinstance(n, str)]
        if odd:
            hint = (f"; for decoder blocks pass a string such as layers={','.join(map(str, chosen))!r}"
                    if all(isinstance(n, int) and not isinstance(n, bool) for n in chosen) else "")
            raise ArmorInputError(f"layers must be linear names (str), a selection string or a predicate; got "
                                  f"{odd[0]!r} ({type(odd[0]).__name__}) in a {type(layers).__name__}{hint}")
        return chosen
    names = prunable_names(model) if isinstance(model, nn.Module) else list(model)
    if callable(layers):
        if not isinstance(model, nn.Module):
            raise ArmorInputError("a layer predicate (name, module) -> bool needs the model, not a list of names")
        chosen = [n for n in names if layers(n, _module_of(model, n))]
        what = "the layer predicate"
    elif layers is None or layers.strip() in ("", "all"):
        chosen, what = names, "layers=None"
    elif _INDEX_SPEC.match(layers):
        wanted: set = set()
        for part in layers.split(","):
            lo, _, hi = part.partition("-")
            lo_i, hi_i = int(lo), int(hi) if hi.strip() else int(lo)
            if hi_i < lo_i:
                raise ArmorInputError(f"layer range {part.strip()!r} is empty (end before start)")
            wanted.update(range(lo_i, hi_i + 1))
        chosen, what = [n for n in names if block_index(n) in wanted], f"layers={layers!r}"
    else:
        try:
            regex = re.compile(layers)
        except re.error as err:
            raise ArmorInputError(f"layers={layers!r} is neither indices like '0-1' nor a valid regular expression: "
                                  f"{err}") from None
        chosen, what = [n for n in names if regex.search(n)], f"layers={layers!r}"
    if not chosen:
        sample = ", ".join(names[:3])
        raise ArmorInputError(f"{what} selects none of the {len(names)} prunable linears (e.g. {sample})")
    return chosen


def shared_across_blocks(model: nn.Module, names: Sequence[str], blocks_prefix: str) -> Dict[str, str]:
    """``{layer: why}`` for each linear of ``names`` whose weight is one tensor held by several decoder
    blocks of the ``nn.ModuleList`` at ``blocks_prefix`` (Zamba's shared transformer block, tied into
    every hybrid layer; a module reused by several layers), with every other linear name that holds
    the same weight: the block pipeline calibrates one block at a time, so such a weight is left
    dense rather than pruned from one layer's statistics while the other layers call it too.

    Example::

        >>> from torch import nn
        >>> tied = nn.Linear(8, 8)
        >>> model = nn.ModuleDict({"layers": nn.ModuleList(
        ...     nn.ModuleDict({"mix": tied, "own": nn.Linear(8, 8)}) for _ in range(3))})
        >>> shared = shared_across_blocks(model, ["layers.0.mix", "layers.0.own"], "layers")
        >>> sorted(shared)
        ['layers.0.mix', 'layers.1.mix', 'layers.2.mix']
        >>> print(shared["layers.2.mix"])
        shared by decoder layers 0, 1, 2
    """
    holders: Dict[int, Set[int]] = {}
    for index, block in enumerate(model.get_submodule(blocks_prefix)):
        for param in block.parameters():
            holders.setdefault(id(param), set()).add(index)
    linears: Dict[int, List[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, nn.Linear):
            linears.setdefault(id(module.weight), []).append(name)
    shared: Dict[str, str] = {}
    for name in names:
        try:
            module = model.get_submodule(name)
        except AttributeError:  # an expert layer of a fused parameter
            continue
        blocks = holders.get(id(getattr(module, "weight", None)), set())
        if len(blocks) > 1:
            why = f"shared by decoder layers {', '.join(str(i) for i in sorted(blocks))}"
            shared.update((alias, why) for alias in linears[id(module.weight)])
    return shared
