"""Folding a traced explanation's shape-only values (the ones channel's forward) into constants.

Each hand-made graph is folded on one input and then run on another of the same shape:
a value folded that was not shape-only would give the first input's numbers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.backends.shape_only import fold_shape_only
from omenn_kernels.testing import FAMILIES, randomize_

aten = torch.ops.aten


def _targets(module: torch.fx.GraphModule) -> list:
    return [node.target for node in module.graph.nodes if node.op == "call_function"]


def _folded(function, *example: torch.Tensor) -> tuple[torch.fx.GraphModule, int]:
    module = make_fx(function)(*example)
    return module, fold_shape_only(module, list(example))


def test_window_sums_of_the_ones_become_constants():
    def explained(x):
        window_sum = F.conv2d(x.new_ones(1, 1, *x.shape[2:]), x.new_ones(1, 1, 3, 3), padding=1)
        return x * window_sum

    module, folded = _folded(explained, torch.randn(2, 3, 5, 5))
    assert folded == 1 and aten.convolution.default not in _targets(module)
    other = torch.randn(2, 3, 5, 5)
    torch.testing.assert_close(module(other), explained(other), rtol=0, atol=0)


def test_a_value_written_in_place_is_not_folded():
    def explained(x):
        accumulated = x.new_zeros(x.shape).exp()  # arithmetic on a factory: foldable but for the write
        accumulated.add_(x)
        return accumulated * 2

    module, folded = _folded(explained, torch.randn(4))
    assert folded == 0
    other = torch.randn(4)
    torch.testing.assert_close(module(other), explained(other), rtol=0, atol=0)


def test_a_selection_by_the_input_is_folded_only_from_a_uniform_tensor():
    def from_ones(x, indices):
        return x * x.new_ones(3, 8).exp().gather(-1, indices)

    def from_positions(x, indices):
        return x * torch.arange(8, dtype=x.dtype).expand(3, 8).exp().gather(-1, indices)

    indices, other_indices = torch.tensor([[0, 1], [2, 3], [4, 5]]), torch.tensor([[7, 6], [5, 4], [3, 2]])
    x, other = torch.randn(3, 2), torch.randn(3, 2)
    for function, gathers in ((from_ones, False), (from_positions, True)):
        module, folded = _folded(function, x, indices)
        assert folded == 1 and (aten.gather.default in _targets(module)) == gathers, function.__name__
        torch.testing.assert_close(module(other, other_indices), function(other, other_indices), rtol=0, atol=0)


def test_parameters_are_never_folded_and_in_place_updates_are_seen():
    weight = torch.randn(4)

    def explained(x):
        return x * (weight * 2).exp()

    module, folded = _folded(explained, torch.randn(4))
    assert folded == 0
    with torch.no_grad():
        weight.add_(1.0)
    other = torch.randn(4)
    torch.testing.assert_close(module(other), explained(other), rtol=0, atol=0)


def test_a_compiled_cnn_computes_no_window_sum_per_call(monkeypatch):
    """The CNN family (convolutions with padding and stride, max and average pooling): its
    ones' forward is all constants, max pooling's selection of the ones included."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    family = FAMILIES["cnn"]
    torch.manual_seed(3)
    model = randomize_(family.build(), seed=3).double().eval()
    x = torch.randn(2, 3, family.size, family.size, dtype=torch.float64)
    explainer = Explainer(model, backend="compiled")
    explainer(x, 1)
    (explanation,) = compiled.explanations(explainer.program(x)[0]).values()
    window_sums = [node for node in explanation.graph.graph.nodes
                   if node.target is aten.convolution.default and node.args[1].op != "get_attr"
                   and node.args[1].target in (aten.new_ones.default, aten.ones.default)]
    assert window_sums == []
    assert any(node.op == "get_attr" and node.target.startswith("_shape_only_")
               for node in explanation.graph.graph.nodes)
    other = torch.randn_like(x)
    reference = Explainer(model, backend="reference")(other, 1)
    got = explainer(other, 1)
    torch.testing.assert_close(got.weight, reference.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.bias, reference.bias, rtol=1e-10, atol=1e-12)
