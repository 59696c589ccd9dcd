"""The fused backend: one ones value per position (pixel, token), and fused ops for the hot rules.

Rules with a fused op (detached activation multipliers, convolution bias spreading,
attention with the ones channel) run it; the others run their reference math on
the shared ones. CPU runs the C++ kernels of ``csrc/``, CUDA the Triton kernels of
``triton_kernels/``.

Explanations differentiable with respect to the parameters (``create_graph``) run the
fused ops whose backward differentiates again (``Rule.fused_differentiable``: convolution,
eval BatchNorm, linear, activations, attention) and the reference math of the others,
still with one ones value per pixel; a warning names the rules whose fused op has no
double backward.
"""

from __future__ import annotations

import functools
import warnings

import torch

from ..capture import CAPTURE_LOCK
from ..linearize.program import Kind, LinearizedProgram
from ..readout import Readout
from .executor import BackendExplanation, ParameterGradient, explain_with, runs_model_forward
from .layout import in_layout_of, runs_channels_last


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None,
                  model_forward: bool = False) -> BackendExplanation:
    """The explanation of ``readout`` with one ones value per pixel and fused rules.

    ``model_forward``: with a total parameter gradient, take the logits' parameter gradient
    from the model's own forward (the held pass) also where the multipliers are all
    piecewise constant, rather than from the fused ops' parameter paths (autograd
    functions whose backward is not the derivative of their forward, which a trace
    records without its backward; see :mod:`~omenn_kernels.backends.compiled`). The fused
    linear layers and attention then take their value's numbers from it
    (``reuse_held_results`` of :func:`~omenn_kernels.backends.executor.forward`).

    A CNN's images run channels-last on the CPU, ``C_w`` comes back in their layout
    (:mod:`~omenn_kernels.backends.layout`).

    Runs under :data:`~omenn_kernels.capture.CAPTURE_LOCK`: not while another thread exports.
    """
    ran_channels_last = runs_channels_last(program, x)
    laid_out = x.contiguous(memory_format=torch.channels_last) if ran_channels_last else x
    with CAPTURE_LOCK:
        explanation = _explain_batch(program, model, laid_out, readout, parameter_gradient, model_forward)
    return in_layout_of(x, ran_channels_last, explanation)


def _explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                   parameter_gradient: ParameterGradient | None, model_forward: bool) -> BackendExplanation:
    if parameter_gradient is None:
        return explain_with(program, model, x, readout, True, lambda rule: rule.fused or rule.reference)
    once_only = sorted({step.rule.name for step in program.steps
                        if step.kind is Kind.LIVE and step.rule.fused is not None
                        and not step.rule.fused_differentiable})
    if once_only:
        warnings.warn(f"omenn_kernels: the fused ops of {', '.join(once_only)} have no double backward, "
                      "so explanations differentiable with respect to the parameters (create_graph=True) "
                      "run their reference rules on the fused backend", RuntimeWarning, stacklevel=5)
    # The linearized logits are the model's own only where the held pass is not the model's forward.
    model_forward = runs_model_forward(program, parameter_gradient, model_forward)
    value_gradient = parameter_gradient == "total" and not model_forward

    def implementation(rule):
        if rule.fused is not None and rule.fused_differentiable:
            return functools.partial(rule.fused, value_gradient=value_gradient)
        return rule.reference
    return explain_with(program, model, x, readout, True, implementation, parameter_gradient, model_forward,
                        reuse_held_results=True)
