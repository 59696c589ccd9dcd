"""Running a linearized program: one forward with the ones channel, one backward.

Shared by the backends, which differ in the shape of the input's ones channel and
in the implementation they pick for each rule (reference math or a fused op).

The held pass gives the values that multipliers are read from (``Rule.held_args``). For a
first-order explanation they are the linearized values detached, read as the forward
reaches them. Explanations differentiable with respect to the parameters
(``parameter_gradient``) bind the parameters without detaching them and keep the
backward's graph. With ``"total"`` the held pass is the model's own forward of the
detached input, run before the linearized one: the multipliers computed from it (and
the gates, which it computes) are constant with respect to the input but follow the
parameters, so the gradient of ``C`` with respect to the parameters is its total
derivative, and the logits are the model's own. With ``"fixed_multipliers"`` the
multipliers stay detached from the parameters too, gates included: attention weights
from query and key projections of their own, or a squeeze-excitation branch, are
computed with the parameters and then detached.

``reuse_held_results``: where the held pass is the model's forward, rules that can
(``Rule.takes_model_result``) take the numbers of the model's result of their operation
from it instead of computing them again (a fused convolution or linear layer, attention's
``A·V``).
"""

from __future__ import annotations

import contextlib
import weakref
from contextvars import ContextVar
from typing import Any, Callable, Iterator, Literal, Mapping, NamedTuple, Protocol

import torch

from ..capture import bound_tensors, functional
from ..errors import UnsupportedOpError
from ..linearize.program import Kind, LinearizedProgram, Step
from ..linearize.registry import Rule, RuleError, arguments, op_name, unsupported
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


def _reader(arg) -> Callable[[Mapping], Any]:
    """A function that reads a node's argument ``arg`` from an env: the value of each node in it
    by name, lists, tuples and dicts rebuilt around them (a fresh dict at every read: rules add
    keywords to theirs), anything else as it is."""
    if isinstance(arg, torch.fx.Node):
        name = arg.name
        return lambda env: env[name]
    if isinstance(arg, dict):
        readers = {key: _reader(value) for key, value in arg.items()}
        return lambda env: {key: read(env) for key, read in readers.items()}
    if isinstance(arg, (list, tuple)) and any(isinstance(a, (torch.fx.Node, list, tuple, dict)) for a in arg):
        readers, kind = [_reader(a) for a in arg], type(arg)
        return lambda env: kind([read(env) for read in readers])
    return lambda env: arg


class _Prepared(NamedTuple):
    """A step with what running it reads, found once per program (see :func:`_prepared`)."""

    step: Step
    name: str
    args: Callable[[Mapping], tuple]  # the node's positional arguments from an env
    kwargs: Callable[[Mapping], dict]
    held: Callable[[Mapping], list] | None  # a LIVE rule's ``held`` keyword (``Rule.held_args``)
    operation: Callable  # the node's operation as the held pass and CONST/GATE steps run it
    released: tuple[str, ...]  # the values no later step reads


def _held_reader(step: Step) -> Callable[[Mapping], list] | None:
    """For a LIVE rule that reads held values: the arguments in schema order (defaults filled in),
    each one at a ``Rule.held_args`` position read from the held values, None elsewhere."""
    if step.kind is not Kind.LIVE or not step.rule.held_args:
        return None
    node = step.node
    bound = arguments(node.target, node.args, node.kwargs)
    readers = [_reader(arg) if index in step.rule.held_args else None for index, arg in enumerate(bound)]
    return lambda held: [read(held) if read is not None else None for read in readers]


# Per program, its steps prepared once: a forward reads arguments through closures instead of
# walking each node's arguments at every call.
_PREPARED: weakref.WeakKeyDictionary[LinearizedProgram, tuple[_Prepared, ...]] = weakref.WeakKeyDictionary()


def _prepared(program: LinearizedProgram) -> tuple[_Prepared, ...]:
    """The program's steps, each with its argument readers and the values released after it."""
    prepared = _PREPARED.get(program)
    if prepared is None:
        prepared = tuple(
            _Prepared(step, step.node.name, _reader(tuple(step.node.args)), _reader(dict(step.node.kwargs)),
                      _held_reader(step), functional(step.node.target), released)
            for step, released in zip(program.steps, program.released_after))
        _PREPARED[program] = prepared
    return prepared


