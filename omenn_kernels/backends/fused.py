"""The fused backend: one ones value per position (pixel, token), and fused ops for the hot rules.

Rules with a fused op (detached activation multipliers, convolution bias spreading,
attention with the ones channel) run it; the others run their reference math on
the shared ones. CPU runs the C++ kernels of ``csrc/``, CUDA the Triton kernels of
``triton_kernels/``. Every fused op's backward differentiates again, so explanations
differentiable with respect to the parameters (``create_graph``) run them too; with a
total parameter gradient the fused convolutions, linear layers and attention take their
value's numbers from the model's own forward (``reuse_held_results`` of
:func:`~omenn_kernels.backends.executor.forward`).
"""

from __future__ import annotations

import torch

from ..capture import CAPTURE_LOCK
from ..linearize.program import LinearizedProgram
from ..readout import Readout
from .executor import BackendExplanation, ParameterGradient, explain_with
from .layout import in_layout_of, runs_channels_last


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
    """The explanation of ``readout`` with one ones value per pixel and fused rules.

    A CNN's images run channels-last on the CPU, ``C_w`` comes back in their layout
    (:mod:`~omenn_kernels.backends.layout`).

    Runs under :data:`~omenn_kernels.capture.CAPTURE_LOCK`: not while another thread exports.
    """
    ran_channels_last = runs_channels_last(program, x)
    laid_out = x.contiguous(memory_format=torch.channels_last) if ran_channels_last else x
    with CAPTURE_LOCK:
        explanation = explain_with(program, model, laid_out, readout, True, lambda rule: rule.fused or rule.reference,
                                   parameter_gradient, reuse_held_results=True)
    return in_layout_of(x, ran_channels_last, explanation)
