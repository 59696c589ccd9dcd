"""keep_freed_memory: freed blocks stay in glibc's heap; the CPU commands set it.

The allocator setting is process-wide, so it is checked in child processes.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from omenn_kernels import cli, demo

GLIBC = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"

# Allocates and frees a 16 MiB tensor, then prints whether keep_freed_memory() took
# effect and the free bytes left in the heap (MiB), from glibc's mallinfo2.
_CHILD = """
import ctypes, sys, torch
from omenn_kernels.cpu_memory import keep_freed_memory
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
kept = keep_freed_memory() if sys.argv[1] == "kept" else None
block = torch.ones(4 * 1024 * 1024)
del block
print(kept, libc.mallinfo2().fordblks >> 20)
"""


def _child(mode: str) -> tuple[str, int]:
    done = subprocess.run([sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, check=True)
    kept, free_mib = done.stdout.split()
    return kept, int(free_mib)


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt and mallinfo2")
def test_freed_block_stays_in_the_heap():
    default_kept, default_free = _child("default")
    kept, kept_free = _child("kept")
    assert default_kept == "None" and kept == "True"
    # With glibc's defaults the 16 MiB block is mapped on its own and unmapped when freed.
    assert default_free < 16 <= kept_free


@pytest.mark.parametrize("argv, called", [
    (["demo"], True),
    (["explain", "images", "--out", "store", "--model", "parts_vit", "--device", "cpu"], True),
    (["explain", "images", "--out", "store", "--model", "parts_vit", "--device", "cuda"], False),
    (["show", "store", "--out", "overlays"], False),
])
def test_cpu_commands_keep_freed_memory(monkeypatch, argv, called):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append(True) or True)
    # The commands' work is replaced: only the set-up before it is under test.
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: 0)
    monkeypatch.setattr(cli, "_explain", lambda args: 0)
    monkeypatch.setattr(cli, "_show", lambda args: 0)
    assert cli.main(argv) == 0
    assert bool(calls) == called
