"""The packed convolution ops (csrc/conv_packed.cpp): oneDNN with each weight reordered once.

Against ATen's convolution and its input gradient in float32 (oneDNN sums in another order:
2e-6 of the largest value), over strides, padding, dilation, groups, odd sizes (a transposed
convolution with an output padding) and both memory formats; and the cache of reordered
weights against every way a weight changes or is replaced.
"""

from __future__ import annotations

import gc

import pytest
import torch

from omenn_kernels import native
from omenn_kernels.backends.packed_weights import packing_available
from omenn_kernels.ops.conv_bias import conv2d_input_grad_packed_cpu, conv2d_packed_cpu
from omenn_kernels.testing import python_entered

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN convolutions")

TOLERANCE = 2e-6
# (in channels, out channels, size, kernel, stride, padding, dilation, groups)
CASES = [(3, 8, (11, 13), 3, 2, 1, 1, 1), (8, 8, (9, 9), 3, 1, 1, 1, 1), (8, 12, (10, 7), 3, 2, 0, 1, 4),
         (6, 6, (12, 12), 3, 1, 2, 2, 6), (4, 5, (8, 9), (1, 3), (2, 1), (0, 1), 1, 1), (16, 4, (5, 5), 1, 1, 0, 1, 1)]


def _pair(value) -> list[int]:
    return list(value) if isinstance(value, tuple) else [value, value]


def _case_id(case) -> str:
    return "-".join(str(v).replace(" ", "") for v in case)


def _operands(case, memory_format, seed: int = 0):
    cin, cout, size, kernel, stride, padding, dilation, groups = case
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cin, *size, generator=generator).contiguous(memory_format=memory_format)
    weight = torch.randn(cout, cin // groups, *_pair(kernel), generator=generator)
    bias = torch.randn(cout, generator=generator)
    return x, weight, bias, (_pair(stride), _pair(padding), _pair(dilation), groups)


def _channels_last(x: torch.Tensor) -> bool:
    return not x.is_contiguous()


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.stride() == want.stride()
    assert (got - want).abs().max() <= TOLERANCE * want.abs().max()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_packed_convolution_and_input_gradient_equal_atens(case, memory_format):
    x, weight, bias, (stride, padding, dilation, groups) = _operands(case, memory_format)
    for b in (bias, None):
        want = torch.ops.aten.convolution(x, weight, b, stride, padding, dilation, False, [0, 0], groups)
        _close(conv2d_packed_cpu(x, weight, b, stride, padding, dilation, groups, _channels_last(x)), want)
    grad = torch.randn_like(want)
    want = torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False, [0, 0],
                                               groups, [True, False, False])[0]
    for layout in (False, True):  # the layout asked for, whatever grad's
        got = conv2d_input_grad_packed_cpu(grad, weight, list(x.shape[2:]), stride, padding, dilation, groups, layout)
        assert got.is_contiguous(memory_format=torch.channels_last if layout else torch.contiguous_format)
        _close(got.contiguous(memory_format=memory_format), want)


def test_the_reordered_weight_follows_every_change_of_the_weight():
    """In-place writes (the version counter), ``.data`` rebinding (the storage), a weight freed
    and another made in its memory, and an inference tensor (no version counter)."""
    x, weight, bias, (stride, padding, dilation, groups) = _operands(CASES[1], torch.channels_last)
    grad = torch.randn(2, 8, 9, 9).contiguous(memory_format=torch.channels_last)

    def check(w: torch.Tensor) -> None:
        _close(conv2d_packed_cpu(x, w, bias, stride, padding, dilation, groups, True),
               torch.ops.aten.convolution(x, w, bias, stride, padding, dilation, False, [0, 0], groups))
        _close(conv2d_input_grad_packed_cpu(grad, w, [9, 9], stride, padding, dilation, groups, True),
               torch.ops.aten.convolution_backward(grad, x, w, None, stride, padding, dilation, False, [0, 0],
                                                   groups, [True, False, False])[0])

    check(weight)
    with torch.no_grad():
        weight.mul_(-2.0)
    check(weight)
    weight.data = torch.randn_like(weight)
    check(weight)
    # A freed weight's memory holding another weight of the same shape and version: only the
    # storage tells them apart.
    memory = bytearray(weight.numel() * weight.element_size())
    for seed in range(2):
        weight = torch.frombuffer(memory, dtype=torch.float32).view(8, 8, 3, 3)
        weight.copy_(torch.randn(8, 8, 3, 3, generator=torch.Generator().manual_seed(seed)))
        check(weight)
        del weight
        gc.collect()
    with torch.inference_mode():
        frozen = torch.randn(8, 8, 3, 3)
    check(frozen)
    with torch.inference_mode():
        frozen.add_(1.0)
    check(frozen)


def test_weights_of_one_shape_keep_a_reordered_copy_each():
    """Two kernels of the same shape and geometry used in turn (a network's repeated blocks):
    each is reordered once, not at every call."""
    x = torch.randn(1, 8, 9, 9).contiguous(memory_format=torch.channels_last)
    weights = [torch.randn(8, 8, 3, 3) for _ in range(2)]
    native.load_cpu_kernels()  # which defines the op
    reorders = torch.ops.omenn.packed_weight_reorders
    before = reorders()
    for _ in range(3):
        for weight in weights:
            _close(conv2d_packed_cpu(x, weight, None, [1, 1], [1, 1], [1, 1], 1, True),
                   torch.ops.aten.convolution(x, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    assert reorders() == before + 2


def test_packed_ops_pass_opcheck_and_run_no_python():
    x, weight, bias, (stride, padding, dilation, groups) = _operands(CASES[2], torch.channels_last)
    grad = torch.randn_like(conv2d_packed_cpu(x, weight, bias, stride, padding, dilation, groups, True))
    calls = [(conv2d_packed_cpu, (x, weight, bias, stride, padding, dilation, groups, True)),
             (conv2d_input_grad_packed_cpu, (grad, weight, [10, 7], stride, padding, dilation, groups, False))]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        op(*args)
        entered = python_entered(lambda: op(*args))
        assert entered == [], f"{op} ran Python per call: {entered}"


def test_packed_ops_refuse_what_they_do_not_run():
    x, weight = torch.randn(1, 4, 6, 6), torch.randn(4, 4, 3, 3)
    with pytest.raises(RuntimeError, match="float32 tensors only"):
        conv2d_packed_cpu(x.double(), weight.double(), None, [1, 1], [1, 1], [1, 1], 1, False)
    with pytest.raises(RuntimeError, match="must be 4-D"):
        conv2d_packed_cpu(x[0], weight, None, [1, 1], [1, 1], [1, 1], 1, False)
    with pytest.raises(RuntimeError, match="does not fit a gradient"):
        conv2d_input_grad_packed_cpu(torch.randn(1, 4, 6, 6), weight, [9, 6], [1, 1], [1, 1], [1, 1], 1, False)
