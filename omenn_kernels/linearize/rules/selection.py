"""R1' selections and writes: ``where``, maximum/minimum, and scatters with CONST indices.

Each is linear in its input-dependent operands once the choice of positions is fixed:

- ``where(c, a, b) = c·a + (1 − c)·b`` with the condition ``c`` CONST or held (a
  comparison of LIVE values is a held multiplier, R5', ending here as a factor); a
  CONST branch ``k`` enters as ``k·O`` of the LIVE branch (R7'). ``masked_fill`` is the
  same with the fill as the CONST branch.
- ``maximum(a, b) = where(a ≥ b, a, b)`` with the comparison of the held values held
  (piecewise constant, like ReLU's ``ξ``); ``minimum`` and ``clamp`` with tensor bounds
  likewise.
- reductions that select (``amax``, ``max(dim)``, ``sort``, ``topk``; min likewise): the
  selected positions held (the arg-max of the held values, as R13' max pooling holds it),
  the values and the ones read there. Used only as a factor, ``amax`` is a held
  multiplier instead (R5': ``x / amax(x)``).
- ``copy``: the source, broadcast to the target's shape.
- writes with CONST indices (``scatter``, ``index_put``, ``select_scatter``,
  ``slice_scatter``): the write applied to the values and,
  with the same indices, to the ones. A CONST operand enters as ``t·Ō`` with ``Ō`` the
  per-sample mean of the LIVE operands' ones (R12). Accumulating writes (``scatter_add``,
  ``index_put(accumulate=True)``, ``scatter_reduce`` with ``sum``/``mean``) sum values,
  so their ones are renormalized as a sum's (R13).
"""

from __future__ import annotations

import torch

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, contains, full_ones, plain, reached, renormalized
from .structure import constant_as_live

aten = torch.ops.aten


def _condition(condition) -> torch.Tensor:
    if isinstance(condition, Live):
        raise RuleError("the condition depends on the input and is used other than as a factor",
                        "R1' where with a CONST or held condition")
    return condition.value if isinstance(condition, Gate) else condition


def _branch(branch, other: Live) -> Live:
    """A branch as a Live value: a CONST ``k`` carried by the ones of the LIVE branch (R7')."""
    if isinstance(branch, Live):
        return branch
    if isinstance(branch, Gate):
        raise RuleError("an input-dependent constant (a gate) is selected in place of a LIVE value; gates "
                        "may only multiply", "R5 (gates multiply LIVE tensors)")
    if isinstance(branch, (int, float, bool)) and branch == 0:
        return Live(torch.zeros_like(other.value), other.ones)
    ones = reached(other.ones)
    return Live(branch * ones, ones)


def selected(condition: torch.Tensor, a, b) -> Live:
    """``where(condition, a, b)`` of LIVE (or CONST) branches, ones chosen with the values."""
    live = a if isinstance(a, Live) else b
    a, b = _branch(a, live), _branch(b, live)
    value = torch.where(condition, a.value, b.value)
    ones = a.ones if a.ones is b.ones else torch.where(condition, a.ones, b.ones)
    return Live(value, ones)


def _where(op, *args, **kwargs):
    condition, a, b = arguments(op, args, kwargs)[:3]
    return selected(_condition(condition), a, b)


def _masked_fill(op, *args, **kwargs):
    x, mask, fill = arguments(op, args, kwargs)[:3]
    if not isinstance(x, Live):
        raise RuleError("the fill value depends on the input", "R1' masked_fill of a LIVE tensor")
    return selected(_condition(mask), fill, x)


def _extremum(op, *args, **kwargs):
    """``maximum``/``minimum``: the larger (smaller) operand, the choice held."""
    a, b = arguments(op, args, kwargs)[:2]
    larger = plain(a) >= plain(b)
    return selected(larger if op is aten.maximum.default else ~larger, a, b)


def _clamp(op, *args, **kwargs):
    """``clamp`` with tensor bounds: ``minimum(maximum(x, low), high)``, each choice held."""
    bound = arguments(op, args, kwargs)
    x = bound[0]
    low, high = (bound[1], bound[2]) if op is aten.clamp.Tensor else \
        (bound[1], None) if op is aten.clamp_min.Tensor else (None, bound[1])
    if low is not None:
        x = _extremum(aten.maximum.default, x, low)
    if high is not None:
        x = _extremum(aten.minimum.default, x, high)
    return x


def _reduced_extremum(op, *args, **kwargs):
    """``amax``/``amin``/``max(dim)``/``min(dim)``/``max()``/``min()``: the value and ones at the held arg-max."""
    bound = arguments(op, args, kwargs)
    x = bound[0]
    if op in (aten.max.default, aten.min.default):
        dims, keepdim = list(range(x.value.dim())), False
    elif op in (aten.max.dim, aten.min.dim):
        dims, keepdim = [bound[1] % x.value.dim()], bound[2]
    else:
        dims = [d % x.value.dim() for d in bound[1]] or list(range(x.value.dim()))
        keepdim = bound[2]
    smallest = op in (aten.amin.default, aten.min.dim, aten.min.default)
    last = list(range(-len(dims), 0))
    flat_value = x.value.movedim(dims, last).flatten(-len(dims))
    held = plain(x).movedim(dims, last).flatten(-len(dims))
    indices = (held.argmin if smallest else held.argmax)(-1, keepdim=True)
    shape = [1 if d in dims else n for d, n in enumerate(x.value.shape)] if keepdim else \
        [n for d, n in enumerate(x.value.shape) if d not in dims]
    value = flat_value.gather(-1, indices).reshape(shape)
    ones = full_ones(x).movedim(dims, last).flatten(-len(dims)).gather(-1, indices).reshape(shape)
    if op in (aten.max.dim, aten.min.dim):
        return Live(value, ones), indices.reshape(shape)
    return Live(value, ones)


