"""Graph capture: the model's forward as an aten graph, via ``torch.export``.

The model is captured in eval semantics (BatchNorm running statistics, no dropout)
without changing it: every module's ``training`` flag is restored afterwards.
Parameters and buffers are not copied; the captured program reads them from the
model by name at every call, so an optimizer step or ``load_state_dict`` is seen.

What a capture bakes in and does not re-read (hooks, submodules, which tensor objects
are the parameters, their shapes, instance-level forwards) is summarized by
:class:`ModelStructure`, so that a cached capture can be checked against the model.

Capturing is serialized process-wide (:data:`CAPTURE_LOCK`): ``torch.export`` keeps its
tracing modes in process-global slots, and while it traces a model it swaps that
model's parameters and buffers for fake tensors.
"""

from __future__ import annotations

import contextlib
import logging
import reprlib
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Union

import sympy
import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_dense
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import free_symbols
from torch.utils._sympy.numbers import int_oo
from torch.nn.modules import module as module_internals
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.module_tracker import ModuleTracker

from .errors import CaptureError, InputError, OutputError
from .early_selection import select_early
from .eval_graph import functionalized
from .folding import fold_batch_norms

log = logging.getLogger("omenn_kernels.capture")

CAPTURE_LOCK = threading.RLock()
"""Held while ``torch.export`` traces a model, and while a model's parameters, buffers or
structure are read, so that a reader never sees the fake tensors export puts in their place.
Also held while the custom ops of the fused rules run (``backends.fused``, ``backends.compiled``):
``torch.library`` wraps each custom op's kernel in a function that, while any thread is
exporting (a process-wide flag), edits ``torch.fx.traceback``'s process-global node
metadata without a lock, and an export in another thread fails or corrupts it meanwhile.
Reentrant, so that a forward (or hook) that explains something while being captured does
not deadlock."""


OutputSelector = Union[int, str, Callable[[Any], torch.Tensor], None]
"""Which tensor of a forward's output is explained: None (the output itself if it is a
tensor, the first element of a tuple or list, the ``"logits"`` entry of a dict or a
Hugging Face ``ModelOutput``), an index, a key or attribute name, or a function of the output."""


def checked_selector(selector: object) -> OutputSelector:
    """``selector`` if it is an :data:`OutputSelector`; a TypeError naming its type if not."""
    if selector is None or callable(selector) or isinstance(selector, (int, str)) and not isinstance(selector, bool):
        return selector
    raise TypeError(f"output must be None, an index, a key or a function of the model's output; got "
                    f"{type(selector).__name__}")


def selected_output(output: Any, selector: OutputSelector) -> torch.Tensor:
    """The tensor ``selector`` picks from a forward's ``output`` (see :data:`OutputSelector`).

    Raises:
        OutputError: nothing fits, or what was picked is not a tensor; the message names
            the output's type (and its keys, for a mapping).
    """
    if selector is None:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, (tuple, list)) and output:
            return _tensor(output[0], output, "its first element")
        if isinstance(output, Mapping) and "logits" in output:
            return _tensor(output["logits"], output, "its 'logits' entry")
        raise OutputError(f"the model returns {_described(output)}, which has no default logits (a tensor, the "
                          "first element of a tuple or list, or a 'logits' entry); pass output= (an index, a key "
                          "or a function of the output)")
    if callable(selector):
        return _tensor(selector(output), output, f"output={getattr(selector, '__name__', 'function')}(...)")
    if isinstance(selector, str):
        if isinstance(output, Mapping) and selector in output:
            return _tensor(output[selector], output, f"output={selector!r}")
        if not isinstance(output, Mapping) and hasattr(output, selector):
            return _tensor(getattr(output, selector), output, f"output={selector!r}")
        raise OutputError(f"output={selector!r} is not a key of the model's output, {_described(output)}")
    if isinstance(output, Mapping):
        output = tuple(output.values())  # a ModelOutput's positions: its entries that are set, in order
    if isinstance(output, (tuple, list)) and -len(output) <= selector < len(output):
        return _tensor(output[selector], output, f"output={selector}")
    raise OutputError(f"output={selector} is not an index of the model's output, {_described(output)}")


