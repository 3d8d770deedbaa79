"""Fake CUDA for the 2:4 path on a CPU-only machine (torch 2.13).

* :func:`fake_cuda`: a ``FakeTensorMode`` in which ``device="cuda"`` tensors exist (shapes, dtypes,
  strides; no values), the storage policy sees a GPU of the given compute capability and backends,
  and ``aten._cslt_compress`` has the shape function it lacks (``d_out·d_in·9/16`` elements for
  fp16/bf16, as ``cuSPARSELtOps.cpp`` allocates). Nothing runs a kernel: the trial matmul is
  skipped on fake tensors.
* :func:`meta_gpu`: the same for a whole model on the ``meta`` device. A CPU-only torch cannot index a
  fake CUDA tensor (``t[..., None]`` takes a CUDA device guard, which the build lacks), and every
  Hugging Face model indexes; meta tensors index. Inside, the storage policy sees an sm90 GPU on
  ``meta`` and ARMOR linears there take the CUDA path (fused wrapper kernels when Triton is
  installed): ``model.to("meta", torch.bfloat16)`` gives 2:4 cores, shapes and strides as on a GPU.
* :func:`traced_ops`: the aten ops of the forward graph AOTAutograd makes of ``fn`` under
  ``torch.compile(fullgraph=True)`` — what would run on the GPU, subclasses unwrapped.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode

from torch_armor.tensor import policy

_LIBRARY: list = []


def _give_cslt_compress_a_shape() -> None:
    if not _LIBRARY:
        lib = torch.library.Library("aten", "IMPL")
        lib.impl("_cslt_compress", lambda dense: dense.new_empty(dense.numel() * 9 // 16), "Meta")
        _LIBRARY.append(lib)


@contextlib.contextmanager
def fake_cuda(monkeypatch, capability: Tuple[int, int] = (9, 0),
              backends: Sequence[str] = ("cusparselt", "cutlass")) -> Iterator[FakeTensorMode]:
    _give_cslt_compress_a_shape()
    gpu = policy.DeviceInfo("cuda", capability, frozenset(backends))
    real = policy.device_info
    monkeypatch.setattr(policy, "device_info", lambda d: gpu if torch.device(d).type == "cuda" else real(d))
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@contextlib.contextmanager
def meta_gpu(monkeypatch, capability: Tuple[int, int] = (9, 0)) -> Iterator[None]:
    from torch_armor.kernels import block_diag
    from torch_armor.tensor import linear_layout

    _give_cslt_compress_a_shape()
    gpu = policy.DeviceInfo("cuda", capability, frozenset({"cusparselt"}))
    real = policy.device_info
    monkeypatch.setattr(policy, "device_info", lambda d: gpu if torch.device(d).type == "meta" else real(d))
    monkeypatch.setattr(linear_layout, "fused_wrappers_available",
                        lambda d: d.type == "meta" and block_diag.triton_importable())
    yield


def traced_ops(fn: Callable, *inputs, graph_pass: Optional[Callable] = None) -> Tuple[List[str], object]:
    """``(op names in graph order, fn's output)`` of the AOTAutograd forward graph of ``fn(*inputs)``,
    after ``graph_pass(graph)`` when given (e.g. a pass inductor would run)."""
    graphs = []

    def capture(gm, example_inputs):
        if graph_pass is not None:
            graph_pass(gm.graph)
            gm.graph.lint()
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=capture))(*inputs)
    assert len(graphs) == 1, f"expected one graph, got {len(graphs)}"
    ops = [str(node.target) for node in graphs[0].graph.nodes if node.op == "call_function"]
    return ops, out

