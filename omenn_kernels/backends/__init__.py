"""Backends that run a linearized program and return ``(C_w, C_b, ŷ)``.

``reference``: plain PyTorch autograd with a full-shape ones channel, the oracle.
``fused``: one ones value per pixel, fused kernels for the hot rules.
"""

from __future__ import annotations

from typing import Callable

from . import fused, reference

BACKENDS: dict[str, Callable] = {"reference": reference.explain_batch, "fused": fused.explain_batch}


def resolve(name: str) -> Callable:
    """The ``explain_batch`` function of backend ``name`` (``"auto"`` picks the fastest available)."""
    if name == "auto":
        name = "fused"
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; available: 'auto', " +
                         ", ".join(repr(b) for b in BACKENDS))
    return BACKENDS[name]
