"""Keeping freed memory in the process for explanation-heavy CPU work (glibc).

glibc's malloc gives large freed blocks back to the system (it unmaps them or trims the
top of the heap), so the next tensor of the same size faults its pages in again and has
them zero-filled. An explanation allocates and frees many such tensors — a forward with
the ones channel, then one backward per read-out — so on the CPU the page faults cost a
large share of the time. On an AMD EPYC (1 thread), ``explain_folder`` on 512 images
with 4 targets each explained 159 instead of 135 images/s with parts_cnn and 148 instead
of 141 with parts_vit (``bench/freed_memory.py``, fresh processes).

:func:`keep_freed_memory` fixes glibc's thresholds so that freed blocks of up to
``MMAP_THRESHOLD`` stay in the heap for reuse. The process then keeps its peak memory
until it exits, which suits a batch job: ``omenn explain`` and ``omenn demo`` call it
when they run on the CPU. It is process-wide, so a library never sets it on its own.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt's parameter numbers (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's upper limit for the mmap threshold on 64-bit systems; blocks above it are still
# mapped and unmapped one by one.
MMAP_THRESHOLD = 32 * 1024 * 1024
_NEVER_TRIM = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make glibc keep freed blocks (up to 32 MiB each) for reuse instead of returning them.

    Returns True where the thresholds were set (Linux with glibc), False where this
    process has no glibc ``mallopt`` (other systems and C libraries), where it is a no-op.
    Both thresholds are set together: fixing only the trim threshold also stops glibc from
    raising its mmap threshold, and every block above 128 KiB would be mapped afresh.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM))
