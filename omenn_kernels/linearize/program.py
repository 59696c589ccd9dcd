"""The graph walker: from a captured aten graph to a linearized program.

One pass classifies every node, asking the rule registry about each operation:

* CONST — does not depend on the input: computed normally.
* GATE — depends on the input but is held constant (R5): a gate operation whose
  result only multiplies, and everything that only feeds gates (``QKᵀ`` and the
  query/key projections of attention, the squeeze-excitation branch).
* LIVE — carries a ones channel: computed by the operation's rule.

Every LIVE node must have a rule; a missing one is reported before anything runs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum
from typing import Callable

import torch

from ..capture import CapturedModel, module_path
from .receiving import receiving_block
from .registry import Rule, lookup, op_name, unsupported


class Kind(Enum):
    CONST = "const"
    GATE = "gate"
    LIVE = "live"


@dataclass
class Step:
    """One node of the program with its classification and rule."""

    node: torch.fx.Node
    kind: Kind
    rule: Rule | None
    module_path: str
    # The block of the result's last-dim features that can receive a gradient (rules with
    # ``Rule.receiving``; None: all).
    receiving: tuple[int, int] | None = None


@dataclass(eq=False)  # compared by identity: the backends key their caches by the program (weakly)
class LinearizedProgram:
    """A captured graph with a rule (or a constant evaluation) for every node."""

    captured: CapturedModel
    steps: list[Step]
    # The input's feature axis (a non-negative index): its ones channel is shared along it, and the
    # explanation sums over it. None: every element of the input is a position with ones of its own.
    feature_dim: int | None = 1

    def __str__(self) -> str:
        """The program as a table: one line per node with its kind, rule and module path."""
        lines = [f"LinearizedProgram of {len(self.steps)} nodes: input {self.captured.input_name}, "
                 f"output {self.captured.output_name}",
                 f"{'node':<28} {'operation':<34} {'kind':<5} {'rule':<32} module"]
        for step in self.steps:
            operation = op_name(step.node.target) if callable(step.node.target) else str(step.node.target)
            rule = step.rule.name if step.rule is not None else "-"
            lines.append(f"{step.node.name:<28} {operation:<34} {step.kind.value:<5} {rule:<32} {step.module_path}")
        return "\n".join(lines)

    @functools.cached_property
    def released_after(self) -> tuple[tuple[str, ...], ...]:
        """Per step, the values that no later step reads (the output excepted): a forward drops
        them there, so that it holds what is still to be read and what autograd saved, not
        every intermediate value until its end."""
        last_read: dict[str, int] = {}
        for index, step in enumerate(self.steps):
            last_read[step.node.name] = index  # a value that no step reads goes where it is made
            for node in step.node.all_input_nodes:
                last_read[node.name] = index
        last_read.pop(self.captured.output_name, None)
        released: list[list[str]] = [[] for _ in self.steps]
        for name, index in last_read.items():
            released[index].append(name)
        return tuple(tuple(names) for names in released)


def _positions(user: torch.fx.Node, node: torch.fx.Node) -> set[int]:
    """Schema positions at which ``node`` is an argument of ``user`` (nested lists included)."""
    found: set[int] = set()
    for index, arg in enumerate(user.args):
        if arg is node or (isinstance(arg, (list, tuple)) and node in arg):
            found.add(index)
    names = [a.name for a in user.target._schema.arguments] if hasattr(user.target, "_schema") else []
    for name, arg in user.kwargs.items():
        if arg is node or (isinstance(arg, (list, tuple)) and node in arg):
            found.add(names.index(name) if name in names else -1)
    return found


def _inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    return list(node.all_input_nodes)


def _only_multiplies(node: torch.fx.Node, dependent: set[torch.fx.Node]) -> bool:
    """Whether every use of ``node`` ends as a factor of a product (the R5 gate condition).

    Uses are followed through operations whose only input-dependent operand is the
    gate itself (views, dropout, scaling by constants).
    """
    for user in node.users:
        if user.op != "call_function":
            return False
        rule = lookup(user.target)
        positions = _positions(user, node)
        others = [n for n in _inputs(user) if n in dependent and n is not node]
        if rule is not None and positions <= set(rule.factor_args) and others:
            continue  # scales another input-dependent tensor: the gate ends here
        if rule is not None and rule.transparent and positions == {0}:
            if not _only_multiplies(user, dependent):
                return False
            continue
        if others or not _only_multiplies(user, dependent):
            return False
    return True


def linearize(captured: CapturedModel) -> LinearizedProgram:
    """Classify every node of the captured graph and check that each LIVE one has a rule.

    Raises:
        UnsupportedOpError: an input-dependent operation has no rule, naming the aten op,
            the module path and the kind of rule it would need.
    """
    nodes = list(captured.graph.nodes)
    dependent: set[torch.fx.Node] = set()
    for node in nodes:
        rule = lookup(node.target) if node.op == "call_function" else None
        if rule is not None and rule.shape_only:
            continue
        if node.name == captured.input_name or any(n in dependent for n in _inputs(node)):
            if node.op != "output":
                dependent.add(node)

    gates: set[torch.fx.Node] = set()
    for node in nodes:
        rule = lookup(node.target) if node in dependent and node.op == "call_function" else None
        if rule is not None and rule.may_gate and (not rule.live or _only_multiplies(node, dependent)):
            gates.add(node)

    # R5': held multipliers (RMS-style normalizers, gated MLPs' activations) are gates where
    # each use ends as a factor of an input-dependent tensor that is no gate; a product of two
    # would-be multipliers keeps neither (R9).
    feeds_gates = _feeding(nodes, dependent, gates)
    order = {node: index for index, node in enumerate(nodes)}

    def nonlinear(operand: torch.fx.Node, product: torch.fx.Node) -> bool:
        return _nonlinear_factor(operand, product, dependent, gates, order)

    products = {node: _factor_products(node, dependent) for node in nodes
                if node in dependent and node not in gates | feeds_gates and _is_multiplier(node, dependent)}
    partners = {node: None if found is None else {p for _, others in found for p in others}
                for node, found in products.items()}
    # A partner that is itself a non-linear function of the input (a gated activation written
    # out in several ops) makes the product one of two non-linear factors: R9 refuses it.
    candidates = {node for node, found in partners.items()
                  if found is not None and not found & (gates | feeds_gates)
                  and not any(nonlinear(other, product) for product, others in products[node] for other in others)}
    held_multipliers = {node for node in candidates if not partners[node] & candidates}
    if held_multipliers:
        gates |= held_multipliers
        feeds_gates = _feeding(nodes, dependent, gates)
    # R5' over a subgraph: a non-linear function of the input written out in several ops
    # (0.5·x·(1 + tanh(…)), x·sigmoid(1.702x)) that ends as a factor of a linear one is held
    # whole, the outermost product first.
    for product in reversed(nodes):
        whole = _held_whole(product, dependent, gates | feeds_gates, nonlinear)
        if whole is not None:
            gates.add(whole)
            feeds_gates = _feeding(nodes, dependent, gates)

    masks = _masks(nodes, dependent)
    steps: list[Step] = []
    live: set[torch.fx.Node] = set()
    for node in nodes:
        if node.op != "call_function":
            continue
        path = module_path(node)
        held = gates | feeds_gates
        if node not in dependent:
            steps.append(Step(node, Kind.CONST, None, path))
        elif node in held or not any(n in live or n.name == captured.input_name for n in _inputs(node)):
            steps.append(Step(node, Kind.GATE, None, path))
        else:
            rule = lookup(node.target)
            if rule is None:
                raise unsupported(node.target, path, "this operation depends on the input and has no "
                                  "OMENN rule")
            if rule.reference is None:
                raise unsupported(node.target, path, "it is not linear in its input-dependent operand, and its "
                                  "result is used other than as a factor of another input-dependent tensor "
                                  "(where it would be held as a multiplier)",
                                  f"{rule.name} (only as a factor of another input-dependent tensor)")
            if rule.masked is not None and any(_positions(node, n) & set(rule.factor_args)
                                               for n in _inputs(node) if n in masks):
                rule = rule.masked
            live.add(node)
            steps.append(Step(node, Kind.LIVE, rule, path))
    without_gradient = {step.node for step in steps if step.kind is not Kind.LIVE}
    for step in steps:
        if step.kind is Kind.LIVE and step.rule.receiving:
            step.receiving = receiving_block(step.node, without_gradient)
    return LinearizedProgram(captured, steps)


def _masks(nodes: list[torch.fx.Node], dependent: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The CONST tensors that hold a boolean or integer tensor's values: that tensor, and what
    structure-only operations (views, selections, casts) make of it alone (R8' masks)."""
    masks: set[torch.fx.Node] = set()
    for node in nodes:
        value = node.meta.get("val")
        if node in dependent or not isinstance(value, torch.Tensor):
            continue
        if not (value.is_floating_point() or value.is_complex()):
            masks.add(node)
            continue
        rule = lookup(node.target) if node.op == "call_function" else None
        tensors = [n for n in _inputs(node) if isinstance(n.meta.get("val"), torch.Tensor)]
        if rule is not None and rule.transparent and tensors and all(n in masks for n in tensors):
            masks.add(node)
    return masks


