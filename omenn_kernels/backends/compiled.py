"""The compiled backend: each explanation traced once per signature into one aten graph, then compiled.

The first call for a signature (the input's shape, dtype and device, and the kind and
shape of the target) runs the fused backend eagerly, which also settles the
ones checks for the input's shape (:class:`~omenn_kernels.linearize.values.OnesChecks`),
so that nothing is read back to the host afterwards. It then traces the whole
explanation — the linearized forward, the read-out and the backward to the input and
the ones, every read-out of ``explain_targets`` included — with ``make_fx`` into one aten
graph, has each folded convolution's input gradient read the unfolded kernel
(:func:`~omenn_kernels.folding.scale_gradients_not_kernels`), folds its shape-only part
(the ones channel's forward) into constants (:mod:`~omenn_kernels.backends.shape_only`),
and compiles that graph (Inductor; CUDA graphs on CUDA). Most fused ops are traced as
their aten math, so that Inductor fuses them with their neighbours
(:func:`~omenn_kernels.ops.traced_as_aten`). Later calls with the same signature run
the compiled graph only: no Python per node, no rule dispatch. A program that serves
several batch sizes (:func:`~omenn_kernels.capture.capture`) is traced and compiled once
per batch size, without capturing or linearizing again.

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
from ..folding import scale_gradients_not_kernels
from ..linearize.program import LinearizedProgram
from ..ops import traced_as_aten
from ..readout import ReadoutFunction
from ..testing import relative_distance
from . import fused
from .executor import ParameterGradient
from .shape_only import fold_shape_only

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
        # On the CPU, Inductor's channels-last layout for convolutions copies every kernel and
        # activation it converts, at a cost in time and memory; it keeps the layout it is given.
        return compile_fx(graph, example, config_patches={"triton.cudagraphs": cuda, "layout_optimization": cuda})


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


def _compilable(target, parameter_gradient: ParameterGradient | None) -> bool:
    """Whether explanations of ``target`` are compiled (else they run on the fused backend)."""
    return parameter_gradient is None and (not callable(target) or isinstance(target, ReadoutFunction))


def replays(program: LinearizedProgram, x: torch.Tensor, target,
            parameter_gradient: ParameterGradient | None = None) -> bool:
    """Whether :func:`explain_batch` of these arguments only runs a graph compiled earlier."""
    if not _compilable(target, parameter_gradient):
        return False
    compiled = program.compiled.get(_signature(x, target))
    return compiled is not None and compiled is not _FAILED


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor,
                  target, parameter_gradient: ParameterGradient | None = None) -> tuple[torch.Tensor, ...]:
    """``(C_w, C_b, ŷ, target, logits)`` from the compiled graph of this signature (see the module docstring)."""
    if not _compilable(target, parameter_gradient):
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
        outputs = compiled.run(*_graph_inputs(x, target))
    # Under CUDA graphs every run writes its outputs into the same buffers: copies outlive the next run.
    return tuple(output.clone() for output in outputs) if x.is_cuda else outputs


def _keep(program: LinearizedProgram, key: tuple, compiled: CompiledExplanation | object) -> None:
    """Keep ``compiled`` as the most recently used of the program's at most ``MAX_COMPILED``."""
    program.compiled[key] = compiled
    while len(program.compiled) > MAX_COMPILED:
        program.compiled.pop(next(iter(program.compiled)))


_FAILED = object()  # a signature whose trace or compilation failed: it runs on the fused backend


