"""The compiled backend: each explanation traced once per signature into one aten graph, then compiled.

The first call for a signature (the input's shape, dtype and device, and the kind and
shape of the target) runs the fused backend eagerly, which also settles the
ones checks for the input's shape (:class:`~omenn_kernels.linearize.values.OnesChecks`),
so that nothing is read back to the host afterwards. It then traces the whole
explanation — the linearized forward, the read-out and the backward to the input and
the ones, every read-out of ``explain_targets`` included — with ``make_fx`` into one aten
graph, and compiles that graph (Inductor; CUDA graphs on CUDA). Later calls with the
same signature run the compiled graph only: no Python per node, no rule dispatch. A
program that serves several batch sizes (:func:`~omenn_kernels.capture.capture`) is
traced and compiled once per batch size, without capturing or linearizing again.

The model's parameters enter the graph as the tensors themselves, so in-place updates
(optimizer steps, ``load_state_dict``) are seen; a re-bound parameter is a structural
change, on which the :class:`~omenn_kernels.api.Explainer` captures and compiles anew.

Read-outs given as a :class:`~omenn_kernels.readout.ReadoutFunction` are traced into the
graph, with their tensor arguments as graph inputs. Run on the fused backend instead:
explanations with ``create_graph`` (the training path), read-outs given as any other
function of the logits (what such a function reads besides the logits would be baked
into the graph), and any signature whose trace or compilation failed (one warning naming
the cause; the explanation is the fused backend's).
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture import CAPTURE_LOCK
from ..linearize.program import LinearizedProgram
from ..readout import ReadoutFunction
from . import fused
from .executor import ParameterGradient

log = logging.getLogger("omenn_kernels.compiled")

Compiler = Callable[[torch.fx.GraphModule, list[torch.Tensor]], Callable]


def inductor(graph: torch.fx.GraphModule, example: list[torch.Tensor]) -> Callable:
    """``graph`` compiled by Inductor as one graph; under CUDA graphs where the inputs are on CUDA.

    The graph is already one aten graph, so it goes to Inductor directly (no Dynamo: no
    guards to check per call). Compiled without autograd: the graph holds the backward.
    """
    from torch._inductor.compile_fx import compile_fx  # imported on first use: it loads all of Inductor

    cuda = any(t.is_cuda for t in example)
    with torch.no_grad():
        return compile_fx(graph, example, config_patches={"triton.cudagraphs": cuda})


@dataclass(frozen=True)
class CompiledExplanation:
    """One signature's explanation, kept in ``LinearizedProgram.compiled``: the traced aten graph
    (``print(c.graph.code)`` shows every op) and the compiled callable that runs it."""

    graph: torch.fx.GraphModule
    run: Callable
    seconds: float  # tracing and compiling


# What compiles a traced explanation; tests may swap in a cheaper one (the traced graph itself).
COMPILER: Compiler = inductor
# Compiled explanations kept per program (per input signature), the least recently used dropped first.
MAX_COMPILED = 8


def _signature(x: torch.Tensor, target) -> tuple:
    """What a compiled explanation is specialized on: the input's shape (a program may serve
    several batch sizes), the target's kind and shape (a read-out function: the function object
    and its arguments' shapes), and autocast (the trace records its casts)."""
    device = x.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    if target is None:
        return ("predicted", tuple(x.shape), autocast)
    if isinstance(target, ReadoutFunction):
        return ("function", tuple(x.shape), target.function,
                tuple((tuple(a.shape), a.dtype, a.device) for a in target.arguments), autocast)
    kind = "indices" if not target.is_floating_point() else "weights"
    return (kind, tuple(x.shape), tuple(target.shape), target.dtype, target.device, autocast)


