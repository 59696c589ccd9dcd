"""R10–R12: structure, zero padding, and constants joined to LIVE tensors.

R10: view, reshape, permute, slicing, indexing, splitting, joining, copies and casts
act on the ones channel exactly as on the value.
R11: zero padding pads the ones with 0 as well.
R12: a CONST joined to LIVE tensors by cat/stack (class, register and distillation
tokens) becomes ``c·Ō`` with ``Ō`` the per-sample mean of the ones of every LIVE
tensor in the join: a constant's share is spread evenly over the whole input.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, contains, plain

aten = torch.ops.aten


_RESHAPE_FOR_VIEW = {aten.view.default: aten.reshape.default,
                     aten._unsafe_view.default: aten.reshape.default}


def _swap(obj: Any, field: str) -> Any:
    """Replace every Live in ``obj`` by its ``field`` ('value' or 'ones')."""
    if isinstance(obj, Live):
        return getattr(obj, field)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(o, field) for o in obj)
    return obj


def _pair(value: Any, ones: Any) -> Any:
    """Zip a result computed on values with the one computed on ones into Live values."""
    if isinstance(value, torch.Tensor):
        return Live(value, ones)
    if isinstance(value, (list, tuple)):
        return type(value)(_pair(v, o) for v, o in zip(value, ones))
    return value


def same_on_ones(op, *args, **kwargs):
    """R10: apply ``op`` to the value and, with the same arguments, to the ones."""
    if contains(args, Gate) or contains(kwargs, Gate):
        raise RuleError("a gate (an input-dependent constant) is used as a structural operand",
                        "R10 with CONST operands only")
    if contains(args[1:], Live) or contains(kwargs, Live):
        raise RuleError("an input-dependent tensor is used as an index or shape",
                        "R10 with CONST indices")
    # The graph is functional, so a view may copy: the ones are often expanded
    # tensors and rule outputs need not have the original strides, which `view` requires.
    op = _RESHAPE_FOR_VIEW.get(op, op)
    value = op(*_swap(args, "value"), **_swap(kwargs, "value"))
    ones = op(*_swap(args, "ones"), **_swap(kwargs, "ones"))
    return _pair(value, ones)


def _getitem(op, sequence, index):
    return sequence[index]


def _eval_dropout(op, x, p, train):
    if train and p > 0:
        raise RuleError("dropout in training mode is random", "R10 (eval-mode dropout only)")
    return x


def _metadata_check(op, *args, **kwargs):
    """Shape/dtype assertions: checked on the value, nothing to linearize."""
    return op(*plain(args), **plain(kwargs))


def _zero_pad(op, *args, **kwargs):
    """R11: zero padding of the value pads the ones with 0 too."""
    bound = arguments(op, args, kwargs)
    if op is aten.pad.default and bound[2] != "constant":
        return same_on_ones(op, *args, **kwargs)  # reflect/replicate/circular copy real positions
    fill = bound[-1]
    if fill not in (None, 0, 0.0):
        raise RuleError(f"constant padding with the non-zero value {fill} adds a constant that no "
                        "ones channel carries", "R11 (zero padding only)")
    return same_on_ones(op, *args, **kwargs)


def _join(op, *args, **kwargs):
    """R10 for LIVE-only joins; R12 when CONST tensors are joined to LIVE ones."""
    bound = arguments(op, args, kwargs)
    tensors, dim = bound[0], bound[1]
    if not any(isinstance(t, torch.Tensor) for t in tensors):
        return same_on_ones(op, *args, **kwargs)
    if any(isinstance(t, Gate) for t in tensors):
        raise RuleError("a gate (an input-dependent constant) is joined to LIVE tensors",
                        "R12 for CONST tensors only")
    live = [t for t in tensors if isinstance(t, Live)]
    reference = live[0].value
    if dim % (reference.dim() + (op is aten.stack.default)) == 0:
        raise RuleError("CONST tensors are joined to LIVE ones along the batch dimension",
                        "R12 along a non-batch dimension")
    # Per-sample mean of the ones over every position of the LIVE tensors in the join.
    total = sum(t.ones.flatten(1).sum(1) for t in live)
    count = sum(t.ones[0].numel() for t in live)
    shared = total / count
    joined = []
    for t in tensors:
        if isinstance(t, Live):
            joined.append(t)
        else:
            share = shared.view(-1, *([1] * (t.dim() - 1))).expand(t.shape)
            joined.append(Live(t * share, share))
    return Live(op([t.value for t in joined], *bound[1:]), op([t.ones for t in joined], *bound[1:]))


STRUCTURE_OPS = [
    aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t,
    aten.flatten, aten.unflatten, aten.expand, aten.slice, aten.select, aten.index, aten.gather,
    aten.roll, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.unsqueeze,
    aten.squeeze, aten.contiguous, aten.clone, aten.alias, aten.detach_copy, aten.flip,
    aten.repeat, aten.narrow, aten.movedim, aten.pixel_shuffle, aten.pixel_unshuffle,
    aten.channel_shuffle, aten.unfold, aten.to, aten._to_copy, aten.type_as, aten.expand_as,
    aten.view_as, aten.reshape_as, aten.tensor_split, aten.index_select, aten.lift_fresh_copy,
]
register(STRUCTURE_OPS, Rule("R10 structure", same_on_ones, transparent=True))
register([aten.dropout, aten.feature_dropout, aten.alpha_dropout],
         Rule("R10 eval-mode dropout (identity)", _eval_dropout, transparent=True))
register([aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.new_zeros,
          aten.new_ones, aten.new_empty, aten.new_full],
         Rule("shape only (CONST)", None, shape_only=True))
register([aten._assert_tensor_metadata], Rule("R10 metadata check", _metadata_check, transparent=True))
register([operator.getitem], Rule("R10 structure", _getitem, transparent=True))
register([aten.pad, aten.constant_pad_nd], Rule("R11 zero padding", _zero_pad, transparent=True))
register([aten.cat, aten.stack, aten.concat, aten.concatenate],
         Rule("R10/R12 join", _join, transparent=True))
