"""Folding the shape-only part of a traced explanation into constants.

The ones channel's forward depends on the input's shape alone: the ones start as one
value per position, and convolutions, normalizations, pooling and residual sums carry
them to values fixed by the layer geometry (the window sums ``S`` of every convolution,
the renormalized shares ``S/stopgrad(S)``, the R11' fills). A traced explanation is
specialized on the input's shape, so all of that is a constant of the graph; computed
per call it costs one convolution per convolutional layer. Where an input-dependent
factor enters (attention's weights times the ones), the ones stop being shape-only and
nothing downstream of it is folded.

A node is shape-only when it is a factory (``new_ones(x, …)``, ``zeros_like(x)`` read
only ``x``'s shape and dtype), a deterministic, functional aten op whose tensor inputs
are all shape-only, or an output of a fused op that depends on shape-only arguments
alone (:func:`~omenn_kernels.ops.shape_only_outputs`). Placeholders and ``get_attr``
nodes (the model's parameters, which optimizer steps change in place) are not; neither
is a node written in place, nor anything computed from it. Only results that cost
arithmetic are stored: a factory, or a view of one, stays in the graph, where the
compiler writes it inline into its kernels.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch.fx import GraphModule, Node

from ..ops import shape_only_outputs

aten = torch.ops.aten

# Ops whose result depends on their tensor arguments' metadata only.
_FACTORIES = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default, aten.ones_like.default,
              aten.zeros_like.default, aten.full_like.default, aten.ones.default, aten.zeros.default,
              aten.full.default, aten.scalar_tensor.default, aten.arange.default, aten.arange.start,
              aten.arange.start_step}


def free(node: Node) -> bool:
    """Whether ``node`` is a factory, a view or a tuple item: no arithmetic of its own."""
    target = node.target
    return target in _FACTORIES or (isinstance(target, torch._ops.OpOverload) and target.is_view) \
        or target is operator.getitem


def foldable_op(node: Node) -> bool:
    """A deterministic, functional aten or prims op (or a tuple item): its value is a function of its
    arguments. (Inductor's decompositions trace some aten ops as prims, a cast as ``convert_element_type``.)"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload) or node.target.namespace not in ("aten", "prims"):
        return False
    schema = node.target._schema
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return not mutates and torch.Tag.nondeterministic_seeded not in node.target.tags


def written_in_place(graph: torch.fx.Graph) -> set[Node]:
    """Nodes that some op writes in place, with the nodes they are views of."""
    written: set[Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for argument, value in zip(node.target._schema.arguments, node.args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, Node):
                written.add(value)
    pending = list(written)
    while pending:  # a view's base is written with it
        node = pending.pop()
        if node.op == "call_function" and free(node) and node.target not in _FACTORIES and node.args \
                and isinstance(node.args[0], Node) and node.args[0] not in written:
            written.add(node.args[0])
            pending.append(node.args[0])
    return written


def _fused_output(node: Node) -> tuple[tuple[int, ...], Callable] | None:
    """The arguments that ``node``, an output of a fused op, depends on alone, and the function that
    computes it from them (:func:`shape_only_outputs`)."""
    if node.target is not operator.getitem or not isinstance(node.args[0], Node):
        return None
    return shape_only_outputs().get(node.args[0].target, {}).get(node.args[1])


def _uniform(value) -> bool:
    """Whether every element of ``value`` is the same (a selection from it is then that value)."""
    return isinstance(value, torch.Tensor) and value.numel() > 0 and bool((value == value.reshape(-1)[0]).all())


def with_arithmetic(graph: torch.fx.Graph, members) -> set[Node]:
    """The computed nodes among ``members`` with arithmetic at or before them (not only
    factories, views and tuple items of what they read)."""
    costly: set[Node] = set()
    for node in graph.nodes:
        if node in members and node.op == "call_function" \
                and (not free(node) or any(n in costly for n in node.all_input_nodes)):
            costly.add(node)
    return costly


class _NoTracedValue(Exception):
    """A tensor that a shape-only node reads the metadata of has no traced value."""


class _ShapeOnly:
    """Finds a graph's shape-only nodes and computes their values, and nothing else.

    The rest of the graph (the model at full size) is not run: a shape-only node reads
    shape-only values, except a factory, which reads another tensor's metadata only (given an
    uninitialized tensor of its traced shape, strides and dtype), and a fused op's output that
    depends on some of its arguments alone, which is computed from them without the op
    (:func:`~omenn_kernels.ops.shape_only_outputs`; the others given as traced).

    A selection (``gather``, ``index``, ``index_select``) whose indices depend on the input
    is shape-only where it selects from a shape-only tensor whose elements are all equal:
    max pooling routes the ones by the input's argmax, and the ones it routes are all 1. Its
    value is that element, at the selection's traced shape.
    """

    def __init__(self, module: GraphModule, example: list[torch.Tensor]):
        self.module = module
        self.written = written_in_place(module.graph)
        self.shape_only: dict[Node, object] = {}  # node → its value
        placeholders = [node for node in module.graph.nodes if node.op == "placeholder"]
        self.inputs: dict[Node, torch.Tensor] = dict(zip(placeholders, example))

    def run(self) -> None:
        with torch.no_grad():
            for node in self.module.graph.nodes:
                if node.op == "call_function" and node not in self.written and self._decides_shape_only(node):
                    try:
                        self.shape_only[node] = self._value(node)
                    except _NoTracedValue:
                        pass

    def _decides_shape_only(self, node: Node) -> bool:
        fused = _fused_output(node)
        if fused is not None:
            inputs = [node.args[0].args[i] for i in fused[0]]
        elif not foldable_op(node):
            return False
        elif node.target in _FACTORIES:
            return True
        elif node.target in _SELECTIONS and node.args[0] in self.shape_only:
            return _uniform(self.shape_only[node.args[0]])
        else:
            inputs = node.all_input_nodes
        return all(n in self.shape_only for n in inputs if isinstance(n, Node))

    def _value(self, node: Node) -> object:
        fused = _fused_output(node)
        if fused is not None:
            indices, compute = fused
            args = [torch.fx.node.map_arg(value, self.shape_only.__getitem__) if i in indices
                    else torch.fx.node.map_arg(value, _traced) for i, value in enumerate(node.args[0].args)]
            return compute(*args)
        if node.target in _SELECTIONS:  # from a uniform tensor (see _decides_shape_only)
            return _uninitialized(node).fill_(self.shape_only[node.args[0]].reshape(-1)[0])
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), self._argument)
        return node.target(*args, **kwargs)

    def _argument(self, node: Node) -> object:
        """A shape-only node's value; for a factory's other arguments, what stands in for them."""
        if node in self.shape_only:
            return self.shape_only[node]
        if node in self.inputs:
            return self.inputs[node]
        if node.op == "get_attr":
            return operator.attrgetter(node.target)(self.module)
        return _uninitialized(node)


