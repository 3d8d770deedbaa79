"""A graph pass for compiled ARMOR models: linears that read the same input share one B-pass launch.

In a decoder block, q/k/v (and gate/up) each begin with a B-pass ``block_diag_rows(x, b_i, None, m,
dtype)`` of the same ``x``. :func:`share_wrapper_inputs` rewrites each such group (same input, same
padding and dtype) into one ``block_diag_rows_shared(x, [b_1, …], m, dtype)``: on CUDA one launch per
block-stack shape that reads ``x`` once. Give it to inductor for one compile, nothing global::

    model = torch.compile(model, options=compile_options())

Example::

    >>> import torch
    >>> def qkv(x, bq, bk, bv):
    ...     return [torch.ops.torch_armor.block_diag_rows(x, b, None, 8, torch.float32) for b in (bq, bk, bv)]
    >>> gm = torch.fx.symbolic_trace(qkv)
    >>> share_wrapper_inputs(gm.graph), [str(n.target) for n in gm.graph.nodes if n.op == "call_function"][0]
    (1, 'torch_armor.block_diag_rows_shared.default')
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any, Dict, List

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

import torch_armor.kernels.block_diag  # noqa: F401  (registers the torch_armor ops the pass rewrites)

__all__ = ["share_wrapper_inputs", "ShareWrapperInputs", "compile_options"]

_ARGS = ("src", "blocks", "bias", "row_multiple", "out_dtype")


def _bound(node: torch.fx.Node) -> Dict[str, Any]:
    return {**dict(zip(_ARGS, node.args)), **node.kwargs}


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _same_input_key(src: Any) -> Any:
    """Equal for nodes that are the same tensor: each linear reshapes its input ``(…, d_in) -> (T, d_in)``
    on its own, so q/k/v's B-passes read three ``view`` nodes of one tensor."""
    if isinstance(src, torch.fx.Node) and src.op == "call_function" and src.target in _VIEWS:
        return ("view", _same_input_key(src.args[0]), tuple(src.args[1]))
    return src


def share_wrapper_inputs(graph: torch.fx.Graph) -> int:
    """Merge the bias-free ``block_diag_rows`` nodes of one input (same padding and dtype) into
    ``block_diag_rows_shared`` nodes, in place; returns how many merged nodes it made. A group whose block
    stacks are not all defined before its first node is left as it is."""
    single = torch.ops.torch_armor.block_diag_rows.default
    shared = torch.ops.torch_armor.block_diag_rows_shared.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: Dict[tuple, List[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (single, torch.ops.torch_armor.block_diag_rows):
            continue
        args = _bound(node)
        if args.get("bias") is not None:
            continue
        groups[_same_input_key(args["src"]), args["row_multiple"], args["out_dtype"]].append(node)
    made = 0
    for (_, row_multiple, out_dtype), nodes in groups.items():
        first = nodes[0]
        src = _bound(first)["src"]
        blocks = [_bound(n)["blocks"] for n in nodes]
        if len(nodes) < 2 or any(isinstance(b, torch.fx.Node) and order[b] > order[first] for b in blocks):
            continue
        with graph.inserting_before(first):
            merged = graph.call_function(shared, (src, blocks, row_multiple, out_dtype))
            if all("val" in n.meta for n in nodes):
                merged.meta["val"] = [n.meta["val"] for n in nodes]
            for i, node in enumerate(nodes):
                item = graph.call_function(operator.getitem, (merged, i))
                item.meta.update(node.meta)
                node.replace_all_uses_with(item)
        for node in nodes:
            graph.erase_node(node)
        made += 1
    return made


class ShareWrapperInputs(CustomGraphPass):
    """:func:`share_wrapper_inputs` as an inductor post-grad pass (``post_grad_custom_post_pass``)."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        share_wrapper_inputs(graph)

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,))


def compile_options() -> Dict[str, Any]:
    """``torch.compile(model, options=compile_options())``: inductor with :class:`ShareWrapperInputs`."""
    return {"post_grad_custom_post_pass": ShareWrapperInputs()}
