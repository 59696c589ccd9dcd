"""Inductor's probe of the CPU's vector instruction sets, run on a thread of its own.

Before it generates its first CPU kernel in a process, Inductor picks the instruction sets
(AVX2, AVX-512, AMX, ...) that the CPU reports and the C++ compiler can use
(``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): for each set the CPU reports, it
builds a small source with that set's flags and loads the library in a child Python. On an
empty Inductor cache these are a few compiler runs of seconds each, one after the other, and
they depend on nothing the explanation computes. :func:`start` runs them on a thread, where
they wait on the compiler while the capture, the eager call and the trace hold the Python
interpreter; :func:`wait` is called before Inductor compiles, which then finds the answer
cached (Inductor caches it per process, and its libraries on disk).
"""

from __future__ import annotations

import logging
import threading

from ..errors import first_line

log = logging.getLogger("omenn_kernels.compiled")
_lock = threading.Lock()
_thread: threading.Thread | None = None


def start() -> None:
    """Start the probe once per process (a no-op after the first call)."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        # Imported on this thread: a module imported by two threads at once can be seen half done.
        from torch._inductor import cpu_vec_isa

        def probe() -> None:
            try:
                cpu_vec_isa.valid_vec_isa_list()
            except Exception as error:  # noqa: BLE001 — Inductor probes again where it needs the answer
                log.debug("Inductor's probe of the vector instruction sets failed on its thread (%s)",
                          first_line(error))

        _thread = threading.Thread(target=probe, name="omenn-kernels-isa-probe", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once a started probe has finished (at once if none was started)."""
    thread = _thread
    if thread is not None:
        thread.join()
