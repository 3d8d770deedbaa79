"""Which storage an ARMOR core gets: one pure function of device, dtype, shape and backends.

:func:`choose_storage` decides, for one ``(d_out, d_in)`` core, between

* ``"semi_structured"`` — the CUDA 2:4 kernels, which are the reason 2:4 exists: cuSPARSELt on
  compute capability 8.0 and newer for float16/bfloat16 (the backend of standard CUDA wheels),
  CUTLASS only on sm8x (its kernels check ``major == 8``), so only where cuSPARSELt is missing;
* ``"dense"`` — the core as a dense matrix with exact zeros: any device, any pattern; on CUDA the
  fallback wherever no 2:4 kernel takes the core (another pattern, float32, below sm80, a shape
  the kernels refuse), always with a reason;
* ``"compact"`` — kept values plus bit-packed positions: half the bytes, for CPU and disk only
  (every call unpacks it, so it never runs on a GPU unless asked for by name).

The same function answers at conversion (``storage="auto"``), on ``.to()`` / ``.half()`` /
``.bfloat16()`` and when a checkpoint is loaded (``from_pretrained(device_map=..., dtype=...)``),
so a core follows its device and dtype. Off CUDA a core keeps the CPU format it has (dense is
the faster one there, compact the smaller one). When the answer on CUDA is not 2:4,
:func:`warn_fallback` says so once, naming the layer and the reason.

Example::

    >>> import torch
    >>> h100 = DeviceInfo("cuda", (9, 0), frozenset({"cusparselt", "cutlass"}))
    >>> choose_storage(h100, torch.bfloat16, (4096, 4096), "2:4")
    StorageChoice(storage='semi_structured', backend='cusparselt', reason='')
    >>> choose_storage(h100, torch.float32, (4096, 4096), "2:4").storage
    'dense'
    >>> choose_storage(DeviceInfo("cpu"), torch.float32, (64, 64), "2:4").storage
    'compact'
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple, Union

import torch

from torch_armor.core.pattern import SparsityPattern, parse_pattern
from torch_armor.errors import ArmorInputError

__all__ = [
    "STORAGES",
    "QUANTIZED",
    "BACKENDS",
    "HALF_DTYPES",
    "DeviceInfo",
    "StorageChoice",
    "ArmorStorageWarning",
    "KernelRefused",
    "device_info",
    "choose_storage",
    "choose_eight_bit",
    "warn_fallback",
]

#: the floating-point core storages (what ``storage=`` accepts besides ``"auto"``)
STORAGES = ("compact", "dense", "semi_structured")
#: storage name of a core quantized with torchao (:mod:`torch_armor.tensor.quant`); never chosen here
QUANTIZED = "quantized"
BACKENDS = ("cusparselt", "cutlass")
HALF_DTYPES = (torch.float16, torch.bfloat16)

# Smallest sparse operand (rows, cols) each backend takes for fp16/bf16; both must also divide the
# shape (torch.sparse.SparseSemiStructuredTensor*._DTYPE_SHAPE_CONSTRAINTS, torch 2.13).
_MIN_SHAPE = {"cusparselt": (16, 16), "cutlass": (32, 64)}
_WARNED: set = set()


class ArmorStorageWarning(UserWarning):
    """A core did not get the storage its device is best at (the message says which layer and why)."""


class KernelRefused(RuntimeError):
    """A 2:4 kernel refused a core the policy chose it for (its trial matmul failed); the message says why."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the policy needs to know about a device: its type, CUDA compute capability, and the
    semi-structured backends this torch build offers there (``"cusparselt"``, ``"cutlass"``)."""

    type: str
    capability: Optional[Tuple[int, int]] = None
    backends: FrozenSet[str] = frozenset()


@dataclass(frozen=True)
class StorageChoice:
    """The policy's answer: a storage, its backend (semi-structured only) and, when the device
    could have done better (a CUDA core that is not 2:4), the reason in words."""

    storage: str
    backend: Optional[str] = None
    reason: str = ""


def device_info(device: Union[str, torch.device]) -> DeviceInfo:
    """:class:`DeviceInfo` of ``device`` as this process sees it (queries CUDA for CUDA devices only)."""
    device = torch.device(device)
    if device.type != "cuda":
        return DeviceInfo(device.type)
    index = device.index if device.index is not None else torch.cuda.current_device()
    backends = set()
    try:
        if torch.backends.cusparselt.is_available():
            backends.add("cusparselt")
    except Exception:  # noqa: BLE001 - stripped builds
        pass
    if torch.version.cuda is not None:  # CUTLASS sparse kernels ship in every CUDA (not ROCm) build
        backends.add("cutlass")
    return DeviceInfo("cuda", tuple(torch.cuda.get_device_capability(index)), frozenset(backends))


def _fits(backend: str, shape: Tuple[int, int]) -> bool:
    rows, cols = _MIN_SHAPE[backend]
    return shape[0] >= rows and shape[0] % rows == 0 and shape[1] >= cols and shape[1] % cols == 0


def _semi_structured(device: DeviceInfo, dtype: torch.dtype, shape: Tuple[int, int],
                     pattern: SparsityPattern, backend: Optional[str]) -> StorageChoice:
    """The 2:4 kernel for a CUDA core, or dense and why not."""
    if not pattern.structured or (pattern.n, pattern.m) != (2, 4):
        return StorageChoice("dense", reason=f"the {pattern} pattern has no sparse kernel (2:4 only)")
    cap = device.capability or (0, 0)
    if cap < (8, 0):
        return StorageChoice("dense", reason=f"compute capability {cap[0]}.{cap[1]} has no sparse tensor cores "
                                             "(2:4 kernels need sm80 or newer)")
    if dtype not in HALF_DTYPES:
        return StorageChoice("dense", reason=f"no 2:4 kernel takes {dtype} (cuSPARSELt: float16, bfloat16); "
                                             "model.bfloat16() or model.half() turns these cores into 2:4 ones")
    candidates = [backend] if backend is not None else list(BACKENDS)
    refused = []
    for name in candidates:
        if name not in device.backends:
            refused.append(f"this torch has no {name}")
        elif name == "cutlass" and cap[0] != 8:
            refused.append(f"CUTLASS 2:4 kernels run on sm8x only, this GPU is sm{cap[0]}{cap[1]}")
        elif not _fits(name, shape):
            rows, cols = _MIN_SHAPE[name]
            refused.append(f"{name} needs both dimensions multiples of ({rows}, {cols}), the core is {shape}")
        else:
            return StorageChoice("semi_structured", backend=name)
    return StorageChoice("dense", reason="; ".join(refused))


def choose_storage(
    device: DeviceInfo,
    dtype: torch.dtype,
    shape: Tuple[int, int],
    pattern: Union[str, SparsityPattern],
    requested: str = "auto",
    *,
    current: Optional[str] = None,
    backend: Optional[str] = None,
) -> StorageChoice:
    """The storage of a ``shape`` core of ``dtype`` with ``pattern`` on ``device``.

    Args:
        requested: ``"auto"`` (the policy decides) or a storage asked for by name: ``"dense"`` and
            ``"compact"`` are taken as asked; ``"semi_structured"`` falls back to dense with a reason
            where no kernel takes the core.
        current: the storage the core has now (a move or cast): off CUDA a CPU format is kept.
        backend: ``"cusparselt"`` or ``"cutlass"`` to allow only that semi-structured backend.

    Raises:
        ValueError: an unknown storage or backend; compact or semi-structured storage for an
            unstructured pattern; semi-structured storage for another pattern than 2:4, off
            CUDA, or for a dtype other than float16/bfloat16.
    """
    p = parse_pattern(pattern)
    if requested not in STORAGES + ("auto",):
        raise ArmorInputError(f"storage must be one of {STORAGES + ('auto',)}, got {requested!r}")
    if backend is not None and backend not in BACKENDS:
        raise ArmorInputError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    shape = (int(shape[0]), int(shape[1]))
    if requested == "auto":
        if not p.structured:
            return StorageChoice("dense")
        if device.type == "cuda":
            return _semi_structured(device, dtype, shape, p, backend)
        return StorageChoice(current if current in ("compact", "dense") else "compact")
    if requested in ("compact", "semi_structured") and not p.structured:
        raise ArmorInputError(f"storage={requested!r} needs an N:M pattern, the core is {p}; use storage='dense'")
    if requested == "semi_structured":
        if (p.n, p.m) != (2, 4):
            raise ArmorInputError(f"semi-structured kernels take 2:4 only, the core is {p}; use 'compact' or 'dense'")
        if device.type != "cuda" or dtype not in HALF_DTYPES:
            raise ArmorInputError(
                f"storage='semi_structured' needs a CUDA float16/bfloat16 core, got {device.type} {dtype}; "
                "pass device='cuda' and dtype=torch.bfloat16 (or float16), or use storage='compact'/'dense'"
            )
        return _semi_structured(device, dtype, shape, p, backend)
    return StorageChoice(requested)


#: compute capability from which cuSPARSELt multiplies each 8-bit format
_EIGHT_BIT_CAPABILITY = {"int8": (8, 0), "fp8": (8, 9)}
_EIGHT_BIT_MIN_SHAPE = (32, 32)  # torch.sparse.SparseSemiStructuredTensorCUSPARSELT, int8 / e4m3


def choose_eight_bit(device: DeviceInfo, qdtype: str, shape: Tuple[int, int]) -> StorageChoice:
    """Where an 8-bit (``"int8"`` / ``"fp8"``) 2:4 core runs: cuSPARSELt's 8-bit kernels on a CUDA GPU that
    has them (int8 sm80+, fp8 sm89+, both dimensions multiples of 32), else the compact 8-bit form
    (backend ``None``), with a reason on CUDA.

    Example::

        >>> choose_eight_bit(DeviceInfo("cuda", (9, 0), frozenset({"cusparselt"})), "fp8", (4096, 4096)).backend
        'cusparselt'
        >>> choose_eight_bit(DeviceInfo("cuda", (8, 0), frozenset({"cusparselt"})), "fp8", (4096, 4096)).reason
        'cuSPARSELt multiplies fp8 2:4 cores from sm89, this GPU is sm80; the fp8 core runs unpacked (slow, same outputs)'
    """
    if device.type != "cuda":
        return StorageChoice(qdtype)
    cap, need = device.capability or (0, 0), _EIGHT_BIT_CAPABILITY[qdtype]
    rows, cols = _EIGHT_BIT_MIN_SHAPE
    if "cusparselt" not in device.backends:
        why = "this torch has no cuSPARSELt"
    elif cap < need:
        why = f"cuSPARSELt multiplies {qdtype} 2:4 cores from sm{need[0]}{need[1]}, this GPU is sm{cap[0]}{cap[1]}"
    elif shape[0] % rows or shape[1] % cols:
        why = f"cuSPARSELt's {qdtype} kernels need both dimensions multiples of {rows}, the core is {tuple(shape)}"
    else:
        return StorageChoice(qdtype, backend="cusparselt")
    return StorageChoice(qdtype, reason=why + f"; the {qdtype} core runs unpacked (slow, same outputs)")


def warn_fallback(layer: Optional[str], shape: Tuple[int, int], choice: StorageChoice) -> None:
    """One :class:`ArmorStorageWarning` per distinct reason, naming the first layer it hit
    (``layer``, or its shape when the name is unknown); nothing when ``choice`` has no reason."""
    if not choice.reason or choice.reason in _WARNED:
        return
    _WARNED.add(choice.reason)
    where = layer or f"a {tuple(shape)} layer"
    warnings.warn(
        f"{where}: keeps a {'dense' if choice.storage == 'dense' else choice.storage + ' compact'} core on the "
        f"GPU (same outputs, no 2:4 speed-up) because {choice.reason}; "
        "every other layer with this reason does the same (warned once)",
        ArmorStorageWarning,
        stacklevel=3,
    )
