"""The compiled backend: each explanation traced once per signature into one aten graph, then compiled.

The first call for a signature (the input's shape, layout, dtype and device, and the kind and
shape of the target) runs the fused backend eagerly, which also settles the
ones checks for the input's shape (:class:`~omenn_kernels.linearize.values.OnesChecks`),
so that nothing is read back to the host afterwards. It then traces the whole
explanation — the linearized forward, the read-out and the backward to the input and
the ones, every read-out of ``explain_targets`` included — with ``make_fx`` into one aten
graph, folds its shape-only part (the ones channel's forward) into constants
(:mod:`~omenn_kernels.backends.shape_only`), takes its parameter-only part (BatchNorms
folded into kernels) out into constants computed again whenever a parameter they come
from changes (:mod:`~omenn_kernels.backends.parameter_only`), has each folded convolution
whose kernel the graph still computes (from trained parameters) read the unfolded kernel in
its input gradient (:func:`~omenn_kernels.folding.scale_gradients_not_kernels`),
runs a float32 CPU graph's convolutions of constant kernels on oneDNN with the kernels
reordered once (:mod:`~omenn_kernels.backends.packed_weights`), writes its views as
reshapes, whose inputs Inductor may lay out otherwise
(:mod:`~omenn_kernels.backends.views_as_reshapes`), and compiles that graph
(Inductor; on the CPU without AOTAutograd, :mod:`~omenn_kernels.backends.direct_inductor`;
CUDA graphs on CUDA; on the CPU a C++ wrapper around the kernels of a graph of few
FLOPs, see :func:`inductor`; on the CPU, the Python wrapper around a graph whose repeated
blocks, a transformer's layers or a stage's bottlenecks, each call one shared subgraph that
Inductor generates once, :mod:`~omenn_kernels.backends.regions`, whose kernels' vector strides
skip a simplification, :mod:`~omenn_kernels.backends.vector_strides`, and whose kernels are built as
one C++ source per compile thread, :mod:`~omenn_kernels.backends.one_build`). Most fused ops are
traced as their aten math, so that Inductor fuses them with their neighbours
(:func:`~omenn_kernels.ops.traced_as_aten`).
Later calls with the same signature run the compiled graph only: no Python per node, no
rule dispatch. Every call of a signature, the first included, returns the compiled graph's
numbers (the first one's come from its check run), so results do not depend on which call
compiled: a resumed bulk run equals an uninterrupted one.

A first-order CPU signature's graph, once it passes its checks, is saved beside Inductor's
cache (:mod:`~omenn_kernels.backends.saved_graphs`), and the graph compiled is that saved
one read back. A later process's first call of the same signature of the same model loads
it instead of running the eager call, the trace, the passes and the checks against the
fused backend; it binds the model's own parameters, checks that the graph gives the
model's logits and a complete explanation, and compiles it from Inductor's cache.

A program that serves several batch sizes (:func:`~omenn_kernels.capture.capture`) is
traced and compiled once, at the size of the first batch of a signature: the signature
holds no batch size. A batch of another size runs that graph in chunks of its size, the
last chunk filled up with copies of its last sample, whose rows are dropped: samples are
independent in the eval-mode forward. The first batch of each new size is also checked
against the fused backend (as at compile time, :func:`check_rows`); a size whose chunked
explanation does not pass (a forward that mixes samples) runs on the fused backend, with
one warning. A batch's numbers depend on its samples and on the size the graph was traced
at, so they do not change between calls; the same batch explained after a first batch of
another size (a new process, say) can differ by rounding.

The model's parameters enter the graph as the tensors themselves, so in-place updates
(optimizer steps, ``load_state_dict``, writes through ``.data``) are seen, and the
constants computed from them (folded and reordered kernels) are refreshed before a run that
follows a change of their values (:mod:`~omenn_kernels.backends.watched`); a re-bound
parameter is a structural change, on which the :class:`~omenn_kernels.api.Explainer`
captures and compiles anew.

Explanations differentiable with respect to the parameters (``create_graph``, the
training path) are traced the same way, the backward to the input and the ones with its
graph kept: the traced graph computes ``C_w(θ)``, ``C_b(θ)`` with the parameters that
require a gradient as graph inputs, and the compiler differentiates that graph again
(Inductor through AOTAutograd: one compiled forward and one compiled backward per
signature), so that a loss of the explanation sends its gradient to the parameters.
The logits' parameter gradient comes from the model's own forward, the held pass of a
total parameter gradient (:mod:`~omenn_kernels.backends.executor`).
The signature then also holds the parameter gradient's kind and which parameters
require a gradient. Its check at compile time also compares the parameter gradient of
a random projection of the explanation with the fused backend's.

Read-outs given as a :class:`~omenn_kernels.readout.ReadoutFunction` are traced into the graph
(see there). Other functions of the logits, and any signature whose trace or compilation failed
(one warning naming the cause), run on the fused backend.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import operator
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import make_fx

from ..capture import CAPTURE_LOCK, bound_tensors
from ..errors import first_line
from ..folding import scale_gradients_not_kernels
from ..gc_paused import gc_paused
from ..linearize.program import LinearizedProgram
from ..linearize.values import channels_last as is_channels_last, traced_forwards
from ..ops import traced_as_aten
from ..readout import Readout
from . import direct_inductor, fused, inductor_start, regions, saved_graphs
from .executor import (BackendExplanation, ParameterGradient, forget_ones_decisions, held_pass, observing_steps,
                       share_ones_decisions)
from .layout import in_layout_of, runs_channels_last
from .no_op_restrides import drop_no_op_restrides
from .one_build import building_as_one
from .parameter_only import ParameterDerived, hoist_parameter_only
from .packed_weights import (OneDNNConvolutions, constant_kernels, forget_reordered_kernel,
                             forget_reordered_kernels, pack_constant_convolutions, packing_available)
from .shape_only import fold_shape_only
from .strided_writes import scatter_strided_writes
from .vector_strides import affine_strides
from .views_as_reshapes import views_as_reshapes
from .watched import Watch

log = logging.getLogger("omenn_kernels.compiled")


Compiler = Callable[[torch.fx.GraphModule, list[torch.Tensor]], Callable]


# A first-order CPU graph whose matrix products and convolutions take at most this many FLOPs
# per thread runs for milliseconds, where the Python wrapper Inductor generates around its
# kernels (a few microseconds per kernel and extern call) is a visible share of each call:
# it gets a C++ wrapper instead, whose own compilation adds seconds to a minute once per
# signature. Larger graphs keep the Python wrapper, whose cost is then negligible.
CPP_WRAPPER_FLOPS_PER_THREAD = 1e9


def matrix_flops(graph: torch.fx.GraphModule, ops: set | None = None) -> int:
    """The FLOPs of ``graph``'s matrix products and convolutions (of the ops in ``ops`` alone,
    given as overload packets), from its traced shapes (``torch.utils.flop_counter``'s formulas;
    the fused ops register theirs)."""
    from torch.utils.flop_counter import flop_registry

    def value(arg):
        if isinstance(arg, torch.fx.Node):
            return operator.attrgetter(arg.target)(graph) if arg.op == "get_attr" else arg.meta["val"]
        return arg

    total = 0
    for node in graph.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        formula = flop_registry.get(packet)
        if node.op == "call_function" and formula is not None and (ops is None or packet in ops):
            args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), value)
            total += formula(*args, **kwargs, out_val=node.meta["val"])
    return total


def inductor(graph: torch.fx.GraphModule, example: list[torch.Tensor]) -> Callable:
    """``graph`` compiled by Inductor as one graph; under CUDA graphs where the inputs are on CUDA,
    with a C++ wrapper where a first-order graph on the CPU is small (``CPP_WRAPPER_FLOPS_PER_THREAD``;
    where that fails, with the Python wrapper, logged at INFO); on the CPU, the kernels' vector
    strides of affine indices are taken without simplifying the index (:mod:`.vector_strides`) and
    the Python wrapper's kernels are built as one C++ source per compile thread (:mod:`.one_build`), once Inductor's
    probe of the vector instruction sets and its cache keys' hashes of torch's sources, started before
    the capture, have finished (:mod:`.inductor_start`).

    The graph is already one aten graph, so it goes to Inductor directly (no Dynamo: no
    guards to check per call). A first-order explanation is compiled without autograd:
    the graph holds the backward; on the CPU, a functional one goes to Inductor's graph compiler
    without AOTAutograd's traces (:mod:`.direct_inductor`). Where example inputs require a gradient (the parameters
    of a differentiable explanation), Inductor differentiates the graph through
    AOTAutograd; without CUDA graphs there, whose output buffers the next call overwrites
    while a training step's autograd graph still holds them.
    """
    from torch._inductor import config as inductor_config  # imported on first use: it loads all of Inductor
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    cuda = any(t.is_cuda for t in example)
    differentiable = any(t.requires_grad for t in example)
    inductor_start.wait()
    cpp_wrapper = False
    if not cuda and not differentiable:
        flops = graph.meta["matrix_flops"] if "matrix_flops" in graph.meta else matrix_flops(graph)
        cpp_wrapper = flops <= CPP_WRAPPER_FLOPS_PER_THREAD * torch.get_num_threads()
        log.debug("compiling a graph of %.3g GFLOP with a %s wrapper", flops / 1e9, "C++" if cpp_wrapper else "Python")

    def compile_with(graph: torch.fx.GraphModule, cpp_wrapper: bool) -> Callable:
        # A first-order graph gets a fake mode with a shape environment (of static shapes: the
        # graph is specialized on its input's), without which Inductor bypasses its on-disk graph
        # cache and every process generates the graph's code again. Not a differentiable one:
        # AOTAutograd would then donate the saved buffers to the backward, which the check of
        # its parameter gradient runs twice.
        fake_mode = None if differentiable else \
            FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True, allow_non_fake_inputs=True)
        with torch.set_grad_enabled(differentiable), \
                tracing(TracingContext(fake_mode)) if fake_mode is not None else contextlib.nullcontext():
            # On the CPU, Inductor's channels-last layout for convolutions copies every kernel and
            # activation it converts, at a cost in time and memory; it keeps the layout it is given.
            # AOTAutograd would make the real inputs' sizes symbolic, which a called subgraph
            # (see regions) cannot take: the Python wrapper gets them fake and static.
            inputs = [fake_mode.from_tensor(t, static_shapes=True) for t in example] \
                if fake_mode is not None and not cpp_wrapper else example
            with contextlib.nullcontext() if cuda else building_as_one(), affine_strides():
                if not cuda and not differentiable and direct_inductor.functional(graph):
                    try:
                        with inductor_config.patch({"layout_optimization": False}):
                            return direct_inductor.compile_graph(graph, inputs, cpp_wrapper)
                    except Exception as error:  # compiled through AOTAutograd instead
                        log.info("Inductor's graph compiler did not compile the explanation directly (%s); "
                                 "compiling it through AOTAutograd", first_line(error))
                return compile_fx(graph, inputs, config_patches={"triton.cudagraphs": cuda and not differentiable,
                                                                  "layout_optimization": cuda,
                                                                  "cpp_wrapper": cpp_wrapper})

    if cpp_wrapper:
        # Through compile_fx (where the direct path declines), the C++ wrapper takes its example
        # inputs from the placeholders' traced values, which make_fx leaves in a fake mode each and
        # Inductor will not mix: it takes the real inputs instead. The direct path makes its own.
        for node in graph.graph.nodes:
            if node.op == "placeholder":
                node.meta.pop("val", None)
        try:
            return compile_with(graph, cpp_wrapper=True)
        except Exception as error:  # the C++ wrapper only saves time: what it cannot compile, Python's may
            log.info("Inductor's C++ wrapper did not compile the explanation (%s); compiling it with the "
                     "Python wrapper", first_line(error))
    if not cuda and not differentiable:
        # Repeated blocks compiled once (Inductor's C++ wrapper cannot call a subgraph).
        outlined = regions.outlined(graph)
        if outlined is not None:
            try:
                return compile_with(outlined, cpp_wrapper=False)
            except Exception as error:  # outlining only saves time: the whole graph compiles without it
                log.info("Inductor did not compile the explanation with its repeated blocks outlined (%s); "
                         "compiling the whole graph", first_line(error))
    return compile_with(graph, cpp_wrapper=False)


@dataclass(frozen=True)
class CompiledExplanation:
    """One signature's explanation, kept in :func:`explanations`: the traced aten graph
    (``print(c.graph.code)`` shows every op) and the compiled callable that runs it."""

    graph: torch.fx.GraphModule
    run: Callable
    seconds: float  # tracing and compiling
    # Where ``seconds`` went, stage by stage (see :data:`STAGES`), over every attempt; ``load`` for a
    # graph a process saved earlier (:mod:`.saved_graphs`), loaded, compiled and run once.
    stages: dict[str, float]
    parameter_derived: ParameterDerived | None  # constants computed from the parameters; refreshed before each run
    packed_kernels: Watch | None  # the model's kernels that packed convolutions read reordered
    batch: int  # the batch size the graph was traced at: other sizes run it in chunks of this size
    # Per other batch size run so far, whether its first batch passed the check against the fused backend.
    batches: dict[int, bool] = field(default_factory=dict)

    def serves(self, batch: int) -> bool:
        """Whether batches of ``batch`` samples run this graph (once their size is checked)."""
        return batch == self.batch or self.batches.get(batch, False)

    def refresh(self) -> None:
        """Bring what the graph keeps between runs up to date with the model's parameters and buffers."""
        if self.parameter_derived is not None:
            self.parameter_derived.refresh()
        if self.packed_kernels is not None:
            for kernel in self.packed_kernels.changed():
                forget_reordered_kernel(kernel)


