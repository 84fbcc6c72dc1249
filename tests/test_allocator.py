"""`keep_freed_memory`: after it, memory a process frees stays mapped and is reused without page faults
(glibc's real allocator, in fresh processes, so the setting reaches nothing else)."""

import subprocess
import sys

PROBE = """
import ctypes, resource, sys
from agent.allocator import keep_freed_memory
print(keep_freed_memory() if sys.argv[1] == "on" else "off")
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 16 << 20
faults = []
for _ in range(4):  # a turn's tensor: allocated, written, freed, and again the next turn
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(*faults)
"""


def faults(mode: str) -> tuple[str, list[int]]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True).stdout.split("\n")
    return out[0], [int(n) for n in out[1].split()]


def test_freed_blocks_are_reused_without_faulting_their_pages_again():
    pages = (16 << 20) // 4096
    took, kept = faults("on")
    assert took == "True"
    assert kept[0] >= pages // 2  # the first use faults its pages in
    assert sum(kept[1:]) < pages // 20  # every later one finds them mapped
    _, default = faults("off")
    assert sum(default[1:]) >= pages // 2  # glibc's defaults hand a block back and fault it in again
