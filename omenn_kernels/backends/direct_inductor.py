"""A first-order explanation's graph compiled by Inductor's graph compiler directly, without AOTAutograd.

What and why: Inductor's ``compile_fx`` hands a graph to AOTAutograd, which traces it twice more
(once to collect what its outputs alias, once to functionalize it and apply Inductor's
decompositions) and runs Inductor's joint-graph passes before Inductor's own graph compiler,
``compile_fx_inner``, lowers it. A first-order explanation's graph needs none of that: it is
traced by ``make_fx`` from functional code (:mod:`.strided_writes` keeps autograd's strided
copies functional), holds no autograd, and is traced with Inductor's decompositions
(:func:`decompositions`) merged into the library's own. So it goes to ``compile_fx_inner`` as an
inference graph, its outputs' strides kept, the model's parameters and buffers made inputs (as
AOTAutograd makes them, :func:`_lifted`), boxed. Torch's own ``compile_to_python`` drives
``compile_fx_inner`` the same way on a graph decomposed against Inductor's table. Inductor's
cache keys the graph as given, so a later process that loads the same saved graph
(:mod:`.saved_graphs`) reads the compiled code back without any pass before the lookup.

A graph that holds a mutating op (not :func:`functional`), or that ``compile_fx_inner`` does not
compile, goes through ``compile_fx``; the compiled graph is checked against the fused backend
either way.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx import GraphModule, Node


def decompositions() -> dict:
    """The decomposition table Inductor's lowering expects its input graph to be traced with."""
    from torch._inductor.decomposition import select_decomp_table  # loads Inductor: on first use

    return select_decomp_table()


def functional(graph: GraphModule) -> bool:
    """Whether no op of ``graph`` (or of a subgraph it calls) mutates its arguments."""
    for module in graph.modules():
        if not isinstance(module, GraphModule):
            continue
        for node in module.graph.nodes:
            schema = getattr(node.target, "_schema", None)
            if node.op == "call_function" and schema is not None and schema.is_mutable:
                return False
    return True


def compile_graph(graph: GraphModule, inputs: list[torch.Tensor], cpp_wrapper: bool) -> CompiledGraph:
    """``graph`` compiled by ``compile_fx_inner`` for ``inputs`` (real or fake ones, under a tracing
    context whose fake mode made the fake ones), with a C++ wrapper or Python's."""
    from torch._inductor.compile_fx import _recursive_record_user_visible_output_idxs, compile_fx_inner
    from torch._inductor.cudagraph_utils import BoxedDeviceIndex
    from torch._inductor.utils import BoxedBool, output_node

    # Inductor rewrites the graph in place: the caller's stays as traced (its subgraphs are made for
    # this compilation, see regions).
    code = copy.deepcopy(graph.graph)
    parameters = _lifted(graph, code)
    graph = GraphModule(graph, code)  # holds the attributes its code still reads
    # Fake, also where the caller has real ones (for the C++ wrapper): Inductor's cache keys a real
    # input by its values, and would miss for another model's weights.
    mode = detect_fake_mode(inputs)
    inputs = [t if isinstance(t, FakeTensor) else mode.from_tensor(t, static_shapes=True)
              for t in [*inputs, *parameters]]
    output = output_node(graph)
    output.meta["user_visible_output_idxs"] = [i for i, value in enumerate(output.args[0]) if isinstance(value, Node)]
    _recursive_record_user_visible_output_idxs(graph)
    with torch.no_grad():
        compiled = compile_fx_inner(graph, inputs, static_input_idxs=(), cudagraphs=BoxedBool(False),
                                    is_inference=True, boxed_forward_device_index=BoxedDeviceIndex(None),
                                    cpp_wrapper=cpp_wrapper)
    return CompiledGraph(compiled, parameters)


class CompiledGraph:
    """Inductor's compiled graph as a function of the graph's own inputs: it takes them boxed (a list it
    empties), the lifted parameters appended (see :func:`_lifted`)."""

    def __init__(self, compiled: Callable, parameters: list[torch.Tensor]) -> None:
        self.compiled = compiled
        self.parameters = parameters

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        with torch.no_grad():  # an inference graph: Inductor's out= calls take no tensor that requires a gradient
            return self.compiled([*inputs, *self.parameters])

    @property
    def source_code(self) -> str:
        """The wrapper code Inductor generated (Python, or C++ for its C++ wrapper)."""
        return self.compiled.source_code


def _lifted(module: GraphModule, graph: torch.fx.Graph) -> list[torch.Tensor]:
    """Make ``module``'s parameters and buffers, which ``graph`` (a copy of its graph) reads with ``get_attr``
    nodes, inputs of ``graph`` after its own, as AOTAutograd makes them: the compiled graph reads them at each
    call, so it sees them changed in place, and Inductor's cache keys them by their metadata instead of
    hashing their values. Returns them in order."""
    lifted = dict(module.named_parameters(remove_duplicate=False))
    lifted.update(module.named_buffers(remove_duplicate=False))
    reads = [node for node in graph.find_nodes(op="get_attr") if node.target in lifted]
    if not reads:
        return []
    last = list(graph.find_nodes(op="placeholder"))[-1]
    tensors = []
    for node in reads:
        with graph.inserting_after(last):
            last = graph.placeholder(f"lifted_{len(tensors)}")
        last.meta.update(node.meta)
        node.replace_all_uses_with(last)
        graph.erase_node(node)
        tensors.append(lifted[node.target])
    return tensors

