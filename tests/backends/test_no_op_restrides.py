"""In-place restrides that move no element, dropped from a traced explanation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.backends.no_op_restrides import drop_no_op_restrides
from omenn_kernels.backends.shape_only import fold_shape_only
from omenn_kernels.testing import randomize_

aten = torch.ops.aten


def _restrided(x: torch.Tensor, stride: list[int]) -> torch.Tensor:
    pooled = x.mean((-1, -2), keepdim=True)
    return pooled.as_strided_(pooled.shape, stride) * 2


def _count(module: torch.fx.GraphModule) -> int:
    return sum(node.target is aten.as_strided_.default for node in module.graph.nodes)


def test_a_restride_along_axes_of_size_one_is_dropped():
    x = torch.randn(2, 5, 4, 4, dtype=torch.float64)
    module = make_fx(lambda x: _restrided(x, [5, 1, 5, 5]))(x)
    assert _count(module) == 1
    assert drop_no_op_restrides(module) == 1 and _count(module) == 0
    other = torch.randn_like(x)
    torch.testing.assert_close(module(other), _restrided(other, [5, 1, 5, 5]), rtol=0, atol=0)


def test_a_restride_that_moves_elements_stays():
    x = torch.randn(2, 3, 1, 1, dtype=torch.float64)
    module = make_fx(lambda x: x.clone().as_strided_((2, 3, 1, 1), (1, 2, 1, 1)) * 2)(x)
    assert drop_no_op_restrides(module) == 0 and _count(module) == 1
    torch.testing.assert_close(module(x), x.clone().as_strided_((2, 3, 1, 1), (1, 2, 1, 1)) * 2, rtol=0, atol=0)


class _ChannelsLastPooled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 6, 3, padding=1)
        self.head = torch.nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pooled = F.adaptive_avg_pool2d(torch.relu(self.conv(x)), 1)
        return self.head(pooled.flatten(1))


def test_the_pooled_ones_of_a_channels_last_model_fold(monkeypatch):
    """A channels-last input's global average pool is a mean and an ``as_strided_`` (ATen's
    ``adaptive_avg_pool2d``): dropped from the graph, which stays exact."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model = randomize_(_ChannelsLastPooled(), seed=4).double().eval().to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64).contiguous(memory_format=torch.channels_last)

    def traced() -> tuple[Explainer, list[torch.fx.Node]]:
        explainer = Explainer(model, backend="compiled")
        explainer(x, 1)
        (explanation,) = compiled.explanations(explainer.program(x)[0]).values()
        return explainer, list(explanation.graph.graph.nodes)

    explainer, nodes = traced()
    with monkeypatch.context() as kept:
        kept.setattr(compiled, "drop_no_op_restrides", lambda graph: 0)
        _, nodes_kept = traced()
    assert any(node.target is aten.as_strided_.default for node in nodes_kept)
    assert not any(node.target is aten.as_strided_.default for node in nodes)
    other = torch.randn_like(x)
    reference = Explainer(model, backend="reference")(other, 1)
    got = explainer(other, 1)
    torch.testing.assert_close(got.weight, reference.weight, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got.bias, reference.bias, rtol=1e-10, atol=1e-12)


def _pooled_ones(x: torch.Tensor) -> torch.Tensor:
    ones = x.new_ones(x.shape[0], 1, *x.shape[2:])
    pooled = ones.mean((-1, -2), keepdim=True).as_strided_((x.shape[0], 1, 1, 1), (1, 1, 1, 1))
    return x * torch.exp(pooled)


def test_a_shape_only_value_restrided_in_place_folds_once_the_restride_is_dropped():
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64)
    written = make_fx(_pooled_ones)(x)
    assert fold_shape_only(written, [x]) == 0, "written in place: not shape-only"
    module = make_fx(_pooled_ones)(x)
    assert drop_no_op_restrides(module) == 1
    assert fold_shape_only(module, [x]) >= 1
    other = torch.randn_like(x)
    torch.testing.assert_close(module(other), _pooled_ones(other), rtol=0, atol=0)