def _ordered(op, *args, **kwargs):
    """``sort``/``topk``: the values and ones at the held order's positions, and the order."""
    bound = arguments(op, args, kwargs)
    x = bound[0]
    if contains(bound[1:], (Live, Gate)):
        raise RuleError("an argument of the ordering depends on the input", "R1' held selections")
    dim = bound[1] if op is aten.sort.default else bound[2]
    indices = op(plain(x), *bound[1:])[1]
    return Live(x.value.gather(dim, indices), full_ones(x).gather(dim, indices)), indices


# Writes: (position of the tensor written into, position of what is written, accumulates).
_WRITES = {
    aten.scatter.src: (0, 3, False), aten.scatter.value: (0, 3, False), aten.scatter_add.default: (0, 3, True),
    aten.index_put.default: (0, 2, None), aten.select_scatter.default: (0, 1, False),
    aten.slice_scatter.default: (0, 1, False), aten.scatter_reduce.two: (0, 3, True),
}


def _written(op, *args, **kwargs):
    """R1' writes with CONST indices: the same write on the values and on the ones."""
    bound = arguments(op, args, kwargs)
    if op is aten.scatter.value:  # a scalar written: a CONST tensor of it
        op, bound = aten.scatter.src, [*bound[:3], torch.full(bound[2].shape, bound[3], dtype=bound[0].value.dtype,
                                                               device=bound[0].value.device)]
    target, source, accumulates = _WRITES[op]
    if op is aten.index_put.default:
        accumulates = bool(bound[3])
    if op is aten.scatter_reduce.two and bound[4] not in ("sum", "mean"):
        raise RuleError(f"scatter_reduce with reduce={bound[4]!r} is not linear in its operands",
                        "R1' scatter_reduce with 'sum' or 'mean'")
    operands = (target, source)
    if contains([a for i, a in enumerate(bound) if i not in operands], (Live, Gate)):
        raise RuleError("an index or mask depends on the input", "R1' writes with CONST indices")
    if any(isinstance(bound[i], Gate) for i in operands):
        raise RuleError("an input-dependent constant (a gate) is written into a tensor; gates may only multiply",
                        "R5 (gates multiply LIVE tensors)")
    live = [bound[i] for i in operands if isinstance(bound[i], Live)]
    values, ones = list(bound), list(bound)
    for i in operands:
        operand = bound[i]
        if not isinstance(operand, Live):
            batch, ndim = live[0].value.shape[0], live[0].value.dim()
            if not isinstance(operand, torch.Tensor) or operand.dim() != ndim or operand.shape[0] not in (1, batch):
                raise RuleError("a CONST operand of the write does not have the LIVE operand's dimensions with "
                                "the batch first", "R1' writes of CONST tensors over the batch (R12)")
            operand = constant_as_live(operand, live)
        values[i], ones[i] = operand.value, full_ones(operand)
    written_ones = op(*ones)
    return Live(op(*values), renormalized(written_ones) if accumulates else written_ones)


register([aten.where.self, aten.where.ScalarSelf, aten.where.ScalarOther, aten.where.Scalar],
         Rule("R1' where (CONST or held condition)", _where, factor_args=(0,)))
register([aten.masked_fill.Scalar, aten.masked_fill.Tensor],
         Rule("R1' masked_fill (CONST or held mask)", _masked_fill, factor_args=(1,)))
register([aten.maximum.default, aten.minimum.default],
         Rule("R1' maximum/minimum (choice held)", _extremum))
register([aten.clamp.Tensor, aten.clamp_min.Tensor, aten.clamp_max.Tensor],
         Rule("R1' clamp with tensor bounds (choices held)", _clamp))
register([aten.amax, aten.amin, aten.max.dim, aten.min.dim, aten.max.default, aten.min.default],
         Rule("R1' held selection (arg-max)", _reduced_extremum, multiplier_args=(0,)))
register([aten.sort.default, aten.topk.default],
         Rule("R1' held selection (order)", _ordered))
def _copied(op, *args, **kwargs):
    """``copy(target, source)``: the source, broadcast to the target's shape and cast to its dtype."""
    target, source = arguments(op, args, kwargs)[:2]
    if not isinstance(source, Live):
        raise RuleError("a tensor that does not depend on the input is copied over one that does",
                        "R1' copy of a LIVE source")
    reference = plain(target)
    return Live(source.value.to(reference.dtype).expand(reference.shape), source.ones)


register([aten.copy.default], Rule("R1' copy (R10)", _copied))
register(list(_WRITES), Rule("R1' write with CONST indices", _written))
