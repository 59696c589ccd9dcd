"""Backends that run a linearized program and return its :class:`~.executor.BackendExplanation`.

``reference``: plain PyTorch autograd with a full-shape ones channel, the oracle.
``fused``: one ones value per pixel, fused kernels for the hot rules.
``compiled``: the fused backend's explanation traced once per signature into one graph and compiled.
``auto`` (the default): the device's fastest eager backend until a signature is hot, then
``compiled`` (:mod:`~.tiered`).

Each backend module keeps what it caches per program itself, weakly keyed by the program.
"""

from __future__ import annotations

import torch

from ..errors import OptionError
from ..linearize.program import LinearizedProgram
from ..readout import Readout
from . import compiled, fused, reference, tiered
from .executor import BackendExplanation, ParameterGradient


# Per device type, the eager backend ``auto`` runs, the fastest without compilation in the
# committed benchmarks (bench/README.md): on CUDA cuDNN and cuBLAS beat the Triton kernels
# launched op by op. Other devices run ``reference`` and do not tier.
AUTO_EAGER = {"cpu": "fused", "cuda": "reference"}


def resolved_name(name: str, device: torch.device) -> str:
    """The eager backend that ``name`` runs on ``device``: ``auto``'s is :data:`AUTO_EAGER`'s
    (which :class:`Backend` tiers up to ``compiled`` once a signature is hot)."""
    if name != "auto":
        return name
    return AUTO_EAGER.get(device.type, "reference")


def _tiers(name: str, device: torch.device) -> bool:
    """Whether ``name`` on ``device`` runs :mod:`~.tiered`: ``auto`` where a compiled explanation's
    saving is measured (:data:`~.tiered.COMPILED_SAVING`)."""
    return name == "auto" and device.type in tiered.COMPILED_SAVING


class Backend:
    """A backend as its callers use it, whichever it is (``auto`` resolved per input device)."""

    def __init__(self, name: str) -> None:
        if name not in ("reference", "fused", "compiled", "auto"):
            raise OptionError(f"unknown backend {name!r}; available: 'reference', 'fused', 'compiled', 'auto'")
        self.name = name

    def explain(self, program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
        """The explanation of ``readout`` for the batch ``x``."""
        module = _MODULES[resolved_name(self.name, x.device)]
        if _tiers(self.name, x.device):
            return tiered.explain_batch(program, model, x, readout, parameter_gradient, eager=module)
        return module.explain_batch(program, model, x, readout, parameter_gradient)

    def before_capture(self, device: torch.device) -> None:
        """Start what this backend will need for a program about to be captured on ``device``
        and the capture does not wait for (``compiled``: :func:`.compiled.before_capture`;
        ``auto`` compiles only once a signature is hot, and starts it then)."""
        if self.name == "compiled":
            compiled.before_capture(device)

    def runs_on(self, program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                parameter_gradient: ParameterGradient | None = None) -> str:
        """The backend :meth:`explain` of these arguments runs: ``auto`` resolved; ``compiled`` only
        where it replays a graph compiled earlier (it traces, compiles and reads back nothing), else
        ``fused`` (a read-out it does not trace, a signature not compiled yet, or that failed to
        compile); ``auto`` runs its eager backend until a signature is hot and compiled."""
        name = resolved_name(self.name, x.device)
        if _tiers(self.name, x.device):
            return "compiled" if tiered.runs_compiled(program, model, x, readout, parameter_gradient) else name
        if name == "compiled" and not compiled.replays(program, model, x, readout, parameter_gradient):
            return "fused"
        return name


_MODULES = {"reference": reference, "fused": fused, "compiled": compiled}
