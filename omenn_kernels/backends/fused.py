"""The fused backend: one ones value per pixel, and fused ops for the hot rules.

Rules with a fused op (detached activation multipliers, convolution bias spreading,
attention with the ones channel) run it; the others run their reference math on
the shared ones. CPU runs the C++ kernels of ``csrc/``, CUDA the Triton kernels of
``triton_kernels/``.

The fused ops differentiate once: their backward kernels have no derivative of their
own, and they give the parameters no gradient. Explanations differentiable with
respect to the parameters therefore run every rule's reference math, still with one
ones value per pixel, and say so with a warning.
"""

from __future__ import annotations

import warnings

import torch

from ..linearize.program import LinearizedProgram
from .executor import ParameterGradient, explain_with


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
                  target, parameter_gradient: ParameterGradient | None = None) -> tuple[torch.Tensor, ...]:
    """``(C_w, C_b, ŷ, target, logits)`` with one ones value per pixel and fused rules."""
    if parameter_gradient is not None:
        warnings.warn("omenn_kernels: the fused ops have no double backward, so explanations "
                      "differentiable with respect to the parameters (create_graph=True) run the "
                      "reference rules on the fused backend, with one ones value per pixel",
                      RuntimeWarning, stacklevel=4)
        return explain_with(program, model, x, target, 1, lambda rule: rule.reference, parameter_gradient)
    return explain_with(program, model, x, target, 1, lambda rule: rule.fused or rule.reference)
