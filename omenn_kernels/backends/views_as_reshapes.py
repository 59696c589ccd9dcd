"""A traced explanation's views written as reshapes, so that the compiler may choose other strides.

``make_fx`` records a ``reshape`` as a ``view`` wherever the tensor's strides, as traced, allow
one. Inductor traces the graph again under its own decompositions, whose outputs need not have
eager's strides: Phi-3's rotary embedding, ``cat([q_rotated, q_passed], -1)`` with ``q_passed``
empty where the whole head rotates, is contiguous in eager and keeps ``q_rotated``'s transposed
layout there (the decomposition drops empty parts), so attention's ``view`` of it as one matrix
per head fails and the signature runs on the fused backend. A ``reshape`` is the same view where
the strides allow one, and a copy where they do not.

A copy would not see a later in-place write of its base, nor pass its own writes on: a view in
an alias tree that some op writes in place stays a view.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from .shape_only import written_in_place

aten = torch.ops.aten


def _alias_root(node: Node) -> Node:
    """The tensor that ``node`` is a view of, through any chain of views (``node`` itself if none)."""
    while node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view \
            and node.args and isinstance(node.args[0], Node):
        node = node.args[0]
    return node


def views_as_reshapes(module: GraphModule) -> int:
    """Replace each ``aten.view`` of ``module`` whose alias tree no op writes in place by
    ``aten.reshape``; returns how many were replaced."""
    written = written_in_place(module.graph)  # with the bases of written views, up to each root
    replaced = 0
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target is aten.view.default and _alias_root(node) not in written:
            node.target = aten.reshape.default
            replaced += 1
    if replaced:
        module.recompile()
    return replaced
