"""Taking a traced explanation's parameter-only arithmetic out of its graph (backends/parameter_only.py).

Hand-made graphs are hoisted, then run after the parameters changed in every way a
training loop or a user changes them; each must give the function's numbers at that
time (float64, exact: the prelude computes what the graph computed). The compiled
backend's explanations are compared with the reference's, 1e-10 relative in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.backends.parameter_only import hoist_parameter_only
from omenn_kernels.testing import change_in_every_way, randomize_, relative_distance

aten = torch.ops.aten


def _targets(module: torch.fx.GraphModule) -> list:
    return [node.target for node in module.graph.nodes if node.op == "call_function"]


def _parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, dtype=torch.float64), requires_grad=False)


def test_parameter_only_arithmetic_is_computed_again_only_when_a_parameter_changed():
    weight, shift = _parameter(4), _parameter(4)

    def explained(x):
        return x * (weight * 2).exp() + shift

    module = make_fx(explained)(torch.randn(4, dtype=torch.float64))
    derived = hoist_parameter_only(module)
    assert derived is not None and len(derived.values) == 1
    assert aten.exp.default not in _targets(module)
    runs = []
    prelude = derived.prelude
    derived.prelude = lambda: runs.append(1) or prelude()
    x = torch.randn(4, dtype=torch.float64)

    def assert_current() -> None:
        derived.refresh()
        torch.testing.assert_close(module(x), explained(x), rtol=0, atol=0)

    assert_current()
    assert len(runs) == 0  # nothing changed since the hoist
    with torch.no_grad():
        weight.add_(1.0)  # an optimizer step
    assert_current()
    assert len(runs) == 1
    weight.data = torch.randn(4, dtype=torch.float64)  # new storage; the version counter may not move
    assert_current()
    assert len(runs) == 2
    with torch.no_grad():
        shift.add_(1.0)  # read by the graph itself, not by the prelude
    assert_current()
    assert len(runs) == 2


def test_views_stay_in_the_graph_and_their_base_is_hoisted():
    weight = _parameter(4)

    def explained(x):
        return x * weight.exp().view(2, 2)

    module = make_fx(explained)(torch.randn(2, 2, dtype=torch.float64))
    derived = hoist_parameter_only(module)
    assert derived is not None and [value.shape for value in derived.values] == [(4,)]
    assert aten.view.default in _targets(module) and aten.exp.default not in _targets(module)


def test_a_value_larger_than_what_it_is_computed_from_stays_in_the_graph():
    """A bias broadcast over the positions by the ones would be a constant per batch size; the
    compiler computes it inside the kernel that reads it."""
    bias = _parameter(4)
    ones = torch.rand(6, 1, dtype=torch.float64)  # a tensor constant, as the folded ones are

    def broadcast(x):
        return x + bias * ones

    def scaled(x):
        return x + (bias * ones.sum()).exp()

    module = make_fx(broadcast)(torch.randn(6, 4, dtype=torch.float64))
    assert hoist_parameter_only(module) is None
    module = make_fx(scaled)(torch.randn(6, 4, dtype=torch.float64))
    assert [value.shape for value in hoist_parameter_only(module).values] == [(4,)]


def test_a_value_the_graph_returns_stays_in_it():
    weight = _parameter(4)

    def explained(x):
        scale = (weight * 2).exp()
        return x * scale, scale

    module = make_fx(explained)(torch.randn(4, dtype=torch.float64))
    assert hoist_parameter_only(module) is None
    assert aten.exp.default in _targets(module)


def test_inference_tensors_are_not_hoisted():
    """They have no version counter, so a change could not be seen."""
    with torch.inference_mode():
        weight = torch.randn(4, dtype=torch.float64)

    def explained(x):
        return x * weight.exp()

    module = make_fx(explained)(torch.randn(4, dtype=torch.float64))
    assert hoist_parameter_only(module) is None


@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
def test_a_kernel_is_kept_in_the_layout_of_its_convolutions_input(memory_format):
    weight, scale = _parameter(5, 3, 3, 3), _parameter(5)

    def explained(x):
        return F.conv2d(x, weight * scale.view(-1, 1, 1, 1), padding=1)

    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).contiguous(memory_format=memory_format)
    module = make_fx(explained)(x)
    derived = hoist_parameter_only(module)
    (kernel,) = derived.values
    assert kernel.is_contiguous(memory_format=memory_format)
    torch.testing.assert_close(module(x), explained(x), rtol=0, atol=0)


class _ConvNet(nn.Module):
    """Convolutions with BatchNorms of few channels (folded biases of at most 8 values) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                                      nn.Conv2d(6, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.GELU())
        self.head = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def _changed_in_every_way(model: _ConvNet) -> None:
    change_in_every_way(model, torch.randn(4, 3, 8, 8, dtype=torch.float64), rebound=model.features[4].weight)


@pytest.mark.parametrize("compiler", ["traced", "inductor"])
def test_compiled_explanations_follow_every_change_of_the_parameters(compiler, monkeypatch):
    """The folded kernels and biases are constants of the graph, computed again after each change.
    With Inductor (one real compilation): a folded bias of at most 8 values, which Inductor writes
    into its code where it is a plain constant, is still read from memory."""
    if compiler == "traced":
        monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model = randomize_(_ConvNet().double(), seed=2).eval()
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    for _ in range(2):  # compiled, then replayed
        explainer(x, 1)
    program, _ = explainer.program(x)
    (explanation,) = compiled.explanations(program).values()
    assert explanation.parameter_derived is not None and len(explanation.parameter_derived.values) == 4
    for _ in range(2):
        _changed_in_every_way(model)
        got, want = explainer(x, 1), reference(x, 1)
        for field in ("weight", "bias", "logit"):
            assert relative_distance(getattr(got, field), getattr(want, field)) <= 1e-10, field


def test_the_graphs_of_two_signatures_share_the_kept_values(monkeypatch):
    """One folded kernel per convolution, whatever the number of signatures (here a class index
    and read-out weights), each graph still following the parameters."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model = randomize_(_ConvNet().double(), seed=4).eval()
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    targets = [1, torch.randn(model(x).shape[1], dtype=torch.float64)]
    for target in targets:
        for _ in range(2):
            explainer(x, target)
    program, _ = explainer.program(x)
    first, second = (explanation.parameter_derived.values for explanation in compiled.explanations(program).values())
    assert len(first) == 4 and all(a is b for a, b in zip(first, second))
    _changed_in_every_way(model)
    for target in targets:
        got, want = explainer(x, target), reference(x, target)
        for field in ("weight", "bias", "logit"):
            assert relative_distance(getattr(got, field), getattr(want, field)) <= 1e-10, field
