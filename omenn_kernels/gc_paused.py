"""Python's cyclic garbage collector paused while a signature is captured, traced, compiled or loaded.

What and why: capturing a model (``torch.export``), tracing its explanation and compiling or
loading the graph create a great many Python objects (graph nodes, fake tensors, symbolic
expressions, Inductor's IR), most of which live until the step ends or longer. Python runs a full
collection each time the objects that survived its younger collections since the last full one
reach a quarter of the oldest generation, so one such step sets off several full collections,
each visiting every object the process tracks, and almost nothing they visit is garbage yet.
Paused for the step, the collector runs after it, when Python's thresholds next call for it:
fewer visits of the same objects, at the cost of keeping the step's cyclic garbage (mostly graph
objects and fake tensors, which hold no data) until then.

The pause is process-wide (the collector has one switch) and reentrant across threads: it
ends when the last of the steps that overlap ends, and leaves the collector off where it was
off before the first.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

_lock = threading.Lock()
_depth = 0  # steps in progress
_was_enabled = False  # the collector's switch before the first of them


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Within the block, Python's cyclic garbage collector does not run (see the module docstring)."""
    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                gc.enable()
