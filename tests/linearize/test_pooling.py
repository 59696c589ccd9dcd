"""R13, R13', R14: pooling, means and interpolation (rules/pooling.py).

Each model pools, adds a CONST (carried by the pooled ones, R7') and ends in a
bias-free head, so ``g = ∂ŷ/∂pooled`` is a row of the head's weight. The oracles:

* average / adaptive pooling: the constant at output p goes in equal shares to the
  *real* (non-padding) input positions of p's window — explicit loops;
* max pooling: to the arg-max of the window — explicit loops;
* interpolation: a constant added after upsampling equals one added before (the
  kernels preserve constants), so its share is ``c · ∂ŷ/∂x`` (autograd of the model).

``C_w`` of these linear models is the model's gradient (autograd of the model itself).
Tolerances (float64): 1e-11 relative, 1e-13 absolute.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import explain
from rule_checks import ATOL, DT, RTOL, assert_complete, gradient, rand


class _PoolThenConstant(nn.Module):
    def __init__(self, pool, out_shape, classes=3, seed=0):
        super().__init__()
        self.pool = pool
        self.c = nn.Parameter(rand(*out_shape, seed=seed))
        self.head = nn.Linear(math.prod(out_shape), classes, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(rand(classes, math.prod(out_shape), seed=seed + 1))

    def forward(self, x):
        return self.head((self.pool(x) + self.c).flatten(1))


def _build(pool, x_shape, seed):
    out_shape = pool(torch.zeros(1, *x_shape[1:], dtype=DT)).shape[1:]
    return _PoolThenConstant(pool, tuple(out_shape), seed=seed).double()


def _check_common(model, x, target):
    e = explain(model, x, target)
    assert_complete(e, model, x, target)
    torch.testing.assert_close(e.weight, gradient(model, x, target), rtol=RTOL, atol=ATOL)
    return e


def _shares_by_windows(model, target, in_hw, windows):
    """C_b: for every (channel, output position), c·g split equally over ``windows[p]``."""
    out_shape = model.c.shape
    g = model.head.weight[target].detach().view(out_shape)
    c = model.c.detach()
    expected = torch.zeros(in_hw, dtype=DT)
    for ch in range(out_shape[0]):
        for p in itertools.product(*[range(n) for n in out_shape[1:]]):
            positions = windows(p)
            for q in positions:
                expected[q] += c[(ch, *p)] * g[(ch, *p)] / len(positions)
    return expected


def _pool_window(p, in_hw, kernel, stride, padding):
    axes = []
    for a in range(2):
        start = p[a] * stride - padding
        axes.append([i for i in range(start, start + kernel) if 0 <= i < in_hw[a]])
    return list(itertools.product(*axes))


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("ceil_mode", [False, True])
def test_avg_pool_with_padding(count_include_pad, ceil_mode):
    in_hw = (6, 7)
    pool = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=count_include_pad, ceil_mode=ceil_mode)
    model = _build(pool, (2, 2, *in_hw), seed=1)
    x = rand(2, 2, *in_hw, seed=2)
    e = _check_common(model, x, 2)
    expected = _shares_by_windows(model, 2, in_hw, lambda p: _pool_window(p, in_hw, 3, 2, 1))
    torch.testing.assert_close(e.bias, expected.expand(2, *in_hw), rtol=RTOL, atol=ATOL)


def _adaptive_window(p, in_hw, out_hw):
    axes = []
    for a in range(2):
        start = (p[a] * in_hw[a]) // out_hw[a]
        end = -((-(p[a] + 1) * in_hw[a]) // out_hw[a])  # ceil
        axes.append(list(range(start, end)))
    return list(itertools.product(*axes))


def test_adaptive_avg_pool_non_divisible():
    in_hw, out_hw = (7, 5), (3, 2)
    model = _build(nn.AdaptiveAvgPool2d(out_hw), (2, 3, *in_hw), seed=3)
    x = rand(2, 3, *in_hw, seed=4)
    e = _check_common(model, x, 0)
    expected = _shares_by_windows(model, 0, in_hw, lambda p: _adaptive_window(p, in_hw, out_hw))
    torch.testing.assert_close(e.bias, expected.expand(2, *in_hw), rtol=RTOL, atol=ATOL)
    # The windows overlap: some pixel really belongs to two windows.
    counts = torch.zeros(in_hw)
    for p in itertools.product(range(3), range(2)):
        for q in _adaptive_window(p, in_hw, out_hw):
            counts[q] += 1
    assert counts.max() > 1


class _MeanHead(nn.Module):
    def __init__(self, reduce, features, seed):
        super().__init__()
        self.reduce = reduce
        self.head = nn.Linear(features, 3)
        with torch.no_grad():
            self.head.weight.copy_(rand(3, features, seed=seed))
            self.head.bias.copy_(rand(3, seed=seed + 1))

    def forward(self, x):
        return self.head(self.reduce(x).flatten(1))


@pytest.mark.parametrize("reduce", ["mean_hw", "sum_hw", "adaptive_1"])
def test_global_reduction_spreads_the_bias_evenly(reduce):
    fn = {"mean_hw": lambda x: x.mean((2, 3)), "sum_hw": lambda x: x.sum((2, 3)),
          "adaptive_1": nn.AdaptiveAvgPool2d(1)}[reduce]
    model = _MeanHead(fn, 3, seed=5).double()
    x = rand(2, 3, 4, 5, seed=6)
    e = _check_common(model, x, 1)
    torch.testing.assert_close(e.bias, torch.full((2, 4, 5), model.head.bias[1].item() / 20, dtype=DT),
                               rtol=RTOL, atol=ATOL)


def test_mean_over_channels_keeps_pixel_identity():
    model = _build(lambda x: x.mean(1, keepdim=True), (2, 4, 3, 3), seed=7)
    x = rand(2, 4, 3, 3, seed=8)
    e = _check_common(model, x, 0)
    g = model.head.weight[0].detach().view(1, 3, 3)
    torch.testing.assert_close(e.bias, (model.c.detach() * g)[0].expand(2, 3, 3), rtol=RTOL, atol=ATOL)


def _integers_with_ties(shape, seed: int) -> torch.Tensor:
    """Values in {-1, 0, 1, 2}: most windows hold equal maxima."""
    return torch.randint(-1, 3, shape, generator=torch.Generator().manual_seed(seed)).to(DT)


@pytest.mark.parametrize("channels,values", [(2, "random"), (16, "ties")])
@pytest.mark.parametrize("kernel,stride,padding", [(2, 2, 0), (3, 2, 1), (3, 1, 1)])
def test_max_pool_ones_at_argmax(kernel, stride, padding, channels, values):
    """16 channels take the CPU's channels-last pooling; with ties the arg-max is the first
    maximum of the window in row-major order, as the model's own pooling picks it."""
    in_hw = (5, 6)
    model = _build(nn.MaxPool2d(kernel, stride, padding), (2, channels, *in_hw), seed=9)
    x = rand(2, channels, *in_hw, seed=10) if values == "random" else _integers_with_ties((2, channels, *in_hw), 10)
    e = _check_common(model, x, 1)
    g = model.head.weight[1].detach().view(model.c.shape)
    c = model.c.detach()
    for b in range(2):
        expected = torch.zeros(in_hw, dtype=DT)
        for ch in range(channels):
            for p in itertools.product(*[range(n) for n in model.c.shape[1:]]):
                window = _pool_window(p, in_hw, kernel, stride, padding)
                arg = max(window, key=lambda q: x[b, ch, q[0], q[1]].item())
                expected[arg] += c[(ch, *p)] * g[(ch, *p)]
        torch.testing.assert_close(e.bias[b], expected, rtol=RTOL, atol=ATOL)


