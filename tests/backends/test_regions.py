"""Regional compilation: repeated blocks of a traced explanation outlined into one shared subgraph each.

The outlined graph runs eagerly here (``invoke_subgraph`` calls its subgraph), op for op the
traced graph's: float64, equal to 1e-12 relative. One test compiles with Inductor.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled, regions
from omenn_kernels.testing import randomize_, relative_distance

from test_compiled_backend import _assert_equal_explanations, _model as _family_model

INVOKE = torch.ops.higher_order.invoke_subgraph


def _model(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """A test family's model; BEiT with three blocks, since its last block, which computes
    only the pooled tokens after its attention (early selection), is no twin of the others."""
    if name != "beit":
        return _family_model(name, dtype)
    import timm

    torch.manual_seed(5)
    model = timm.create_model("beit_base_patch16_224", img_size=64, depth=3, num_classes=10)
    return randomize_(model, seed=5).to(dtype).eval(), torch.randn(2, 3, 64, 64, dtype=dtype)


def _outlined_calls(graph: torch.fx.GraphModule) -> Counter:
    """Per shared subgraph, how often the graph calls it."""
    return Counter(node.args[1] for node in graph.graph.nodes if node.target is INVOKE)


@pytest.fixture
def outlining(monkeypatch):
    """Compile with the outlined traced graph, after checking it against the traced graph on the
    example inputs; the outlined graphs compiled, in order."""
    graphs = []

    def compiler(graph, example):
        outlined = regions.outlined(graph)
        if outlined is None:
            return graph
        with torch.no_grad():
            for got, want in zip(outlined(*example), graph(*example)):
                assert torch.equal(got, want) if not got.is_floating_point() else \
                    relative_distance(got, want) <= 1e-12
        graphs.append(outlined)
        return outlined
    monkeypatch.setattr(compiled, "COMPILER", compiler)
    return graphs


@pytest.mark.parametrize("name, depth", [("vit", 11), ("beit", 2), ("swin", None), ("convnext", None),
                                         ("resnet", None), ("torchvision_vit", None)])
def test_repeated_blocks_are_outlined_with_the_fused_numbers(name, depth, outlining):
    """A transformer of ``depth`` identical layers (the last layer, which computes only the class
    token or the pooled tokens after its attention, is another): the forward of a layer and its
    backward are one subgraph each, called once per identical layer. Other models (stages of other widths, shifted windows, a
    first layer whose input has other strides): twins called at least twice each, a smaller graph."""
    model, x = _model(name, torch.float64)
    explainer = Explainer(model, backend="compiled")
    for _ in range(2):  # compiles, then runs the outlined graph
        _assert_equal_explanations(explainer(x, 1), Explainer(model, backend="fused")(x, 1), torch.float64)
    (graph,) = outlining
    calls = _outlined_calls(graph)
    if depth is not None:
        assert sorted(calls.values()) == [depth, depth], calls
    assert calls and all(count >= 2 for count in calls.values()), calls
    (traced,) = compiled.explanations(explainer.program(x)[0]).values()
    assert len(graph.graph.nodes) < len(traced.graph.graph.nodes)


def test_blocks_of_other_shapes_are_not_twins(outlining):
    """Blocks of one code but other widths, and a model without indexed blocks, stay inline."""
    torch.manual_seed(0)
    widths = (6, 6, 8, 8, 8)
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.GELU())
                                 for a, b in zip(widths, widths[1:]))

    class Blocks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers, self.head = layers, torch.nn.Linear(8, 3)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    from omenn_kernels.testing import randomize_
    model = randomize_(Blocks(), seed=1).double().eval()
    x = torch.randn(3, 6, dtype=torch.float64)
    _assert_equal_explanations(Explainer(model, backend="compiled")(x, 1), Explainer(model, backend="fused")(x, 1),
                               torch.float64)
    (graph,) = outlining
    # layers.0 (6 → 6) and layers.1 (6 → 8) have no twin; layers.2 and layers.3 (8 → 8) are twins
    assert set(_outlined_calls(graph).values()) == {2}

    outlining.clear()
    model, x = _model("mlp", torch.float64)
    Explainer(model, backend="compiled")(x, 1)
    assert not outlining


def test_every_readouts_backward_is_outlined_apart(outlining):
    """Several read-outs per image (one backward each): each backward's blocks are twins of the others'."""
    model, x = _model("vit", torch.float64)
    targets = torch.eye(10, dtype=torch.float64)[torch.tensor([[1, 2, 3], [4, 5, 6]])]  # (B, T, K) read-out weights
    got = Explainer(model, backend="compiled").explain_targets(x, targets)
    _assert_equal_explanations(got, Explainer(model, backend="fused").explain_targets(x, targets), torch.float64)
    (graph,) = outlining
    calls = sorted(_outlined_calls(graph).values())
    assert calls[-1] >= 3 * 2  # one backward subgraph, called per block and read-out


def test_a_loaded_graph_is_outlined_as_the_saved_one(outlining, monkeypatch, tmp_path):
    """A new process's loaded graph carries its regions: its outlined code is the saving process's,
    so Inductor finds that code in its cache."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "SAVE_WITH_ANY_COMPILER", True)
    model, x = _model("vit", torch.float64)
    Explainer(model, backend="compiled")(x, 1)
    explainer = Explainer(model, backend="compiled")
    explainer(x, 1)
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    assert tuple(kept.stages) == ("load",)
    saved, loaded = outlining

    def code(graph):
        return [graph.code] + [getattr(graph, name).code for name in sorted(_outlined_calls(graph))]
    assert code(loaded) == code(saved) and len(_outlined_calls(loaded)) == 2


def test_inductor_compiles_the_outlined_blocks_once(monkeypatch, caplog, tmp_path):
    """Real Inductor, the Python wrapper: a three-layer BEiT's outlined explanation compiles (no fallback to
    the whole graph, nor to the fused backend) and equals the reference; each subgraph is generated once."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "CPP_WRAPPER_FLOPS_PER_THREAD", 0)
    model, x = _model("beit", torch.float32)
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG, logger="omenn_kernels.compiled"):
        warnings.filterwarnings("error", message="omenn_kernels")  # a fallback to the fused backend would warn
        explainer(x, 1)
        _assert_equal_explanations(explainer(x, 1), Explainer(model, backend="reference")(x, 1), torch.float32)
    assert "outlined" in caplog.text and "did not compile" not in caplog.text
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    source = kept.run.source_code
    subgraphs = [line for line in source.splitlines() if line.startswith("def omenn_region")]
    assert len(subgraphs) == 2 and all(source.count(f"{line[4:line.index('(')]}(") >= 3 for line in subgraphs)
