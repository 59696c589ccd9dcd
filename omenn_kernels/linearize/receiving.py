"""Which output features of a LIVE node can receive a gradient: decided once, from the graph.

A fused ``qkv`` projection is one LIVE node whose query and key thirds only feed gates:
the backward of the explanation gives them no gradient, whatever the input. Knowing this
from the graph (instead of reading the gradient's zeros on the host at every call) lets
the backward multiply only the receiving block and keeps the explanation free of host
syncs.

The features of the node's last dimension are followed as an index tensor through the
structure operations (``Rule.transparent``: reshape, permute, unbind, getitem, ...) that
the node's value passes through, each run on the index tensor with the graph's own
arguments (symbolic sizes at their example values). A use by a GATE or CONST node carries
no gradient; any other use receives every feature it holds. Whatever cannot be followed
(an operation that fails on the index tensor, an operand besides the followed one) counts
as receiving: the answer may only be too large, never too small.
"""

from __future__ import annotations

import torch

from .registry import lookup


# The largest value (in elements, at the example batch size) whose features are followed;
# a larger one counts every feature as receiving rather than spend its memory on the index.
MAX_FOLLOWED = 1 << 26


def _followed(user: torch.fx.Node) -> bool:
    """Whether the features can be followed through ``user`` (a structure operation)."""
    rule = lookup(user.target) if user.op == "call_function" else None
    return rule is not None and rule.transparent


class _Unknown(Exception):
    """An argument whose value is not known from the graph alone."""


def _hint(size) -> int:
    """A size as an int: a symbolic size at the example value export traced it with."""
    if isinstance(size, torch.SymInt):
        if size.node.hint is None:
            raise _Unknown(str(size))
        return int(size.node.hint)
    return int(size)


def _known(arg, followed: torch.fx.Node, tag):
    """``arg`` with ``followed`` replaced by ``tag`` and symbolic sizes by their example values."""
    if arg is followed:
        return tag
    if isinstance(arg, torch.fx.Node):
        value = arg.meta.get("val")
        if isinstance(value, torch.SymInt):
            return _hint(value)
        if isinstance(value, (int, float, bool)):
            return value
        raise _Unknown(arg.name)
    if isinstance(arg, torch.SymInt):
        return _hint(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(_known(a, followed, tag) for a in arg)
    if isinstance(arg, dict):
        return {k: _known(v, followed, tag) for k, v in arg.items()}
    return arg


def _features_in(tag) -> torch.Tensor:
    """The feature indices held by ``tag`` (a tensor, or a tuple/list of them)."""
    if isinstance(tag, torch.Tensor):
        return tag.flatten().long()
    if isinstance(tag, (list, tuple)):
        parts = [_features_in(t) for t in tag if isinstance(t, (torch.Tensor, list, tuple))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    return torch.zeros(0, dtype=torch.long)


def receiving_block(node: torch.fx.Node, without_gradient: set[torch.fx.Node]) -> tuple[int, int] | None:
    """``(start, stop)``: the contiguous block of ``node``'s last-dim features that a LIVE use
    can reach; None where every feature may (or where it cannot be told).

    ``without_gradient``: the GATE and CONST nodes, through which no gradient flows back.
    """
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return None
    if not any(user in without_gradient or _followed(user) for user in node.users):
        return None  # every use receives every feature: nothing to follow
    try:
        shape = [_hint(size) for size in value.shape]
    except _Unknown:
        return None
    if torch.Size(shape).numel() > MAX_FOLLOWED:
        return None
    features = shape[-1]
    received = torch.zeros(features, dtype=torch.bool)
    tags = {node: torch.arange(features, dtype=torch.float32).expand(shape).contiguous()}
    pending = [node]
    while pending:
        current = pending.pop()
        tag = tags.pop(current)
        for user in current.users:
            if user in without_gradient:
                continue  # held constant or shape-only: no gradient reaches ``current`` through it
            others = [n for n in user.all_input_nodes if n is not current
                      and isinstance(n.meta.get("val"), torch.Tensor)]
            if _followed(user) and not others:
                try:
                    followed = user.target(*_known(user.args, current, tag), **_known(user.kwargs, current, tag))
                except Exception:  # noqa: BLE001 — anything not followed counts as receiving
                    received[_features_in(tag)] = True
                    continue
                if followed is not None:
                    tags[user] = followed
                    pending.append(user)
                continue
            received[_features_in(tag)] = True
    if bool(received.all()) or not bool(received.any()):
        return None
    indices = received.nonzero().flatten()
    start, stop = int(indices[0]), int(indices[-1]) + 1
    if stop - start != len(indices):
        return None  # not one block: the whole product
    return start, stop