# What compiles a traced explanation; tests may swap in a cheaper one (the traced graph itself).
COMPILER: Compiler = inductor
# Compiled explanations kept per program (per input signature), the least recently used dropped first.
MAX_COMPILED = 8


def _signature(x: torch.Tensor, channels_last: bool, readout: Readout, parameter_gradient: ParameterGradient | None,
               trained: dict[str, torch.Tensor], any_batch: bool) -> tuple:
    """What a compiled explanation is specialized on: the input's shape, its batch size as
    None where the program serves ``any_batch`` size (see :func:`_per_sample`), and layout
    (see :func:`~omenn_kernels.backends.layout.runs_channels_last`), the read-out's kind and
    shape (a read-out function: the function object and its arguments' shapes), autocast (the
    trace records its casts), and for a differentiable explanation the parameter gradient's
    kind and the parameters it takes."""
    device = x.device.type
    autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
    differentiation = (parameter_gradient, tuple(trained)) if parameter_gradient is not None else None
    function = readout.target.function if readout.kind == "function" else None
    arguments = readout.target.arguments if function else readout.tensors

    def shape(tensor: torch.Tensor) -> tuple:
        return (None, *tensor.shape[1:]) if any_batch and _per_sample(tensor, x) else tuple(tensor.shape)
    # A function's arguments that are not tensors are baked into its graph.
    described = tuple((shape(a), a.dtype, a.device) if isinstance(a, torch.Tensor) else (type(a), a)
                      for a in arguments)
    return (readout.kind, (shape(x), channels_last), function, described, autocast, differentiation)


