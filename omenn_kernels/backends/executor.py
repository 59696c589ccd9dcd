"""Running a linearized program: one forward with the ones channel, one backward.

Shared by the backends, which differ in the shape of the input's ones channel and
in the implementation they pick for each rule (reference math or a fused op).

Explanations differentiable with respect to the parameters (``parameter_gradient``):
the parameters are bound without detaching them and the backward keeps its graph.
With ``"total"`` the forward also runs every LIVE operation on the ``held`` values
(unless its rule computed the held result itself: attention from the weights it holds,
and the fused linear, whose linearized value then takes the held result's numbers), which
is the model's own forward of the detached input: the multipliers computed from
it are constant with respect to the input but follow the parameters, so the gradient
of ``C`` with respect to the parameters is its total derivative. A program whose
multipliers are all piecewise constant (ReLU, max pooling, eval-mode BatchNorm: no gate
and no rule with ``held_multipliers``) skips the held forward: its multipliers do not
change with the parameters, so the total derivative is the one with them held, and the
linearized logits carry the model's own parameter gradient. With
``"fixed_multipliers"`` the multipliers stay detached from the parameters too, gates
included: attention weights from query and key projections of their own, or a
squeeze-excitation branch, are computed with the parameters and then detached.
"""

from __future__ import annotations

import weakref
from typing import Callable, Literal, NamedTuple

import torch

from ..capture import bound_tensors
from ..errors import UnsupportedOpError
from ..linearize.program import Kind, LinearizedProgram
from ..linearize.registry import Rule, RuleError, op_name, unsupported
from ..linearize.values import Gate, Live, contains, ones_checks, plain
from ..readout import Readout

Implementation = Callable[[Rule], Callable]
ParameterGradient = Literal["total", "fixed_multipliers"]
PARAMETER_GRADIENTS: tuple[str, ...] = ("total", "fixed_multipliers")

# Per program and shape of the input's ones (and parameter gradient), what a forward found at each bias
# with the checks decided by shapes alone (values.OnesChecks): later forwards replay it, reading nothing.
_ONES_DECIDED: weakref.WeakKeyDictionary[LinearizedProgram, dict[tuple, tuple[bool, ...]]] = \
    weakref.WeakKeyDictionary()


class BackendExplanation(NamedTuple):
    """A batch's explanation as every backend returns it (the API adds the contribution)."""

    weight: torch.Tensor  # C_w, the input's shape (with T read-outs, T after the batch)
    bias: torch.Tensor  # C_b, summed over the feature axis
    logit: torch.Tensor  # ŷ, the explained read-out of the logits: (B,) or (B, T)
    target: torch.Tensor  # what was explained: (B,) class indices, (B, K) or (B, T, K) read-out weights
    logits: torch.Tensor  # (B, K), all the logits of the same forward


def _as_gate(result, detached: bool):
    if isinstance(result, torch.Tensor):
        return Gate(result.detach() if detached else result)
    if isinstance(result, (list, tuple)):
        return type(result)(_as_gate(r, detached) for r in result)
    return result


def _lookup_env(env: dict, arg):
    if isinstance(arg, torch.fx.Node):
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_lookup_env(env, a) for a in arg)
    if isinstance(arg, dict):
        return {k: _lookup_env(env, v) for k, v in arg.items()}
    return arg


def _has_held(result) -> bool:
    """Whether every Live of a rule's result already has its held value (set by the rule)."""
    if isinstance(result, Live):
        return result.held is not None
    if isinstance(result, (list, tuple)):
        return all(_has_held(part) for part in result)
    return True


def _attach_held(result, held) -> None:
    """Give each Live of a rule's result the matching part of the op's result on held values."""
    if isinstance(result, Live):
        result.held = held
    elif isinstance(result, (list, tuple)):
        for part, held_part in zip(result, held):
            _attach_held(part, held_part)


