"""A compiled signature's traced graph kept on disk, so that a new process does not trace it again.

What and why: Inductor keeps the code it generates on disk, so a second process compiles a
signature from its cache; but before it can look there, each process traces the explanation
(``make_fx``), runs the graph passes and checks the traced and compiled graphs against the
fused backend, which together take longer than the compilation on a warm cache. So once a
graph has passed its checks, :func:`save` writes it next to Inductor's cache
(``<TORCHINDUCTOR_CACHE_DIR>/omenn_graphs``), and :func:`load` gives a later process the
graph for the same key, its parameters bound from the model, ready to compile.

The file holds the graph after its passes and the prelude of its parameter-only values
(:mod:`~omenn_kernels.backends.parameter_only`), each as its code, with the model's
parameters and buffers named (bound again by name on loading, so the graph reads the
model's current tensors) and the graph's own constants (the shape-only values,
:mod:`~omenn_kernels.backends.shape_only`) by value.

The key (:func:`key`) hashes what the trace depends on: the library's source and torch's
version, the captured graph and the program's rules, the name, shape, strides, dtype,
device and ``requires_grad`` of every tensor the capture binds, and the compiled signature;
so a model of the same structure with other weights (parameters and buffers) loads it too.
A trace depends on no tensor's values: the ones checks of a traced forward are decided by
shapes, or not decided and then not read (:class:`~omenn_kernels.linearize.values.OnesChecks`),
and the values the graph computes from parameters and buffers are graph inputs or recomputed
from them (the prelude). Differentiable explanations and read-out functions (whose identity is
the process's) are not saved.
"""

from __future__ import annotations

import functools
import hashlib
import io
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule

from ..atomic_file import write_atomically
from ..capture import bound_tensors
from ..errors import first_line
from ..linearize.program import LinearizedProgram
from . import regions
from .parameter_only import ParameterDerived

log = logging.getLogger("omenn_kernels.compiled")

# Saved graphs kept, the least recently used removed first (a graph is a few hundred KiB to a few MiB).
MAX_SAVED = 64


@dataclass
class SavedGraph:
    """A loaded graph: what :func:`~omenn_kernels.backends.compiled.inductor` compiles, bound to the model."""

    graph: GraphModule  # its ``meta["matrix_flops"]`` chooses Inductor's wrapper (the graph keeps no shapes)
    parameter_derived: ParameterDerived | None


def folder() -> Path:
    """Where saved graphs are kept: ``omenn_graphs`` in Inductor's cache folder."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "omenn_graphs"


@functools.cache
def _source_digest() -> str:
    """sha256 of the library's Python source: a changed rule, pass or file layout traces another graph."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def _tensor_key(tensor: torch.Tensor) -> tuple:
    """The tensor's memory, as the graph's constants and the model's bound tensors share it."""
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tuple(tensor.stride()), tensor.dtype, tensor.device)


def key(program: LinearizedProgram, model: torch.nn.Module, signature: tuple) -> str:
    """The hash under which the graph of ``signature`` is saved (see the module docstring)."""
    digest = hashlib.sha256()
    digest.update(f"{torch.__version__} {_source_digest()}".encode())
    digest.update(program.captured.graph.python_code("self").src.encode())
    digest.update(str(program).encode())
    digest.update(repr((program.feature_dim, program.captured.batch_range, signature)).encode())
    for name, value in sorted(bound_tensors(program.captured, model).items()):
        if isinstance(value, torch.Tensor):
            digest.update(repr((name, tuple(value.shape), value.stride(), value.dtype, str(value.device),
                                value.requires_grad)).encode())
        else:
            digest.update(repr((name, value)).encode())
    return digest.hexdigest()


def _skeleton(module: GraphModule, bound: dict[tuple, str], left_out: set[str] = frozenset()
              ) -> tuple[bytes, dict[str, str]]:
    """``module`` pickled without the model's tensors (nor the attributes ``left_out``), and per
    model tensor left out the name it is bound under.

    Every tensor attribute is pickled as a parameter: unpickling traces the graph's code again,
    which keeps the names of parameters and renames other tensor attributes.
    """
    attributes: dict[str, object] = {}
    named: dict[str, str] = {}
    for node in module.graph.nodes:
        if node.op != "get_attr":
            continue
        value = getattr(module, node.target)
        if not isinstance(value, torch.Tensor):
            attributes[node.target] = value
            continue
        if node.target in left_out:
            value = torch.empty(0, device="meta")
        elif _tensor_key(value) in bound:
            named[node.target] = bound[_tensor_key(value)]
            value = torch.empty(0, device="meta")
        attributes[node.target] = torch.nn.Parameter(value.detach(), requires_grad=False)
    copy = torch.fx.Graph()  # a copy: a GraphModule takes its graph over
    copy.output(copy.graph_copy(module.graph, {}))
    buffer = io.BytesIO()
    pickle.dump(GraphModule(attributes, copy), buffer)
    return buffer.getvalue(), named