def _per_sample(tensor: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``tensor``, the images ``x`` or one of the read-out's tensors, has one row per
    sample: its first dimension is the batch's. (Class indices and read-out weights always
    have; a read-out function's argument that has is taken to be per sample, as labels are.)"""
    return tensor.dim() > 0 and tensor.shape[0] == x.shape[0]


def _compilable(readout: Readout) -> bool:
    """Whether explanations of ``readout`` are compiled (else they run on the fused backend): not a
    plain function, nor a read-out function with an argument that is neither a tensor nor
    hashable (a list: the signature, which bakes its value in, could not hold it)."""
    try:  # tensors hash by identity
        hash(readout.target.arguments if readout.kind == "function" else None)
    except TypeError:
        return False
    return readout.kind != "callable"


def _trained(program: LinearizedProgram, model: torch.nn.Module,
             parameter_gradient: ParameterGradient | None) -> dict[str, torch.Tensor]:
    """The parameters that a differentiable explanation's graph takes as inputs: those that
    require a gradient, each tensor once (under its first placeholder's name); none for a
    first-order explanation. The others enter the graph as the tensors themselves."""
    if parameter_gradient is None:
        return {}
    trained: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, value in bound_tensors(program.captured, model, differentiable=True).items():
        if isinstance(value, torch.Tensor) and value.requires_grad and id(value) not in seen:
            seen.add(id(value))
            trained[name] = value
    return trained


def explanations(program: LinearizedProgram) -> dict[tuple, CompiledExplanation | object]:
    """``program``'s compiled explanations (or a marker: runs on fused) per signature, least recently used first."""
    return _EXPLANATIONS.setdefault(program, {})


_EXPLANATIONS: weakref.WeakKeyDictionary[LinearizedProgram, dict[tuple, CompiledExplanation | object]] = \
    weakref.WeakKeyDictionary()


def replays(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
            parameter_gradient: ParameterGradient | None = None) -> bool:
    """Whether :func:`explain_batch` of these arguments only runs a graph compiled earlier."""
    key = signature(program, model, x, readout, parameter_gradient)
    compiled = None if key is None else explanations(program).get(key)
    return compiled is not None and compiled is not _FAILED and compiled.serves(x.shape[0])


def runs_fused(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
               parameter_gradient: ParameterGradient | None = None) -> bool:
    """Whether :func:`explain_batch` of these arguments runs the fused backend without tracing or
    checking anything: a read-out it does not trace, a signature whose trace or compilation failed,
    or a batch size that failed its check."""
    key = signature(program, model, x, readout, parameter_gradient)
    compiled = None if key is None else explanations(program).get(key)
    return key is None or compiled is _FAILED or (compiled is not None and compiled.batches.get(x.shape[0]) is False)


def signature(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
              parameter_gradient: ParameterGradient | None = None) -> tuple | None:
    """The signature whose graph explains these arguments (see :func:`_signature`), or None where
    the read-out is not traced (:func:`explain_batch` runs it on the fused backend)."""
    if not _compilable(readout):
        return None
    return _signature(x, runs_channels_last(program, x), readout, parameter_gradient,
                      _trained(program, model, parameter_gradient), program.captured.serves_batch(x.shape[0]))


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
    """The explanation of ``readout`` from the compiled graph of this signature (see the module docstring)."""
    if not _compilable(readout):
        return fused.explain_batch(program, model, x, readout, parameter_gradient)
    given = x
    channels_last = runs_channels_last(program, x)
    # A compiled graph assumes its inputs' strides: the images in the layout decided, the read-out's contiguous.
    x = x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    readout = readout.with_tensors([t.contiguous() for t in readout.tensors])
    trained = _trained(program, model, parameter_gradient)
    batch = x.shape[0]
    key = _signature(x, channels_last, readout, parameter_gradient, trained, program.captured.serves_batch(batch))
    compiled = explanations(program).pop(key, None)
    if compiled is None:  # the first call of this signature: loaded, or eager, then traced, compiled and checked
        saved_key = _saved_key(program, model, x, readout, parameter_gradient, key)
        with gc_paused():
            loaded = _loaded(program, model, x, readout, saved_key) if saved_key is not None else None
        if loaded is not None:
            compiled, outputs = loaded
            _keep(program, key, compiled)
            return in_layout_of(given, channels_last, outputs)
        before_capture(x.device)  # an auto signature that is hot compiles here
        check = _FusedCheck(program, model, x, readout, parameter_gradient, trained)
        check.share_ones_decisions()  # the trace reads no ones where shapes decide them
        # make_fx, like torch.export, holds process-wide dispatch modes while it traces
        with CAPTURE_LOCK, gc_paused():
            compiled, outputs = _compiled(program, model, x, readout, parameter_gradient, trained, check, saved_key)
            _keep(program, key, compiled)
        return in_layout_of(given, channels_last, outputs if compiled is _FAILED else
                            _owned(outputs, x, parameter_gradient))
    _keep(program, key, compiled)
    if compiled is _FAILED or compiled.batches.get(batch) is False:
        return in_layout_of(given, channels_last, fused.explain_batch(program, model, x, readout, parameter_gradient))
    if batch != compiled.batch and batch not in compiled.batches:  # the first batch of this size: checked
        check = _FusedCheck(program, model, x, readout, parameter_gradient, trained)
        outputs = _run(compiled, x, readout, trained, parameter_gradient)
        mismatch = check.mismatch(outputs, computing_dtype(compiled.graph.graph, x))
        compiled.batches[batch] = mismatch is None
        if mismatch:
            warnings.warn(f"omenn_kernels: run in chunks of {compiled.batch} samples, the "
                          f"{mismatch.format(type(model).__name__)} on a batch of {batch}; batches of {batch} "
                          "run on the fused backend", RuntimeWarning, stacklevel=4)
            outputs = check.whole()
        return in_layout_of(given, channels_last, outputs)
    return in_layout_of(given, channels_last, _run(compiled, x, readout, trained, parameter_gradient))


def check_rows(program: LinearizedProgram, x: torch.Tensor,
               parameter_gradient: ParameterGradient | None) -> torch.Tensor | None:
    """The samples of ``x`` whose fused explanation a compiled graph's is checked against first: the
    first and the last, where the batch has more than two and the capture serves a batch of two (a
    forward that explains each sample on its own shows a wrong graph on the pair as on the batch, at
    a fraction of a fused call); None, every sample, otherwise, in half precision and for a
    differentiable explanation, whose parameter gradient sums over the batch. See :class:`_FusedCheck`."""
    if parameter_gradient is not None or x.shape[0] <= 2 or not program.captured.serves_batch(2) \
            or x.dtype not in REORDERED_TOLERANCE or torch.is_autocast_enabled(x.device.type):
        return None  # in half precision, completeness is bounded by the fused backend's own error
    return torch.tensor([0, x.shape[0] - 1], device=x.device)


class _FusedCheck:
    """The check of a compiled graph's explanation of ``x`` against the fused backend's.

    The fused backend explains the samples :func:`check_rows` picks, and the graph's explanation
    must equal it there and be complete on every sample (:func:`_mismatch`). Where it is not, the
    fused backend explains the whole batch, which decides: a forward that mixes samples (a mean
    over the batch) differs on the pair alone, and its graph may still be right for this batch.
    The fused run on the pair also settles the ones checks (``OnesChecks``) that a trace of the
    whole batch reads (:meth:`share_ones_decisions`); they are dropped again where the pair does
    not decide.
    """

    def __init__(self, program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                 parameter_gradient: ParameterGradient | None, trained: dict[str, torch.Tensor]) -> None:
        self.program, self.model, self.x, self.readout = program, model, x, readout
        self.parameter_gradient, self.trained = parameter_gradient, trained
        self.rows = check_rows(program, x, parameter_gradient)
        self.shared: list[tuple] = []
        self.expected = fused.explain_batch(program, model, *self._samples(), parameter_gradient)

    def _samples(self) -> tuple[torch.Tensor, Readout]:
        """The images and the read-out of the samples checked."""
        if self.rows is None:
            return self.x, self.readout
        tensors = [t.index_select(0, self.rows) if _per_sample(t, self.x) else t for t in self.readout.tensors]
        return self.x.index_select(0, self.rows), self.readout.with_tensors(tensors)

    def share_ones_decisions(self) -> None:
        """Give the whole batch the ones checks the fused run on the pair decided, for a trace."""
        if self.rows is not None:
            self.shared = share_ones_decisions(self.program, len(self.rows), self.x.shape[0])

    def mismatch(self, got: BackendExplanation, dtype: torch.dtype, pair_decides: bool = False) -> str | None:
        """Why ``got`` is not the fused backend's explanation (see :func:`_mismatch`), or None. With
        ``pair_decides``, a mismatch on the pair is the answer: the whole batch is not explained."""
        mismatch = _mismatch(_detached(got), _detached(self.expected), self.x, dtype, self.rows)
        if mismatch and self.rows is not None and not pair_decides:
            self.whole()
            mismatch = _mismatch(_detached(got), _detached(self.expected), self.x, dtype)
        if mismatch is None and self.parameter_gradient is not None:
            mismatch = _gradient_mismatch(got, self.expected, list(self.trained.values()), self.x, dtype)
        return mismatch

    def onednn_mismatch(self, dtype: torch.dtype) -> str | None:
        """Why the fused backend's explanation of the checked samples, computed as a graph with
        oneDNN's convolutions computes it (:class:`~omenn_kernels.backends.packed_weights.OneDNNConvolutions`),
        is not its own (see :func:`_mismatch`), or None."""
        x, readout = self._samples()
        with OneDNNConvolutions(traced_as_aten(x.device)):
            got = fused.explain_batch(self.program, self.model, x, readout, self.parameter_gradient)
        return _mismatch(_detached(got), _detached(self.expected), x, dtype,
                         subject="explanation of {} with oneDNN's convolutions")

    def whole(self) -> BackendExplanation:
        """The fused backend's explanation of the whole batch."""
        if self.rows is not None:
            forget_ones_decisions(self.program, self.shared)
            self.rows, self.shared = None, []
            self.expected = fused.explain_batch(self.program, self.model, self.x, self.readout,
                                                self.parameter_gradient)
        return self.expected


def _at(explanation: BackendExplanation, rows: torch.Tensor | None) -> BackendExplanation:
    return explanation if rows is None else BackendExplanation(*(t.index_select(0, rows) for t in explanation))


def before_capture(device: torch.device) -> None:
    """Start what compiling on ``device`` needs and the capture of a program does not wait for:
    on the CPU, Inductor's probe of the vector instruction sets and the hashes of its cache keys
    (:mod:`.inductor_start`)."""
    if device.type == "cpu" and COMPILER is inductor:
        inductor_start.start()


def _saved_key(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
               parameter_gradient: ParameterGradient | None, signature: tuple) -> str | None:
    """The key under which this signature's traced graph is saved for later processes
    (:mod:`~omenn_kernels.backends.saved_graphs`), or None where it is not: a differentiable
    explanation, a read-out function (its identity is this process's), a device other than the CPU
    or a compiler other than Inductor (a test's)."""
    if parameter_gradient is not None or readout.kind == "function" or x.device.type != "cpu" or \
            COMPILER is not inductor and not SAVE_WITH_ANY_COMPILER:
        return None
    return saved_graphs.key(program, model, signature)


def saved(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout) -> bool:
    """Whether a process saved the graph of this first-order signature (its first call loads it)."""
    key = signature(program, model, x, readout)
    saved_key = None if key is None else _saved_key(program, model, x, readout, None, key)
    return saved_key is not None and saved_graphs.exists(saved_key)


# Tests set this to save and load graphs compiled by a compiler of their own.
SAVE_WITH_ANY_COMPILER = False


def _loaded(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
            saved_key: str) -> tuple[CompiledExplanation, BackendExplanation] | None:
    """The compiled explanation of a graph a process saved earlier under ``saved_key``, and its outputs
    on ``x``; None where none is saved or it does not pass its check (logged: it is traced again).

    Its check is the model's: the graph gives the logits of the model's own forward on the first
    two samples (its parameters are bound by name, so a graph bound wrongly would not) and a
    complete explanation, to the tolerance of a reordered computation (see :func:`_mismatch`);
    the graph was checked against the fused backend when it was saved.
    """
    started = time.perf_counter()
    saved = saved_graphs.load(saved_key, program, model)
    if saved is None:
        return None
    example = [x, *readout.tensors]
    try:
        with CAPTURE_LOCK:
            run = COMPILER(saved.graph, example)
            outputs = BackendExplanation(*run(*example))
        # Two samples show a graph bound wrongly as well as all do, at a fraction of a forward.
        rows = 2 if x.shape[0] > 2 and program.captured.serves_batch(2) else x.shape[0]
        held, _ = held_pass(program, bound_tensors(program.captured, model), x[:rows])
        own = held[program.captured.output_name]
    except Exception as error:  # noqa: BLE001 — traced again
        log.info("the saved explanation graph of %s could not be compiled (%s); tracing it again",
                 type(model).__name__, first_line(error))
        return None
    tolerance = REORDERED_TOLERANCE.get(computing_dtype(saved.graph.graph, x), HALF_LOGITS_TOLERANCE)
    error, scale = _completeness(outputs, x)
    if relative_distance(outputs.logits[:rows], own) > tolerance or bool((error > tolerance * scale).any()):
        log.info("the saved explanation graph of %s does not give the model's logits or a complete "
                 "explanation; tracing it again", type(model).__name__)
        return None
    seconds = time.perf_counter() - started
    log.info("loaded and compiled the saved explanation of %s for input %s %s and target %s in %.1f s",
             type(model).__name__, tuple(x.shape), x.dtype, readout.kind, seconds)
    derived = {id(value) for value in saved.parameter_derived.values} if saved.parameter_derived is not None else set()
    kernels = [kernel for kernel in constant_kernels(saved.graph) if id(kernel) not in derived]
    return CompiledExplanation(saved.graph, run, seconds, {"load": seconds}, saved.parameter_derived,
                               Watch(kernels) if kernels else None, x.shape[0]), outputs


def _run(compiled: CompiledExplanation, x: torch.Tensor, readout: Readout, trained: dict[str, torch.Tensor],
         parameter_gradient: ParameterGradient | None) -> BackendExplanation:
    """The compiled graph's explanation of ``x``: one run where the batch has the size the graph
    was traced at, else one run per chunk of that size, the last chunk filled up with copies of
    its last sample (and the read-out's rows), whose rows are then dropped.

    The graph calls the fused rules' custom ops: not while another thread exports
    (CAPTURE_LOCK). A first-order graph holds the backward already and its parameters need
    none; a differentiable one records its compiled backward for the caller's loss.
    """
    inputs = (x, *readout.tensors)
    per_sample = [_per_sample(tensor, x) for tensor in inputs]
    batch, size = x.shape[0], compiled.batch
    chunks = []
    with torch.set_grad_enabled(parameter_gradient is not None), CAPTURE_LOCK:
        compiled.refresh()
        for start in range(0, batch, size):
            chunk = [batch_rows(tensor, start, size) if rows else tensor for tensor, rows in zip(inputs, per_sample)]
            chunks.append(_owned(compiled.run(*chunk, *trained.values()), x, parameter_gradient))
    if len(chunks) == 1 and batch == size:
        return chunks[0]
    return BackendExplanation(*(torch.cat(parts)[:batch] for parts in zip(*chunks)))


def batch_rows(tensor: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Rows ``start`` to ``start + size`` of ``tensor``, filled up with copies of its last row, in its layout."""
    rows = tensor[start:start + size]
    if rows.shape[0] == size:
        return rows
    filled = torch.cat([rows, rows[-1:].expand(size - rows.shape[0], *rows.shape[1:])])
    return filled.contiguous(memory_format=torch.channels_last) if is_channels_last(tensor) else filled


def _owned(outputs, x: torch.Tensor, parameter_gradient: ParameterGradient | None) -> BackendExplanation:
    """The compiled graph's outputs as the caller's: under CUDA graphs every run writes its
    outputs into the same buffers, so copies, which outlive the next run."""
    return BackendExplanation(*(output.clone() for output in outputs)) if x.is_cuda and parameter_gradient is None \
        else BackendExplanation(*outputs)


def _keep(program: LinearizedProgram, key: tuple, compiled: CompiledExplanation | object) -> None:
    """Keep ``compiled`` as the most recently used of the program's at most ``MAX_COMPILED``."""
    kept = explanations(program)
    kept[key] = compiled
    while len(kept) > MAX_COMPILED:
        kept.pop(next(iter(kept)))


_FAILED = object()  # a signature whose trace or compilation failed: it runs on the fused backend

# The stages of a compilation, as ``CompiledExplanation.stages`` names them: the trace of the
# fused explanation (make_fx), the graph passes (shape-only folding, parameter-only hoisting,
# packed convolutions), the check of the fused explanation with oneDNN's convolutions before a
# graph with packed ones is compiled, the graph saved for later processes and read back
# (:mod:`.saved_graphs`), Inductor (the C++ compiler included), and the compiled graph's check run.
STAGES = ("trace", "passes", "check oneDNN", "save", "inductor", "check compiled")


def _compiled(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
              parameter_gradient: ParameterGradient | None, trained: dict[str, torch.Tensor],
              check: _FusedCheck, saved_key: str | None = None
              ) -> tuple[CompiledExplanation | object, tuple | BackendExplanation]:
    """The traced and compiled explanation of ``readout``'s signature, passed by ``check``, and the
    outputs of its check run on this input.

    The compiled graph is checked against the fused backend's explanation of the same input:
    its fused kernels round differently, so it must reproduce that explanation to the
    precision it computes in (:func:`computing_dtype`), and in half precision give the same
    logits and a complete explanation (see :func:`_mismatch`). A differentiable
    explanation's compiled graph must also give the parameters the fused backend's gradient
    (:func:`_gradient_mismatch`). A float32 graph on the CPU is first tried with its
    convolutions on oneDNN (:mod:`~omenn_kernels.backends.packed_weights`), on a copy of the
    trace, and compiled again with ATen's where that does not pass. oneDNN sums in another
    order, which can flip a ReLU gate: before that graph is compiled, the fused backend explains
    the check's samples once more as the graph computes them, with oneDNN's convolutions
    (:class:`~omenn_kernels.backends.packed_weights.OneDNNConvolutions`), and where that fails
    the check, ATen's are taken at the cost of a fused call of the samples rather than a
    compilation. A packed graph's own check failing on the pair also takes ATen's, without the
    fused explanation of the whole batch (which only a forward that mixes samples would need,
    and ATen's always serve). No traced graph is run uncompiled: a run costs about an eager
    call of the batch, and the compiled graph's check covers the trace. Returns ``_FAILED``
    and the fused backend's explanation of the batch (after one warning naming the cause)
    where tracing or compiling fails or a check does not hold.

    With a ``saved_key`` the graph that passes its check is saved for later processes
    (:mod:`~omenn_kernels.backends.saved_graphs`); the graph compiled is the one they will load
    (saved and read back), so that they find its code in Inductor's cache.
    """
    differentiable = parameter_gradient is not None
    head = 1 + len(readout.tensors)

    def explanation(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The trained parameters (inputs[head:]) are the model's own tensors: the trace reads
        # them through the model and records them as these inputs.
        weight, bias, logit, target, logits = fused.explain_batch(
            program, model, inputs[0], readout.with_tensors(inputs[1:head]), parameter_gradient)
        if differentiable:
            return weight, bias, logit, target, logits
        return weight.detach(), bias.detach(), logit.detach(), target, logits.detach()

    example = [x, *readout.tensors, *trained.values()]  # the images, the read-out's tensors, the trained parameters
    decompositions = traced_as_aten(x.device, differentiable)
    if x.device.type == "cpu" and not differentiable and COMPILER is inductor:
        decompositions = {**direct_inductor.decompositions(), **decompositions}  # compiled without AOTAutograd

    stages = dict.fromkeys(STAGES, 0.0)

    def timed(stage: str, started: float) -> float:
        now = time.perf_counter()
        stages[stage] += now - started
        return now

    def traced() -> tuple[torch.fx.GraphModule, int, ParameterDerived | None]:
        started = time.perf_counter()
        # A first-order explanation is traced on fake tensors: no value is computed, the ops are
        # recorded (the model's parameters and buffers stay real: the graph reads them). A
        # differentiable one is traced on real tensors: traced on fake ones, convolutional models'
        # parameter gradients fail their check. One fake mode holds every traced value's metadata.
        with traced_forwards(), observing_steps(regions.Recorder()), \
                tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True, allow_non_fake_inputs=True))):
            graph = make_fx(explanation, decomposition_table=decompositions,
                            tracing_mode="real" if differentiable else "fake", _allow_non_fake_inputs=True)(*example)
        started = timed("trace", started)
        drop_no_op_restrides(graph)
        scatter_strided_writes(graph)
        folded = fold_shape_only(graph, example)
        parameter_derived = hoist_parameter_only(graph)
        timed("passes", started)
        return graph, folded, parameter_derived

    def checked_and_compiled(graph: torch.fx.GraphModule, parameter_derived: ParameterDerived | None, pack: bool,
                             dtype: torch.dtype
                             ) -> tuple[torch.fx.GraphModule, Callable | None, tuple | None, str | None, tuple]:
        started = time.perf_counter()
        if pack:  # on a copy of the graph (its tensors shared): the graph stays for ATen's convolutions
            graph = torch.fx.GraphModule(graph, copy.deepcopy(graph.graph))
        packed = pack_constant_convolutions(graph) if pack else 0
        scale_gradients_not_kernels(graph.graph)
        views_as_reshapes(graph)
        graph.recompile()
        started = timed("passes", started)
        saved = None
        if saved_key is not None:
            try:
                # The graph is saved without its shapes: its FLOPs go with it.
                saved = saved_graphs.record(program, model, graph, parameter_derived, matrix_flops(graph))
                loaded = saved_graphs.bound(saved, program, model)
                graph, parameter_derived = loaded.graph, loaded.parameter_derived
            except Exception as error:  # noqa: BLE001 — only not saved
                log.info("the traced explanation of %s cannot be saved for later processes (%s)",
                         type(model).__name__, first_line(error))
                saved = None
            started = timed("save", started)
        counts = (packed, parameter_derived, saved)
        compiled = COMPILER(graph, example)
        started = timed("inductor", started)
        with torch.set_grad_enabled(differentiable):
            result = BackendExplanation(*compiled(*example))
        mismatch = check.mismatch(result, dtype, pair_decides=bool(packed))
        timed("check compiled", started)
        return graph, compiled, result, mismatch, counts

    start = time.perf_counter()
    mismatch = None
    try:
        # The passes change the traced graph several times: its code is generated once, where it is read or run.
        with _use_lazy_graph_module(True):
            traced_graph, folded, traced_parameter_derived = traced()
        failure = None
    except Exception as error:  # any failure of the toolchain falls back, never a wrong map
        failure = first_line(error)
    # oneDNN's convolutions sum in another order than ATen's: where that moves the explanation
    # beyond the checks' tolerance (a ReLU gate flipped by a rounding), ATen's are kept.
    onednn = x.device.type == "cpu" and x.dtype == torch.float32 and not differentiable and packing_available() \
        and failure is None and _convolutions_weigh(traced_graph)
    # Read on the traced graph (the passes after it change no dtype; a saved graph holds no values).
    dtype = computing_dtype(traced_graph.graph, x) if failure is None else None

    def without_onednn(why: str) -> None:
        log.info("the explanation of %s with oneDNN's convolutions did not pass its checks (%s); compiling "
                 "it with ATen's", type(model).__name__, why)
        forget_reordered_kernels()

    if onednn:
        started = time.perf_counter()
        try:
            why = check.onednn_mismatch(dtype)
            why = why and why.format(type(model).__name__)
        except Exception as error:  # any failure of the toolchain: ATen's convolutions
            why = first_line(error)
        timed("check oneDNN", started)
        if why:
            without_onednn(why)
            onednn = False
    for pack in ((True, False) if onednn else (False,)) if failure is None else ():
        try:
            graph, compiled, result, mismatch, (packed, parameter_derived, saved) = checked_and_compiled(
                traced_graph, traced_parameter_derived, pack, dtype)
            failure = None
        except Exception as error:  # any failure of the toolchain falls back, never a wrong map
            failure = first_line(error)
        if pack and (failure or mismatch):
            without_onednn(failure or mismatch.format(type(model).__name__))
        elif failure is None:
            break
    if failure is not None:
        warnings.warn(f"omenn_kernels: the compiled backend could not compile the explanation of "
                      f"{type(model).__name__} on an input of shape {tuple(x.shape)} ({failure}); this signature "
                      "runs on the fused backend", RuntimeWarning, stacklevel=5)
        return _FAILED, check.whole()
    if mismatch:
        warnings.warn(f"omenn_kernels: the {mismatch.format(type(model).__name__)}; this signature runs on the "
                      "fused backend", RuntimeWarning, stacklevel=5)
        return _FAILED, check.whole()
    if saved is not None:
        saved_graphs.save(saved_key, saved)
    seconds = time.perf_counter() - start
    log.info("compiled the explanation of %s for input %s %s and target %s%s in %.1f s (%s; %d aten nodes, "
             "%d shape-only values folded, %d parameter-only values kept, %d convolutions with reordered "
             "kernels)", type(model).__name__, tuple(x.shape),
             x.dtype, readout.kind,
             f", differentiable ({parameter_gradient}, {len(trained)} parameter tensors)" if differentiable else "",
             seconds, ", ".join(f"{stage} {spent:.1f} s" for stage, spent in stages.items()),
             sum(node.op == "call_function" for node in graph.graph.nodes), folded,
             len(parameter_derived.values) if parameter_derived is not None else 0, packed)
    # The folded kernels are the library's own, changed by refreshes that the C++ side sees.
    derived = {id(value) for value in parameter_derived.values} if parameter_derived is not None else set()
    kernels = [kernel for kernel in constant_kernels(graph) if id(kernel) not in derived]
    return CompiledExplanation(graph, compiled, seconds, stages, parameter_derived,
                               Watch(kernels) if kernels else None, x.shape[0]), \
        result


