"""Fused op ``omenn::activation``: R4's ``x·ξ(x)`` with ``ξ`` held, and its backward.

Forward ``x·ξ(x)``; backward ``dy·ξ(x)`` with ``ξ`` recomputed from the saved ``x``
(nothing else is saved). The backward is linear in ``dy`` with ``ξ`` held, so it
differentiates again as itself.

Cost: forward one read of ``x`` and one write; backward one read of ``dy`` and ``x`` and
one write. Elementwise ``ξ`` is cheap next to the memory traffic, so the kernels save
the reference's separate ``ξ`` tensor and product.

Kernels: CPU ``csrc/activation.cpp`` (through ``omenn::activation_cpu``), CUDA
``triton_kernels/activation.py``. Reference: :func:`reference`, the rule's ``ξ``
(:func:`~omenn_kernels.linearize.rules.activation.multiplier`).

The rule's fused form runs where a kernel exists; where ``ξ`` must follow the parameters
(a total parameter gradient through a smooth activation, whose held value then carries a
gradient) the rule's reference math runs instead.
"""

from __future__ import annotations

import torch

from ..linearize.registry import arguments
from ..linearize.rules.activation import multiplier
from ..linearize.values import Live
from ..native import define_cpu_op
from . import fuse, fused_op, kernels_available

aten = torch.ops.aten

# The activations with a kernel, by the kernels' names for them (csrc/activation.cpp and
# triton_kernels.activation.KINDS use the same).
_KINDS = {aten.relu.default: "relu", aten.silu.default: "silu", aten.hardswish.default: "hardswish"}
# Multipliers that are piecewise constant (0/1, or 1/slope): they do not change with the parameters.


def fused_kind(op, rest: list) -> tuple[str, float] | None:
    """The kernels' name of activation ``op`` (with its extra arguments) and its slope, or None."""
    if op is aten.gelu.default:
        return ("gelu_tanh" if rest and rest[0] == "tanh" else "gelu"), 0.0
    if op is aten.leaky_relu.default:
        return "leaky_relu", float(rest[0]) if rest else 0.01
    kind = _KINDS.get(op)
    return (kind, 0.0) if kind else None


def _multiplier(x: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """``ξ(x)`` by the rule's reference math."""
    op, rest = {"gelu": (aten.gelu.default, ()), "gelu_tanh": (aten.gelu.default, ("tanh",)),
                "silu": (aten.silu.default, ()), "relu": (aten.relu.default, ()),
                "hardswish": (aten.hardswish.default, ()),
                "leaky_relu": (aten.leaky_relu.default, (slope,))}[kind]
    return multiplier(op, x, *rest)[0]


def reference(x: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """``x·ξ(x)`` by the rule's reference math, ``ξ`` held."""
    return x * _multiplier(x.detach(), kind, slope)


def reference_backward(grad: torch.Tensor, x: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """``grad·ξ(x)`` by the rule's reference math."""
    return grad * _multiplier(x, kind, slope)


_activation_cpu = define_cpu_op("activation_cpu(Tensor x, str kind, float slope) -> Tensor",
                                lambda x, kind, slope: torch.empty_like(x))
_activation_backward_cpu = define_cpu_op(
    "activation_backward_cpu(Tensor grad, Tensor x, str kind, float slope) -> Tensor",
    lambda grad, x, kind, slope: torch.empty_like(x))


@fused_op("omenn::activation", triton=True)
def activation(x: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """``x·ξ(x)`` for the activation ``kind`` (see :func:`fused_kind`), ``ξ`` held."""
    if x.device.type == "cuda":
        from ..triton_kernels.activation import activation_forward

        return activation_forward(x, kind, slope)
    return _activation_cpu(x, kind, slope)


@fused_op("omenn::activation_backward", triton=True)
def activation_backward(grad: torch.Tensor, x: torch.Tensor, kind: str, slope: float) -> torch.Tensor:
    """``grad·ξ(x)``, ``ξ`` recomputed from ``x``."""
    if x.device.type == "cuda":
        from ..triton_kernels.activation import activation_backward as kernel

        return kernel(grad, x, kind, slope)
    return _activation_backward_cpu(grad, x, kind, slope)


def _activation_setup(ctx, inputs, output) -> None:
    x, ctx.kind, ctx.slope = inputs
    ctx.save_for_backward(x)


def _activation_grad(ctx, grad):
    (x,) = ctx.saved_tensors
    # ξ is held: detached, a differentiated backward has no edge to the forward.
    return activation_backward(grad, x.detach(), ctx.kind, ctx.slope), None, None


activation.register_autograd(_activation_grad, setup_context=_activation_setup)


def _activation_backward_setup(ctx, inputs, output) -> None:
    _grad, x, ctx.kind, ctx.slope = inputs
    ctx.save_for_backward(x)


def _activation_backward_grad(ctx, grad_grad):
    """``dy·ξ(x)`` with ``ξ`` held: its derivative with respect to ``dy`` is ``ξ(x)`` again."""
    (x,) = ctx.saved_tensors
    return activation_backward(grad_grad, x, ctx.kind, ctx.slope), None, None, None


activation_backward.register_autograd(_activation_backward_grad, setup_context=_activation_backward_setup)


def _can_fuse(op, *args, held: list | None = None, **kwargs) -> bool:
    x, *rest = arguments(op, args, kwargs)
    kind = fused_kind(op, rest)
    return kind is not None and kernels_available(x.value) and (held is None or not held[0].requires_grad)


def _fused(op, *args, **kwargs) -> Live:
    """R4 through :func:`activation`: ``x·ξ(x)`` (every activation with a kernel has ``f(0) = 0``)."""
    x, *rest = arguments(op, args, kwargs)
    return Live(activation(x.value, *fused_kind(op, rest)), x.ones)


fuse([aten.relu, aten.leaky_relu, aten.gelu, aten.silu, aten.hardswish], _can_fuse, _fused)
