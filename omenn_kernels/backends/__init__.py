"""Backends that run a linearized program and return its :class:`~.executor.BackendExplanation`.

``reference``: plain PyTorch autograd with a full-shape ones channel, the oracle.
``fused``: one ones value per pixel, fused kernels for the hot rules.
``compiled``: the fused backend's explanation traced once per signature into one graph and compiled.
``auto`` (the default): on the CPU ``fused`` until a signature is hot, then ``compiled``
(:mod:`~.tiered`); ``reference`` elsewhere: the fastest as measured there.

Each backend module keeps what it caches per program itself, weakly keyed by the program.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..linearize.program import LinearizedProgram
from ..readout import Readout
from . import compiled, fused, reference, tiered
from .executor import BackendExplanation, ParameterGradient


def resolved_name(name: str, device: torch.device) -> str:
    """The eager backend that ``name`` runs on ``device``: ``auto``'s is the one the committed
    benchmarks show fastest there without compilation (``bench/README.md``): ``fused`` on the
    CPU (which :class:`Backend` tiers up to ``compiled`` once a signature is hot); ``reference``
    on CUDA, where cuDNN and cuBLAS beat the Triton kernels launched op by op.
    """
    if name != "auto":
        return name
    return "fused" if device.type == "cpu" else "reference"


def _tiers(name: str, device: torch.device) -> bool:
    """Whether ``name`` on ``device`` runs :mod:`~.tiered`: ``auto`` on the CPU."""
    return name == "auto" and device.type == "cpu"


class Backend:
    """A backend as its callers use it, whichever it is (``auto`` resolved per input device)."""

    def __init__(self, name: str) -> None:
        if name not in ("reference", "fused", "compiled", "auto"):
            raise OptionError(f"unknown backend {name!r}; available: 'reference', 'fused', 'compiled', 'auto'")
        self.name = name

    def explain(self, program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
        """The explanation of ``readout`` for the batch ``x``."""
        module = tiered if _tiers(self.name, x.device) else \
            {"reference": reference, "fused": fused, "compiled": compiled}[resolved_name(self.name, x.device)]
        return module.explain_batch(program, model, x, readout, parameter_gradient)

    def runs_on(self, program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                parameter_gradient: ParameterGradient | None = None) -> str:
        """The backend :meth:`explain` of these arguments runs: ``auto`` resolved; ``compiled`` only
        where it replays a graph compiled earlier (it traces, compiles and reads back nothing), else
        ``fused`` (a read-out it does not trace, a signature not compiled yet, or not hot yet, or
        that failed to compile)."""
        if _tiers(self.name, x.device):
            return "compiled" if tiered.runs_compiled(program, model, x, readout, parameter_gradient) else "fused"
        name = resolved_name(self.name, x.device)
        if name == "compiled" and not compiled.replays(program, model, x, readout, parameter_gradient):
            return "fused"
        return name