# Below this share of a graph's matrix FLOPs its convolutions are not packed: a ViT's patch
# embedding (under 1 %) runs no faster packed, and a packed graph costs a run before Inductor.
PACKED_CONVOLUTIONS_MIN_SHARE = 0.1


def _convolutions_weigh(graph: torch.fx.GraphModule) -> bool:
    """Whether ``graph``'s convolutions are worth packing (:data:`PACKED_CONVOLUTIONS_MIN_SHARE`)."""
    convolutions = matrix_flops(graph, {torch.ops.aten.convolution, torch.ops.aten.convolution_backward})
    return convolutions > 0 and convolutions >= PACKED_CONVOLUTIONS_MIN_SHARE * matrix_flops(graph)


def _detached(explanation: BackendExplanation) -> BackendExplanation:
    return BackendExplanation(*(value.detach() for value in explanation))


def relative_distance(got: torch.Tensor, want: torch.Tensor) -> float:
    """``‖got − want‖ / ‖want‖`` (Frobenius), computed in float64."""
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm().clamp_min(1e-300))


# Relative (Frobenius) bounds on the difference from the fused backend's explanation (the reordered
# ones and the half-precision logits' also bound a padded token batch's logits, see ``tokens``).
REORDERED_TOLERANCE = {torch.float64: 1e-8, torch.float32: 1e-4}  # fused kernels: other rounding
HALF_LOGITS_TOLERANCE, _HALF_COMPLETENESS = 5e-2, 2e-2