def _feeding(nodes: list[torch.fx.Node], dependent: set[torch.fx.Node],
             gates: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """What only feeds gates (or gate arguments such as attention's Q and K): a gate too."""
    feeds_gates: set[torch.fx.Node] = set()
    for node in reversed(nodes):
        if node not in dependent or node in gates or node.op != "call_function":
            continue
        if node.users and all(_feeds_gate(user, node, gates, feeds_gates) for user in node.users):
            feeds_gates.add(node)
    return feeds_gates


def _is_multiplier(node: torch.fx.Node, dependent: set[torch.fx.Node]) -> bool:
    """Whether ``node`` is non-linear in an input-dependent operand (``Rule.multiplier_args``)."""
    rule = lookup(node.target) if node.op == "call_function" else None
    if rule is None or not rule.multiplier_args:
        return False
    return any(_positions(node, operand) & set(rule.multiplier_args)
               for operand in _inputs(node) if operand in dependent)


def _factor_products(node: torch.fx.Node, dependent: set[torch.fx.Node]
                     ) -> list[tuple[torch.fx.Node, set[torch.fx.Node]]] | None:
    """The products in which every use of ``node`` ends as a factor, each with its other
    input-dependent factors; None where a use ends otherwise. Uses are followed through
    operations whose only input-dependent operand is ``node``."""
    found: list[tuple[torch.fx.Node, set[torch.fx.Node]]] = []
    for user in node.users:
        if user.op != "call_function":
            return None
        rule = lookup(user.target)
        others = {n for n in _inputs(user) if n in dependent and n is not node}
        if not others:
            further = _factor_products(user, dependent)
            if further is None:
                return None
            found.extend(further)
        elif rule is not None and _positions(user, node) <= set(rule.factor_args):
            found.append((user, others))
        else:
            return None
    return found


def _nonlinear_factor(operand: torch.fx.Node, product: torch.fx.Node, dependent: set[torch.fx.Node],
                      gates: set[torch.fx.Node], order: dict[torch.fx.Node, int]) -> bool:
    """Whether ``product``'s factor ``operand`` is a non-linear function of the input of its own:
    the elementwise part of the graph that only ``operand`` is computed from (its ancestors
    through elementwise operations all of whose uses lead into it, up to the values the
    other factor shares) holds a non-linear operation (``Rule.multiplier_args``) or a gate.
    The walk stops at other operations (matrix products, reductions, attention): what a
    layer computes from their results is a function of its own, linearized by its own rules."""
    part = {operand}
    ancestors: set[torch.fx.Node] = set()
    pending = [operand] if _elementwise(operand) else []
    while pending:
        for parent in _inputs(pending.pop()):
            if parent in dependent and parent not in ancestors and _elementwise(parent):
                ancestors.add(parent)
                pending.append(parent)
    for node in sorted(ancestors, key=order.__getitem__, reverse=True):
        if all(user in part for user in node.users):
            part.add(node)
    return any(node in gates or _is_multiplier(node, dependent) for node in part)


def _elementwise(node: torch.fx.Node) -> bool:
    """Whether ``node`` computes each element from the same elements of its operands (a
    pointwise aten op, or a cast)."""
    target = node.target
    return node.op == "call_function" and (target is torch.ops.aten._to_copy.default or
                                           torch.Tag.pointwise in getattr(target, "tags", ()))


def _held_whole(product: torch.fx.Node, dependent: set[torch.fx.Node], held: set[torch.fx.Node],
                nonlinear: Callable[[torch.fx.Node, torch.fx.Node], bool]) -> torch.fx.Node | None:
    """The factor of ``product``, a product of two input-dependent factors that are not held,
    to hold whole (R5'): the one that is a non-linear function of the input, where the other
    is linear and every use of it ends as a factor of a linear one. None otherwise (R9
    refuses a product of two linear or two non-linear factors)."""
    if product not in dependent or product in held or product.op != "call_function":
        return None
    rule = lookup(product.target)
    operands = list(dict.fromkeys(n for n in _inputs(product) if n in dependent and n not in held))
    if rule is None or len(operands) != 2 or \
            any(not _positions(product, n) <= set(rule.factor_args) for n in operands):
        return None
    first, second = (nonlinear(n, product) for n in operands)
    if first == second:
        return None
    whole = operands[0] if first else operands[1]
    uses = _factor_products(whole, dependent)
    if uses is None or any(nonlinear(other, use) for use, others in uses for other in others):
        return None
    return whole


def _feeds_gate(user: torch.fx.Node, node: torch.fx.Node, gates: set, feeds_gates: set) -> bool:
    if user in gates or user in feeds_gates:
        return True
    if user.op != "call_function":
        return False
    rule = lookup(user.target)
    return rule is not None and bool(rule.gate_args) and _positions(user, node) <= set(rule.gate_args)
