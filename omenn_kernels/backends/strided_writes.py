"""A copy into a strided view of a fresh buffer, written as the functional scatter it is.

What and why: autograd's backward of an ``as_strided`` view (ATen's ``adaptive_avg_pool2d``
to 1×1 restrides its output in place, so every CNN with a global pooling head has one) makes
a zero buffer, copies the gradient into a strided view of it and returns another view of the
buffer. A trace records the copy in place (``copy_``). A graph that writes in place goes to
Inductor through AOTAutograd, whose functionalization costs two more traces, and is not saved
for later processes (:mod:`~omenn_kernels.backends.saved_graphs`, whose code computes an op
of no inputs once, on loading). The copy into the view is ``as_strided_scatter`` of the
buffer, which the later views read instead: the graph stays functional
(:mod:`~omenn_kernels.backends.direct_inductor`).
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten


def _fresh(node: Node) -> bool:
    """Whether ``node`` makes a new tensor: an op that writes nothing and aliases none of its inputs."""
    schema = getattr(node.target, "_schema", None)
    return node.op == "call_function" and schema is not None and not schema.is_mutable \
        and all(value.alias_info is None for value in schema.returns)


def _scatter(write: Node, position: dict[Node, int]) -> tuple[Node, Node] | None:
    """The view and buffer of ``write`` where it is a ``copy_`` of a value of the view's shape and dtype
    into an ``as_strided`` view of a fresh buffer, that nothing reads but after it; else None."""
    if write.op != "call_function" or write.target is not aten.copy_.default or write.users or write.kwargs:
        return None
    view, source = write.args[0], write.args[1]
    if not isinstance(view, Node) or not isinstance(source, Node) or view.target is not aten.as_strided.default \
            or list(view.users) != [write] or view.kwargs or not isinstance(view.args[0], Node):
        return None
    buffer = view.args[0]
    got, want = source.meta.get("val"), view.meta.get("val")
    if not _fresh(buffer) or not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) \
            or got.shape != want.shape or got.dtype != want.dtype:
        return None
    if any(position[user] < position[write] for user in buffer.users if user is not view):
        return None
    return view, buffer


def scatter_strided_writes(module: GraphModule) -> int:
    """Rewrite each copy into a strided view of a fresh buffer as ``as_strided_scatter`` (see the module
    docstring); returns how many."""
    graph = module.graph
    position = {node: i for i, node in enumerate(graph.nodes)}
    rewritten = 0
    for write in list(graph.nodes):
        found = _scatter(write, position)
        if found is None:
            continue
        view, buffer = found
        with graph.inserting_before(write):
            scattered = graph.call_function(aten.as_strided_scatter.default, (buffer, write.args[1], *view.args[1:]))
        if "val" in buffer.meta:
            scattered.meta["val"] = buffer.meta["val"]
        buffer.replace_all_uses_with(scattered, delete_user_cb=lambda user: user not in (view, scattered))
        graph.erase_node(write)
        graph.erase_node(view)
        rewritten += 1
    if rewritten:
        module.recompile()
    return rewritten
