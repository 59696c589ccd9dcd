"""Regional compilation: each repeated block's share of a traced explanation compiled once, called per block.

What and why: Inductor's own time (lowering, scheduling, code generation) grows with the
graph's nodes, and a traced explanation holds every layer of a transformer twice, once in
the forward and once in the backward. Layers of one structure are the same code on other
parameters. So the trace records which graph nodes each program step made, in the forward
and, through hooks on the step's autograd nodes, in each backward (:class:`Recorder`), and
:func:`outlined` replaces every set of regions of identical code by calls of one shared
subgraph (``torch.ops.higher_order.invoke_subgraph``), which Inductor lowers, generates and
compiles once.

A block is a module whose name ends in a number (``blocks.3``, ``layer1.2``,
``model.layers.0``, ``encoder_layer_0``), the outermost first; where a block's region has no
twin (a ResNet stage's first bottleneck, a Swin stage), the blocks one level deeper inside it
are tried. Twins are outlined only where that leaves fewer operations to compile: n twins of
m operations and k outputs become one subgraph and n calls with k unpackings each, so they
need (n − 1)·m > n·(1 + k) (a single layer's twins stay inline).
A region is the nodes of one block in one pass (the forward, or one backward), together
with the unlabeled nodes on a path between two of them (the sum of a residual branch's
gradients, which the autograd engine makes between two steps' autograd nodes). A region
that a path leaves and re-enters through another block's node stays inline.

Two regions are twins where their nodes are the same ops with the same constants, wired
the same way, and their inputs (the parameters, the folded constants and the values that
enter from before) have the same shapes, strides, dtypes and devices: a call of the shared
subgraph on a region's inputs computes what the region computed, op for op. The outlined
graph is checked against the fused backend like any compiled graph.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import operator
from collections import Counter
from typing import Iterable

import torch
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..linearize.program import Step
from ..linearize.values import Live

log = logging.getLogger("omenn_kernels.compiled")

# A traced node's (pass, block path): the pass is "forward" or "backward N" (N counts the
# backward passes of one explanation: one per read-out), the path that of the step that made it.
REGION = "omenn_region"
# A loaded graph's nodes carry the described value of their traced node here (no ``val``).
DESCRIBED = "omenn_described"


class Recorder:
    """Labels the nodes of a ``make_fx`` trace with the program step that made them (see the module
    docstring); pass it to :func:`~omenn_kernels.backends.executor.observing_steps` around the trace."""

    def __init__(self) -> None:
        self.graph: Graph | None = None
        self.mark: Node | None = None  # the last node before the running step's (or autograd node's)
        self.paths: list[str] = []  # the module path of each step run
        self.sequence_starts: list[int] = []  # each step's first autograd sequence number, then the forward's end
        self.backwards = -1

    def step(self, step: Step) -> None:
        if self.graph is None:
            mode = get_proxy_mode()
            if mode is None:  # not a trace
                return
            self.graph = mode.tracer.graph
        else:
            self._label_since_mark(("forward", self.paths[-1]))
        self.paths.append(step.module_path)
        self.sequence_starts.append(torch.autograd._get_sequence_nr())
        self.mark = _last(self.graph)

    def done(self, output: Live) -> None:
        if self.graph is None or not self.paths:
            return
        self._label_since_mark(("forward", self.paths[-1]))
        self.sequence_starts.append(torch.autograd._get_sequence_nr())
        root = output.value.grad_fn
        roots = [t.grad_fn for t in (output.value, output.ones)
                 if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        for node in _autograd_nodes(roots):
            index = bisect.bisect_right(self.sequence_starts, node._sequence_nr()) - 1
            if 0 <= index < len(self.paths):
                node.register_prehook(self._prehook(counts_passes=node is root))
                node.register_hook(self._posthook(self.paths[index]))

    def _prehook(self, counts_passes: bool):
        def prehook(grad_outputs):
            if counts_passes:  # the output's autograd node runs once per backward, before any step's
                self.backwards += 1
            self.mark = _last(self.graph)
        return prehook

    def _posthook(self, path: str):
        def posthook(grad_inputs, grad_outputs):
            self._label_since_mark((f"backward {max(self.backwards, 0)}", path))
        return posthook

    def _label_since_mark(self, label: tuple[str, str]) -> None:
        node = self.mark.next
        while node.op != "root":
            node.meta[REGION] = label
            node = node.next


def _last(graph: Graph) -> Node:
    return next(iter(reversed(graph.nodes)))


def _autograd_nodes(roots: list) -> Iterable:
    seen, pending = set(roots), list(roots)
    while pending:
        node = pending.pop()
        yield node
        for parent, _ in node.next_functions:
            if parent is not None and parent not in seen:
                seen.add(parent)
                pending.append(parent)


def _blocks(path: str) -> list[str]:
    """The block paths that hold ``path``, outermost first: its prefixes whose last name ends in a
    number (``blocks.3``, ``layer1``, ``encoder_layer_0``)."""
    parts = path.split(".")
    return [".".join(parts[:i + 1]) for i, part in enumerate(parts) if part[-1:].isdigit()]


def described(value) -> object:
    """What a twin's input must match: a tensor's shape, strides, dtype and device; else its value."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), tuple(value.stride()), value.dtype, value.device.type)
    return repr(value)


