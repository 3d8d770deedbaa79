"""The storage policy as a pure function over devices, dtypes, shapes and backends (no GPU needed)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from torch_armor.tensor import policy
from torch_armor.tensor.policy import DeviceInfo, StorageChoice, choose_storage

BOTH = frozenset({"cusparselt", "cutlass"})
A100, H100, B200 = DeviceInfo("cuda", (8, 0), BOTH), DeviceInfo("cuda", (9, 0), BOTH), DeviceInfo("cuda", (10, 0), BOTH)
T4 = DeviceInfo("cuda", (7, 5), BOTH)
CPU = DeviceInfo("cpu")
HALF = (torch.float16, torch.bfloat16)


def expected(device: DeviceInfo, dtype, shape, pattern: str) -> tuple:
    """The rules of issue #21, written out independently: ``(storage, backend)``."""
    if pattern.startswith("unstructured"):
        return "dense", None
    if device.type != "cuda":
        return "compact", None
    if pattern != "2:4" or device.capability < (8, 0) or dtype not in HALF:
        return "dense", None
    rows, cols = shape
    if "cusparselt" in device.backends and rows % 16 == 0 and cols % 16 == 0 and rows >= 16 and cols >= 16:
        return "semi_structured", "cusparselt"
    if device.capability[0] == 8 and "cutlass" in device.backends and rows % 32 == 0 and cols % 64 == 0:
        return "semi_structured", "cutlass"
    return "dense", None


DEVICES = [CPU, T4, A100, H100, B200, DeviceInfo("cuda", (8, 6), frozenset({"cutlass"})),
           DeviceInfo("cuda", (9, 0), frozenset({"cutlass"})), DeviceInfo("cuda", (8, 9), frozenset())]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(4096, 4096), (4096, 11008), (576, 1536), (48, 80), (8, 8), (96, 64)]
PATTERNS = ["2:4", "4:8", "1:4", "unstructured:0.5"]


@pytest.mark.parametrize("device", DEVICES, ids=lambda d: f"{d.type}{d.capability or ''}{sorted(d.backends)}")
def test_auto_follows_the_rules(device):
    for dtype, shape, pattern in itertools.product(DTYPES, SHAPES, PATTERNS):
        got = choose_storage(device, dtype, shape, pattern)
        assert (got.storage, got.backend) == expected(device, dtype, shape, pattern), (dtype, shape, pattern)
        # a reason exactly when a GPU core misses its 2:4 kernel
        missed = device.type == "cuda" and got.storage == "dense" and not pattern.startswith("unstructured")
        assert bool(got.reason) == missed, (dtype, shape, pattern, got)


def test_reasons_say_what_to_do():
    assert "bfloat16" in choose_storage(H100, torch.float32, (4096, 4096), "2:4").reason
    assert "sm80" in choose_storage(T4, torch.float16, (4096, 4096), "2:4").reason
    assert "2:4 only" in choose_storage(H100, torch.float16, (4096, 4096), "4:8").reason
    hopper_cutlass = choose_storage(DeviceInfo("cuda", (9, 0), frozenset({"cutlass"})), torch.bfloat16,
                                    (4096, 4096), "2:4")
    assert hopper_cutlass.storage == "dense" and "sm8x only" in hopper_cutlass.reason
    small = choose_storage(A100, torch.float16, (8, 8), "2:4")
    assert "multiples of (16, 16)" in small.reason and "multiples of (32, 64)" in small.reason


def test_off_gpu_a_core_keeps_its_cpu_format():
    assert choose_storage(CPU, torch.float32, (64, 64), "2:4", current="dense").storage == "dense"
    assert choose_storage(CPU, torch.bfloat16, (64, 64), "2:4", current="compact").storage == "compact"
    assert choose_storage(CPU, torch.float16, (64, 64), "2:4", current="semi_structured").storage == "compact"
    # on a GPU the current format does not matter: a compact core is never kept there
    assert choose_storage(H100, torch.bfloat16, (64, 64), "2:4", current="compact").storage == "semi_structured"
    assert choose_storage(H100, torch.float32, (64, 64), "2:4", current="compact").storage == "dense"


def test_requested_storages():
    assert choose_storage(H100, torch.bfloat16, (64, 64), "2:4", "compact") == StorageChoice("compact")
    assert choose_storage(CPU, torch.float32, (64, 64), "2:4", "dense") == StorageChoice("dense")
    assert choose_storage(A100, torch.float16, (64, 64), "2:4", "semi_structured", backend="cutlass") == \
        StorageChoice("semi_structured", "cutlass")
    refused = choose_storage(A100, torch.float16, (16, 16), "2:4", "semi_structured", backend="cutlass")
    assert refused.storage == "dense" and "cutlass needs" in refused.reason
    with pytest.raises(ValueError, match="needs a CUDA float16/bfloat16 core"):
        choose_storage(CPU, torch.float16, (64, 64), "2:4", "semi_structured")
    with pytest.raises(ValueError, match="needs a CUDA float16/bfloat16 core"):
        choose_storage(H100, torch.float32, (64, 64), "2:4", "semi_structured")
    with pytest.raises(ValueError, match="2:4 only"):
        choose_storage(H100, torch.float16, (64, 64), "4:8", "semi_structured")
    with pytest.raises(ValueError, match="needs an N:M pattern"):
        choose_storage(CPU, torch.float32, (64, 64), "unstructured:0.5", "compact")
    with pytest.raises(ValueError, match="storage must be one of"):
        choose_storage(CPU, torch.float32, (64, 64), "2:4", "csr")
    with pytest.raises(ValueError, match="backend must be"):
        choose_storage(H100, torch.float16, (64, 64), "2:4", backend="triton")


def test_device_info_of_this_machine():
    assert policy.device_info("cpu") == DeviceInfo("cpu")
    if torch.cuda.is_available():
        info = policy.device_info("cuda")
        assert info.capability == torch.cuda.get_device_capability() and "cutlass" in info.backends


def test_fallback_warned_once_per_reason_naming_the_first_layer(monkeypatch):
    monkeypatch.setattr(policy, "_WARNED", set())
    choice = choose_storage(H100, torch.float32, (64, 64), "2:4")
    with pytest.warns(policy.ArmorStorageWarning, match=r"^model\.layers\.0\.mlp\.up_proj: keeps a dense core"):
        policy.warn_fallback("model.layers.0.mlp.up_proj", (64, 64), choice)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy.warn_fallback("model.layers.1.mlp.up_proj", (64, 64), choice)  # same reason: silent
        policy.warn_fallback("x", (64, 64), choose_storage(H100, torch.bfloat16, (64, 64), "2:4"))  # no reason
    with pytest.warns(policy.ArmorStorageWarning, match=r"^a \(8, 8\) layer: "):
        policy.warn_fallback(None, (8, 8), choose_storage(H100, torch.float16, (8, 8), "2:4"))