def record(program: LinearizedProgram, model: torch.nn.Module, graph: GraphModule,
           parameter_derived: ParameterDerived | None, flops: int) -> dict:
    """What :func:`save` writes of ``graph`` and the prelude of its parameter-only values."""
    bound = {_tensor_key(t): name for name, t in bound_tensors(program.captured, model).items()
             if isinstance(t, torch.Tensor)}
    index = {id(value): i for i, value in enumerate(parameter_derived.values)} if parameter_derived else {}
    derived = {node.target: (index[id(getattr(graph, node.target))], tuple(getattr(graph, node.target).stride()))
               for node in graph.graph.nodes
               if node.op == "get_attr" and id(getattr(graph, node.target)) in index}
    # Per input and operation in order, what outlining repeated blocks reads (:mod:`.regions`): the
    # saved code keeps no metadata.
    labels = [(node.meta.get(regions.REGION), regions.described(node.meta["val"]) if "val" in node.meta else None)
              for node in _labelled(graph)]
    return {"flops": flops, "derived": derived, "regions": labels,
            "graph": _skeleton(graph, bound, set(derived)),
            "prelude": _skeleton(parameter_derived.prelude, bound) if parameter_derived else None}


def bound(saved: dict, program: LinearizedProgram, model: torch.nn.Module) -> SavedGraph:
    """The graph of a :func:`record`, reading ``model``'s tensors, its parameter-only values computed."""
    named = {name: t for name, t in bound_tensors(program.captured, model, differentiable=True).items()
             if isinstance(t, torch.Tensor)}
    graph = _bound(saved["graph"], named)
    parameter_derived = None
    if saved["prelude"] is not None:
        prelude = _bound(saved["prelude"], named)
        with torch.no_grad():
            fresh = prelude()
        values = list(fresh)
        for attribute, (index, stride) in saved["derived"].items():
            value = fresh[index]
            values[index] = torch.empty_strided(value.shape, stride, dtype=value.dtype,
                                                device=value.device).copy_(value)
            setattr(graph, attribute, values[index])
        sources = [getattr(prelude, node.target) for node in prelude.graph.nodes if node.op == "get_attr"]
        parameter_derived = ParameterDerived(prelude, values, sources)
    graph.recompile()
    graph.meta["matrix_flops"] = saved["flops"]
    nodes = _labelled(graph)
    if len(nodes) == len(saved["regions"]):
        for node, (label, description) in zip(nodes, saved["regions"]):
            if label is not None:
                node.meta[regions.REGION] = label
            if description is not None:
                node.meta[regions.DESCRIBED] = description
    return SavedGraph(graph, parameter_derived)


def _labelled(graph: GraphModule) -> list[torch.fx.Node]:
    """The nodes that keep their order when the graph's code is traced again: its inputs and the
    operations that read an input or attribute (operations of none, ``zeros`` and what is computed
    from it alone, come back as constants)."""
    constant: set[torch.fx.Node] = set()
    labelled = []
    for node in graph.graph.nodes:
        if node.op == "call_function" and all(arg in constant for arg in node.all_input_nodes):
            constant.add(node)
        elif node.op in ("placeholder", "call_function"):
            labelled.append(node)
    return labelled


def _bound(skeleton: tuple[bytes, dict[str, str]], named: dict[str, torch.Tensor]) -> GraphModule:
    """The pickled module reading the model's parameters and buffers themselves (as a traced graph
    does, so that it sees them change, ``.data`` re-bound included), its own constants as buffers."""
    data, names = skeleton
    module = pickle.loads(data)
    for node in module.graph.nodes:
        if node.op == "get_attr" and node.target in module._parameters:
            own = module._parameters.pop(node.target)
            value = named[names[node.target]] if node.target in names else own.data
            if isinstance(value, torch.nn.Parameter):
                module._parameters[node.target] = value
            else:
                module.register_buffer(node.target, value)
    return module


def save(file_key: str, saved: dict) -> None:
    """Write a :func:`record` under ``file_key``, whole or not at all (also where another process
    writes it); a failure is logged, never raised: the graph is only not saved."""
    try:
        target = folder() / f"{file_key}.pt"
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(target, lambda path: path.write_bytes(pickle.dumps(saved)))
        kept = sorted(target.parent.glob("*.pt"), key=_last_used, reverse=True)
        for stale in kept[MAX_SAVED:]:
            stale.unlink(missing_ok=True)
    except OSError as error:
        log.info("the traced explanation was not saved for later processes: %s", first_line(error))


def _last_used(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:  # removed meanwhile by another process
        return 0.0


def exists(file_key: str) -> bool:
    """Whether a graph is saved under ``file_key``."""
    return (folder() / f"{file_key}.pt").is_file()


def load(file_key: str, program: LinearizedProgram, model: torch.nn.Module) -> SavedGraph | None:
    """The graph saved under ``file_key``, bound to ``model``'s tensors; None where none is saved
    or it cannot be read (logged: it is traced again, and saved anew)."""
    path = folder() / f"{file_key}.pt"
    if not path.is_file():
        return None
    try:
        with open(path, "rb") as file:
            saved = pickle.load(file)
        os.utime(path)  # used: the last to be removed (see MAX_SAVED)
        return bound(saved, program, model)
    except Exception as error:  # noqa: BLE001 — a damaged file is traced again and replaced
        log.info("the saved traced explanation %s could not be loaded (%s); tracing it again", path,
                 first_line(error))
        return None