def _tensor(picked: Any, output: Any, what: str) -> torch.Tensor:
    if not isinstance(picked, torch.Tensor):
        raise OutputError(f"{what} of the model's output ({_described(output)}) is a {type(picked).__name__}, "
                          "not a tensor of logits")
    return picked


def _described(output: Any) -> str:
    """The output's type, and its keys or length, for error messages."""
    name = type(output).__name__
    if isinstance(output, Mapping):
        return f"a {name} with keys {list(output.keys())}"
    if isinstance(output, (tuple, list)):
        return f"a {name} of {len(output)} elements"
    return f"a {name}"


class _SelectedOutput(torch.nn.Module):
    """``model`` whose forward returns the one tensor ``selector`` picks from its output, so that
    export traces the pick and the captured graph has one output. The model is the child
    ``model``: :data:`_PREFIX` is taken off the parameters' names and the module paths."""

    def __init__(self, model: torch.nn.Module, selector: OutputSelector) -> None:
        super().__init__()
        self.model = model
        self.selector = checked_selector(selector)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return selected_output(self.model(x), self.selector)


_PREFIX = "model."


@dataclass
class CapturedModel:
    """A captured forward: the functional aten graph and how to bind its inputs."""

    program: ExportedProgram
    graph: torch.fx.Graph
    input_name: str
    bindings: dict[str, tuple[InputKind, str]]  # placeholder name -> (kind, FQN / constant name)
    output_name: str
    # The batch sizes the graph holds for, (lowest, highest or None): the range export gave
    # a symbolic batch dimension; None where the graph holds for the example's shape only.
    batch_range: tuple[int, int | None] | None = None

    def serves_batch(self, size: int) -> bool:
        """Whether the graph holds for a batch of ``size`` (besides the example's own)."""
        if self.batch_range is None:
            return False
        lowest, highest = self.batch_range
        return lowest <= size and (highest is None or size <= highest)


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


