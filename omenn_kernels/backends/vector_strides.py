"""An index's stride along Inductor's vectorized loop variable taken without ``sympy.simplify`` of the index.

What and why: Inductor's CPU code generator asks, for every load and store of every kernel it
considers vectorizing, how far the index moves when the vectorized loop variable moves by one
(``stride_at_vec_range``). It first rewrites the index for a vector's range: each
``FloorDiv(var, d)`` and ``ModularIndexing(var, d, m)`` that is constant across a vector becomes a
free symbol. Then it calls ``sympy.simplify`` on the whole index, and takes the stride as
``simplify(index(var + 1) − index(var))``. ``sympy.simplify`` tries many rewrites of the whole
expression, even of a sum of a few products, and an explanation's graph asks for thousands of
strides; most are of affine indices (``75648*x0 + 64*x1 + x2``) with nothing to rewrite.

Where the index holds neither ``FloorDiv`` nor ``ModularIndexing``, the rewrite changes nothing
and the simplification of the index is an equivalence, so the stride is the same difference
simplified: ``stride_at(index, var)``, a number or an expression equal to Inductor's. Other
indices take Inductor's function. While :func:`affine_strides` is active on a thread, that
thread's code generation takes this path; others are untouched. A torch without these functions
is left as it is: the path only saves time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

_active = threading.local()  # .on: whether this thread's strides skip the simplification
_install_lock = threading.Lock()
_inductor: dict[str, Callable] = {}  # Inductor's stride_at_vec_range and stride_at, once installed


@contextlib.contextmanager
def affine_strides() -> Iterator[None]:
    """Within the block, this thread's vector strides of affine indices skip ``sympy.simplify`` of the index."""
    _install()
    outer = getattr(_active, "on", False)
    _active.on = True
    try:
        yield
    finally:
        _active.on = outer


def stride_at_vec_range(index: sympy.Expr, var: sympy.Symbol, vec_length: int | None = None) -> sympy.Expr:
    """Inductor's ``stride_at_vec_range``; for an index without floor divisions or modulos, its
    stride without simplifying the index first (module docstring)."""
    if getattr(_active, "on", False) and not index.has(FloorDiv, ModularIndexing):
        return _inductor["stride_at"](index, var)
    return _inductor["stride_at_vec_range"](index, var, vec_length)


def _install() -> None:
    with _install_lock:
        if _inductor:
            return
        try:
            from torch._inductor import sizevars
            from torch._inductor.codegen import cpp

            found = {"stride_at_vec_range": cpp.stride_at_vec_range, "stride_at": sizevars.stride_at}
        except (ImportError, AttributeError):
            return
        _inductor.update(found)
        cpp.stride_at_vec_range = stride_at_vec_range