def _traced(node: Node) -> torch.Tensor:
    """``node``'s traced (fake) value: its shape, strides and dtype, no data."""
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise _NoTracedValue(node.name)
    return value


def _uninitialized(node: Node) -> torch.Tensor:
    """A tensor of ``node``'s traced shape, strides, dtype and device, its elements not set."""
    value = _traced(node)
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


_SELECTIONS = {aten.gather.default, aten.index.Tensor, aten.index_select.default}


def fold_shape_only(module: GraphModule, example: list[torch.Tensor]) -> int:
    """Replace each shape-only value that costs arithmetic and feeds the rest of ``module``
    by a constant computed from ``example`` (the inputs the graph is specialized on).

    Returns the number of constants stored. The graph is changed in place and recompiled.
    """
    analysis = _ShapeOnly(module, example)
    analysis.run()
    shape_only = analysis.shape_only
    costly = with_arithmetic(module.graph, shape_only)
    folded = 0
    for node in [n for n in module.graph.nodes if n in costly]:
        value = shape_only[node]
        if not isinstance(value, torch.Tensor) or all(user in shape_only for user in node.users):
            continue
        name = f"_shape_only_{folded}"
        # Persistent: a set of non-persistent names would change Inductor's cache key with each
        # process's string hashing (see parameter_only.hoist_parameter_only).
        module.register_buffer(name, value.detach())
        with module.graph.inserting_before(node):
            constant = module.graph.get_attr(name)
        constant.meta.update(node.meta)
        node.replace_all_uses_with(constant, delete_user_cb=lambda user: user not in shape_only)
        folded += 1
    module.graph.eliminate_dead_code()
    module.recompile()
    return folded