def _graph_inputs(x: torch.Tensor, target) -> list[torch.Tensor]:
    """The compiled graph's inputs: the images, then the target's tensors."""
    if target is None:
        return [x]
    if isinstance(target, ReadoutFunction):
        return [x, *target.arguments]
    return [x, target]


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
                  target, parameter_gradient: ParameterGradient | None = None) -> tuple[torch.Tensor, ...]:
    """``(C_w, C_b, ŷ, target, logits)`` from the compiled graph of this signature (see the module docstring)."""
    if parameter_gradient is not None or (callable(target) and not isinstance(target, ReadoutFunction)):
        return fused.explain_batch(program, model, x, target, parameter_gradient)
    key = _signature(x, target)
    compiled = program.compiled.pop(key, None)
    if compiled is None:  # the first call of this signature: eager, then traced and compiled
        result = fused.explain_batch(program, model, x, target)
        with CAPTURE_LOCK:  # make_fx, like torch.export, holds process-wide dispatch modes while it traces
            _keep(program, key, _compiled(program, model, x, target, result))
        return result
    _keep(program, key, compiled)
    if compiled is _FAILED:
        return fused.explain_batch(program, model, x, target)
    # The graph calls the fused rules' custom ops: not while another thread exports (CAPTURE_LOCK).
    with torch.no_grad(), CAPTURE_LOCK:  # the graph holds the backward already; its parameters need none
        return compiled.run(*_graph_inputs(x, target))


def _keep(program: LinearizedProgram, key: tuple, compiled: CompiledExplanation | object) -> None:
    """Keep ``compiled`` as the most recently used of the program's at most ``MAX_COMPILED``."""
    program.compiled[key] = compiled
    while len(program.compiled) > MAX_COMPILED:
        program.compiled.pop(next(iter(program.compiled)))


_FAILED = object()  # a signature whose trace or compilation failed: it runs on the fused backend


def _compiled(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, target,
              expected: tuple[torch.Tensor, ...]) -> CompiledExplanation | object:
    """The traced and compiled explanation of ``target``'s signature, checked against ``expected``.

    Returns ``_FAILED`` (after one warning naming the cause) where tracing or compiling fails
    or the compiled graph does not reproduce the fused backend's explanation.
    """
    def explanation(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if isinstance(target, ReadoutFunction):
            traced_target = ReadoutFunction(target.function, tuple(inputs[1:]))
        else:
            traced_target = inputs[1] if len(inputs) > 1 else None
        weight, bias, explained, chosen, logits = fused.explain_batch(program, model, inputs[0], traced_target)
        return weight.detach(), bias.detach(), explained.detach(), chosen, logits.detach()

    example = _graph_inputs(x, target)
    start = time.perf_counter()
    try:
        graph = make_fx(explanation)(*example)
        compiled = COMPILER(graph, example)
        with torch.no_grad():
            result = compiled(*example)
    except Exception as error:  # any failure of the toolchain falls back, never a wrong map
        warnings.warn(f"omenn_kernels: the compiled backend could not compile the explanation of "
                      f"{type(model).__name__} on an input of shape {tuple(x.shape)} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); this signature runs on the "
                      "fused backend", RuntimeWarning, stacklevel=5)
        return _FAILED
    tolerance = 1e-5 if x.dtype in (torch.float32, torch.float64) else 1e-2
    for name, got, want in zip(("weight", "bias", "logit"), result, expected):
        scale = want.abs().max().clamp_min(1e-12)
        if not bool(((got - want).abs().max() <= tolerance * scale)):
            warnings.warn(f"omenn_kernels: the compiled explanation of {type(model).__name__} differs from the "
                          f"fused backend's in its {name} by more than {tolerance:g} relative; this signature "
                          "runs on the fused backend", RuntimeWarning, stacklevel=5)
            return _FAILED
    seconds = time.perf_counter() - start
    log.info("compiled the explanation of %s for input %s %s and target %s in %.1f s (%d aten nodes)",
             type(model).__name__, tuple(x.shape), x.dtype, _signature(x, target)[0], seconds,
             sum(node.op == "call_function" for node in graph.graph.nodes))
    return CompiledExplanation(graph, compiled, seconds)