class _ConvReluPool(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, padding=1)
        self.c2 = nn.Conv2d(4, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        y = self.pool(torch.relu(self.c1(x)))
        y = F.max_pool2d(torch.relu(self.c2(y)), 3, 1, 1)
        return self.head(y.flatten(1))


def test_relu_maxpool_conv_linear_weight_is_gradient():
    torch.manual_seed(11)
    model = _ConvReluPool().double()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(rand(*p.shape, seed=p.numel(), scale=0.2))
    x = rand(2, 3, 6, 6, seed=12)
    _check_common(model, x, 2)


class _UpThenConstant(nn.Module):
    def __init__(self, mode, size=None, scale=None, align_corners=None):
        super().__init__()
        self.kwargs = dict(mode=mode, size=size, scale_factor=scale, align_corners=align_corners)
        self.c = nn.Parameter(rand(2, 1, 1, seed=13))  # one constant per channel
        self.head = None

    def forward(self, x):
        return self.head((F.interpolate(x, **self.kwargs) + self.c).flatten(1))


UPSAMPLES = {
    "nearest_x2": dict(mode="nearest", scale=2),
    "nearest_size": dict(mode="nearest", size=(7, 8)),
    "nearest_exact_size": dict(mode="nearest-exact", size=(7, 8)),
    "bilinear_x2": dict(mode="bilinear", scale=2, align_corners=False),
    "bilinear_size_aligned": dict(mode="bilinear", size=(7, 8), align_corners=True),
    "bicubic_size": dict(mode="bicubic", size=(7, 9), align_corners=False),
}


@pytest.mark.parametrize("name", list(UPSAMPLES))
def test_upsampling_complete_and_constant_shares(name):
    model = _UpThenConstant(**UPSAMPLES[name]).double()
    x = rand(2, 2, 3, 4, seed=14)
    n = F.interpolate(x, **model.kwargs).numel() // 2
    model.head = nn.Linear(n, 3, bias=False).double()
    with torch.no_grad():
        model.head.weight.copy_(rand(3, n, seed=15))
    e = _check_common(model, x, 0)
    grad = gradient(model, x, 0)
    expected = (model.c.detach().view(1, 2, 1, 1) * grad).sum(1)
    torch.testing.assert_close(e.bias, expected, rtol=RTOL, atol=ATOL)


def test_shared_ones_at_argmax_differentiates_twice():
    """The fused backend's ones (one per pixel) read at each channel's arg-max: the backward
    adds into the shared ones directly; first and second derivatives against gradcheck."""
    from omenn_kernels.linearize.rules.pooling import _SharedAtArgMax

    generator = torch.Generator().manual_seed(21)
    shared = torch.rand(2, 1, 12, dtype=DT, generator=generator, requires_grad=True)
    indices = torch.randint(0, 12, (2, 5, 4), generator=generator)  # channels pick the same pixels too
    # Positions last (N, C, L), and positions first with the channels inner (N, L, C), as in
    # channels-last memory.
    for shared, indices, dim in ((shared, indices, -1), (shared.detach().mT.requires_grad_(True), indices.mT, 1)):
        assert torch.autograd.gradcheck(lambda s: _SharedAtArgMax.apply(s, indices, dim), (shared,))
        assert torch.autograd.gradgradcheck(lambda s: _SharedAtArgMax.apply(s, indices, dim), (shared,))
        expected = shared.detach().expand(indices.shape[0], *(12 if d == dim % 3 else n
                                                              for d, n in enumerate(indices.shape) if d)).gather(dim,
                                                                                                            indices)
        torch.testing.assert_close(_SharedAtArgMax.apply(shared, indices, dim), expected, rtol=0, atol=0)
