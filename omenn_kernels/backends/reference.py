"""The reference backend: every rule's reference math in plain PyTorch autograd.

The input's ones channel has the full shape of the input (one entry per element);
rules keep ones shared along a dimension only where the rule book makes them equal
(after a mean over channels, for instance). This is the oracle every fast path is
tested against.
"""

from __future__ import annotations

import torch

from ..linearize.program import LinearizedProgram
from ..readout import Readout
from .executor import BackendExplanation, ParameterGradient, explain_with


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
    """The explanation of ``readout`` with full-shape ones and reference rules."""
    return explain_with(program, model, x, readout, False, lambda rule: rule.reference, parameter_gradient)