def forward(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
            ones: torch.Tensor, implementation: Implementation,
            parameter_gradient: ParameterGradient | None = None, held_forward: bool = False) -> Live:
    """Run the linearized program on ``(x, ones)`` and return the LIVE model output.

    ``implementation(rule)`` picks the function that runs each LIVE rule.
    ``parameter_gradient`` (None: everything is detached from the parameters) is
    explained in the module's docstring; ``held_forward`` runs the held forward with
    ``"total"`` also where the multipliers are all piecewise constant.

    Raises:
        UnsupportedOpError: a rule met operands it cannot linearize (e.g. a product of
            two LIVE tensors), naming the op and module path.
    """
    captured = program.captured
    env: dict[str, object] = bound_tensors(captured, model, differentiable=parameter_gradient is not None)
    track_held = parameter_gradient == "total" and (held_forward or program.multipliers_follow_held)
    env[captured.input_name] = Live(x, ones, x.detach() if track_held else None)
    # The rules a forward runs, so the biases it meets, differ with the parameter gradient.
    ones_key = (tuple(ones.shape), parameter_gradient)
    decided = _ONES_DECIDED.setdefault(program, {})
    with ones_checks(decided.get(ones_key)) as checks:
        for step, released in zip(program.steps, program.released_after):
            node = step.node
            args = _lookup_env(env, node.args)
            kwargs = _lookup_env(env, node.kwargs)
            if step.kind is Kind.CONST:  # may read only the shape of a LIVE argument
                env[node.name] = node.target(*plain(args), **plain(kwargs))
            elif step.kind is Kind.GATE:  # fixed multipliers: a gate computed with parameters ignores them
                env[node.name] = _as_gate(node.target(*plain(args), **plain(kwargs)),
                                          detached=parameter_gradient == "fixed_multipliers")
            else:
                rule_kwargs = {**kwargs, "receiving": step.receiving} if step.rule.receiving else kwargs
                try:
                    env[node.name] = implementation(step.rule)(node.target, *args, **rule_kwargs)
                except RuleError as error:
                    raise unsupported(node.target, step.module_path, error.why, error.rule_kind) from None
                if track_held and not _has_held(env[node.name]):
                    _attach_held(env[node.name], node.target(*plain(args), **plain(kwargs)))
            del args, kwargs
            for name in released:
                del env[name]
    if checks.shape_decided:
        decided[ones_key] = tuple(checks.fills)
    output = env[captured.output_name]
    if not isinstance(output, Live):
        producer = next((s for s in program.steps if s.node.name == captured.output_name), None)
        kind = "is held constant (a gate: softmax/sigmoid)" if contains(output, Gate) else \
            "does not depend on the input"
        raise UnsupportedOpError(
            f"the model's output {kind}; explain needs logits that depend linearly on the input "
            "through supported rules",
            op=op_name(producer.node.target) if producer else "",
            module_path=producer.module_path if producer else "", rule_kind="a LIVE output")
    return output


def _model_logits(output: Live, parameter_gradient: ParameterGradient | None) -> torch.Tensor:
    """The logits to return: the linearized forward's numbers, with the model's parameter gradient.

    With ``"total"`` the held forward is the model's own function of the parameters; without
    one (all multipliers piecewise constant) the linearized value is, since holding the
    multipliers fixed changes nothing there. Otherwise the linearized value's gradient holds
    the multipliers fixed, so it is never exposed. The numbers stay the linearized
    forward's (equal up to rounding), so that first-order results do not change with
    ``parameter_gradient``.
    """
    logits = output.value.detach()
    if parameter_gradient != "total":
        return logits
    if output.held is None:
        return output.value
    return output.held + (logits - output.held).detach()


def explain_with(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                 shared_ones: bool, implementation: Implementation,
                 parameter_gradient: ParameterGradient | None = None,
                 held_forward: bool = False) -> BackendExplanation:
    """The explanation of ``readout`` for the batch ``x``.

    The input's ones channel has one entry per element, or with ``shared_ones`` one per
    position (shared along the feature axis, ``program.feature_dim``); ``C_b`` is its
    gradient summed over the feature axis: (B, H, W) for images (B, C, H, W). With T
    read-outs per image (``ŷ`` of shape (B, T)) the forward runs once and the backward
    once per read-out: ``C_w`` is (B, T, C, H, W) and ``C_b`` (B, T, H, W).

    With ``parameter_gradient`` (see the module's docstring) ``C_w`` and ``C_b`` are
    differentiable with respect to the model's parameters; so are ``ŷ`` and ``logits``
    with ``"total"`` (the model's own gradient), while with ``"fixed_multipliers"`` they
    are detached. ``held_forward``: as in :func:`forward`.
    """
    keep_graph = parameter_gradient is not None
    with torch.inference_mode(False), torch.enable_grad():
        inputs = x.detach().clone().requires_grad_(True)
        feature = program.feature_dim
        ones_shape = list(x.shape)
        if shared_ones and feature is not None:
            ones_shape[feature] = 1
        ones = x.new_ones(ones_shape).requires_grad_(True)
        output = forward(program, model, inputs, ones, implementation, parameter_gradient, held_forward)
        target = readout.chosen(output.value)
        # The linearized ŷ, differentiated for C_w and C_b; the returned ŷ has the logits' parameter gradient.
        linear_readout = readout.value(output.value, target)
        if linear_readout.dim() == 1:
            weight, ones_grad = _gradients(linear_readout.sum(), inputs, ones, keep_graph, keep_graph)
            bias = _per_position(ones_grad, feature)
        else:
            count = linear_readout.shape[1]
            per_readout = [_gradients(linear_readout[:, t].sum(), inputs, ones,
                                      keep_graph or t + 1 < count, keep_graph)
                           for t in range(count)]
            weight = torch.stack([w for w, _ in per_readout], 1)
            bias = torch.stack([_per_position(o, feature) for _, o in per_readout], 1)
        logits = _model_logits(output, parameter_gradient)
    return BackendExplanation(weight, bias, readout.value(logits, target), target, logits)


def _per_position(ones_grad: torch.Tensor, feature: int | None) -> torch.Tensor:
    """``C_b``: the ones' gradient summed over the feature axis (kept where there is none)."""
    return ones_grad if feature is None else ones_grad.sum(feature)


def _gradients(readout: torch.Tensor, inputs: torch.Tensor, ones: torch.Tensor,
               retain: bool, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.autograd.grad(readout, [inputs, ones], retain_graph=retain, create_graph=create_graph,
                               allow_unused=True, materialize_grads=True)
