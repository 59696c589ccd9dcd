"""R4: elementwise activations as ``f(0)·O + x·stopgrad(ξ(x))`` (rules/activation.py).

Every expected value is computed independently of the package, element by element
with Python's ``math`` module: ``f`` from its textbook formula, ``ξ(x) = (f(x) − f(0))/x``
from the definition, and ``ξ(0) = f'(0)`` from the analytic derivative.

Tolerances (float64): multipliers against the definition 1e-12 relative (the quotient
(f(x) − f(0))/x loses a few ulps when |x| is small; inputs stay at |x| ≥ 0.05);
explanations 1e-12 relative / 1e-13 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from omenn_kernels import explain
from omenn_kernels.linearize import lookup
from omenn_kernels.linearize.rules.activation import multiplier
from omenn_kernels.linearize.values import Live
from rule_checks import ATOL, DT

aten = torch.ops.aten
RTOL = 1e-12  # tighter than rule_checks.RTOL (see the module docstring)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _softplus(x: float, beta: float = 1.0, threshold: float = 20.0) -> float:
    return x if beta * x > threshold else math.log1p(math.exp(beta * x)) / beta


def _tanh_gelu(x: float) -> float:
    return 0.5 * x * (1.0 + math.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


# name -> (aten op, extra args, f written out, f'(0) written out, torch module)
# f'(0) at a kink (ReLU, ReLU6 at 0, LeakyReLU) follows PyTorch's gradient
# convention, so that C_w of a ReLU network equals its gradient.
ACTIVATIONS = {
    "gelu": (aten.gelu.default, ("none",), lambda x: x * _phi(x), 0.5, lambda: nn.GELU()),
    "gelu_tanh": (aten.gelu.default, ("tanh",), _tanh_gelu, 0.5, lambda: nn.GELU("tanh")),
    "silu": (aten.silu.default, (), lambda x: x * _sigmoid(x), 0.5, lambda: nn.SiLU()),
    "relu": (aten.relu.default, (), lambda x: max(x, 0.0), 0.0, lambda: nn.ReLU()),
    "leaky_relu": (aten.leaky_relu.default, (0.2,), lambda x: x if x > 0 else 0.2 * x, 0.2,
                   lambda: nn.LeakyReLU(0.2)),
    "hardswish": (aten.hardswish.default, (), lambda x: x * min(max(x + 3.0, 0.0), 6.0) / 6.0, 0.5,
                  lambda: nn.Hardswish()),
    "elu": (aten.elu.default, (1.0, 1.0, 1.0), lambda x: x if x > 0 else math.expm1(x), 1.0,
            lambda: nn.ELU(1.0)),
    "tanh": (aten.tanh.default, (), math.tanh, 1.0, lambda: nn.Tanh()),
    "softplus": (aten.softplus.default, (1.0, 20.0), _softplus, 0.5, lambda: nn.Softplus()),
    "softplus_beta2": (aten.softplus.default, (2.0, 20.0), lambda x: _softplus(x, 2.0), 0.5,
                       lambda: nn.Softplus(2.0)),
    "mish": (aten.mish.default, (), lambda x: x * math.tanh(_softplus(x)), math.tanh(math.log(2.0)),
             lambda: nn.Mish()),
    "relu6": (aten.hardtanh.default, (0.0, 6.0), lambda x: min(max(x, 0.0), 6.0), 0.0,
              lambda: nn.ReLU6()),
    "hardtanh": (aten.hardtanh.default, (-1.0, 1.0), lambda x: min(max(x, -1.0), 1.0), 1.0,
                 lambda: nn.Hardtanh(-1.0, 1.0)),
    "sigmoid": (aten.sigmoid.default, (), _sigmoid, 0.25, lambda: nn.Sigmoid()),
}


def _sample(seed: int, n: int = 64) -> torch.Tensor:
    """Random inputs spanning every regime (|x| up to 8, ReLU6's clip at 6), none near 0."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=DT) * 3.0
    x = torch.where(x.abs() < 0.05, torch.full_like(x, 0.37), x)
    return torch.cat([x, torch.tensor([-7.5, -0.75, 6.5, 7.9], dtype=DT)])


def _elementwise(f, x: torch.Tensor) -> torch.Tensor:
    return torch.tensor([f(v) for v in x.tolist()], dtype=DT)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_multiplier_matches_definition(name):
    op, rest, f, _, _ = ACTIVATIONS[name]
    x = _sample(sum(map(ord, name)))  # a stable per-activation seed
    xi, offset = multiplier(op, x, *rest)
    f0 = f(0.0)
    expected = _elementwise(lambda v: (f(v) - f0) / v, x)
    torch.testing.assert_close(xi, expected, rtol=RTOL, atol=ATOL)
    # The offset is f(0), and f(0) + x·ξ(x) reproduces f(x).
    assert offset == pytest.approx(f0, abs=1e-15)
    torch.testing.assert_close(offset + x * xi, _elementwise(f, x), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_multiplier_at_zero_is_derivative(name):
    op, rest, f, slope, _ = ACTIVATIONS[name]
    x = torch.tensor([0.0, 1.5, -1.5, 0.0], dtype=DT)
    xi, _ = multiplier(op, x, *rest)
    assert xi[0].item() == pytest.approx(slope, abs=1e-15)
    assert xi[3].item() == pytest.approx(slope, abs=1e-15)
    assert torch.isfinite(xi).all()
    # Away from 0 the multiplier is the quotient, not the derivative.
    assert xi[1].item() == pytest.approx((f(1.5) - f(0.0)) / 1.5, rel=RTOL)


@pytest.mark.parametrize("name", ["gelu", "gelu_tanh", "silu", "hardswish", "tanh", "softplus", "mish",
                                  "sigmoid", "elu"])
def test_multiplier_tends_to_derivative_near_zero(name):
    # ξ is continuous at 0 for smooth f: ξ(±1e-6) ≈ f'(0) (first-order error ~1e-6).
    op, rest, _, slope, _ = ACTIVATIONS[name]
    xi, _ = multiplier(op, torch.tensor([1e-6, -1e-6], dtype=DT), *rest)
    torch.testing.assert_close(xi, torch.full((2,), slope, dtype=DT), rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_rule_routes_gradient_through_detached_multiplier(name):
    """The reference: value f(x); ∂/∂x = ξ(x) (detached, not f'(x)); ∂/∂O = f(0); ones pass."""
    op, rest, f, _, _ = ACTIVATIONS[name]
    x0 = _sample(7 + len(name), 30).reshape(2, 17)
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    g = torch.randn(x0.shape, generator=torch.Generator().manual_seed(3), dtype=DT)
    out = lookup(op).reference(op, Live(x, ones), *rest, held=[x0, *rest])
    torch.testing.assert_close(out.value.detach(), _elementwise(f, x0.flatten()).view_as(x0),
                               rtol=RTOL, atol=ATOL)
    # The ones pass unchanged (possibly shared along some dims: compare broadcast).
    torch.testing.assert_close(out.ones.detach().expand(x0.shape), torch.ones_like(x0), rtol=0, atol=0)
    x_grad, ones_grad = torch.autograd.grad((out.value * g).sum(), [x, ones], allow_unused=True,
                                            materialize_grads=True)
    f0 = f(0.0)
    xi = _elementwise(lambda v: (f(v) - f0) / v, x0.flatten()).view_as(x0)
    torch.testing.assert_close(x_grad, g * xi, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ones_grad, g * f0, rtol=RTOL, atol=ATOL)


def test_paper_gelu_example_multiplier():
    """The paper: GELU at x = −0.75 has ξ = Φ(−0.75) ≈ 0.2266, contribution ≈ −0.17, gradient ≈ 0."""
    x = torch.tensor([-0.75], dtype=DT)
    xi, offset = multiplier(aten.gelu.default, x, "none")
    assert offset == 0.0
    assert xi.item() == pytest.approx(0.2266, abs=5e-5)
    assert xi.item() == pytest.approx(_phi(-0.75), rel=1e-14)
    assert (x * xi).item() == pytest.approx(-0.17, abs=5e-3)
    # GELU'(x) = Φ(x) + x·φ(x), written out: nearly zero at −0.75.
    derivative = _phi(-0.75) + (-0.75) * math.exp(-0.75 ** 2 / 2) / math.sqrt(2 * math.pi)
    assert abs(derivative) < 1e-3
    xt = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(xt).sum(), xt)
    assert abs(grad.item()) < 1e-3


class _OneActivation(nn.Module):
    """Flatten → Linear(identity) → activation → Linear(all ones): ŷ = Σ_i f(x_i)."""

    def __init__(self, n: int, act: nn.Module):
        super().__init__()
        self.first = nn.Linear(n, n, bias=False)
        self.act = act
        self.last = nn.Linear(n, 1, bias=False)
        with torch.no_grad():
            self.first.weight.copy_(torch.eye(n))
            self.last.weight.fill_(1.0)

    def forward(self, x):
        return self.last(self.act(self.first(x.flatten(1))))


def test_paper_gelu_example_through_explain():
    """OMENN's C is GELU(x) per input; input × gradient is not (it is ≈ 0 at −0.75)."""
    x = torch.tensor([[[[-0.75, 0.5], [1.3, -2.1]]]], dtype=DT)
    model = _OneActivation(4, nn.GELU()).double()
    e = explain(model, x, 0)
    gelu = _elementwise(lambda v: v * _phi(v), x.flatten()).view(1, 2, 2)
    torch.testing.assert_close(e.contribution, gelu, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, torch.zeros_like(e.bias), rtol=0, atol=ATOL)
    assert e.contribution[0, 0, 0].item() == pytest.approx(-0.17, abs=5e-3)
    # Input × gradient, by autograd on the model itself.
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xg).sum(), xg)
    input_x_gradient = (grad * x).sum(1)
    assert abs(input_x_gradient[0, 0, 0].item()) < 1e-3
    assert (input_x_gradient - gelu).abs().max().item() > 0.1
    # C_w is Φ(x), not GELU'(x).
    phi = _elementwise(_phi, x.flatten()).view_as(x)
    torch.testing.assert_close(e.weight, phi, rtol=RTOL, atol=ATOL)