def _compiled(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, target,
              expected: tuple[torch.Tensor, ...]) -> CompiledExplanation | object:
    """The traced and compiled explanation of ``target``'s signature, checked against ``expected``.

    Two checks against the fused backend's explanation of the same input: the traced graph,
    run as it is, must reproduce it to rounding (where it calls the same ops in the same
    order; where ops were traced as their aten math, :func:`~omenn_kernels.ops.traced_as_aten`,
    as the compiled graph must); the compiled graph, whose fused kernels round differently,
    must too in float32 and float64, and in half precision must give the same logits and a
    complete explanation (see :func:`_mismatch`). Returns ``_FAILED`` (after one warning
    naming the cause) where tracing or compiling fails or a check does not hold.
    """
    def explanation(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if isinstance(target, ReadoutFunction):
            traced_target = ReadoutFunction(target.function, tuple(inputs[1:]))
        else:
            traced_target = inputs[1] if len(inputs) > 1 else None
        weight, bias, explained, chosen, logits = fused.explain_batch(program, model, inputs[0], traced_target)
        return weight.detach(), bias.detach(), explained.detach(), chosen, logits.detach()

    example = _graph_inputs(x, target)
    decompositions = traced_as_aten(x.device)
    start = time.perf_counter()
    try:
        graph = make_fx(explanation, decomposition_table=decompositions)(*example)
        scale_gradients_not_kernels(graph.graph)
        folded = fold_shape_only(graph, example)
        with torch.no_grad():
            replayed = graph(*example)
        compiled = COMPILER(graph, example)
        with torch.no_grad():
            result = compiled(*example)
    except Exception as error:  # any failure of the toolchain falls back, never a wrong map
        warnings.warn(f"omenn_kernels: the compiled backend could not compile the explanation of "
                      f"{type(model).__name__} on an input of shape {tuple(x.shape)} ({type(error).__name__}: "
                      f"{str(error).splitlines()[0] if str(error) else ''}); this signature runs on the "
                      "fused backend", RuntimeWarning, stacklevel=5)
        return _FAILED
    mismatch = _mismatch(replayed, expected, x, "traced", exact_order=not decompositions) or \
        _mismatch(result, expected, x, "compiled", exact_order=False)
    if mismatch:
        warnings.warn(f"omenn_kernels: the {mismatch.format(type(model).__name__)}; this signature runs on the "
                      "fused backend", RuntimeWarning, stacklevel=5)
        return _FAILED
    seconds = time.perf_counter() - start
    log.info("compiled the explanation of %s for input %s %s and target %s in %.1f s (%d aten nodes, "
             "%d shape-only values folded)", type(model).__name__, tuple(x.shape), x.dtype,
             _signature(x, target)[0], seconds, sum(node.op == "call_function" for node in graph.graph.nodes),
             folded)
    return CompiledExplanation(graph, compiled, seconds)


# Relative (Frobenius) bounds on the difference from the fused backend's explanation.
_ORDERED_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}  # the same ops in the same order
_REORDERED_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}  # fused kernels: other rounding
_HALF_LOGITS, _HALF_COMPLETENESS = 5e-2, 2e-2


def _mismatch(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], x: torch.Tensor, stage: str,
              exact_order: bool) -> str | None:
    """Why ``got`` (weight, bias, logit, target, logits) is not the fused backend's ``want``, or None.

    In half precision the weight and bias of two correct explanations that round
    differently can differ by tens of percent (a rounding flips a gate, and the backward
    carries the change), so the compiled graph is held there to what does not depend on
    rounding order: the logits (forward values), and completeness, ``Σ C_w·x + Σ C_b = ŷ``
    per read-out, to 2 % of the three terms' magnitudes plus four times the fused
    backend's own completeness error. The returned message has ``{}`` for the model's name.
    """
    half = x.dtype not in _ORDERED_TOLERANCE
    if half and not exact_order:
        if relative_distance(got[4], want[4]) > _HALF_LOGITS:
            return f"{stage} explanation of {{}} gives logits that differ from the fused backend's by more " \
                   f"than {_HALF_LOGITS:g} relative"
        error, scale = _completeness(got, x)
        if bool((error > _HALF_COMPLETENESS * scale + 4 * _completeness(want, x)[0]).any()):
            return f"{stage} explanation of {{}} is not complete (Σ C differs from the logit by more than " \
                   f"{_HALF_COMPLETENESS:g} of |Σ C_w·x| + |Σ C_b| + |logit|, four times the fused backend's error " \
                   "added)"
        return None
    tolerance = 1e-2 if half else (_ORDERED_TOLERANCE if exact_order else _REORDERED_TOLERANCE)[x.dtype]
    for name, index in (("weight", 0), ("bias", 1), ("logit", 2)):
        if relative_distance(got[index], want[index]) > tolerance:
            return f"{stage} explanation of {{}} differs from the fused backend's in its {name} by more than " \
                   f"{tolerance:g} relative"
    return None


def _completeness(explanation: tuple[torch.Tensor, ...], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|Σ C_w·x + Σ C_b − ŷ|`` and ``|Σ C_w·x| + |Σ C_b| + |ŷ|`` per read-out, in float64."""
    weight, bias, explained = (t.double() for t in explanation[:3])
    inputs = x.double().unsqueeze(1) if weight.dim() > x.dim() else x.double()  # T read-outs
    weighted = (weight * inputs).flatten(explained.dim()).sum(-1)
    biased = bias.flatten(explained.dim()).sum(-1)
    return (weighted + biased - explained).abs(), weighted.abs() + biased.abs() + explained.abs()
