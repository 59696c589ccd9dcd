"""Property tests: randomly composed small CNNs are explained completely.

Hypothesis draws a sequence of layers from {Conv2d (random kernel, stride, padding,
dilation, groups), BatchNorm2d (random statistics), ReLU, GELU, SiLU, Hardswish,
LeakyReLU, MaxPool2d, AvgPool2d, a residual wrapper around a shape-preserving
sub-block, squeeze-excitation}, then AdaptiveAvgPool2d → Flatten → Linear, and checks
on random float64 inputs that

* the explanation is complete: ``|Σ C − ŷ| ≤ 1e-9 · max(|ŷ|, Σ|C|)`` per image (relative
  to the size of the summed terms, so that a logit near 0 does not inflate the error),
  and ``ŷ`` is the model's own logit;
* with every bias and BatchNorm shift zero (``β = 0``, running mean 0), ``C_b = 0``.

Runs are deterministic (``derandomize=True``, no example database).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omenn_kernels import explain

DT = torch.float64
TOL = 1e-9

SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU, "hardswish": nn.Hardswish,
               "leaky_relu": lambda: nn.LeakyReLU(0.1)}


@dataclass(frozen=True)
class Conv:
    cin: int
    cout: int
    kernel: int
    stride: int
    padding: int
    dilation: int
    groups: int


@dataclass(frozen=True)
class BN:
    c: int


@dataclass(frozen=True)
class Act:
    name: str


@dataclass(frozen=True)
class MaxPool:
    kernel: int
    stride: int
    padding: int


@dataclass(frozen=True)
class AvgPool:
    kernel: int
    stride: int
    padding: int
    count_include_pad: bool


@dataclass(frozen=True)
class SE:
    c: int
    hidden: int


@dataclass(frozen=True)
class Residual:
    body: tuple


def _conv_out(n: int, k: int, s: int, p: int, d: int) -> int:
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _divisors(n: int) -> list[int]:
    return [g for g in range(1, n + 1) if n % g == 0]


@st.composite
def conv_layer(draw, c: int, h: int, w: int):
    groups = draw(st.sampled_from(_divisors(c)))
    cout = groups * draw(st.integers(1, max(1, 6 // groups)))
    kernel = draw(st.integers(1, 3))
    dilation = draw(st.integers(1, 2)) if kernel > 1 else 1
    stride = draw(st.integers(1, 2))
    padding = draw(st.integers(0, dilation * (kernel - 1)))
    if min(h, w) < dilation * (kernel - 1) + 1:
        kernel, dilation = 1, 1
    return Conv(c, cout, kernel, stride, padding, dilation, groups)


@st.composite
def shape_preserving(draw, c: int):
    groups = draw(st.sampled_from(_divisors(c)))
    kernel = draw(st.sampled_from([1, 3]))
    dilation = draw(st.integers(1, 2)) if kernel == 3 else 1
    body = [Conv(c, c, kernel, 1, dilation * (kernel - 1) // 2, dilation, groups)]
    if draw(st.booleans()):
        body.append(BN(c))
    body.append(Act(draw(st.sampled_from(list(ACTIVATIONS)))))
    return Residual(tuple(body))


@st.composite
def architectures(draw):
    c = draw(st.integers(1, 3))
    h, w = draw(st.integers(5, 9)), draw(st.integers(5, 9))
    input_shape = (draw(st.integers(1, 2)), c, h, w)
    layers = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["conv", "conv", "bn", "act", "act", "maxpool", "avgpool",
                                     "residual", "se"]))
        if kind == "conv":
            layer = draw(conv_layer(c, h, w))
            c = layer.cout
            h = _conv_out(h, layer.kernel, layer.stride, layer.padding, layer.dilation)
            w = _conv_out(w, layer.kernel, layer.stride, layer.padding, layer.dilation)
        elif kind == "bn":
            layer = BN(c)
        elif kind == "act":
            layer = Act(draw(st.sampled_from(list(ACTIVATIONS))))
        elif kind in ("maxpool", "avgpool"):
            if min(h, w) < 2:
                continue
            kernel = draw(st.integers(2, 3))
            kernel = min(kernel, h, w)
            stride = draw(st.integers(1, 2))
            padding = draw(st.integers(0, kernel // 2))
            if kind == "maxpool":
                layer = MaxPool(kernel, stride, padding)
            else:
                layer = AvgPool(kernel, stride, padding, draw(st.booleans()))
            h = _conv_out(h, kernel, stride, padding, 1)
            w = _conv_out(w, kernel, stride, padding, 1)
        elif kind == "residual":
            layer = draw(shape_preserving(c))
        else:
            layer = SE(c, draw(st.integers(1, 3)))
        layers.append(layer)
    classes = draw(st.integers(2, 4))
    return input_shape, tuple(layers), c, classes


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Conv2d(c, hidden, 1), nn.Conv2d(hidden, c, 1)

    def forward(self, x):
        return x * torch.sigmoid(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class ResidualBlock(nn.Module):
    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def build_layer(spec) -> nn.Module:
    if isinstance(spec, Conv):
        return nn.Conv2d(spec.cin, spec.cout, spec.kernel, spec.stride, spec.padding, spec.dilation, spec.groups)
    if isinstance(spec, BN):
        return nn.BatchNorm2d(spec.c)
    if isinstance(spec, Act):
        return ACTIVATIONS[spec.name]()
    if isinstance(spec, MaxPool):
        return nn.MaxPool2d(spec.kernel, spec.stride, spec.padding)
    if isinstance(spec, AvgPool):
        return nn.AvgPool2d(spec.kernel, spec.stride, spec.padding, count_include_pad=spec.count_include_pad)
    if isinstance(spec, SE):
        return SqueezeExcite(spec.c, spec.hidden)
    return ResidualBlock(nn.Sequential(*[build_layer(s) for s in spec.body]))


def build(layers, channels: int, classes: int, seed: int, zero_bias: bool) -> nn.Module:
    model = nn.Sequential(*[build_layer(s) for s in layers], nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(channels, classes)).double()
    g = torch.Generator().manual_seed(seed)
    rand = lambda shape: torch.randn(shape, generator=g, dtype=DT)  # noqa: E731
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                c = module.num_features
                module.weight.copy_(torch.rand(c, generator=g, dtype=DT) + 0.5)
                module.bias.copy_(torch.zeros(c, dtype=DT) if zero_bias else rand(c) * 0.5)
                module.running_mean.copy_(torch.zeros(c, dtype=DT) if zero_bias else rand(c) * 0.5)
                module.running_var.copy_(torch.rand(c, generator=g, dtype=DT) + 0.5)
            elif isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.copy_(rand(module.weight.shape) * (2.0 / module.weight[0].numel()) ** 0.5)
                module.bias.copy_(rand(module.bias.shape) * 0.5)
        if zero_bias:  # the SE biases only shape a gate: they stay random
            gate_layers = {id(m) for se in model.modules() if isinstance(se, SqueezeExcite)
                           for m in (se.fc1, se.fc2)}
            for module in model.modules():
                if isinstance(module, (nn.Conv2d, nn.Linear)) and id(module) not in gate_layers:
                    module.bias.zero_()
    return model.eval()


def _check_complete(e, model, x, readout):
    logits = model(x).detach()
    expected = logits.gather(1, readout[:, None])[:, 0] if not readout.is_floating_point() \
        else (logits * readout).sum(1)
    torch.testing.assert_close(e.logit, expected, rtol=1e-12, atol=1e-12 * logits.abs().max().item())
    scale = torch.maximum(e.logit.abs(), e.contribution.abs().flatten(1).sum(1))
    error = (e.contribution.flatten(1).sum(1) - e.logit).abs()
    assert bool((error <= TOL * scale).all()), (error / scale).tolist()


@SETTINGS
@given(architecture=architectures(), seed=st.integers(0, 2 ** 16), readout=st.sampled_from(["class", "weights"]))
def test_random_networks_are_complete(architecture, seed, readout):
    input_shape, layers, channels, classes = architecture
    model = build(layers, channels, classes, seed, zero_bias=False)
    x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    if readout == "class":
        target = torch.tensor([(seed + i) % classes for i in range(input_shape[0])])
    else:  # a contrastive / weighted read-out of the logits
        target = torch.randn(input_shape[0], classes, generator=torch.Generator().manual_seed(seed + 2), dtype=DT)
    e = explain(model, x, target)
    _check_complete(e, model, x, target)


@SETTINGS
@given(architecture=architectures(), seed=st.integers(0, 2 ** 16))
def test_random_networks_without_biases_have_no_bias_contribution(architecture, seed):
    input_shape, layers, channels, classes = architecture
    model = build(layers, channels, classes, seed, zero_bias=True)
    x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(seed + 1), dtype=DT)
    target = torch.tensor([seed % classes] * input_shape[0])
    e = explain(model, x, target)
    _check_complete(e, model, x, target)
    assert bool((e.bias == 0).all()) or e.bias.abs().max() <= 1e-14 * e.contribution.abs().max()
    torch.testing.assert_close((e.weight * x).sum(1), e.contribution, rtol=0,
                               atol=1e-14 * e.contribution.abs().max().item())