def _mismatch(got: BackendExplanation, want: BackendExplanation, x: torch.Tensor,
              dtype: torch.dtype, rows: torch.Tensor | None = None,
              subject: str = "compiled explanation of {}") -> str | None:
    """Why ``got``, the explanation of ``x``, is not the fused backend's explanation ``want`` of its
    samples ``rows`` (all where None), or None, to the tolerance of ``dtype``, the least precise type
    the explanation computes in (:func:`computing_dtype`). Where ``want`` holds some samples, every
    sample of ``got`` must also be complete, to the tolerance of ``dtype``.

    In half precision the weight and bias of two correct explanations that round
    differently can differ by tens of percent (a rounding flips a gate, and the backward
    carries the change), so the compiled graph is held there to what does not depend on
    rounding order: the logits (forward values), and completeness, ``Σ C_w·x + Σ C_b = ŷ``
    per read-out, to 2 % of the three terms' magnitudes plus four times the fused
    backend's own completeness error. The returned message names ``got`` as ``subject``, with
    ``{}`` for the model's name.
    """
    if rows is not None:
        mismatch = _incomplete(got, x, REORDERED_TOLERANCE.get(dtype, _HALF_COMPLETENESS), subject)
        if mismatch:
            return mismatch
        got, x = _at(got, rows), x.index_select(0, rows)
    if dtype not in REORDERED_TOLERANCE:
        if relative_distance(got.logits, want.logits) > HALF_LOGITS_TOLERANCE:
            return f"{subject} gives logits that differ from the fused backend's by more " \
                   f"than {HALF_LOGITS_TOLERANCE:g} relative"
        error, scale = _completeness(got, x)
        if bool((error > _HALF_COMPLETENESS * scale + 4 * _completeness(want, x)[0]).any()):
            return f"{subject} is not complete (Σ C differs from the logit by more than " \
                   f"{_HALF_COMPLETENESS:g} of |Σ C_w·x| + |Σ C_b| + |logit|, four times the fused backend's error " \
                   "added)"
        return None
    tolerance = REORDERED_TOLERANCE[dtype]
    for name in ("weight", "bias", "logit"):
        if relative_distance(getattr(got, name), getattr(want, name)) > tolerance:
            return f"{subject} differs from the fused backend's in its {name} by more than " \
                   f"{tolerance:g} relative"
    return None