def test_softplus_offset_carried_by_ones_through_explain():
    """f(0) ≠ 0: with an identity Linear the ones are averaged, and still C[i] = f(x_i)."""
    x = torch.tensor([[[[-1.2, 0.4, 2.0]]], [[[0.9, -3.0, 0.25]]]], dtype=DT)
    model = _OneActivation(3, nn.Softplus()).double()
    e = explain(model, x, 0)
    expected = _elementwise(_softplus, x.flatten()).view(2, 1, 3)
    torch.testing.assert_close(e.contribution, expected, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, torch.full_like(e.bias, math.log(2.0)), rtol=RTOL, atol=ATOL)


class _EveryActivation(nn.Module):
    """Input position j goes through activation j alone; ŷ = Σ_j w_j f_j(x_j)."""

    def __init__(self, names):
        super().__init__()
        self.acts = nn.ModuleList(ACTIVATIONS[n][4]() for n in names)
        self.head = nn.Linear(len(names), 2, bias=False)

    def forward(self, x):
        flat = x.flatten(1)
        return self.head(torch.stack([act(flat[:, j]) for j, act in enumerate(self.acts)], 1))


def test_every_activation_module_through_explain():
    """The torch modules capture to the ops above; C_j = w_j f_j(x_j), C_w = w_j ξ_j(x_j)."""
    names = list(ACTIVATIONS)
    torch.manual_seed(0)
    model = _EveryActivation(names).double()
    x = torch.randn(2, 1, 1, len(names), dtype=DT) * 2.5
    x = torch.where(x.abs() < 0.05, torch.full_like(x, -0.3), x)
    x[0, 0, 0, names.index("gelu")] = -0.75
    target = 1
    e = explain(model, x, target)
    w = model.head.weight[target].detach()
    for b in range(2):
        for j, name in enumerate(names):
            f = ACTIVATIONS[name][2]
            v = x[b, 0, 0, j].item()
            assert e.contribution[b, 0, j].item() == pytest.approx(w[j].item() * f(v), rel=1e-11, abs=1e-13)
            assert e.weight[b, 0, 0, j].item() == pytest.approx(
                w[j].item() * (f(v) - f(0.0)) / v, rel=1e-11, abs=1e-13)
            assert e.bias[b, 0, j].item() == pytest.approx(w[j].item() * f(0.0), rel=1e-11, abs=1e-13)
