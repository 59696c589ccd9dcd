"""Export's training graph as the functional eval-mode graph the rules read, without a retrace.

``torch.export`` returns a training graph: composite ops such as ``dropout`` and
``batch_norm`` are kept whole, and in-place ops (``relu_`` of ``ReLU(inplace=True)``,
``x += shortcut``) stay in place. ``ExportedProgram.run_decompositions({})`` turns it into
a functional inference graph by tracing the whole graph twice more through AOTAutograd
(alias analysis, then functionalization), with the batch dimension symbolic; that costs
more than the export itself. On the graphs models export, the differences are a few
local rewrites, made here node by node:

- ``dropout(x, p, train=False)`` is ``x``; so is a ``to`` that changes nothing, and any
  other ``to`` is ``_to_copy``;
- ``batch_norm(x, γ, β, μ, σ², training=False, …)`` is
  ``_native_batch_norm_legit_no_training(x, γ, β, μ, σ², …)[0]``, the op folding reads;
- ``op_(x, …)`` on a fresh tensor ``x`` (no view of it exists and no input or weight it
  is) is ``op(x, …)``, its later readers reading the result instead.

Composite shape ops that may alias (``reshape``, ``flatten``, ``contiguous``, ``chunk``)
stay as they are: without writes, an alias and a copy hold the same values, and the rules
take them. Any other op that the retrace would change (a write into a view or an input,
another composite op that may alias, a higher-order op), or autocast at the time of the
capture, makes :func:`functionalized` decline, and
the caller runs ``run_decompositions({})``.
"""

from __future__ import annotations

import operator

import torch
from torch._export.utils import _check_valid_to_preserve, _is_cia_op
from torch.export import ExportedProgram
from torch.fx import Node
from torch.fx.operator_schemas import normalize_function

aten = torch.ops.aten

# Composite ops that may alias their input and hold for inputs of any strides (unlike ``view``),
# which the rules take as they are.
_KEPT_ALIASING = {aten.reshape.default, aten.reshape_as.default, aten.flatten.using_ints, aten.unflatten.int,
                  aten.contiguous.default, aten.expand_as.default, aten.chunk.default,
                  aten.tensor_split.sections, aten.tensor_split.indices}
_CASTS = {aten.to.dtype, aten.to.device, aten.to.dtype_layout, aten.to.other}


def functionalized(program: ExportedProgram) -> bool:
    """Rewrite ``program``'s training graph in place into the graph ``run_decompositions({})``
    returns, up to the kept shape ops; False, with the graph unchanged, where it cannot."""
    if torch._C._is_any_autocast_enabled():
        return False  # the retrace, run under autocast, writes its casts into the graph
    graph = program.graph
    plan = _plan(graph)
    if plan is None:
        return False
    order = {node: i for i, node in enumerate(graph.nodes)}
    # Identities first, so that a write through one is a write to its input; the others after
    # the writes, as they add nodes, which the writes' reader order does not know.
    for kind in ("identity", "in_place", "cast", "batch_norm"):
        for node, node_kind in plan:
            if node_kind == kind:
                _REWRITES[kind](graph, node, order)
    graph.eliminate_dead_code()
    graph.lint()
    outputs = next(iter(reversed(graph.nodes))).args[0]
    for spec, value in zip(program.graph_signature.output_specs, outputs):
        if isinstance(value, Node):
            spec.arg.name = value.name  # an output that was an identity is now its input
    program.graph_module.recompile()
    return True


def _plan(graph: torch.fx.Graph) -> list[tuple[Node, str]] | None:
    """The nodes to rewrite and their rewrites, in graph order; None where some node needs the retrace."""
    plan, fresh = [], set()
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        kind = _kind(node)
        if kind == "in_place":
            if not _writable(node.args[0], node, fresh, order) or not _keeps_dtype(node):
                return None
        elif kind is None and not _kept(node):
            return None
        if kind is not None:
            plan.append((node, kind))
        if kind in ("in_place", "cast", "batch_norm") or kind is None and _returns_fresh(node):
            fresh.add(node)
    return plan


def _kind(node: Node) -> str | None:
    """Which rewrite ``node`` takes, if any."""
    op = node.target
    if op is aten.dropout.default and not _argument(node, 2, "train"):
        return "identity"
    if op in _CASTS and isinstance(node.args[0], Node):
        return "identity" if _changes_nothing(node) else "cast"
    if op is aten.batch_norm.default and not _argument(node, 5, "training") \
            and all(isinstance(_argument(node, i, name), Node) for i, name in ((3, "running_mean"), (4, "running_var"))):
        return "batch_norm"
    if isinstance(op, torch._ops.OpOverload) and _functional_twin(op) is not None:
        return "in_place"
    return None