def computing_dtype(graph: torch.fx.Graph, x: torch.Tensor) -> torch.dtype:
    """The least precise floating-point type the explanation of ``x`` in ``graph`` computes in: ``x``'s,
    autocast's where it is on, or one the graph casts to or creates tensors of. A model may compute
    parts of itself in a lower precision than its input's (Hugging Face's Llama computes its RMSNorm
    and rotary embedding in float32 in a float64 model); the compiled graph rounds those parts
    differently from the fused backend, to that precision.
    """
    dtypes = {x.dtype}
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtypes.add(torch.get_autocast_dtype(device))

    def add(value):
        if isinstance(value, torch.dtype):
            dtypes.add(value)
        elif isinstance(value, torch.Tensor):
            dtypes.add(value.dtype)
        return value

    for node in graph.nodes:
        torch.fx.node.map_aggregate((node.args, node.kwargs, node.meta.get("val")), add)
    return max((dtype for dtype in dtypes if dtype.is_floating_point), key=lambda dtype: torch.finfo(dtype).eps)


def _incomplete(explanation: BackendExplanation, x: torch.Tensor, tolerance: float,
                subject: str = "compiled explanation of {}") -> str | None:
    """Why ``explanation`` of ``x``, named ``subject``, is not complete to ``tolerance`` of each
    read-out's three terms, or None."""
    error, scale = _completeness(explanation, x)
    if bool((error > tolerance * scale).any()):
        return f"{subject} is not complete (Σ C differs from the logit by more than " \
               f"{tolerance:g} of |Σ C_w·x| + |Σ C_b| + |logit|)"
    return None


