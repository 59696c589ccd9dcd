"""R7–R9: sums, constants added or multiplied, and products of LIVE tensors.

R7: ``a + b`` of LIVE tensors: the values add, the ones average.
R7': LIVE ``a`` plus a CONST ``c``: ``a + c·O_a`` — the ones carry the constant.
R8: LIVE ``a`` scaled by a CONST or a gate: ``a·c``, ones unchanged.
R8': a LIVE tensor multiplied by a mask (a CONST of boolean or integer values, such as a
padding mask, also cast to floating point): the positions it zeroes are removed,
``O_a·[c ≠ 0]``, so that later biases spread over the real positions only.
R9: a product of two LIVE tensors has no linear form: a clear error.
R1' for ``addcmul``/``addcdiv`` (``a + v·t₁·t₂``, ``a + v·t₁/t₂``): R7' and R8 in one op.
"""

from __future__ import annotations

import torch

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, reached, removed_where_zero, summed_ones

aten = torch.ops.aten

_ADDITIVE_GATE = RuleError(
    "an input-dependent constant (a gate such as a softmax or sigmoid result) is added to a LIVE "
    "tensor; gates may only multiply", "R5 (gates multiply LIVE tensors)")


def _add(op, *args, **kwargs):
    """R7 / R7' for add and sub (with ``alpha``)."""
    a, b, alpha = arguments(op, args, kwargs)[:3]
    alpha = 1 if alpha is None else alpha
    sign = -1 if op in (aten.sub.Tensor, aten.sub.Scalar) else 1
    if isinstance(a, Gate) or isinstance(b, Gate):
        raise _ADDITIVE_GATE
    if isinstance(a, Live) and isinstance(b, Live):
        value = a.value + sign * alpha * b.value
        return Live(value, summed_ones(a.ones, b.ones))
    live, const, live_first = (a, b, True) if isinstance(a, Live) else (b, a, False)
    ones = live.ones if isinstance(const, (int, float)) and const == 0 else reached(live.ones)
    carried = const * ones
    if live_first:
        value = live.value + sign * alpha * carried
    else:
        value = carried + sign * alpha * live.value
    return Live(value, ones)


def _rsub(op, *args, **kwargs):
    """``other - alpha·a`` with LIVE ``a`` and CONST ``other`` (R7')."""
    a, other, alpha = arguments(op, args, kwargs)[:3]
    if not isinstance(a, Live) or isinstance(other, (Live, Gate)):
        raise _ADDITIVE_GATE if isinstance(other, Gate) else RuleError(
            "rsub with a LIVE subtrahend only is supported", "R7'")
    value = other * a.ones - alpha * a.value
    return Live(value, a.ones)


def _scale(op, *args, **kwargs):
    """R8: a LIVE tensor multiplied or divided by a CONST or a gate."""
    a, b = arguments(op, args, kwargs)[:2]
    divide = op in (aten.div.Tensor, aten.div.Scalar)
    if isinstance(a, Live) and isinstance(b, Live):
        raise RuleError("both factors depend on the input and neither is a gate (softmax/sigmoid "
                        "weights): the product has no linear form",
                        "R9 (a product of two LIVE tensors is unsupported)")
    if divide and not isinstance(a, Live):
        raise RuleError("the divisor depends on the input", "R8 (division by a CONST only)")
    live, factor = (a, b) if isinstance(a, Live) else (b, a)
    factor = factor.value if isinstance(factor, Gate) else factor
    value = live.value / factor if divide else live.value * factor
    if not divide and isinstance(factor, torch.Tensor) and not (factor.is_floating_point() or factor.is_complex()):
        return Live(value, removed_where_zero(live.ones, factor))  # R8'
    return Live(value, live.ones)


def _masked(op, *args, **kwargs):
    """R8': a LIVE tensor multiplied by a mask cast to floating point."""
    a, b = arguments(op, args, kwargs)[:2]
    live, mask = (a, b) if isinstance(a, Live) else (b, a)
    return Live(live.value * mask, removed_where_zero(live.ones, mask))


def _div_rounding(op, *args, **kwargs):
    bound = arguments(op, args, kwargs)
    if bound[2] is not None:
        raise RuleError(f"division with rounding_mode={bound[2]!r} is not linear",
                        "R8 (true division only)")
    return _scale(aten.div.Tensor, bound[0], bound[1])


def _addcmul(op, *args, **kwargs):
    """``a + v·t₁·t₂`` (``addcdiv``: ``a + v·t₁/t₂``) with one LIVE term: R7' and R8 in one op."""
    a, t1, t2, scale = arguments(op, args, kwargs)[:4]
    divide = op is aten.addcdiv.default
    if isinstance(t1, Live) or isinstance(t2, Live):
        product = _scale(aten.div.Tensor if divide else aten.mul.Tensor, t1, t2)
        product = Live(scale * product.value, product.ones)
        return _add(aten.add.Tensor, a, product, 1) if isinstance(a, Live) else \
            _add(aten.add.Tensor, product, a, 1)
    if isinstance(t1, Gate) or isinstance(t2, Gate):
        raise _ADDITIVE_GATE
    return _add(aten.add.Tensor, a, scale * (t1 / t2 if divide else t1 * t2), 1)


def _neg(op, a):
    return Live(-a.value, a.ones)


register([aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar],
         Rule("R7 sum / R7' constant added", _add))
register([aten.rsub.Tensor, aten.rsub.Scalar], Rule("R7' constant minus LIVE", _rsub))
register([aten.mul.Tensor, aten.mul.Scalar],
         Rule("R8 scaled by a constant or gate", _scale, factor_args=(0, 1),
              masked=Rule("R8' scaled by a mask", _masked, factor_args=(0, 1))))
# An input-dependent divisor makes the quotient a held multiplier where it only scales (R5').
register([aten.div.Tensor, aten.div.Scalar],
         Rule("R8 divided by a constant or gate", _scale, factor_args=(1,), multiplier_args=(1,)))
register([aten.div.Tensor_mode, aten.div.Scalar_mode], Rule("R8 divided by a constant or gate", _div_rounding))
register([aten.neg], Rule("R8 scaled by -1", _neg))
register([aten.addcmul], Rule("R1' addcmul (R7' + R8)", _addcmul, factor_args=(1, 2)))
register([aten.addcdiv], Rule("R1' addcdiv (R7' + R8)", _addcmul, factor_args=(2,)))
