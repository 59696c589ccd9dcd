"""Graph capture: the model's forward as an aten graph, via ``torch.export``.

The model is captured in eval semantics (BatchNorm running statistics, no dropout)
without changing it: every module's ``training`` flag is restored afterwards.
Parameters and buffers are not copied; the captured program reads them from the
model by name at every call, so an optimizer step or ``load_state_dict`` is seen.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind

from .errors import CaptureError


@dataclass
class CapturedModel:
    """A captured forward: the functional aten graph and how to bind its inputs."""

    program: ExportedProgram
    graph: torch.fx.Graph
    input_name: str
    bindings: dict[str, tuple[InputKind, str]]  # placeholder name -> (kind, FQN / constant name)
    output_name: str


@contextlib.contextmanager
def eval_semantics(model: torch.nn.Module) -> Iterator[None]:
    """Put every submodule in eval mode for the duration, then restore each flag."""
    flags = [(module, module.training) for module in model.modules()]
    try:
        model.eval()
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def capture(model: torch.nn.Module, example: torch.Tensor) -> CapturedModel:
    """Capture ``model(example)`` with ``torch.export`` (non-strict) in eval semantics.

    Raises:
        CaptureError: the forward cannot be exported, takes other inputs, or does not
            return a single tensor.
    """
    try:
        with eval_semantics(model):
            program = torch.export.export(model, (example,), strict=False)
        program = program.run_decompositions({})  # functional ops, eval-mode norms
    except Exception as error:  # export raises many unrelated types; report them as one
        raise CaptureError(
            f"torch.export could not capture {type(model).__name__}.forward on an input of shape "
            f"{tuple(example.shape)} ({type(error).__name__}: {error}). OMENN needs a forward that "
            "torch.export can trace: one tensor in, one tensor out, no data-dependent Python "
            "control flow on tensor values."
        ) from error

    signature = program.graph_signature
    user_inputs = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    mutations = [s for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if len(user_inputs) != 1:
        raise CaptureError(f"the captured forward takes {len(user_inputs)} tensor inputs; "
                           "explain needs exactly one (the image batch)")
    if len(outputs) != 1 or mutations:
        raise CaptureError(
            f"the captured forward returns {len(outputs)} outputs and mutates {len(mutations)} "
            "buffers; explain needs exactly one output tensor (the logits) and no state changes")
    if not hasattr(outputs[0].arg, "name"):
        raise CaptureError("the model's output is not a tensor computed by its forward")
    bindings = {
        spec.arg.name: (spec.kind, spec.target)
        for spec in signature.input_specs
        if spec.kind != InputKind.USER_INPUT
    }
    return CapturedModel(program, program.graph, user_inputs[0].arg.name, bindings, outputs[0].arg.name)


def bound_tensors(captured: CapturedModel, model: torch.nn.Module,
                  differentiable: bool = False) -> dict[str, object]:
    """The current parameters, buffers and constants of ``model`` for the graph's placeholders.

    Detached, unless ``differentiable``: then what is computed from them can be
    differentiated with respect to the model's parameters.
    """
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    values: dict[str, object] = {}
    for name, (kind, target) in captured.bindings.items():
        if kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if target not in named:
                raise CaptureError(f"the model no longer has the parameter or buffer '{target}' "
                                   "it was captured with; create a new Explainer")
            values[name] = named[target] if differentiable else named[target].detach()
        else:
            values[name] = captured.program.constants[target]
    return values


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost submodule whose forward produced ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path.replace("L['self'].", "").replace("L['self']", "")