def capture(model: torch.nn.Module, example: torch.Tensor, output: OutputSelector = None,
            fold_batch_norm: bool = True, select_first: bool = True) -> CapturedModel:
    """Capture ``model(example)`` with ``torch.export`` (non-strict) in eval semantics, the output
    tensor that ``output`` selects (:func:`selected_output`) as the graph's one output.

    Where ``example`` holds at least two samples, the batch dimension is exported as
    symbolic (``Dim.AUTO``), so that one capture serves every batch size of at least 2;
    a forward that fixes its batch size (or that export cannot trace with a symbolic one)
    is captured for the example's shape alone (``CapturedModel.batch_dynamic``). A batch
    of one is always captured on its own: export specializes sizes 0 and 1.

    ``fold_batch_norm``: merge each eval-mode BatchNorm into the convolution that feeds it
    (:mod:`~omenn_kernels.folding`; the same explanation, up to rounding).

    ``select_first``: move selections of positions (the last token's, the class token's)
    ahead of the position-wise operations before them, so that positions the output does
    not read are not computed (:mod:`~omenn_kernels.early_selection`; the same explanation,
    up to rounding).

    Thread-safe: captures run one at a time in the process (see :data:`CAPTURE_LOCK`).

    Raises:
        InputError: export failed, and so does the model's own forward on ``example``
            (e.g. an image with the wrong number of channels).
        OutputError: ``output`` picks no tensor from the model's output.
        CaptureError: the forward cannot be exported, takes other inputs, or mutates buffers.
    """
    if not is_dense(example):
        # export's guards cannot describe the strides of a view with gaps (a crop of a larger
        # batch): the same values, laid out densely, trace the same graph.
        example = example.contiguous()
    # The caller's dispatch modes (a FlopCounterMode, say) see none of the tracing's fake ops.
    with CAPTURE_LOCK, _disable_current_modes():
        try:
            with eval_semantics(model):
                program = _export(_SelectedOutput(model, output), example)
            if not functionalized(program):
                log.debug("%s: the exported graph is made functional by run_decompositions", type(model).__name__)
                program = program.run_decompositions({})  # functional ops, eval-mode norms
        except OutputError:
            raise
        except Exception as error:  # export raises many unrelated types; report them as one
            _check_forward_runs(model, example)
            raise CaptureError(
                f"torch.export could not capture {type(model).__name__}.forward on an input of shape "
                f"{tuple(example.shape)} ({type(error).__name__}: {error}). OMENN needs a forward that "
                "torch.export can trace: one tensor in, no data-dependent Python control flow on "
                "tensor values."
            ) from error

    signature = program.graph_signature
    user_inputs = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    outputs = [s for s in signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    mutations = [s for s in signature.output_specs if s.kind != OutputKind.USER_OUTPUT]
    if len(user_inputs) != 1:
        raise CaptureError(f"the captured forward takes {len(user_inputs)} tensor inputs; "
                           "explain needs exactly one (the image batch)")
    if mutations:
        raise CaptureError(f"the captured forward mutates {len(mutations)} buffers; explain needs a forward "
                           "without state changes")
    if not hasattr(outputs[0].arg, "name"):
        raise CaptureError("the model's output is not a tensor computed by its forward")
    if fold_batch_norm:
        with CAPTURE_LOCK, _disable_current_modes():  # the folded nodes' shapes are traced in export's fake mode
            folded = fold_batch_norms(program.graph, user_inputs[0].arg.name)
        if folded:
            log.debug("%s: %d BatchNorms folded into convolutions", type(model).__name__, folded)
    if select_first:
        with CAPTURE_LOCK, _disable_current_modes():
            moved = select_early(program.graph)
        if moved:
            log.debug("%s: a selection moved ahead of %d operations", type(model).__name__, moved)
    bindings = {
        spec.arg.name: (spec.kind, spec.target.removeprefix(_PREFIX)
                        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) else spec.target)
        for spec in signature.input_specs
        if spec.kind != InputKind.USER_INPUT
    }
    return CapturedModel(program, program.graph, user_inputs[0].arg.name, bindings, outputs[0].arg.name,
                         _batch_range(program, user_inputs[0].arg.name))


def _batch_range(program: ExportedProgram, input_name: str) -> tuple[int, int | None] | None:
    """The batch sizes ``program`` holds for, where its batch dimension is symbolic."""
    batch = next(n for n in program.graph.nodes if n.name == input_name).meta["val"].shape[0]
    symbols = free_symbols(batch)
    if len(symbols) != 1 or batch.node.expr not in symbols:  # fixed, or tied to another size
        return None
    ranges = program.range_constraints.get(batch.node.expr)
    if ranges is None:
        return None
    return int(ranges.lower), (None if ranges.upper in (int_oo, sympy.oo) else int(ranges.upper))


def _export(model: torch.nn.Module, example: torch.Tensor) -> ExportedProgram:
    """``torch.export`` of ``model(example)``, with a symbolic batch dimension where it can be one."""
    if example.dim() > 0 and example.shape[0] >= 2:
        try:
            return torch.export.export(model, (example,), dynamic_shapes=({0: torch.export.Dim.AUTO},),
                                       strict=False)
        except Exception as error:  # a forward that export traces only with a fixed batch size
            log.debug("%s captured for batch size %d alone: %s", type(model).__name__, example.shape[0], error)
    return torch.export.export(model, (example,), strict=False)


