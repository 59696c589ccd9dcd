"""What Inductor computes once per process before its first CPU compilation, run on a thread of its own.

Before it generates its first CPU kernel in a process, Inductor picks the instruction sets
(AVX2, AVX-512, AMX, ...) that the CPU reports and the C++ compiler can use
(``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): for each set the CPU reports, it
builds a small source with that set's flags and loads the library in a child Python. On an
empty Inductor cache these are a few compiler runs of seconds each, one after the other. Its
graph cache's key then hashes the source files of torch and Triton
(``torch._inductor.codecache.torch_key``, ``CacheBase.get_system``), on every cache and in
every process. None of it depends on what the explanation computes: :func:`start` runs it
on a thread, where it waits on the compiler and the files while the capture, the eager call
and the trace hold the Python interpreter; :func:`wait` is called before Inductor compiles,
which then finds each answer cached (Inductor caches them per process, and the probe's
libraries on disk).
"""

from __future__ import annotations

import logging
import threading

from ..errors import first_line

log = logging.getLogger("omenn_kernels.compiled")
_lock = threading.Lock()
_thread: threading.Thread | None = None


def start() -> None:
    """Start the work once per process (a no-op after the first call)."""
    global _thread
    with _lock:
        if _thread is not None:
            return
        # Imported on this thread: a module imported by two threads at once can be seen half done.
        from torch._inductor import codecache, cpu_vec_isa

        def run() -> None:
            for name, work in (("probe of the vector instruction sets", cpu_vec_isa.valid_vec_isa_list),
                               ("hash of torch's sources", codecache.torch_key),
                               ("description of the system", codecache.CacheBase.get_system)):
                try:
                    work()
                except Exception as error:  # noqa: BLE001 — Inductor computes it again where it needs it
                    log.debug("Inductor's %s failed on its thread (%s)", name, first_line(error))

        _thread = threading.Thread(target=run, name="omenn-kernels-inductor-start", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once started work has finished (at once if none was started)."""
    thread = _thread
    if thread is not None:
        thread.join()
