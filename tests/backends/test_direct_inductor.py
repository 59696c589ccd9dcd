"""Which traced graphs go to Inductor's graph compiler directly (see ``backends/direct_inductor.py``),
and the rewrite that keeps autograd's strided copies functional (``backends/strided_writes.py``); a
compilation through it is checked in ``test_compiled_backend.py``."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels.backends import direct_inductor
from omenn_kernels.backends.strided_writes import scatter_strided_writes


def test_a_graph_that_writes_in_place_goes_through_aot_autograd():
    x = torch.randn(2, 3)
    functional = make_fx(lambda x: x.new_zeros(2, 3).add(x).relu())(x)
    in_place = make_fx(lambda x: x.new_zeros(2, 3).add_(x).relu())(x)
    assert direct_inductor.functional(functional)
    assert not direct_inductor.functional(in_place)



def test_a_copy_into_a_strided_view_of_a_fresh_buffer_becomes_a_scatter():
    """Autograd's backward of an ``as_strided`` view, as traced: zeros, a copy into one view, another view read."""
    def backward(grad):
        storage = grad.new_zeros(12)
        storage.as_strided((2, 3), (3, 1), 2).copy_(grad)
        return storage.as_strided((3, 4), (4, 1)) * 2
    grad = torch.randn(2, 3, dtype=torch.float64)
    graph = make_fx(backward)(grad)
    assert not direct_inductor.functional(graph)
    assert scatter_strided_writes(graph) == 1
    assert direct_inductor.functional(graph)
    assert torch.equal(graph(grad), backward(grad))


def test_a_copy_read_before_it_is_written_stays():
    def backward(grad):
        storage = grad.new_zeros(6)
        before = storage * 1
        storage.as_strided((2, 3), (3, 1)).copy_(grad)
        return before, storage
    graph = make_fx(backward)(torch.randn(2, 3))
    assert scatter_strided_writes(graph) == 0