def _kept(node: Node) -> bool:
    """Whether ``node`` reads the same in the functional graph."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload):  # getitem, or arithmetic on symbolic sizes
        return op is operator.getitem or not isinstance(op, (torch._ops.OperatorBase, torch._ops.OpOverloadPacket)) \
            and isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool))
    if op._schema.is_mutable:
        return False
    if op in _KEPT_ALIASING:
        return True
    return not _is_cia_op(op) or _check_valid_to_preserve(op)  # the composite ops the retrace keeps


def _functional_twin(op: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """``op``'s out-of-place form where ``op`` writes its first argument alone and returns it
    (``relu_`` → ``relu``, ``add_.Tensor`` → ``add.Tensor``)."""
    schema = op._schema
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    if not schema.is_mutable or len(written) != 1 or schema.arguments[0] is not written[0] \
            or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        return None
    packet = getattr(aten, schema.name.split("::")[1].removesuffix("_"), None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or [a.name for a in twin._schema.arguments] != [a.name for a in schema.arguments] \
            or twin._schema.is_mutable or any(r.alias_info is not None for r in twin._schema.returns):
        return None
    return twin


def _writable(x: object, write: Node, fresh: set[Node], order: dict[Node, int]) -> bool:
    """Whether writing ``x`` in place at ``write`` is seen by nothing but the readers after it:
    ``x`` is a result of its own (not an input, a weight or a view), read before ``write``
    by no view. An identity is its input."""
    while isinstance(x, Node) and _kind(x) == "identity":
        x = x.args[0]
    if not isinstance(x, Node) or x not in fresh:
        return False
    return all(order[reader] > order[write] or reader is write or _returns_fresh(reader) for reader in _readers(x))


def _keeps_dtype(write: Node) -> bool:
    """Whether ``write``'s out-of-place form computes in the dtype it writes: its tensor
    arguments share the written one's (``half.add_(float)`` rounds to half; ``add`` would not)."""
    dtype = write.args[0].meta["val"].dtype
    return all(arg.meta["val"].dtype == dtype for arg in write.all_input_nodes
               if isinstance(arg.meta.get("val"), torch.Tensor))


def _readers(x: Node) -> list[Node]:
    """The nodes that read ``x``, directly or through identities."""
    readers = []
    for user in x.users:
        readers.extend(_readers(user) if _kind(user) == "identity" else [user])
    return readers


def _returns_fresh(node: Node) -> bool:
    """Whether ``node``'s results are new tensors, not views of its arguments."""
    op = node.target
    if op is operator.getitem:
        return isinstance(node.args[0], Node) and _returns_fresh(node.args[0])
    if not isinstance(op, torch._ops.OpOverload) or op in _KEPT_ALIASING:
        return False
    return all(r.alias_info is None for r in op._schema.returns)


def _argument(node: Node, index: int, name: str) -> object:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name)


def _changes_nothing(cast: Node) -> bool:
    """Whether ``cast`` (a ``to``) returns its input itself."""
    arguments = _cast_arguments(cast)
    x, out = cast.args[0].meta["val"], cast.meta["val"]
    return not arguments.get("copy") and arguments.get("memory_format") in (None, torch.preserve_format) \
        and (x.dtype, x.device, x.layout) == (out.dtype, out.device, out.layout)


def _cast_arguments(cast: Node) -> dict:
    """The arguments of ``cast`` (a ``to``) by name, but its input."""
    return normalize_function(cast.target, cast.args, cast.kwargs, normalize_to_only_use_kwargs=True).kwargs


def _identity(graph: torch.fx.Graph, node: Node, order: dict[Node, int]) -> None:
    node.replace_all_uses_with(node.args[0])
    graph.erase_node(node)


def _copy(graph: torch.fx.Graph, node: Node, order: dict[Node, int]) -> None:
    arguments, out = _cast_arguments(node), node.meta["val"]
    options = {"dtype": out.dtype, "layout": out.layout, "device": out.device,
               **{name: arguments[name] for name in ("non_blocking", "memory_format") if arguments.get(name)}}
    with graph.inserting_before(node):
        copy = graph.call_function(aten._to_copy.default, (node.args[0],), options)
    copy.meta = dict(node.meta)
    node.replace_all_uses_with(copy)
    graph.erase_node(node)


def _batch_norm_no_training(graph: torch.fx.Graph, node: Node, order: dict[Node, int]) -> None:
    x, weight, bias, mean, variance = (_argument(node, i, name) for i, name in
                                       enumerate(("input", "weight", "bias", "running_mean", "running_var")))
    momentum, eps = _argument(node, 6, "momentum"), _argument(node, 7, "eps")
    out = node.meta["val"]
    with graph.inserting_before(node):
        norm = graph.call_function(aten._native_batch_norm_legit_no_training.default,
                                   (x, weight, bias, mean, variance, momentum, eps))
        norm.meta = {**node.meta, "val": (out, out.new_empty((0,)), out.new_empty((0,)))}
        result = graph.call_function(operator.getitem, (norm, 0))
        result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _out_of_place(graph: torch.fx.Graph, node: Node, order: dict[Node, int]) -> None:
    x = node.args[0]
    for reader in [user for user in x.users if user is not node and order[user] > order[node]]:
        reader.replace_input_with(x, node)
    node.target = _functional_twin(node.target)


_REWRITES = {"identity": _identity, "in_place": _out_of_place, "cast": _copy, "batch_norm": _batch_norm_no_training}
