"""Backends that run a linearized program and return ``(C_w, C_b, ŷ)``.

``reference``: plain PyTorch autograd with a full-shape ones channel, the oracle.
``fused``: one ones value per pixel, fused kernels for the hot rules.
``compiled``: the fused backend's explanation traced once per signature into one graph and compiled.
``auto`` (the default): ``fused`` on the CPU, ``reference`` elsewhere: the fastest as measured there.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import OptionError
from . import compiled, fused, reference


def resolved_name(name: str, device: torch.device) -> str:
    """The backend that ``name`` runs on ``device``: ``auto`` resolved (see :func:`_fastest`)."""
    if name != "auto":
        return name
    return "fused" if device.type == "cpu" else "reference"


def _fastest(program, model, x, target, parameter_gradient=None) -> tuple:
    """The backend the committed benchmarks show fastest for first-order explanations on
    the input's device type: ``fused`` on the CPU (``bench/results/end_to_end_cpu.json``,
    ``compiled_cpu.json``, ``compiled_cpu_parts.json``: ``compiled`` is faster once compiled,
    but its compilation takes from half a minute to minutes per signature, paid back only
    after a hundred or more batches of one shape),
    ``reference`` on CUDA
    (``end_to_end_gpu.json``: cuDNN and cuBLAS beat the Triton kernels launched op by op;
    ``compiled_gpu.json``: ``compiled`` takes 0.18–0.22× the reference's time once
    compiled, but its compilation of about a minute per signature pays off only after
    900–1,100 batches of the same shape).
    """
    backend = {"fused": fused, "reference": reference}[resolved_name("auto", x.device)]
    return backend.explain_batch(program, model, x, target, parameter_gradient)


BACKENDS: dict[str, Callable] = {"reference": reference.explain_batch, "fused": fused.explain_batch,
                                 "compiled": compiled.explain_batch, "auto": _fastest}


def resolve(name: str) -> Callable:
    """The ``explain_batch`` function of backend ``name`` (``"auto"``: the fastest for the input's device)."""
    if name not in BACKENDS:
        raise OptionError(f"unknown backend {name!r}; available: " + ", ".join(repr(b) for b in BACKENDS))
    return BACKENDS[name]
