"""engine/memory.py: when a streamed run pins glibc's mmap threshold, and what pinning does."""

import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

from torch_armor.engine import memory

sizes = st.integers(min_value=1, max_value=10**13)


@given(sizes, sizes)
def test_pin_is_needed_exactly_above_the_share(checkpoint, available):
    assert memory.pin_needed(checkpoint, available) == (checkpoint * 10 > available)  # PIN_SHARE = 0.1


@given(sizes, sizes, sizes)
def test_a_larger_checkpoint_never_unpins(small, extra, available):
    assert memory.pin_needed(small + extra, available) >= memory.pin_needed(small, available)


@given(sizes)
def test_unknown_memory_pins(checkpoint):
    assert memory.pin_needed(checkpoint, None)


def test_available_memory_is_at_most_the_total():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
    assert 0 < memory.available_memory() <= total


_FAULTS = textwrap.dedent("""
    import resource, sys, torch
    from torch_armor.engine import memory
    if sys.argv[1] == "pin":
        assert memory.fix_mmap_threshold()
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):  # let glibc's dynamic threshold settle on 16 MB chunks
        torch.ones(2048, 2048)
    before = faults()
    for _ in range(20):
        torch.ones(2048, 2048)  # 16 MB, touched, freed
    print(faults() - before)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or memory._glibc() is None, reason="glibc only")
def test_pinning_gives_every_large_tensor_fresh_pages():
    def faults(mode):
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.split()[-1])
    pages = 20 * 16 * 2**20 // 4096
    assert faults("pin") > pages // 2      # each 16 MB tensor mmapped afresh: a fault per page
    assert faults("nopin") < pages // 20   # reused from the heap
