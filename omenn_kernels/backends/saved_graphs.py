"""A compiled signature's traced graph kept on disk, so that a new process does not trace it again.

What and why: Inductor keeps the code it generates on disk, so a second process compiles a
signature from its cache; but before it can look there, each process traces the explanation
(``make_fx``), runs the graph passes and checks the traced and compiled graphs against the
fused backend, which together take longer than the compilation on a warm cache. So once a
graph has passed its checks, :func:`save` writes it next to Inductor's cache
(``<TORCHINDUCTOR_CACHE_DIR>/omenn_graphs``), and :func:`load` gives a later process the
graph for the same key, its parameters bound from the model, ready to compile.

The file holds the graph after its passes and the prelude of its parameter-only values
(:mod:`~omenn_kernels.backends.parameter_only`), each node by node, with the model's
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
import importlib
import logging
import operator
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule, Node
from torch.fx._lazy_graph_module import _LazyGraphModule

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


@dataclass(frozen=True)
class _Node:
    """A reference to the node of this name, in a saved node's arguments."""

    name: str


def _target(node: Node) -> object:
    """How a node's target is saved: an operator by its name (``aten.mm.default``), another function by
    its module and name, an input, attribute or output by its string."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return ("op", str(target))
    module, name = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if module is None or "<" in name or _resolved(("function", module, name)) is not target:
        raise TypeError(f"the graph calls {target!r}, which cannot be found again by its name")
    return ("function", module, name)


def _resolved(target: object) -> object:
    """The target that :func:`_target` saved."""
    if isinstance(target, str):
        return target
    if target[0] == "op":
        namespace, name, overload = target[1].split(".")
        return getattr(getattr(getattr(torch.ops, namespace), name), overload)
    return operator.attrgetter(target[2])(importlib.import_module(target[1]))


def _skeleton(module: GraphModule, bound: dict[tuple, str], left_out: set[str] = frozenset()) -> dict:
    """``module`` as data: each node (its kind, name, target, arguments and the labels that outlining
    repeated blocks reads, :mod:`.regions`), its own tensor constants by value, and per model tensor
    it reads the name that tensor is bound under (the attributes ``left_out`` neither).

    Rebuilt node for node (:func:`_bound`), the graph has the same code, so a later process finds
    the compiled graph in Inductor's cache, which keys a graph by its code.
    """
    nodes = []
    for node in module.graph.nodes:
        labels = {regions.REGION: node.meta.get(regions.REGION),
                  regions.DESCRIBED: regions.described(node.meta["val"]) if "val" in node.meta
                  else node.meta.get(regions.DESCRIBED)}
        nodes.append((node.op, node.name, _target(node), torch.fx.node.map_arg(node.args, lambda n: _Node(n.name)),
                      torch.fx.node.map_arg(node.kwargs, lambda n: _Node(n.name)),
                      {key: label for key, label in labels.items() if label is not None}))
    constants: dict[str, torch.Tensor] = {}
    names: dict[str, str] = {}
    for node in module.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(module)
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"the graph reads {node.target}, a {type(value).__name__}, not a tensor")
        if "." in node.target:
            raise ValueError(f"the graph reads {node.target}, an attribute of a submodule")
        if _tensor_key(value) in bound:
            names[node.target] = bound[_tensor_key(value)]
        elif node.target not in left_out:
            constants[node.target] = value.detach()
    return {"nodes": nodes, "constants": constants, "names": names}


def record(program: LinearizedProgram, model: torch.nn.Module, graph: GraphModule,
           parameter_derived: ParameterDerived | None, flops: int) -> dict:
    """What :func:`save` writes of ``graph`` and the prelude of its parameter-only values."""
    bound = {_tensor_key(t): name for name, t in bound_tensors(program.captured, model).items()
             if isinstance(t, torch.Tensor)}
    index = {id(value): i for i, value in enumerate(parameter_derived.values)} if parameter_derived else {}
    derived = {node.target: (index[id(getattr(graph, node.target))], tuple(getattr(graph, node.target).stride()))
               for node in graph.graph.nodes
               if node.op == "get_attr" and id(getattr(graph, node.target)) in index}
    return {"flops": flops, "derived": derived, "graph": _skeleton(graph, bound, set(derived)),
            "prelude": _skeleton(parameter_derived.prelude, bound) if parameter_derived else None}


def bound(saved: dict, program: LinearizedProgram, model: torch.nn.Module) -> SavedGraph:
    """The graph of a :func:`record`, reading ``model``'s tensors, its parameter-only values computed."""
    named = {name: t for name, t in bound_tensors(program.captured, model, differentiable=True).items()
             if isinstance(t, torch.Tensor)}
    derived: dict[str, torch.Tensor] = {}
    parameter_derived = None
    if saved["prelude"] is not None:
        prelude = _bound(saved["prelude"], named)
        with torch.no_grad():
            fresh = prelude()
        values = list(fresh)
        for attribute, (index, stride) in saved["derived"].items():
            value = fresh[index]
            values[index] = derived[attribute] = torch.empty_strided(
                value.shape, stride, dtype=value.dtype, device=value.device).copy_(value)
        sources = [getattr(prelude, node.target) for node in prelude.graph.nodes if node.op == "get_attr"]
        parameter_derived = ParameterDerived(prelude, values, sources)
    graph = _bound(saved["graph"], named, derived)
    graph.meta["matrix_flops"] = saved["flops"]
    return SavedGraph(graph, parameter_derived)


def _bound(skeleton: dict, named: dict[str, torch.Tensor], derived: dict[str, torch.Tensor] | None = None
           ) -> GraphModule:
    """The module of a :func:`_skeleton`, reading the model's parameters and buffers themselves (as a
    traced graph does, so that it sees them change, ``.data`` re-bound included), its own constants
    and the ``derived`` values left out of the skeleton as buffers."""
    graph = torch.fx.Graph()
    built: dict[str, Node] = {}

    def node_of(reference: _Node) -> Node:
        return built[reference.name]

    for op, name, target, args, kwargs, labels in skeleton["nodes"]:
        args = torch.fx.node.map_aggregate(args, lambda a: node_of(a) if isinstance(a, _Node) else a)
        kwargs = torch.fx.node.map_aggregate(kwargs, lambda a: node_of(a) if isinstance(a, _Node) else a)
        node = graph.create_node(op, _resolved(target), args, kwargs, name=name)
        if node.name != name:
            raise ValueError(f"the saved graph names two nodes {name}")
        node.meta.update(labels)
        built[name] = node
    root = torch.nn.Module()
    for target, name in skeleton["names"].items():
        value = named[name]
        if isinstance(value, torch.nn.Parameter):
            root.register_parameter(target, value)
        else:
            root.register_buffer(target, value)
    for target, value in {**skeleton["constants"], **(derived or {})}.items():
        root.register_buffer(target, value)
    return _LazyGraphModule(root, graph)  # its code generated where it is read or run: outlining makes new modules


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
