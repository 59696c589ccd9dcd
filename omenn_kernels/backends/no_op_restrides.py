"""In-place restrides that move no element, dropped from a traced explanation.

ATen's ``adaptive_avg_pool2d`` to 1×1 is a mean over the spatial axes followed, for a
channels-last input, by ``as_strided_`` to channels-last strides. A trace on fake tensors
records that ``as_strided_`` where their strides suggest channels-last — on the ones'
``(N, 1, H, W)`` too, where the real trace saw a contiguous tensor and recorded none. The
strides it sets differ only along axes of size 1, so every element keeps its place: the op
changes no value. An op written in place is not shape-only
(:mod:`~omenn_kernels.backends.shape_only`), so the ones' pooled mean and everything
computed from it would stay in the graph, computed per call; dropped, they fold.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten


def _moves_no_element(node: Node) -> bool:
    """Whether ``node`` is an ``as_strided_`` that keeps its input's size, offset and the strides
    of every axis longer than 1."""
    if node.op != "call_function" or node.target is not aten.as_strided_.default:
        return False
    base, size, stride, *rest = node.args
    value = base.meta.get("val") if isinstance(base, Node) else None
    if not isinstance(value, torch.Tensor):
        return False
    offset = rest[0] if rest else node.kwargs.get("storage_offset")
    return list(value.shape) == list(size) and (offset is None or offset == value.storage_offset()) \
        and all(length == 1 or value.stride(axis) == step for axis, (length, step) in enumerate(zip(size, stride)))


def drop_no_op_restrides(graph: GraphModule) -> int:
    """Replace each ``as_strided_`` of ``graph`` that moves no element by its input; how many."""
    dropped = 0
    for node in list(graph.graph.nodes):
        if _moves_no_element(node):
            node.replace_all_uses_with(node.args[0])
            graph.graph.erase_node(node)
            dropped += 1
    if dropped:
        graph.recompile()
    return dropped
