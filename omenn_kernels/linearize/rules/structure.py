"""R10–R12: structure, zero padding, and constants joined to LIVE tensors.

R10: view, reshape, permute, slicing, indexing, splitting, joining, copies and casts
act on the ones channel exactly as on the value; so do the R1' selections that copy
positions (``diagonal``, reflection and replication padding, ``im2col``).
R11: zero padding pads the ones with 0 as well.
R12: a CONST joined to LIVE tensors by cat/stack (class, register and distillation
tokens) becomes ``c·Ō`` with ``Ō`` the per-sample mean of the ones of every LIVE
tensor in the join: a constant's share is spread evenly over the whole input.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from ...capture import functional
from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, contains, plain, renormalized

aten = torch.ops.aten


# Act on shared (size-1) dimensions of the ones exactly as on full ones.
_DIRECT = {aten.permute.default, aten.transpose.int, aten.t.default, aten.movedim.int,
           aten.movedim.intlist, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims,
           aten.contiguous.default, aten.clone.default, aten.alias.default, aten.detach_copy.default,
           aten.lift_fresh_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
           aten.to.other, aten._to_copy.default, aten.roll.default, aten.flip.default}
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default,
             aten.flatten.using_ints, aten.unflatten.int, aten.view_as.default,
             aten.reshape_as.default}
_ALONG_DIM = {aten.slice.Tensor, aten.narrow.default, aten.select.int, aten.unbind.int,
              aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor,
              aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
              aten.tensor_split.sections, aten.tensor_split.indices}
# Operands after the first that only lend their shape or dtype.
_SHAPE_OPERAND = {aten.type_as.default, aten.expand_as.default, aten.view_as.default,
                  aten.reshape_as.default}


def _aligned(ones: torch.Tensor, ndim: int) -> torch.Tensor:
    """``ones`` with leading size-1 dimensions added up to ``ndim``."""
    return ones.reshape((1,) * (ndim - ones.dim()) + tuple(ones.shape)) if ones.dim() < ndim else ones


def reshaped_ones(ones: torch.Tensor, old: tuple, new: tuple) -> torch.Tensor:
    """Reshape ones shared along some dims of a value of shape ``old`` to shape ``new``.

    Dimensions are matched in groups of equal product; a group the ones share entirely
    stays shared (size 1), a group they share in part is expanded first.
    """
    ones = _aligned(ones, len(old))
    target, expand_to, i, j = [], list(ones.shape), 0, 0
    while i < len(old) or j < len(new):
        i_end, j_end = i + 1, j + 1
        if i == len(old):  # trailing new size-1 dims
            target.append(1)
            j += 1
            continue
        if j == len(new):  # trailing old size-1 dims
            i += 1
            continue
        size_old, size_new = old[i], new[j]
        while size_old != size_new:
            if size_old < size_new:
                size_old *= old[i_end]
                i_end += 1
            else:
                size_new *= new[j_end]
                j_end += 1
        shared = [ones.shape[d] == 1 for d in range(i, i_end)]
        if all(shared) and size_old != 1:
            target.extend([1] * (j_end - j))
        else:
            if any(shared):
                expand_to[i:i_end] = old[i:i_end]
            target.extend(new[j:j_end])
        i, j = i_end, j_end
    return ones.expand(expand_to).reshape(target)


def _ones_of_structure(op, args, kwargs, value_in: torch.Tensor, result):
    """Apply structural ``op`` to the (possibly shared) ones of ``args[0]``."""
    ones = _aligned(args[0].ones, value_in.dim())
    rest = list(args[1:])
    if op in _DIRECT:
        if op is aten.squeeze.dim or op is aten.squeeze.dims:
            dims = rest[0] if isinstance(rest[0], (list, tuple)) else [rest[0]]
            keep = [d for d in dims if value_in.shape[d] == 1]
            return ones.squeeze(keep) if keep else ones
        return op(ones, *rest, **kwargs)
    if op is aten.squeeze.default:
        return ones.squeeze([d for d, n in enumerate(value_in.shape) if n == 1])
    if op in _RESHAPES:
        return reshaped_ones(ones, tuple(value_in.shape), tuple(result.shape))
    if op in (aten.expand.default, aten.expand_as.default):
        return _aligned(ones, result.dim())
    if op in _ALONG_DIM:
        names = [a.name for a in op._schema.arguments]
        dim = arguments(op, args, kwargs)[names.index("dim")]
        if dim is None:  # repeat_interleave over the flattened tensor
            return op(ones.expand(value_in.shape), *rest, **kwargs)
        dim %= value_in.dim()
        if ones.shape[dim] == 1:
            if op is aten.select.int:
                return ones.select(dim, 0)
            if op is aten.unbind.int:
                return [ones.select(dim, 0)] * len(result)
            if isinstance(result, (list, tuple)):
                return [ones] * len(result)
            return ones
        return op(ones, *rest, **kwargs)
    return op(ones.expand(value_in.shape), *rest, **kwargs)  # generic: act on full ones


def _swap(obj: Any, field: str) -> Any:
    """Replace every Live in ``obj`` by its ``field`` ('value' or 'ones')."""
    if isinstance(obj, Live):
        return getattr(obj, field)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_swap(o, field) for o in obj)
    return obj


def _pair(value: Any, ones: Any) -> Any:
    """Zip results computed on values and on ones into Live values."""
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
    if op in _SHAPE_OPERAND:
        args = (args[0], *plain(args[1:]))
    if contains(args[1:], Live) or contains(kwargs, Live) or not isinstance(args[0], Live):
        raise RuleError("an input-dependent tensor is used as an index or shape",
                        "R10 with CONST indices")
    op = functional(op)  # rule outputs need not have the capture's strides
    value = op(args[0].value, *args[1:], **kwargs)
    return _pair(value, _ones_of_structure(op, args, kwargs, args[0].value, value))


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


def _joined_ones(op, pieces: list[Live], dim: int) -> torch.Tensor:
    """Join the (possibly shared) ones of ``pieces`` as ``op`` joins their values."""
    ndim = pieces[0].value.dim()
    ones = [_aligned(p.ones, ndim) for p in pieces]
    if op is aten.stack.default:
        shape = [max(o.shape[d] for o in ones) for d in range(ndim)]
        return op([o.expand(shape) for o in ones], dim)
    dim = dim % ndim
    shape = [max(o.shape[d] for o in ones) for d in range(ndim)]
    expanded = []
    for piece, o in zip(pieces, ones):
        piece_shape = list(shape)
        piece_shape[dim] = piece.value.shape[dim]
        expanded.append(o.expand(piece_shape))
    return op(expanded, dim)


def constant_as_live(constant: torch.Tensor, live: list[Live]) -> Live:
    """R12: a CONST tensor (batch first) as ``c·Ō``, ``Ō`` the per-sample mean of the ones over every
    position of the ``live`` tensors, renormalized (the constant keeps its value where padding
    lowers the mean)."""
    counts = [t.value[0].numel() for t in live]
    mean = sum(t.ones.expand(t.value.shape[0], *t.ones.shape[1:]).flatten(1).mean(1) * n
               for t, n in zip(live, counts)) / sum(counts)
    shared = renormalized(mean).view(-1, *([1] * (constant.dim() - 1)))
    return Live(constant * shared, shared)


def _join(op, *args, **kwargs):
    """R10 for LIVE-only joins; R12 when CONST tensors are joined to LIVE ones."""
    bound = arguments(op, args, kwargs)
    tensors, dim = bound[0], bound[1]
    if any(isinstance(t, Gate) for t in tensors):
        raise RuleError("a gate (an input-dependent constant) is joined to LIVE tensors",
                        "R12 for CONST tensors only")
    if op is not aten.stack.default:  # an empty CONST (a fresh key-value cache) adds nothing to a cat
        tensors = [t for t in tensors if isinstance(t, Live) or t.numel() > 0]
    live = [t for t in tensors if isinstance(t, Live)]
    if len(live) < len(tensors):
        if dim % (live[0].value.dim() + (op is aten.stack.default)) == 0:
            raise RuleError("CONST tensors are joined to LIVE ones along the batch dimension",
                            "R12 along a non-batch dimension")
        tensors = [t if isinstance(t, Live) else constant_as_live(t, live) for t in tensors]
    value = op([t.value for t in tensors], dim)
    return Live(value, _joined_ones(op, tensors, dim))


STRUCTURE_OPS = [
    aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t,
    aten.flatten, aten.unflatten, aten.expand, aten.slice, aten.select, aten.index, aten.gather,
    aten.roll, aten.split, aten.split_with_sizes, aten.chunk, aten.unbind, aten.unsqueeze,
    aten.squeeze, aten.contiguous, aten.clone, aten.alias, aten.detach_copy, aten.flip,
    aten.repeat, aten.narrow, aten.movedim, aten.pixel_shuffle, aten.pixel_unshuffle,
    aten.channel_shuffle, aten.unfold, aten.to, aten._to_copy, aten.type_as, aten.expand_as,
    aten.view_as, aten.reshape_as, aten.tensor_split, aten.index_select, aten.lift_fresh_copy,
    aten.repeat_interleave.self_int, aten.repeat_interleave.self_Tensor, aten.diagonal,
    aten.reflection_pad1d, aten.reflection_pad2d, aten.reflection_pad3d, aten.replication_pad1d,
    aten.replication_pad2d, aten.replication_pad3d, aten.im2col,
]
register(STRUCTURE_OPS, Rule("R10 structure", same_on_ones, transparent=True))
register([aten.dropout, aten.feature_dropout, aten.alpha_dropout],
         Rule("R10 eval-mode dropout (identity)", _eval_dropout, transparent=True))
register([aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.new_zeros,
          aten.new_ones, aten.new_empty, aten.new_full, aten.sym_size, aten.sym_numel, aten.sym_stride,
          aten.sym_storage_offset, aten.sym_is_contiguous, aten.fill.Scalar],
         Rule("shape only (CONST)", None, shape_only=True))
register([aten._assert_tensor_metadata],
         Rule("R10 metadata check", _metadata_check, transparent=True))
register([operator.getitem], Rule("R10 structure", _getitem, transparent=True))
register([aten.pad, aten.constant_pad_nd],
         Rule("R11 zero padding", _zero_pad, transparent=True))
register([aten.cat, aten.stack, aten.concat, aten.concatenate],
         Rule("R10/R12 join", _join, transparent=True))
