"""Backends that run a linearized program and return ``(C_w, C_b, ŷ)``.

``reference``: plain PyTorch autograd with a full-shape ones channel, the oracle.
``fused``: one ones value per pixel, fused kernels for the hot rules.
``compiled``: the fused backend's explanation traced once per signature into one graph and compiled.
``auto``: ``fused`` on the CPU, ``reference`` elsewhere: the faster of the two as measured there.
"""

from __future__ import annotations

from typing import Callable

from ..errors import OptionError
from . import compiled, fused, reference


def _fastest(program, model, x, target, parameter_gradient=None) -> tuple:
    """``fused`` for CPU inputs, ``reference`` for the others: the faster one as measured.

    On an H100 (bench/results/end_to_end_gpu.json, batch 64, bfloat16) the reference's
    cuDNN and cuBLAS calls beat the Triton kernels, whose launches through custom ops
    cost more than they save (ViT-B/16: 63 ms against 91 ms; ResNet-50: 76 against 153).
    """
    backend = fused if x.device.type == "cpu" else reference
    return backend.explain_batch(program, model, x, target, parameter_gradient)


BACKENDS: dict[str, Callable] = {"reference": reference.explain_batch, "fused": fused.explain_batch,
                                 "compiled": compiled.explain_batch, "auto": _fastest}


def resolve(name: str) -> Callable:
    """The ``explain_batch`` function of backend ``name`` (``"auto"``: the fastest for the input's device)."""
    if name not in BACKENDS:
        raise OptionError(f"unknown backend {name!r}; available: " + ", ".join(repr(b) for b in BACKENDS))
    return BACKENDS[name]
