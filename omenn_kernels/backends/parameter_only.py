"""Taking a traced explanation's parameter-only arithmetic out of its graph.

Part of a traced explanation reads the model's parameters and buffers alone: each
BatchNorm folded into its convolution (:mod:`~omenn_kernels.folding`: the kernel ``W·s``
and bias ``b·s + t``, ``s = γ/√(var+ε)``), and whatever else a model computes from its
weights (a scaled or summed kernel). Computed per call, that is a pass over those
parameters at every explanation, which at small batches costs as much as the layers'
activations; and a convolution whose input runs channels-last converts its kernel to
that layout at every call.

A first-order explanation's graph holds the parameters as the tensors themselves
(``get_attr``). :func:`hoist_parameter_only` moves each parameter-only value that costs
arithmetic and feeds the rest of the graph into a prelude, and has the graph read it as
a constant (a kernel in its convolution's input layout). The constants are kept between
calls: :meth:`ParameterDerived.refresh`, called before every run, computes them again,
in place, where the values of a parameter or buffer they come from changed since, by any
route: optimizer steps, ``load_state_dict``, ``.data =``, and in-place writes through
``.data``, which move neither version counter nor storage (values are compared with a
copy, :mod:`~omenn_kernels.backends.watched`).
A parameter that a differentiable explanation trains is a graph input, not a
``get_attr``, so nothing computed from it is taken out.

The price is memory: the constants live as long as a compiled explanation that reads them,
one folded copy of each folded convolution's kernel, shared by the graphs of every
signature (batch size) of the model, and one copy of the parameters they come from.
"""

from __future__ import annotations

import operator
import weakref

import torch
from torch.fx import GraphModule, Node

from ..linearize.values import channels_last
from .shape_only import foldable_op, free, with_arithmetic, written_in_place
from .watched import Watch

aten = torch.ops.aten

# The kept values by recipe (the ops and source tensors that compute them) and layout, so that
# the graphs of several signatures share them. An entry lives while a graph holds its value;
# that graph's prelude holds the source tensors, so their ids are not reused meanwhile.
_KEPT: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

# Ops that take a convolution kernel, with the kernel's position and those of the activations
# whose layout ATen converts the kernel to.
_KERNEL_USERS = {aten.convolution.default: (1, (0,)), aten.convolution_backward.default: (2, (0, 1))}


class ParameterDerived:
    """The parameter-only values that a compiled graph reads as constants, and how to compute them.

    Attributes:
        prelude: a graph of no inputs that returns the values from the parameters and buffers.
        values: the constants the graph reads (refreshed in place).
        sources: the parameters and buffers the prelude reads.
    """

    def __init__(self, prelude: GraphModule, values: list[torch.Tensor], sources: list[torch.Tensor]):
        self.prelude = prelude
        self.values = values
        self.sources = sources
        self._watch = Watch(sources)

    def refresh(self) -> None:
        """Compute the values again, in place, if a source's values changed since they were computed."""
        if not self._watch.changed():
            return
        with torch.no_grad():
            for value, fresh in zip(self.values, self.prelude()):
                value.copy_(fresh)


def hoist_parameter_only(module: GraphModule) -> ParameterDerived | None:
    """Move ``module``'s parameter-only values that cost arithmetic and feed the rest of the graph
    into a prelude, and have the graph read them as constants (buffers of ``module``).

    Returns what computes and refreshes them, or None where there are none. The graph is
    changed in place and recompiled.
    """
    graph = module.graph
    parameter_only = _parameter_only(module)
    costly = with_arithmetic(graph, parameter_only)
    # What the graph keeps: every other node, and the views it reads of parameter-only values
    # (a view costs nothing and the folding patterns read through it; its base is hoisted).
    stays: set[Node] = set()
    for node in reversed(graph.nodes):
        if node not in parameter_only or (_view(node) and any(user in stays for user in node.users)):
            stays.add(node)
    hoisted = [node for node in graph.nodes if node in costly and node not in stays and not _view(node)
               and isinstance(node.meta.get("val"), torch.Tensor) and any(user in stays for user in node.users)
               and node.meta["val"].numel() <= _source_elements(module, node)]
    if not hoisted:
        return None
    prelude = _prelude(module, hoisted)
    with torch.no_grad():
        fresh = prelude()
    values = []
    recipes: dict[Node, tuple] = {}
    for index, (node, value) in enumerate(zip(hoisted, fresh)):
        key = (_recipe(module, node, recipes), _layout(node))
        kept = _KEPT.get(key)
        if kept is None:
            kept = _KEPT[key] = value.clone(memory_format=key[1])  # its own storage, never a parameter's
        else:
            kept.copy_(value)
        value = kept
        name = f"_parameter_derived_{index}"
        # Persistent, as every buffer of the graph: Inductor's cache key pickles the set of non-persistent
        # names, whose order changes with each process's string hashing, and would miss in every process.
        module.register_buffer(name, value)
        with graph.inserting_before(node):
            constant = graph.get_attr(name)
        constant.meta.update(node.meta)
        node.replace_all_uses_with(constant, delete_user_cb=lambda user: user in stays)
        values.append(value)
    graph.eliminate_dead_code()
    graph.lint()
    module.recompile()
    sources = [operator.attrgetter(node.target)(prelude) for node in prelude.graph.nodes if node.op == "get_attr"]
    return ParameterDerived(prelude, values, sources)