def _check_forward_runs(model: torch.nn.Module, example: torch.Tensor) -> None:
    """Raise InputError if the model's own forward fails on ``example`` (eval semantics, no grad).

    Distinguishes an input the model cannot take from a forward export cannot trace.
    The buffers are replaced by copies for the call, so a forward that updates them
    leaves the model's own unchanged.
    """
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers(remove_duplicate=False)}
    try:
        with eval_semantics(model), torch.no_grad():
            torch.func.functional_call(model, buffers, (example,), strict=False)
    except Exception as error:  # whatever the model raises, it is the model's own failure
        raise InputError(
            f"the model's own forward fails on an input of shape {tuple(example.shape)} "
            f"({type(error).__name__}: {error}); check the input shape (image size, channels) and dtype it expects"
        ) from error


def bound_tensors(captured: CapturedModel, model: torch.nn.Module,
                  differentiable: bool = False) -> dict[str, object]:
    """The current parameters, buffers and constants of ``model`` for the graph's placeholders.

    Those that require a gradient detached, unless ``differentiable``: then what is computed
    from them can be differentiated with respect to the model's parameters. (A tensor that
    requires none, a buffer or a frozen parameter, is taken as it is: a detached alias would
    only add an op to each trace.)
    """
    with CAPTURE_LOCK:  # not while another thread's export has swapped in fake tensors
        named = dict(model.named_parameters(remove_duplicate=False))
        named.update(model.named_buffers(remove_duplicate=False))
    values: dict[str, object] = {}
    for name, (kind, target) in captured.bindings.items():
        if kind in (InputKind.PARAMETER, InputKind.BUFFER):
            if target not in named:
                raise CaptureError(f"the model no longer has the parameter or buffer '{target}' "
                                   "it was captured with; create a new Explainer")
            value = named[target]
            values[name] = value if differentiable or not value.requires_grad else value.detach()
        else:
            values[name] = captured.program.constants[target]
    return values


def reference_parameter(model: torch.nn.Module) -> torch.Tensor | None:
    """The model's first floating-point parameter (its dtype and device), None if it has none."""
    with CAPTURE_LOCK:  # not a fake tensor of another thread's export
        return next((p for p in model.parameters() if p.is_floating_point()), None)


def _global_hook_ids() -> tuple[tuple, tuple]:
    """The handle ids of the forward (pre-)hooks registered for every module of the process, but
    for torch's module trackers (``FlopCounterMode``'s, for one), which record which module runs
    and change no value."""
    return tuple(tuple(handle for handle, hook in getattr(module_internals, table, {}).items()
                       if not isinstance(getattr(hook, "__self__", None), ModuleTracker))
                 for table in ("_global_forward_pre_hooks", "_global_forward_hooks"))


def _structure_key(model: torch.nn.Module) -> list:
    """A flat summary of what :class:`ModelStructure` watches, cheap to compute at every call.

    Holds object ids: equal keys mean the same objects only while the objects of one of
    them are kept alive (``ModelStructure.pinned``), since CPython reuses the ids of freed
    objects. Hook handle ids come from a counter and are never reused.
    """
    key: list = [_global_hook_ids()]
    append = key.append
    stack = [model]
    while stack:
        module = stack.pop()
        state = module.__dict__
        append(id(module))
        append(type(module))
        pre_hooks, hooks = state.get("_forward_pre_hooks"), state.get("_forward_hooks")
        if pre_hooks:
            append(("pre-hooks", *pre_hooks))
        if hooks:
            append(("hooks", *hooks))
        forward = state.get("forward")
        if forward is not None:
            append(("forward", id(forward)))
        for table in (state.get("_parameters") or {}, state.get("_buffers") or {}):
            for name, tensor in table.items():
                append((name, id(tensor), tensor.shape, tensor.dtype) if tensor is not None else (name, None))
        plain = _plain_attributes(state)
        if plain:
            append(plain)
        children = state.get("_modules")
        if children:
            append(tuple(children))
            stack.extend(child for child in reversed(children.values()) if child is not None)
    return key