class _Detached:
    """The held values where the held pass is not the model's forward (first-order, fixed
    multipliers): the forward's own values as it computes them, detached. Read like the model
    forward's dict of results, it holds nothing ahead and nothing to release."""

    def __init__(self, env: dict) -> None:
        self.env = env

    def __getitem__(self, name: str):
        return plain(self.env[name])

    def __contains__(self, name: str) -> bool:
        return False

    def pop(self, name: str, default=None) -> None:
        return None


class StepObserver(Protocol):
    """Told of each step a forward runs, and of its output (see :func:`observing_steps`)."""

    def step(self, step: Step) -> None: ...

    def done(self, output: Live) -> None: ...


_OBSERVER: ContextVar[StepObserver | None] = ContextVar("omenn_step_observer", default=None)


@contextlib.contextmanager
def observing_steps(observer: StepObserver) -> Iterator[None]:
    """Forwards run inside call ``observer.step`` before each step and ``observer.done`` with the
    LIVE output (a trace records which graph nodes each step made: :mod:`.regions`)."""
    token = _OBSERVER.set(observer)
    try:
        yield
    finally:
        _OBSERVER.reset(token)


def held_pass(program: LinearizedProgram, env: dict, x: torch.Tensor, reuse_results: bool = False
              ) -> tuple[dict, dict]:
    """The model's own forward of ``x`` detached, every node's result by name; ``env`` binds the
    parameters and buffers (not detached). With ``reuse_results`` also, by name, what each rule
    that takes the model's result gets (``Rule.takes_model_result``): the node's result, or what
    the rule's ``model_form`` returns with it."""
    held, results = dict(env), {}
    held[program.captured.input_name] = x.detach()
    for prepared in _prepared(program):
        args, kwargs = prepared.args(held), prepared.kwargs(held)
        step = prepared.step
        reused = reuse_results and step.kind is Kind.LIVE and step.rule.takes_model_result
        if reused and step.rule.model_form is not None:
            held[prepared.name], results[prepared.name] = step.rule.model_form(*args, **kwargs)
        else:
            held[prepared.name] = prepared.operation(*args, **kwargs)
            if reused:
                results[prepared.name] = held[prepared.name]
    return held, results


def forward(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
            ones: torch.Tensor, implementation: Implementation,
            parameter_gradient: ParameterGradient | None = None,
            reuse_held_results: bool = False) -> tuple[Live, torch.Tensor | None]:
    """Run the linearized program on ``(x, ones)``: the LIVE model output, and the model's own
    output where the held pass is the model's forward (else None).

    ``implementation(rule)`` picks the function that runs each LIVE rule. The held pass and
    ``reuse_held_results`` are explained in the module's docstring.

    Raises:
        UnsupportedOpError: a rule met operands it cannot linearize (e.g. a product of
            two LIVE tensors), naming the op and module path.
    """
    captured = program.captured
    env: dict[str, object] = bound_tensors(captured, model, differentiable=parameter_gradient is not None)
    held, results = held_pass(program, env, x, reuse_held_results) if parameter_gradient == "total" \
        else (_Detached(env), {})
    env[captured.input_name] = Live(x, ones)
    model_output = held[captured.output_name] if isinstance(held, dict) else None
    # The rules a forward runs, so the biases it meets, differ with the parameter gradient.
    ones_key = (tuple(ones.shape), parameter_gradient)
    decided = _ONES_DECIDED.setdefault(program, {})
    observer = _OBSERVER.get()
    with ones_checks(decided.get(ones_key)) as checks:
        for prepared in _prepared(program):
            step, name = prepared.step, prepared.name
            if observer is not None:
                observer.step(step)
            if step.kind is Kind.LIVE:
                env[name] = _run_rule(prepared, implementation(step.rule), env, held, results.pop(name, None))
            else:  # may read only the shape of a LIVE argument
                value = held[name] if name in held else \
                    prepared.operation(*prepared.args(held), **prepared.kwargs(held))
                # fixed multipliers: a gate computed with parameters ignores them
                env[name] = value if step.kind is Kind.CONST else \
                    _as_gate(value, detached=parameter_gradient == "fixed_multipliers")
            for released in prepared.released:
                del env[released]
                held.pop(released, None)
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
    if observer is not None:
        observer.done(output)
    return output, model_output