def _parameter_only(module: GraphModule) -> set[Node]:
    """The nodes of ``module`` computed from its tensor constants alone (never written in place),
    less those that the graph returns or that a returned value is computed from (the caller
    would otherwise hold, and could write, a kept constant)."""
    graph = module.graph
    written = written_in_place(graph)
    parameter_only: set[Node] = set()
    for node in graph.nodes:
        if node in written:
            continue
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(module)
            if isinstance(value, torch.Tensor) and not value.is_inference():  # inference tensors have no version
                parameter_only.add(node)
        elif foldable_op(node) and node.all_input_nodes and all(n in parameter_only for n in node.all_input_nodes):
            parameter_only.add(node)
    pending = [n for n in graph.output_node().all_input_nodes if n in parameter_only]
    while pending:
        node = pending.pop()
        parameter_only.discard(node)
        pending.extend(n for n in node.all_input_nodes if n in parameter_only)
    return parameter_only


def _source_elements(module: GraphModule, node: Node) -> int:
    """The number of elements of the tensor constants that ``node`` is computed from.

    A value with more (a bias broadcast over the positions by the ones: one copy per batch
    size) is left to the compiler, which computes it inside the kernel that reads it."""
    sources: set[Node] = set()
    pending = [node]
    while pending:
        current = pending.pop()
        if current.op == "get_attr":
            sources.add(current)
        pending.extend(current.all_input_nodes)
    return sum(operator.attrgetter(source.target)(module).numel() for source in sources)


def _recipe(module: GraphModule, node: Node, recipes: dict[Node, tuple]) -> tuple:
    """What computes ``node``: its op and arguments, down to the identities of the tensors it reads."""
    if node not in recipes:
        if node.op == "get_attr":
            recipes[node] = ("tensor", id(operator.attrgetter(node.target)(module)))
        else:
            def recipe(n: Node) -> tuple:
                return _recipe(module, n, recipes)
            arguments = torch.fx.node.map_arg((node.args, node.kwargs), recipe)
            recipes[node] = (str(node.target), _hashable(arguments))
    return recipes[node]


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    return value


def _view(node: Node) -> bool:
    return free(node) and node.target is not operator.getitem


def _prelude(module: GraphModule, hoisted: list[Node]) -> GraphModule:
    """A graph of no inputs computing ``hoisted`` from ``module``'s parameters and buffers."""
    needed: set[Node] = set()
    pending = list(hoisted)
    while pending:
        node = pending.pop()
        if node not in needed:
            needed.add(node)
            pending.extend(node.all_input_nodes)
    prelude = torch.fx.Graph()
    copies: dict[Node, Node] = {}
    for node in module.graph.nodes:
        if node in needed:
            copies[node] = prelude.node_copy(node, lambda n: copies[n])
    prelude.output(tuple(copies[node] for node in hoisted))
    return GraphModule(module, prelude)  # refers to the same parameter and buffer tensors


def _layout(node: Node) -> torch.memory_format:
    """Channels-last for a convolution kernel whose convolutions take channels-last activations
    (ATen would convert it at every call), else contiguous."""
    for user in node.users:
        positions = _KERNEL_USERS.get(user.target)
        if positions is None or len(user.args) <= positions[0] or user.args[positions[0]] is not node:
            continue
        activations = [user.args[i].meta.get("val") for i in positions[1] if isinstance(user.args[i], Node)]
        if any(isinstance(a, torch.Tensor) and channels_last(a) for a in activations):
            return torch.channels_last
    return torch.contiguous_format
