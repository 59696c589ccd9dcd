"""The registry of linearization rules, keyed by aten operation.

A rule says how one aten operation acts on LIVE values and their ones channel.
Rules live in one module per op family (``omenn_kernels.linearize.rules.*``);
the graph walker only asks this registry, it knows no operation by name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..errors import UnsupportedOpError

OpKey = Any  # torch._ops.OpOverload or a Python callable such as operator.getitem


@dataclass(frozen=True)
class Rule:
    """How one operation is linearized.

    Attributes:
        name: the rule book's entry, e.g. ``"R2 convolution"``.
        reference: ``reference(op, *args, **kwargs)``; arguments are Live, Gate or
            CONST values, the result is Live (or a tuple/list containing Live). None:
            the operation has no linear form, only a held multiplier's (``multiplier_args``).
        fused: the same contract, running a fused ``torch.ops.omenn`` op where it
            applies and the reference math elsewhere; attached by :mod:`omenn_kernels.ops`
            (:func:`attach_fused`), so that no rule imports a kernel. None when the
            reference math is already the fast path.
        factor_args: argument positions where a Gate/CONST operand only scales a
            LIVE operand (multiplications): a gate may end there.
        gate_args: argument positions consumed only through a gate (the query and
            key of attention): what feeds them needs no ones channel.
        may_gate: the operation (softmax, sigmoid) is a gate when every use of its
            result ends in a ``factor_args`` position; it is then held constant.
        multiplier_args: argument positions where an input-dependent operand makes the
            operation non-linear (an activation's input, a divisor, the base of a power):
            with such an operand its result is a held multiplier, a gate (R5'), where
            every use of it ends as a factor of another input-dependent tensor that is
            neither a gate nor such a multiplier; the graph walker decides it.
        transparent: structure-only operation (view, permute, ...): a gate passing
            through it is still a gate.
        live: False when the operation has no linear form at all (softmax): a LIVE
            use of its result is an error.
        shape_only: the result depends on the shape of its input, not its values
            (``zeros_like``): it is CONST.
        held_args: argument positions whose held values the rule reads, to compute multipliers
            that change smoothly with them (GELU's ``ξ``, LayerNorm's ``1/σ``, attention
            weights). ``reference`` and ``fused`` then take the keyword ``held``, the arguments in
            schema order with None elsewhere, each LIVE one as its held value: the same
            numbers, constant with respect to the input (the value detached, or for a total
            parameter gradient the model's own forward, which still depends on the parameters).
            Piecewise-constant multipliers (ReLU's 0/1, an arg-max) are read from the operands'
            values: they do not change with the parameters.
        takes_model_result: ``reference`` and ``fused`` take the keyword ``model_result``, the
            model's own result of the operation, where the executor reuses it: its numbers
            equal the rule's value up to rounding, so a fused form may take them instead of
            computing them again.
        model_form: the operation as the held pass runs it for a rule that takes its result: it
            returns the result and what the rule gets as ``model_result`` (attention: its output
            and weights). None: the operation itself, its result given.
        receiving: ``reference`` and ``fused`` take the keyword ``receiving``, the block
            ``(start, stop)`` of the result's last-dim features that can receive a
            gradient (None: all), which the graph walker decides once
            (:mod:`~omenn_kernels.linearize.receiving`).
        masked: the rule for the operation where a CONST operand at a ``factor_args``
            position holds a boolean or integer tensor's values, cast or viewed (a padding
            mask as a float); the graph walker decides it.
    """

    name: str
    reference: Callable[..., Any] | None
    fused: Callable[..., Any] | None = None
    factor_args: tuple[int, ...] = ()
    gate_args: tuple[int, ...] = ()
    may_gate: bool = False
    multiplier_args: tuple[int, ...] = ()
    transparent: bool = False
    live: bool = True
    shape_only: bool = False
    held_args: tuple[int, ...] = ()
    takes_model_result: bool = False
    model_form: Callable[..., Any] | None = None
    receiving: bool = False
    masked: Rule | None = None


_RULES: dict[OpKey, Rule] = {}
_REFUSED: dict[OpKey, str] = {}


def register(ops: Iterable[OpKey], rule: Rule) -> Rule:
    """Register ``rule`` for each operation (OpOverload or OpOverloadPacket) in ``ops``."""
    for overload in _overloads(ops):  # out= variants never occur in captured graphs
        _RULES[overload] = rule
    return rule


def _overloads(ops: Iterable[OpKey]) -> list[OpKey]:
    found = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):
            found += [getattr(op, name) for name in op.overloads() if not name.endswith("out")]
        else:
            found.append(op)
    return found


def attach_fused(ops: Iterable[OpKey], fused_of: Callable[[Rule], Callable[..., Any]]) -> None:
    """Give the rules of ``ops`` their fused form ``fused_of(rule)`` (``Rule.fused``)."""
    attached: dict[int, Rule] = {}
    for op in _overloads(ops):
        rule = _RULES.get(op)
        if rule is None:  # an overload that no captured graph holds (out= variants)
            continue
        if id(rule) not in attached:
            attached[id(rule)] = dataclasses.replace(rule, fused=fused_of(rule))
        _RULES[op] = attached[id(rule)]


def refuse(ops: Iterable[OpKey], why: str) -> None:
    """Record why each operation in ``ops`` has no rule: its error names this reason."""
    for overload in _overloads(ops):
        _REFUSED[overload] = why


def refusal(op: OpKey) -> str | None:
    """Why ``op`` has no rule, where that was decided (:func:`refuse`), else None."""
    return _REFUSED.get(op)


class RuleError(Exception):
    """Raised by a rule when its operands are of kinds it cannot linearize.

    The graph walker turns it into an :class:`UnsupportedOpError` naming the op and
    the module path.
    """

    def __init__(self, why: str, rule_kind: str) -> None:
        super().__init__(why)
        self.why = why
        self.rule_kind = rule_kind


def arguments(op: OpKey, args: tuple, kwargs: dict) -> list:
    """All arguments of an aten call in schema order, defaults filled in."""
    if not isinstance(op, torch._ops.OpOverload):
        return list(args)
    bound = list(args)
    for spec in op._schema.arguments[len(args):]:
        if spec.name in kwargs:
            bound.append(kwargs[spec.name])
        elif spec.has_default_value():
            bound.append(spec.default_value)
        else:
            bound.append(None)
    return bound


def lookup(op: OpKey) -> Rule | None:
    """The rule registered for ``op``, or None."""
    return _RULES.get(op)


def op_name(op: OpKey) -> str:
    """A readable name such as ``aten.conv2d.default``."""
    if isinstance(op, torch._ops.OpOverload):
        return f"aten.{op._schema.name.split('::')[-1]}.{op._overloadname}"
    return getattr(op, "__name__", str(op))


def needed_rule_kind(op: OpKey) -> str:
    """Why an operation has no rule (:func:`refuse`), or else the kind of rule it would need,
    from its schema and tags."""
    if op in _REFUSED:
        return f"a rule that OMENN does not define ({_REFUSED[op]})"
    if not isinstance(op, torch._ops.OpOverload):
        return "a rule for this Python callable"
    tags = set(op.tags)
    schema = op._schema
    tensor_inputs = [a for a in schema.arguments if str(a.type).startswith("Tensor")]
    if torch.Tag.pointwise in tags and len(tensor_inputs) == 1:
        return "an elementwise activation rule (R4: f(0)·O + x·ξ(x))"
    if torch.Tag.pointwise in tags:
        return "an arithmetic rule (R7–R9: sums, constant scaling; products of two LIVE tensors are unsupported)"
    if torch.Tag.view_copy in tags or any(a.alias_info is not None for a in schema.returns):
        return "a structure rule (R10: the same operation applied to the ones channel)"
    if "pool" in schema.name or "upsample" in schema.name or "interp" in schema.name:
        return "a pooling/interpolation rule (R13/R14: the ones pooled and renormalized)"
    if "norm" in schema.name:
        return "a normalization rule (R3/R3': 1/σ detached, β carried by the ones)"
    return "a new rule: a linear form of this operation in its LIVE inputs with the ones channel"


def unsupported(op: OpKey, module_path: str, why: str, rule_kind: str | None = None) -> UnsupportedOpError:
    """Build the error for an operation the linearization cannot handle."""
    kind = rule_kind or needed_rule_kind(op)
    where = f"module '{module_path}'" if module_path else "the model's top-level forward"
    return UnsupportedOpError(
        f"{op_name(op)} in {where}: {why}. It would need {kind}.",
        op=op_name(op),
        module_path=module_path,
        rule_kind=kind,
    )