def _input_description(node: Node, module: GraphModule) -> object:
    if node.op == "get_attr":
        return described(operator.attrgetter(node.target)(module))
    if DESCRIBED in node.meta:
        return node.meta[DESCRIBED]
    if "val" in node.meta:
        return described(node.meta["val"])
    return ("undescribed", node.name)  # no twin


class _Region:
    """One region: its nodes in graph order, its inputs in the order its code first reads them, and
    its code as a hashable value (see :func:`_code`)."""

    def __init__(self, nodes: list[Node], module: GraphModule) -> None:
        self.nodes = nodes
        local = {node: i for i, node in enumerate(nodes)}
        inputs: dict[Node, int] = {}

        def encoded(arg):
            if isinstance(arg, Node):
                return ("node", local[arg]) if arg in local else ("input", inputs.setdefault(arg, len(inputs)))
            if isinstance(arg, (list, tuple)):
                return (type(arg).__name__, tuple(encoded(a) for a in arg))
            if isinstance(arg, dict):
                return ("dict", tuple((key, encoded(value)) for key, value in arg.items()))
            return (type(arg).__qualname__, repr(arg))

        body = tuple((node.target, encoded(node.args), encoded(node.kwargs)) for node in nodes)
        self.inputs = list(inputs)
        self.code = (body, tuple(_input_description(node, module) for node in self.inputs))
        self.outputs = {i for i, node in enumerate(nodes) if any(user not in local for user in node.users)}


def _closed(members: list[Node], nodes: list[Node], position: dict[Node, int], blocked: set[Node]
            ) -> list[Node] | None:
    """``members`` with the nodes on a path between two of them, in graph order; None where such a
    node is ``blocked`` (another block's)."""
    inside = set(members)
    low, high = position[members[0]], position[members[-1]]
    span = nodes[low:high + 1]
    after = set(inside)  # reached from the region
    for node in span:
        if node not in inside and any(arg in after for arg in node.all_input_nodes):
            after.add(node)
    before = set(inside)  # reaching the region
    for node in reversed(span):
        if node not in inside and any(user in before for user in node.users):
            before.add(node)
    between = (after & before) - inside
    if between & blocked:
        return None
    return sorted(inside | between, key=position.__getitem__)


