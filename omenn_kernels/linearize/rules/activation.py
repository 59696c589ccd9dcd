"""R4: elementwise activations as ``f(0)·O + x·stopgrad(ξ(x))``.

Fused op ``omenn::activation`` (GELU, tanh-GELU, SiLU, ReLU, LeakyReLU, Hardswish):
:mod:`omenn_kernels.ops.activation`.

``ξ(x) = (f(x) − f(0))/x`` with ``ξ(0) = f'(0)``. Closed forms are used where they
exist (GELU: Φ(x), SiLU: σ(x), ReLU: 1[x>0], Hardswish: relu6(x+3)/6); every other
activation uses the quotient. Sigmoid and hard-sigmoid whose result multiplies a
LIVE tensor are gates (R5), decided by the graph walker from ``may_gate``; so is any
activation whose every use scales another LIVE tensor (R5', a gated MLP's ``silu``).
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch

from ..registry import Rule, arguments, register
from ..values import Live

aten = torch.ops.aten


def _gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    if approximate == "tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))
        return 0.5 * (1.0 + torch.tanh(inner))
    return 0.5 * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def _leaky_relu(x: torch.Tensor, negative_slope: float = 0.01) -> torch.Tensor:
    return torch.where(x > 0, torch.ones_like(x), torch.full_like(x, negative_slope))


CLOSED_FORM: dict = {
    aten.relu.default: lambda x: (x > 0).to(x.dtype),
    aten.gelu.default: _gelu,
    aten.silu.default: torch.sigmoid,
    aten.hardswish.default: lambda x: (x + 3.0).clamp(0.0, 6.0) / 6.0,
    aten.leaky_relu.default: _leaky_relu,
}


@functools.lru_cache(maxsize=256)
def _at_zero(op: Callable, rest: tuple) -> tuple[float, float]:
    """``f(0)`` and ``f'(0)`` of ``op`` (with its extra arguments), in float64; once per op and arguments."""
    zero = torch.zeros((), dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        at_zero = op(zero, *rest)
        (slope,) = torch.autograd.grad(at_zero, zero)
    return at_zero.item(), slope.item()


def multiplier(op, x: torch.Tensor, *rest) -> tuple[torch.Tensor, float]:
    """The multiplier ``ξ(x)`` of activation ``op`` and its offset ``f(0)``.

    ``op(x, *rest) == f(0) + x·ξ(x)`` elementwise (up to rounding). ``ξ`` follows ``x``'s
    autograd history: pass a value held constant with respect to the input
    (``Rule.held_args``).
    """
    closed = CLOSED_FORM.get(op)
    if closed is not None:
        return closed(x, *rest), 0.0
    offset, slope = _at_zero(op, tuple(rest))
    quotient = (op(x, *rest) - offset) / torch.where(x == 0, torch.ones_like(x), x)
    return torch.where(x == 0, torch.full_like(x, slope), quotient), offset


def _activation(op, *args, held: list | None = None, **kwargs):
    """R4: ``f(0)·O + x·ξ(x̄)`` with ``x̄`` the held ``x``; the ones pass through. A piecewise-constant
    ``ξ`` (no ``held``) is read from the value itself."""
    x, *rest = arguments(op, args, kwargs)
    xi, offset = multiplier(op, x.value.detach() if held is None else held[0], *rest)
    value = x.value * xi
    if offset != 0.0:
        value = value + offset * x.ones
    return Live(value, x.ones)


# Piecewise-constant multipliers (0/1, or 1/slope): their derivative is zero, so they do not
# change with the parameters.
register([aten.relu, aten.leaky_relu, aten.hardshrink],
         Rule("R4 elementwise activation", _activation, multiplier_args=(0,)))
register([aten.gelu, aten.silu, aten.hardswish, aten.elu, aten.celu, aten.selu, aten.hardtanh,
          aten.relu6, aten.tanh, aten.softplus, aten.mish, aten.softshrink, aten.clamp.default,
          aten.clamp_min.default, aten.clamp_max.default, aten.log_sigmoid, aten.sin, aten.cos, aten.tan,
          aten.asin, aten.acos, aten.atan, aten.sinh, aten.cosh, aten.asinh, aten.atanh, aten.expm1, aten.log1p],
         Rule("R4 elementwise activation", _activation, multiplier_args=(0,), held_args=(0,)))
register([aten.sigmoid, aten.hardsigmoid],
         Rule("R4 elementwise activation / R5 gate", _activation, may_gate=True, held_args=(0,)))