def _describe(model: torch.nn.Module) -> tuple[dict[str, dict], list]:
    """Per module path, what :class:`ModelStructure` watches in readable form; and the objects it names."""
    described: dict[str, dict] = {}
    objects: list = []
    for path, module in model.named_modules(remove_duplicate=False):
        state = module.__dict__
        forward = state.get("forward")
        tensors = {}
        for kind, table in (("parameter", state.get("_parameters") or {}), ("buffer", state.get("_buffers") or {})):
            for name, tensor in table.items():
                tensors[name] = (kind, None) if tensor is None else \
                    (kind, id(tensor), tuple(tensor.shape), tensor.dtype)
                objects.append(tensor)
        described[path] = {
            "id": id(module), "type": type(module).__name__,
            "pre_hooks": tuple(state.get("_forward_pre_hooks") or ()),
            "hooks": tuple(state.get("_forward_hooks") or ()),
            "forward": None if forward is None else id(forward), "tensors": tensors,
            "attributes": dict(_plain_attributes(state)),
        }
        objects.extend((module, forward))
    return described, objects


# What every module's __dict__ holds for nn.Module itself (``training`` included: a capture
# runs in eval mode whatever the flag).
_MODULE_STATE = frozenset(torch.nn.Module().__dict__)
_PLAIN = frozenset({bool, int, float, complex, str, type(None)})


def _plain_attributes(state: dict) -> tuple:
    """A module's plain attributes (numbers, strings, booleans, None, and tuples and lists of
    them) as ``(name, value)`` pairs, lists as tuples. Values are compared by ``==`` after
    identity, so that an unchanged NaN stays equal."""
    plain = []
    for name, value in state.items():
        kind = type(value)
        if kind in _PLAIN:
            if name not in _MODULE_STATE:
                plain.append((name, value))
        elif (kind is tuple or kind is list) and _plain_sequence(value):
            plain.append((name, value if kind is tuple else tuple(value)))
    return tuple(plain)


def _plain_sequence(values: tuple | list) -> bool:
    return all(type(value) in _PLAIN or type(value) in (tuple, list) and _plain_sequence(value) for value in values)


def _name(path: str) -> str:
    return f"'{path}'" if path else "the root module"


def _tensor_change(name: str, old: tuple, new: tuple | None) -> str | None:
    """How one parameter or buffer slot changed (None: it did not)."""
    if new is None:
        return f"{old[0]} '{name}' was removed"
    if old == new:
        return None
    if old[1] is None or new[1] is None:
        return f"{new[0]} '{name}' was set to {'None' if new[1] is None else 'a tensor'}"
    if old[2:] != new[2:]:
        return f"{new[0]} '{name}' changed from shape {old[2]} {old[3]} to shape {new[2]} {new[3]}"
    return f"{new[0]} '{name}' was re-bound to another tensor"


def _module_changes(path: str, old: dict, new: dict) -> list[str]:
    """What changed in the module at ``path`` itself (not in its submodules)."""
    if old["id"] != new["id"]:
        return [f"the submodule {_name(path)} was replaced ({old['type']} by {new['type']})"]
    changes = []
    if old["type"] != new["type"]:
        changes.append(f"the class of {_name(path)} changed from {old['type']} to {new['type']}")
    if old["pre_hooks"] != new["pre_hooks"]:
        changes.append(f"the forward pre-hooks of {_name(path)} changed")
    if old["hooks"] != new["hooks"]:
        changes.append(f"the forward hooks of {_name(path)} changed")
    if old["forward"] != new["forward"]:
        changes.append(f"the forward of {_name(path)} was replaced on the instance")
    prefix = f"{path}." if path else ""
    for name, slot in old["tensors"].items():
        change = _tensor_change(prefix + name, slot, new["tensors"].get(name))
        if change:
            changes.append(change)
    changes.extend(f"{slot[0]} '{prefix}{name}' was added" for name, slot in new["tensors"].items()
                   if name not in old["tensors"])
    for name in old["attributes"].keys() | new["attributes"].keys():
        before, after = old["attributes"].get(name, _ABSENT), new["attributes"].get(name, _ABSENT)
        if before is not after and before != after:
            changes.append(f"the attribute '{prefix}{name}' changed from {_shown(before)} to {_shown(after)}")
    return changes


