"""FLOPs of the fused ops (``torch.utils.flop_counter``) and of a traced explanation.

Each fused op with matrix work registers a FLOP formula: counted by ``FlopCounterMode``,
it must equal the count of the aten products it stands for (a convolution, a linear
layer, attention's two products; an input gradient the products of the forward whose
output has the gradient's shape). The compiled backend reads the traced graph's FLOPs
from its shapes (:func:`~omenn_kernels.backends.compiled.matrix_flops`) to choose
Inductor's wrapper: that count must equal ``FlopCounterMode`` over a run of the graph.
Counts are integers: compared exactly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.backends.packed_weights import packing_available
from omenn_kernels.ops import attention, conv_bias, linear_ones
from omenn_kernels.testing import FAMILIES, randomize_


def _flops(call) -> int:
    with FlopCounterMode(display=False) as counter:
        call()
    return counter.get_total_flops()


def _conv_operands(groups: int = 1):
    torch.manual_seed(0)
    x, weight = torch.randn(2, 4, 9, 7), torch.randn(6, 4 // groups, 3, 2)
    return x, weight, torch.randn(6), [2, 1], [1, 1], [1, 2], groups


@pytest.mark.parametrize("groups", [1, 2])
def test_a_convolution_with_the_ones_counts_the_convolutions_products(groups):
    x, weight, bias, stride, padding, dilation, groups = _conv_operands(groups)
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    ones = torch.ones(2, 1, 9, 7)
    window_sum = torch.rand(2, 1, *value.shape[2:]) + 1
    want = _flops(lambda: F.conv2d(x, weight, bias, stride, padding, dilation, groups))
    assert want > 0
    assert _flops(lambda: conv_bias.conv2d_ones(x, ones, window_sum, weight, bias, stride, padding, dilation,
                                                groups)) == want
    grad = torch.randn_like(value)
    assert _flops(lambda: conv_bias.conv2d_input_grad(grad, x, weight, stride, padding, dilation, groups)) == want


@pytest.mark.skipif(not packing_available(), reason="needs oneDNN and the C++ extension")
def test_the_packed_convolution_and_its_input_gradient_count_the_convolutions_products():
    x, weight, bias, stride, padding, dilation, groups = _conv_operands()
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    want = _flops(lambda: F.conv2d(x, weight, bias, stride, padding, dilation, groups))
    assert _flops(lambda: conv_bias.conv2d_packed_cpu(x, weight, bias, stride, padding, dilation, groups,
                                                      False)) == want
    grad = torch.randn_like(value)
    assert _flops(lambda: conv_bias.conv2d_input_grad_packed_cpu(grad, weight, list(x.shape[2:]), stride, padding,
                                                                 dilation, groups, False)) == want


def test_a_linear_layer_with_the_ones_counts_its_product_and_its_gradient_the_receiving_features():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 5, 8), torch.randn(12, 8), torch.randn(12)
    ones = torch.ones(2, 5, 1)
    assert _flops(lambda: linear_ones.linear_ones(x, ones, weight, bias, 0, 12)) == \
        _flops(lambda: F.linear(x, weight, bias)) > 0
    grad = torch.randn(2, 5, 12)
    assert _flops(lambda: linear_ones.linear_input_grad(grad, weight, 8, 12)) == \
        _flops(lambda: grad[..., 8:].reshape(-1, 4) @ weight[8:])


@pytest.mark.parametrize("head_sizes", [(16, 16), (16, 8)], ids=["one head size", "values of another size"])
def test_attention_counts_its_two_products_and_its_backward_the_scores_and_dv(head_sizes):
    torch.manual_seed(0)
    d, dv = head_sizes
    q, k, v = torch.randn(2, 3, 5, d), torch.randn(2, 3, 7, d), torch.randn(2, 3, 7, dv)
    scores = q @ k.transpose(-2, -1)
    grad = torch.randn(2, 3, 5, dv)
    assert _flops(lambda: attention.attention(q, k, v, None, 0.25)) == \
        _flops(lambda: q @ k.transpose(-2, -1)) + _flops(lambda: scores @ v) > 0
    _, lse = attention.attention(q, k, v, None, 0.25)
    assert _flops(lambda: attention.attention_backward_dv(q, k, grad, lse, None, 0.25)) == \
        _flops(lambda: q @ k.transpose(-2, -1)) + _flops(lambda: scores.transpose(-2, -1) @ grad)


@pytest.mark.parametrize("name", ["vit", "cnn"])
def test_the_traced_graphs_flops_read_from_its_shapes_equal_a_counted_run(name, monkeypatch):
    graphs = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graphs.append((graph, example)) or graph)
    family = FAMILIES[name]
    torch.manual_seed(1)
    model = randomize_(family.build(), seed=1).eval()
    Explainer(model, backend="compiled")(torch.randn(2, 3, family.size, family.size), 1)
    ((graph, example),) = graphs
    with torch.no_grad():
        counted = _flops(lambda: graph(*example))
    assert compiled.matrix_flops(graph) == counted > 0


@pytest.mark.parametrize("create_graph", [False, True], ids=["first_order", "differentiable"])
def test_an_explanation_under_flop_counter_mode_counts_its_own_products_only(create_graph):
    """``FlopCounterMode`` registers global module hooks (its module tracker, which changes no
    value) and counts what runs under it: the explainer neither captures the model again for
    those hooks nor lets the mode count the capture's trace (fake tensors of a symbolic batch).
    The counted call that captures and the later ones count the same FLOPs."""
    family = FAMILIES["cnn"]
    model = randomize_(family.build()).eval()
    x = torch.randn(2, 3, family.size, family.size)
    explainer = Explainer(model, backend="fused")
    first = _flops(lambda: explainer(x, 1, create_graph=create_graph))  # captures under the mode
    (program, _), = explainer._programs.values()
    again = _flops(lambda: explainer(x, 1, create_graph=create_graph))
    assert isinstance(first, int) and first == again > 0
    assert [entry[0] for entry in explainer._programs.values()] == [program]


def test_the_cpu_flash_attention_of_a_model_is_counted_like_its_math():
    """torch has no formula for its CPU flash attention; the library registers CUDA flash
    attention's: the forward counts the products of the math path (``QKᵀ``, ``P·V``), the
    backward those of its backward plus the recomputed scores."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(3))
    counted = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH):
        with sdpa_kernel(backend):
            forward = _flops(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v))
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
            backward = _flops(lambda: out.backward(torch.randn_like(out)))
        counted[backend] = forward, backward
    scores = 2 * 2 * 3 * 17 * 17 * 8  # one product of (B, H, T, T) with head size 8
    assert counted[SDPBackend.MATH] == (2 * scores, 4 * scores)
    assert counted[SDPBackend.FLASH_ATTENTION] == (2 * scores, 5 * scores)
