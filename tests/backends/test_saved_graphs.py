"""Saved traced graphs: a new Explainer (as a new process) loads the graph instead of tracing it.

The graphs are compiled as traced (``COMPILER`` swapped for the identity, saved as Inductor's
would be); tolerances are the fused backend's in float64, 1e-10 relative.
"""

from __future__ import annotations

import logging
import operator
import os
import pickle

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled, regions, saved_graphs
from omenn_kernels.capture import bound_tensors

from test_compiled_backend import _assert_equal_explanations, _model


@pytest.fixture
def saving(monkeypatch, tmp_path):
    """Traced graphs compiled as they are, and saved in an Inductor cache folder of this test's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    monkeypatch.setattr(compiled, "SAVE_WITH_ANY_COMPILER", True)
    return tmp_path / "omenn_graphs"


def _explained(model: torch.nn.Module, x: torch.Tensor):
    """A new Explainer's explanation of class 1 and how its graph was made (its stages)."""
    explainer = Explainer(model, backend="compiled")
    explanation = explainer(x, 1)
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    return explanation, tuple(kept.stages)


def test_a_new_explainer_loads_the_saved_graph_and_reads_the_models_parameters(saving):
    """The first Explainer traces and saves; a new one of the same model loads the graph, with the
    same numbers; after a change of the parameters and buffers (BatchNorm statistics) it loads it
    again and explains with the new ones; another input shape traces anew."""
    model, x = _model("cnn", torch.float64)
    first, stages = _explained(model, x)
    assert "trace" in stages and len(list(saving.glob("*.pt"))) == 1
    again, stages = _explained(model, x)
    assert stages == ("load",)
    for field in ("contribution", "weight", "bias", "logits"):
        assert torch.equal(getattr(again, field), getattr(first, field)), field

    with torch.no_grad():
        for tensor in [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]:
            tensor.mul_(1 + 0.1 * torch.rand_like(tensor))
    changed, stages = _explained(model, x)
    assert stages == ("load",)
    _assert_equal_explanations(changed, Explainer(model, backend="fused")(x, 1), torch.float64)

    _, stages = _explained(model, torch.randn(2, 3, 24, 24, dtype=torch.float64))
    assert "trace" in stages


def test_a_damaged_or_wrongly_bound_saved_graph_is_traced_again(saving, caplog):
    """A file that does not unpickle, and a graph whose parameters are bound to the wrong tensors
    (its logits are not the model's), are traced again (logged), and the file is replaced."""
    model, x = _model("cnn", torch.float64)
    expected, _ = _explained(model, x)
    (path,) = saving.glob("*.pt")
    saved = path.read_bytes()

    path.write_bytes(saved[:len(saved) // 2])
    with caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        got, stages = _explained(model, x)
    assert "trace" in stages and "could not be loaded" in caplog.text
    _assert_equal_explanations(got, expected, torch.float64)
    assert _explained(model, x)[1] == ("load",)  # saved anew

    # Two tensors of one shape (a BatchNorm's weight and bias) swapped: the graph runs, wrongly.
    explainer = Explainer(model, backend="fused")
    shapes = {name: tuple(t.shape) for name, t in bound_tensors(explainer.program(x)[0].captured, model).items()}
    record = pickle.loads(saved)
    names = record["prelude"]["names"]
    first, second = next((a, b) for a in names for b in names
                         if a < b and names[a] != names[b] and shapes[names[a]] == shapes[names[b]])
    names[first], names[second] = names[second], names[first]
    path.write_bytes(pickle.dumps(record))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        got, stages = _explained(model, x)
    assert "trace" in stages
    assert "could not be compiled" in caplog.text or "does not give the model's logits" in caplog.text
    _assert_equal_explanations(got, expected, torch.float64)


def test_a_graph_is_saved_whole_for_every_user_or_not_at_all(saving, monkeypatch, caplog):
    """A write that fails (a full disk) leaves no file behind, logged, and the explanation stands;
    a saved graph is readable by every user of a shared cache, as Inductor's files are."""
    model, x = _model("cnn", torch.float64)

    def full_disk(source, destination):
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as patched, caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        patched.setattr(os, "replace", full_disk)
        explanation, _ = _explained(model, x)
    assert "not saved for later processes" in caplog.text and "No space left" in caplog.text
    assert list(saving.iterdir()) == []
    _assert_equal_explanations(explanation, Explainer(model, backend="fused")(x, 1), torch.float64)

    _explained(model, x)  # a new explainer traces again, and saves
    (path,) = saving.iterdir()
    assert path.suffix == ".pt" and path.stat().st_mode & 0o777 == 0o644


def test_a_loaded_graph_computes_each_op_at_each_call_and_keeps_its_code(saving):
    """A graph is saved node for node: rebuilt, it has the traced graph's code (Inductor's cache keys
    a graph by its code), and an op of no inputs that the graph writes into in place is computed
    again at each call, so no call sees another's writes."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    buffer = graph.call_function(torch.ops.aten.full.default, ([3],), {"fill_value": 1.0, "dtype": torch.float64})
    graph.call_function(torch.ops.aten.add_.Tensor, (buffer, x))
    doubled = graph.call_function(operator.mul, (buffer, graph.get_attr("scale")))
    graph.output((doubled,))
    module = torch.fx.GraphModule({"scale": torch.tensor(2.0, dtype=torch.float64)}, graph)
    module.graph.find_nodes(op="get_attr")[0].meta[regions.REGION] = ("forward", "blocks.0")

    loaded = saved_graphs._bound(pickle.loads(pickle.dumps(saved_graphs._skeleton(module, {}))), {})
    assert loaded.code == module.code
    assert loaded.graph.find_nodes(op="get_attr")[0].meta[regions.REGION] == ("forward", "blocks.0")
    x = torch.rand(3, dtype=torch.float64)
    for _ in range(2):
        (got,) = loaded(x)
        torch.testing.assert_close(got, 2 * (1 + x), rtol=0, atol=0)


def test_a_graph_that_calls_a_function_not_found_by_name_is_not_saved(saving):
    """A target that its module and name do not give back (a local function) cannot be saved."""
    def local(tensor):
        return tensor + 1

    graph = torch.fx.Graph()
    graph.output(graph.call_function(local, (graph.placeholder("x"),)))
    module = torch.fx.GraphModule({}, graph)
    with pytest.raises(TypeError, match="cannot be found again by its name"):
        saved_graphs._skeleton(module, {})