_ABSENT = object()


def _shown(value: object) -> str:
    return "absent" if value is _ABSENT else reprlib.repr(value)


@dataclass
class ModelStructure:
    """What a capture of a model depends on but does not re-read when it runs.

    Recorded with the capture: the model's forward (pre-)hooks and the process-wide
    module hooks, every submodule (by path, object and class), forwards set on
    instances, which tensor objects the parameters and buffers are, with their shapes and
    dtypes, and each module's plain attributes that a capture bakes in: numbers,
    strings, booleans, None, and tuples and lists of them (``self.scale``, timm's
    ``global_pool``, ``conv.stride``), but ``training``, which a capture sets itself.
    The tensors' values are not part of it: in-place updates (optimizer steps,
    ``load_state_dict``) are read at every call anyway. Not watched: attributes of
    other kinds (a tensor that is not a buffer, a config object, a dict).
    """

    key: list
    described: dict[str, dict]
    global_hooks: tuple[tuple, tuple]
    pinned: list  # every object whose id is in ``key``, kept alive so that no other object gets its id

    @classmethod
    def record(cls, model: torch.nn.Module) -> "ModelStructure":
        """The structure of ``model`` now."""
        with CAPTURE_LOCK:
            described, objects = _describe(model)
            return cls(_structure_key(model), described, _global_hook_ids(), objects)

    def matches(self, model: torch.nn.Module) -> bool:
        """Whether ``model`` still has this structure (one pass over its modules)."""
        with CAPTURE_LOCK:
            return _structure_key(model) == self.key

    def changes(self, model: torch.nn.Module) -> str:
        """One sentence saying how the structure of ``model`` differs from this one."""
        with CAPTURE_LOCK:
            described, _ = _describe(model)
            global_hooks = _global_hook_ids()
        changes = []
        if global_hooks != self.global_hooks:
            changes.append("the global module forward hooks (torch.nn.modules.module) changed")
        replaced: list[str] = []
        for path, old in self.described.items():
            if any(path.startswith(f"{outer}.") for outer in replaced):
                continue  # inside a replaced or removed submodule: reported there
            new = described.get(path)
            if new is None or new["id"] != old["id"]:
                replaced.append(path)
            if new is None:
                changes.append(f"the submodule {_name(path)} was removed")
            else:
                changes.extend(_module_changes(path, old, new))
        changes.extend(f"the submodule {_name(path)} was added" for path in described
                       if path not in self.described
                       and not any(path.startswith(f"{outer}.") for outer in replaced))
        return "; ".join(changes) if changes else "the order of the model's submodules changed"


def module_path(node: torch.fx.Node) -> str:
    """The dotted path of the innermost submodule whose forward produced ``node``."""
    stack = node.meta.get("nn_module_stack") or {}
    # export marks nodes made outside any module's forward (a dynamic batch size) with a placeholder entry
    paths = [path for path, _ in stack.values() if not path.startswith("_empty_nn_module_stack")]
    if not paths:
        return ""
    path = paths[-1].replace("L['self'].", "").replace("L['self']", "")
    return "" if path == _PREFIX.rstrip(".") else path.removeprefix(_PREFIX)


# A captured graph is functional: a view there may copy, as it must on tensors whose strides
# differ from the capture's (channels-last images).
_COPYING_VIEWS = {torch.ops.aten.view.default: torch.ops.aten.reshape.default,
                  torch.ops.aten._unsafe_view.default: torch.ops.aten.reshape.default}


def functional(op: Callable) -> Callable:
    """The operation to run for a captured graph's node ``op`` on tensors of any strides: a view
    as a reshape."""
    return _COPYING_VIEWS.get(op, op)
