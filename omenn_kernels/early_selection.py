"""Capture-time selection first: positions the explained output never reads are not computed.

A causal LM's explanation reads the logits of its last position (``logits_to_keep``), a
ViT's its class token (``x[:, 0]``): the graph selects a few positions of the last hidden
states after the last block has computed all of them. Every operation on the way that
works position by position commutes with the selection, ``slice(f(x)) = f(slice(x))``:
elementwise operations (operands broadcast along the axis stay whole), normalizations and
reductions over other axes, matrix products over the features, reshapes and transposes
that keep the axis whole. So the selection moves before them, up to where an operation
mixes positions or where another user reads the positions it drops. The last block's MLP
and attention projection then run on the explained positions alone, forward and backward.

Attention is where it stops, although its output rows are its query rows: R6 gives the
output the ones of the value at the same position, which an attention with fewer queries
than values (R6') cannot tell.

The explanation does not change (beyond rounding): every rule acts on the selected
positions and their ones as it acts on all of them before a selection, and R10 selects
the ones with the values.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.node import map_arg

aten = torch.ops.aten
Node = torch.fx.Node

_UNARY = {aten._to_copy.default, aten.alias.default}  # elementwise without the pointwise tag
_NORMS = {aten.layer_norm.default, aten.rms_norm.default}  # (x, normalized_shape, …)
_REDUCTIONS = {aten.mean.dim, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}  # (x, dims, keepdim, …)
_RESHAPES = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_MATRIX_PRODUCTS = {aten.mm.default: 0, aten.addmm.default: 1}  # op: position of the (rows, features) input


def select_early(graph: torch.fx.Graph) -> int:
    """Move each slice of an axis (and each ``select``, as a slice of one) ahead of the
    position-wise operations that compute its input; returns the number of operations moved.

    A selection moves past an operation only when every user of the operation's result
    takes the same selection, so that nothing is computed twice; selections of the graph's
    output are left alone (the export's signature names that node).
    """
    moved, changed = 0, True
    while changed:
        changed = False
        for node in reversed(list(graph.nodes)):
            if node._erased or node.op != "call_function":
                continue
            if node.target is aten.select.int and _select_moved(graph, node) or _is_slice(node) and _slice_moved(graph, node):
                moved, changed = moved + 1, True
    if moved:
        graph.lint()
    return moved


def _slice_moved(graph: torch.fx.Graph, node: Node) -> bool:
    """Whether the slice ``node`` (with every equal slice of its input) moved past its input's operation."""
    x = node.args[0]
    selection = _slice_of(node)
    readers = [user for user in x.users if not _is_dtype_check(user)]
    if selection is None or not _same_slices(x, readers) or any(u.op == "output" for s in readers for u in s.users):
        return False
    first = min(readers, key=_position)  # the new nodes go before every slice of x
    earlier = _moved(graph, first, x, *selection)
    if earlier is None:
        return False
    for check in [user for user in x.users if _is_dtype_check(user)]:  # the slice has x's dtype and device
        with graph.inserting_after(earlier):
            _call(graph, check, check.target, earlier, *check.args[1:], **check.kwargs)
        graph.erase_node(check)
    for user in readers:  # the equal slices of x, ``node`` among them
        user.replace_all_uses_with(earlier)
        _erase_unused(graph, user)
    return True


def _is_dtype_check(node: Node) -> bool:
    """Whether ``node`` is export's check of a tensor's dtype, device or layout (not its size)."""
    return node.target is aten._assert_tensor_metadata.default and all(a is None for a in node.args[1:3]) \
        and node.kwargs.get("size") is None and node.kwargs.get("stride") is None


def _select_moved(graph: torch.fx.Graph, select: Node) -> bool:
    """Whether ``select(x, d, i)``, as ``squeeze(slice(x, d, i, i + 1), d)``, moved past ``x``'s operation."""
    x, dim, index = select.args
    if not isinstance(x, Node) or not isinstance(index, int) or _mover(x) is None or _shape(x) is None \
            or len([u for u in x.users if not _is_dtype_check(u)]) != 1 or any(u.op == "output" for u in select.users):
        return False
    dim = dim % len(_shape(x))
    with graph.inserting_before(select):
        sliced = _call(graph, select, aten.slice.Tensor, x, dim, index, sys.maxsize if index == -1 else index + 1)
        squeezed = _call(graph, select, aten.squeeze.dim, sliced, dim)
    select.replace_all_uses_with(squeezed)
    graph.erase_node(select)
    if _slice_moved(graph, sliced):
        return True
    with graph.inserting_before(sliced):  # as it was
        select = _call(graph, squeezed, aten.select.int, x, dim, index)
    squeezed.replace_all_uses_with(select)
    graph.erase_node(squeezed)
    graph.erase_node(sliced)
    return False


def _erase_unused(graph: torch.fx.Graph, node: Node) -> None:
    """Erase ``node`` and then each of its inputs that nothing else reads (placeholders kept)."""
    pending = [node]
    while pending:
        node = pending.pop()
        if node._erased or node.users or node.op != "call_function":
            continue
        inputs = node.all_input_nodes
        graph.erase_node(node)
        pending.extend(inputs)


def _position(node: Node) -> int:
    return next(i for i, n in enumerate(node.graph.nodes) if n is node)


def _is_slice(node: Node) -> bool:
    return node.op == "call_function" and node.target is aten.slice.Tensor


def _slice_of(node: Node) -> tuple[int, int, int] | None:
    """``(dim, start, end)`` of a slice with step 1 of an axis of static size, non-negative and
    clamped; None for other slices and for one that keeps the whole axis."""
    x, dim, start, end, step = (list(node.args) + [0, None, None, 1][len(node.args) - 1:])[:5]
    shape = _shape(x)
    if shape is None or step != 1 or not all(v is None or isinstance(v, int) for v in (dim, start, end)):
        return None
    dim = dim % len(shape)
    size = shape[dim]
    if not isinstance(size, int):
        return None
    start = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    end = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    if start == 0 and end == size or end <= start:
        return None
    return dim, start, end


def _same_slices(x: Node, readers: list[Node]) -> bool:
    """Whether each of ``readers``, users of ``x``, is the same slice of it."""
    selections = {(_slice_of(user) if _is_slice(user) and user.args[0] is x else None) for user in readers}
    return len(selections) == 1 and None not in selections


def _shape(value) -> tuple | None:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _call(graph: torch.fx.Graph, like: Node, op, *args, **kwargs) -> Node:
    """A node computing ``op(*args, **kwargs)``, with ``like``'s metadata (its module path) and its own fake value."""
    node = graph.call_function(op, args, kwargs)
    node.meta.update({key: value for key, value in like.meta.items() if key != "val"})
    inputs = node.all_input_nodes
    if inputs and all("val" in n.meta for n in inputs):
        fake_args, fake_kwargs = map_arg((args, kwargs), lambda n: n.meta["val"])
        fake_mode = detect_fake_mode([n.meta["val"] for n in inputs])
        with fake_mode or contextlib.nullcontext():
            node.meta["val"] = op(*fake_args, **fake_kwargs)
    return node


# Builds an operation's result on its inputs sliced (by the first argument, a function of a
# node and its axis) along the axis ``dim`` of the result, ``length`` positions long.
Mover = Callable[[Callable[[Node, int], Node], Node, int, int], "Node | None"]


def _moved(graph: torch.fx.Graph, selection: Node, x: Node, dim: int, start: int, end: int) -> Node | None:
    """``x``'s operation on its inputs sliced along ``dim``'s axis, or None where it does not
    work position by position along it."""
    mover = _mover(x)
    if mover is None or _shape(x) is None:
        return None

    def sliced(value: Node, axis: int) -> Node:
        return _call(graph, x, aten.slice.Tensor, value, axis, start, end)

    with graph.inserting_before(selection):
        return mover(sliced, x, dim, end - start)


def _mover(x: Node) -> Mover | None:
    if x.op != "call_function" or not isinstance(x.target, torch._ops.OpOverload):
        return None
    tags = x.target.tags
    if x.target in _UNARY or torch.Tag.pointwise in tags and torch.Tag.nondeterministic_seeded not in tags:
        return _elementwise
    return _MOVERS.get(x.target)


def _rebuilt(x: Node, args: list, kwargs: dict | None = None) -> Node:
    """``x``'s operation on ``args`` (and ``kwargs``, by default its own)."""
    return _call(x.graph, x, x.target, *args, **(dict(x.kwargs) if kwargs is None else kwargs))


def _elementwise(sliced, x: Node, dim: int, length: int) -> Node | None:
    """Each tensor operand sliced along its broadcast-aligned axis, unless it is broadcast along it."""
    if any(isinstance(v, Node) for v in x.kwargs.values()):
        return None
    rank = len(_shape(x))
    args = []
    for arg in x.args:
        if isinstance(arg, (list, tuple)) and any(isinstance(a, Node) for a in arg):
            return None
        shape = _shape(arg)
        if shape is None:
            if isinstance(arg, Node):
                return None
            args.append(arg)
            continue
        axis = dim - (rank - len(shape))
        args.append(arg if axis < 0 or shape[axis] == 1 else sliced(arg, axis))
    return _rebuilt(x, args)


def _norm(sliced, x: Node, dim: int, length: int) -> Node | None:
    """A normalization over trailing axes other than ``dim``."""
    value, normalized, *rest = x.args
    if dim >= len(_shape(value)) - len(normalized):
        return None
    return _rebuilt(x, [sliced(value, dim), normalized, *rest])


def _reduction(sliced, x: Node, dim: int, length: int) -> Node | None:
    """A reduction over axes after ``dim`` (or with the reduced axes kept)."""
    value, dims, *rest = x.args
    if dims is None:
        return None
    rank = len(_shape(value))
    reduced = [d % rank for d in (dims if isinstance(dims, (list, tuple)) else [dims])]
    keepdim = bool(rest[0]) if rest else bool(x.kwargs.get("keepdim", False))
    if not reduced or dim in reduced or not keepdim and min(reduced) < dim:
        return None
    return _rebuilt(x, [sliced(value, dim), dims, *rest])


def _linear(sliced, x: Node, dim: int, length: int) -> Node | None:
    """``linear(z, W, b)`` over ``z``'s last axis."""
    value, *rest = x.args
    if dim >= len(_shape(value)) - 1:
        return None
    return _rebuilt(x, [sliced(value, dim), *rest])


def _transpose(sliced, x: Node, dim: int, length: int) -> Node | None:
    value, first, second = x.args
    rank = len(_shape(value))
    first, second = first % rank, second % rank
    axis = second if dim == first else first if dim == second else dim
    return _rebuilt(x, [sliced(value, axis), first, second])


def _permute(sliced, x: Node, dim: int, length: int) -> Node | None:
    value, dims = x.args
    return _rebuilt(x, [sliced(value, dims[dim] % len(_shape(value))), dims])


def _whole_slice(sliced, x: Node, dim: int, length: int) -> Node | None:
    """A slice that keeps its axis whole goes (``h[:, -k:]`` exports as
    ``slice(slice(h, 0, 0, max), 1, -k, max)``); any other stays, since two slices of two
    axes that moved past each other would swap forever (``x[:, :H, :W]``)."""
    value, axis, *rest = x.args
    start, end, step = (list(rest) + [None, None, 1][len(rest):])[:3]
    size = _shape(value)[axis]
    if start in (None, 0) and step == 1 and (end is None or end == sys.maxsize or isinstance(size, int) and end >= size):
        return sliced(value, dim)
    return None


def _reshape(sliced, x: Node, dim: int, length: int) -> Node | None:
    """A reshape that keeps ``dim``'s axis whole, or the flatten–matrix product–unflatten
    of a linear layer written out (``view(addmm(b, view(z, (-1, F)), W), (*lead, G))``)."""
    value, shape = x.args
    if not isinstance(shape[dim], int) or shape[dim] == -1:
        return None
    reshaped = list(shape)
    reshaped[dim] = length
    before, after = _shape(value), _shape(x)
    product = math.prod(after[:dim])
    for axis, size in enumerate(before):
        if statically_known_true(math.prod(before[:axis]) == product) and statically_known_true(size == after[dim]):
            return _rebuilt(x, [sliced(value, axis), reshaped])
    flat = _matrix_product_input(value)
    if flat is None:
        return None
    rows = flat.args[0]
    lead = _shape(rows)
    if len(lead) != len(after) or dim == len(after) - 1 or not statically_known_true(_shape(flat)[1] == lead[-1]) \
            or not all(statically_known_true(a == b) for a, b in zip(lead[:-1], after[:-1])):
        return None
    args = list(value.args)
    args[_MATRIX_PRODUCTS[value.target]] = _call(value.graph, flat, aten.reshape.default, sliced(rows, dim),
                                                 [-1, lead[-1]])
    return _rebuilt(x, [_rebuilt(value, args), reshaped])


def _matrix_product_input(value: Node) -> Node | None:
    """The flattening reshape read by ``value``, a matrix product whose only user is a reshape;
    None where ``value`` is not one."""
    if value.op != "call_function" or value.target not in _MATRIX_PRODUCTS or len(value.users) != 1:
        return None
    if value.target is aten.addmm.default and len(_shape(value.args[0]) or ()) == 2 and _shape(value.args[0])[0] != 1:
        return None  # a bias per row
    flat = value.args[_MATRIX_PRODUCTS[value.target]]
    if not isinstance(flat, Node) or flat.target not in _RESHAPES or len(flat.users) != 1 \
            or not isinstance(flat.args[0], Node) or len(_shape(flat) or ()) != 2:
        return None
    return flat


_MOVERS: dict = {
    **dict.fromkeys(_NORMS, _norm),
    **dict.fromkeys(_REDUCTIONS, _reduction),
    **dict.fromkeys(_RESHAPES, _reshape),
    aten.linear.default: _linear,
    aten.slice.Tensor: _whole_slice,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
}
