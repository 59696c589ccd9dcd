"""The traced graph's views written as reshapes, except where a write in place needs the view."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels.backends.views_as_reshapes import views_as_reshapes

aten = torch.ops.aten


def _targets(graph: torch.fx.GraphModule) -> list:
    return [node.target for node in graph.graph.nodes if node.target in (aten.view.default, aten.reshape.default)]


def test_a_view_becomes_a_reshape_that_takes_a_transposed_tensor():
    def f(x):
        return (x * 2).view(6, 4).sum(0)

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    graph = make_fx(f)(x)
    assert _targets(graph) == [aten.view.default]
    assert views_as_reshapes(graph) == 1
    assert _targets(graph) == [aten.reshape.default]
    transposed = torch.randn(3, 2, 4, dtype=torch.float64).transpose(0, 1)  # where the view fails
    torch.testing.assert_close(graph(transposed), f(transposed.contiguous()), rtol=1e-15, atol=0)


def test_a_view_in_an_alias_tree_written_in_place_stays_a_view():
    def f(x):
        y = x * 2
        flat = y.view(6, 4)
        rows = flat.view(2, 12)  # two views of one base
        y.add_(1)  # seen through both
        return rows.sum(1), (x + 1).view(-1)

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    graph = make_fx(f)(x)
    assert views_as_reshapes(graph) == 1  # the view of x + 1, which no op writes
    assert _targets(graph) == [aten.view.default, aten.view.default, aten.reshape.default]
    for got, want in zip(graph(x), f(x)):
        torch.testing.assert_close(got, want, rtol=1e-15, atol=0)