def _run_rule(prepared: _Prepared, rule: Callable, env: dict, held, model_result):
    """The result of a LIVE step's ``rule``, given its operands (their held values where it reads
    them, and the model's result where the held pass gives it)."""
    step = prepared.step
    args, kwargs = prepared.args(env), prepared.kwargs(env)
    if step.rule.receiving:
        kwargs["receiving"] = step.receiving
    if prepared.held is not None:
        kwargs["held"] = prepared.held(held)
    if model_result is not None:
        kwargs["model_result"] = model_result
    try:
        return rule(step.node.target, *args, **kwargs)
    except RuleError as error:
        raise unsupported(step.node.target, step.module_path, error.why, error.rule_kind) from None


def _model_logits(output: Live, model_output: torch.Tensor | None) -> torch.Tensor:
    """The logits to return: the linearized forward's numbers, with the gradient of the model's own
    output (``"total"``) or none (the linearized value's gradient holds the multipliers fixed, so
    it is never exposed). The numbers stay the linearized forward's (equal up to rounding), so
    that first-order results do not change with ``parameter_gradient``.
    """
    logits = output.value.detach()
    if model_output is None:
        return logits
    return model_output + (logits - model_output).detach()


def share_ones_decisions(program: LinearizedProgram, rows: int, batch: int) -> list[tuple]:
    """Give batches of ``batch`` samples the ones checks that forwards on ``rows`` samples of the
    same shape decided by shapes (:class:`~omenn_kernels.linearize.values.OnesChecks`), where they
    have none; returns the keys added, for :func:`forget_ones_decisions`. Right for a forward that
    explains each sample on its own, whose ones are the same in every sample: what the check that
    follows must show."""
    decided = _ONES_DECIDED.setdefault(program, {})
    added = []
    for (shape, parameter_gradient), fills in list(decided.items()):
        key = ((batch, *shape[1:]), parameter_gradient)
        if shape and shape[0] == rows and key not in decided:
            decided[key] = fills
            added.append(key)
    return added


def forget_ones_decisions(program: LinearizedProgram, keys: list[tuple]) -> None:
    """Drop the ones checks :func:`share_ones_decisions` gave, where its check failed."""
    decided = _ONES_DECIDED.get(program, {})
    for key in keys:
        decided.pop(key, None)


def explain_with(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                 shared_ones: bool, implementation: Implementation,
                 parameter_gradient: ParameterGradient | None = None,
                 reuse_held_results: bool = False) -> BackendExplanation:
    """The explanation of ``readout`` for the batch ``x``.

    The input's ones channel has one entry per element, or with ``shared_ones`` one per
    position (shared along the feature axis, ``program.feature_dim``); ``C_b`` is its
    gradient summed over the feature axis: (B, H, W) for images (B, C, H, W). With T
    read-outs per image (``ŷ`` of shape (B, T)) the forward runs once and the backward
    once per read-out: ``C_w`` is (B, T, C, H, W) and ``C_b`` (B, T, H, W).

    With ``parameter_gradient`` (see the module's docstring) ``C_w`` and ``C_b`` are
    differentiable with respect to the model's parameters; so are ``ŷ`` and ``logits``
    with ``"total"`` (the model's own gradient), while with ``"fixed_multipliers"`` they
    are detached. ``reuse_held_results``: as in :func:`forward`.
    """
    keep_graph = parameter_gradient is not None
    with torch.inference_mode(False), torch.enable_grad():
        inputs = x.detach().clone().requires_grad_(True)
        feature = program.feature_dim
        ones_shape = list(x.shape)
        if shared_ones and feature is not None:
            ones_shape[feature] = 1
        ones = x.new_ones(ones_shape).requires_grad_(True)
        output, model_output = forward(program, model, inputs, ones, implementation, parameter_gradient,
                                       reuse_held_results)
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
        logits = _model_logits(output, model_output)
    return BackendExplanation(weight, bias, readout.value(logits, target), target, logits)


def _per_position(ones_grad: torch.Tensor, feature: int | None) -> torch.Tensor:
    """``C_b``: the ones' gradient summed over the feature axis (kept where there is none)."""
    return ones_grad if feature is None else ones_grad.sum(feature)


def _gradients(readout: torch.Tensor, inputs: torch.Tensor, ones: torch.Tensor,
               retain: bool, create_graph: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.autograd.grad(readout, [inputs, ones], retain_graph=retain, create_graph=create_graph,
                               allow_unused=True, materialize_grads=True)