def _gradient_mismatch(got: BackendExplanation, want: BackendExplanation,
                       parameters: list[torch.Tensor], x: torch.Tensor, dtype: torch.dtype) -> str | None:
    """Why the parameter gradient of a random projection of ``got`` (the compiled graph's
    differentiable outputs) is not that of ``want`` (the fused backend's), or None.

    Relative (Frobenius) over all parameters, with the tolerance of a reordered computation in
    ``dtype`` (:func:`computing_dtype`), float32 or float64. In half precision the gradient, like
    the weight (see :func:`_mismatch`), moves with rounding order and is not compared.
    """
    if dtype not in REORDERED_TOLERANCE or not parameters:
        return None
    pairs = [(g, w) for g, w in zip(got, want) if isinstance(w, torch.Tensor) and w.requires_grad]
    generator = torch.Generator(device=x.device).manual_seed(0)
    projections = [torch.randn(w.shape, generator=generator, device=w.device, dtype=w.dtype) for _, w in pairs]

    def gradient(values: list[torch.Tensor]) -> torch.Tensor:
        loss = sum((value * projection).sum() for value, projection in zip(values, projections))
        # The fused backend's graph is the caller's explanation: kept for the caller's loss.
        parts = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True, materialize_grads=True)
        return torch.cat([part.flatten() for part in parts])
    tolerance = REORDERED_TOLERANCE[dtype]
    if relative_distance(gradient([g for g, _ in pairs]), gradient([w for _, w in pairs])) > tolerance:
        return f"compiled explanation of {{}} gives the parameters a gradient that differs from the fused " \
               f"backend's by more than {tolerance:g} relative"
    return None


def _completeness(explanation: BackendExplanation, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|Σ C_w·x + Σ C_b − ŷ|`` and ``|Σ C_w·x| + |Σ C_b| + |ŷ|`` per read-out, in float64."""
    weight, bias, explained = (t.double() for t in explanation[:3])
    inputs = x.double().unsqueeze(1) if weight.dim() > x.dim() else x.double()  # T read-outs
    weighted = (weight * inputs).flatten(explained.dim()).sum(-1)
    biased = bias.flatten(explained.dim()).sum(-1) if bias.dim() > explained.dim() else bias  # no positions
    return (weighted + biased - explained).abs(), weighted.abs() + biased.abs() + explained.abs()