def outlined(module: GraphModule) -> GraphModule | None:
    """``module``'s graph with each set of twin regions (see the module docstring) replaced by calls of
    one shared subgraph, as a new module sharing ``module``'s tensors; None where no region repeats."""
    nodes = list(module.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    chains: dict[Node, tuple[str, list[str]]] = {}
    for node in nodes:
        label = node.meta.get(REGION)
        if node.op == "call_function" and label is not None and _blocks(label[1]):
            chains[node] = (label[0], _blocks(label[1]))
    blocked = set(chains)
    chosen: list[list[_Region]] = []
    taken: set[Node] = set()
    remaining = [node for node in nodes if node in chains]
    level = 0
    while remaining:
        groups: dict[tuple[str, str], list[Node]] = {}
        for node in remaining:
            phase, chain = chains[node]
            if len(chain) > level:
                groups.setdefault((phase, chain[level]), []).append(node)
        twins: dict[tuple, list[_Region]] = {}
        for members in groups.values():
            closed = _closed(members, nodes, position, blocked - set(members))
            if closed is not None:
                region = _Region(closed, module)
                twins.setdefault(region.code, []).append(region)
        for regions in twins.values():
            regions = [r for r in regions if not taken.intersection(r.nodes)]
            outputs = len(set().union(*(region.outputs for region in regions)))
            if (len(regions) - 1) * len(regions[0].nodes) > len(regions) * (1 + outputs):
                chosen.append(regions)
                for region in regions:
                    taken.update(region.nodes)
        remaining = [node for members in groups.values() if not taken.intersection(members) for node in members]
        level += 1
    if not chosen:
        return None
    return _rewritten(module, chosen)


def _rewritten(module: GraphModule, classes: list[list[_Region]]) -> GraphModule:
    """``module``'s graph with each region of ``classes`` replaced by a call of its class's subgraph,
    its nodes in the original order but for the regions, each placed where its first node was."""
    nodes = list(module.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    attributes = {node.target: operator.attrgetter(node.target)(module) for node in nodes if node.op == "get_attr"}
    unit_of: dict[Node, object] = {}
    for k, regions in enumerate(classes):
        outputs = sorted(set().union(*(region.outputs for region in regions)))
        attributes[f"omenn_region_{k}"] = _subgraph(regions[0], outputs)
        for region in regions:
            region.outputs = outputs
            region.name = f"omenn_region_{k}"
            for node in region.nodes:
                unit_of[node] = region
    units: dict[object, list[Node]] = {}
    for node in nodes:
        units.setdefault(unit_of.get(node, node), []).append(node)
    depends: dict[object, set] = {}
    users: dict[object, list] = {unit: [] for unit in units}
    for unit, members in units.items():
        depends[unit] = {unit_of.get(arg, arg) for node in members for arg in node.all_input_nodes} - {unit}
        for dependency in depends[unit]:
            users[dependency].append(unit)
    waiting = Counter({unit: len(dependencies) for unit, dependencies in depends.items()})
    # positions are unique: a unit is never compared
    ready = [(position[members[0]], unit) for unit, members in units.items() if not waiting[unit]]
    heapq.heapify(ready)
    graph, env, subgraph_nodes = Graph(), {}, {}
    while ready:
        _, unit = heapq.heappop(ready)
        if isinstance(unit, _Region):
            if unit.name not in subgraph_nodes:
                subgraph_nodes[unit.name] = graph.get_attr(unit.name)
            call = graph.call_function(torch.ops.higher_order.invoke_subgraph,
                                       (subgraph_nodes[unit.name], unit.name, *(env[n] for n in unit.inputs)))
            call.meta["val"] = tuple(unit.nodes[i].meta.get("val") for i in unit.outputs)
            for j, i in enumerate(unit.outputs):
                item = graph.call_function(operator.getitem, (call, j))
                item.meta = dict(unit.nodes[i].meta)
                env[unit.nodes[i]] = item
        else:
            env[unit] = graph.node_copy(unit, env.__getitem__)
        for user in users[unit]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (position[units[user][0]], user))
    if len(env) + sum(len(r.nodes) - len(r.outputs) for regions in classes for r in regions) != len(nodes):
        raise AssertionError("outlining left nodes out: a region is not convex")
    result = GraphModule(attributes, graph)
    result.meta.update(module.meta)
    log.debug("outlined %d regions into %d subgraphs", sum(len(regions) for regions in classes), len(classes))
    return result


def _subgraph(region: _Region, outputs: list[int]) -> GraphModule:
    """The region's nodes as a graph of its inputs, returning the nodes at ``outputs``."""
    graph = Graph()
    env = {}
    for i, node in enumerate(region.inputs):
        env[node] = graph.placeholder(f"input_{i}")
        if "val" in node.meta:
            env[node].meta["val"] = node.meta["val"]
    for node in region.nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[region.nodes[i]] for i in outputs))
    return GraphModule(torch.nn.Module(), graph)
