"""The fused backend: one ones value per pixel, and fused ops for the hot rules.

Rules with a fused op (detached activation multipliers, convolution bias spreading,
attention with the ones channel) run it; the others run their reference math on
the shared ones. CPU runs the C++ kernels of ``csrc/``, CUDA the Triton kernels of
``triton_kernels/``.
"""

from __future__ import annotations

import torch

from ..linearize.program import LinearizedProgram
from .executor import explain_with


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
                  target) -> tuple[torch.Tensor, ...]:
    """``(C_w, C_b, ŷ, target, logits)`` with one ones value per pixel and fused rules."""
    return explain_with(program, model, x, target, 1, lambda rule: rule.fused or rule.reference)
