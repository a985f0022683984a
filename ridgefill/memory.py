"""Keep freed memory in the process, so that the next tensor of the same size reuses it.

glibc returns a freed block of more than a few MB to the kernel at once (and trims the heap's free top), so the next
allocation of that size gets fresh pages, each costing a page fault when first written. A forward pass allocates
and frees the same activations layer after layer, and on a virtual machine a fault costs 15-45 µs: decoding from
a 4K-token prompt on one CPU thread then spends more time in the kernel than in the model. `keep_freed_memory`
raises glibc's two thresholds (`mallopt`), so blocks up to 32 MB come from the heap and 1 GB of free heap is kept;
peak memory is unchanged, memory is returned later. The CLI calls it at start, as the benchmarks and the tests do.
Elsewhere than glibc on Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
MMAP_THRESHOLD = 32 << 20  # the largest glibc accepts on 64-bit
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory() -> bool:
    """Set glibc's thresholds (module docstring); True if they were set, False where there is no glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl has mallopt as a stub)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
