"""Running a linearized program: one forward with the ones channel, one backward.

Shared by the backends, which differ in the shape of the input's ones channel and
in the implementation they pick for each rule (reference math or a fused op).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..capture import bound_tensors
from ..errors import UnsupportedOpError
from ..linearize.program import Kind, LinearizedProgram
from ..linearize.registry import Rule, RuleError, op_name, unsupported
from ..linearize.values import Gate, Live, contains, plain

Implementation = Callable[[Rule], Callable]


def _as_gate(result):
    if isinstance(result, torch.Tensor):
        return Gate(result)
    if isinstance(result, (list, tuple)):
        return type(result)(_as_gate(r) for r in result)
    return result


def _lookup_env(env: dict, arg):
    if isinstance(arg, torch.fx.Node):
        return env[arg.name]
    if isinstance(arg, (list, tuple)):
        return type(arg)(_lookup_env(env, a) for a in arg)
    if isinstance(arg, dict):
        return {k: _lookup_env(env, v) for k, v in arg.items()}
    return arg


def forward(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
            ones: torch.Tensor, implementation: Implementation) -> Live:
    """Run the linearized program on ``(x, ones)`` and return the LIVE model output.

    ``implementation(rule)`` picks the function that runs each LIVE rule.

    Raises:
        UnsupportedOpError: a rule met operands it cannot linearize (e.g. a product of
            two LIVE tensors), naming the op and module path.
    """
    captured = program.captured
    env: dict[str, object] = bound_tensors(captured, model)
    env[captured.input_name] = Live(x, ones)
    for step in program.steps:
        node = step.node
        args = _lookup_env(env, node.args)
        kwargs = _lookup_env(env, node.kwargs)
        if step.kind is Kind.CONST:  # may read only the shape of a LIVE argument
            env[node.name] = node.target(*plain(args), **plain(kwargs))
        elif step.kind is Kind.GATE:
            env[node.name] = _as_gate(node.target(*plain(args), **plain(kwargs)))
        else:
            try:
                env[node.name] = implementation(step.rule)(node.target, *args, **kwargs)
            except RuleError as error:
                raise unsupported(node.target, step.module_path, error.why, error.rule_kind) from None
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


def read_out(logits: torch.Tensor, target: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The explained read-out ``ŷ`` (B,) of ``logits`` and the target it used.

    ``target``: (B,) class indices, (B, K) read-out weights, or None for the predicted class.
    """
    if target is None:
        target = logits.detach().argmax(-1)
    if target.is_floating_point():
        return (logits * target.to(logits.dtype)).sum(-1), target
    return logits.gather(1, target.unsqueeze(1)).squeeze(1), target


def explain_with(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
                 target: torch.Tensor | None, ones_channels: int,
                 implementation: Implementation) -> tuple[torch.Tensor, ...]:
    """``(C_w, C_b, ŷ, target)`` for the read-out ``ŷ`` of ``target`` (see :func:`read_out`).

    The input's ones channel has ``ones_channels`` channels: C (one per element) or 1
    (one per pixel); ``C_b`` is its gradient summed over them.
    """
    with torch.inference_mode(False), torch.enable_grad():
        inputs = x.detach().clone().requires_grad_(True)
        ones = x.new_ones(x.shape[0], ones_channels, *x.shape[2:]).requires_grad_(True)
        logits = forward(program, model, inputs, ones, implementation)
        explained, target = read_out(logits.value, target)
        weight, ones_grad = torch.autograd.grad(explained.sum(), [inputs, ones], allow_unused=True,
                                                materialize_grads=True)
    return weight, ones_grad.sum(1), explained.detach(), target
