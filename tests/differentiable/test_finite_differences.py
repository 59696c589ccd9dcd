"""The parameter gradient of an attribution loss equals central finite differences of C.

``create_graph=True`` with ``parameter_gradient="total"`` promises the total derivative
of ``C(θ)``, ``C_w(θ)`` and ``C_b(θ)``: the multipliers stay constant with respect to
the input but follow θ. The check: a loss ``L = Σ R·C + Σ R_w·C_w + Σ R_b·C_b`` with
fixed random weights, its autograd derivative along a direction ``v`` against
``(L(θ + hv) − L(θ − hv)) / 2h`` from first-order explanations. Directions: every
parameter tensor alone (so one wrong tensor cannot hide among the others), and all
parameters at once.

float64, h = 1e-5: the truncation error is O(h²) ≈ 1e-10 and the rounding error
≈ 1e-16/h ≈ 1e-11 relative, so the tolerance is 1e-6 relative to the size of the
directional derivative (or of the whole gradient along v, for tiny ones). Three backends:
the fused one differentiates its own ops twice (convolution, BatchNorm, linear,
activations); the compiled one (a second call, which runs the compiled graph; compiled
here with the traced graph itself) differentiates its traced graph.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from differentiable_models import DT, MODELS, SMOOTH

STEP = 1e-5
RTOL = 1e-6


def _loss_weights(x: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    batch, channels, height, width = x.shape
    return (torch.randn(batch, height, width, generator=generator, dtype=DT),
            torch.randn(batch, channels, height, width, generator=generator, dtype=DT),
            torch.randn(batch, height, width, generator=generator, dtype=DT))


def _attribution_loss(explanation, weights) -> torch.Tensor:
    on_contribution, on_weight, on_bias = weights
    return ((explanation.contribution * on_contribution).sum() + (explanation.weight * on_weight).sum()
            + (explanation.bias * on_bias).sum())


def _shifted_loss(explainer: Explainer, x, target, weights, params, direction, step: float) -> float:
    with torch.no_grad():
        saved = [p.clone() for p in params]
        for p, v in zip(params, direction):
            p.add_(step * v)
    try:
        return _attribution_loss(explainer(x, target), weights).item()
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)


def _directions(params: list[torch.Tensor], seed: int) -> list[tuple[str, list[torch.Tensor]]]:
    generator = torch.Generator().manual_seed(seed)
    full = [torch.randn(p.shape, generator=generator, dtype=DT) for p in params]
    alone = [(f"parameter {i} {tuple(p.shape)}", [v if j == i else torch.zeros_like(v) for j, v in enumerate(full)])
             for i, (p, v) in enumerate(zip(params, full))]
    return alone + [("all parameters", full)]


def _directional_derivatives(family: str, parameter_gradient: str, directions: slice = slice(None),
                             backend: str = "reference"):
    """Per direction of :func:`_directions`: (name, autograd's derivative along it, the central
    finite difference, the size of the gradient along it)."""
    model, x = MODELS[family]()
    target = torch.tensor([1, 3])
    weights = _loss_weights(x, seed=1)
    explainer = Explainer(model, backend=backend)
    params = list(model.parameters())

    if backend == "compiled":  # the first call of a signature runs the fused backend and compiles
        with warnings.catch_warnings():  # a fallback to the fused backend would test that again
            warnings.simplefilter("error", RuntimeWarning)
            explainer(x, target, create_graph=True, parameter_gradient=parameter_gradient)
    explanation = explainer(x, target, create_graph=True, parameter_gradient=parameter_gradient)
    gradient = torch.autograd.grad(_attribution_loss(explanation, weights), params)
    for name, direction in _directions(params, seed=2)[directions]:
        analytic = sum(float((g * v).sum()) for g, v in zip(gradient, direction))
        numeric = (_shifted_loss(explainer, x, target, weights, params, direction, STEP)
                   - _shifted_loss(explainer, x, target, weights, params, direction, -STEP)) / (2 * STEP)
        yield name, analytic, numeric, sum(float(g.norm() * v.norm()) for g, v in zip(gradient, direction))


@pytest.mark.parametrize("backend", ["reference", "auto", "compiled"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_total_gradient_matches_finite_differences(monkeypatch, family, backend):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    for name, analytic, numeric, size in _directional_derivatives(family, "total", backend=backend):
        scale = max(abs(numeric), 1e-3 * size)
        assert abs(analytic - numeric) <= RTOL * scale, (
            f"{family}, {name}: autograd {analytic:.12g}, finite differences {numeric:.12g}")


@pytest.mark.parametrize("family", SMOOTH)
def test_fixed_multipliers_differ_from_finite_differences(family):
    """The surrogate holds the multipliers fixed in θ: not the total derivative (so the test above can fail)."""
    ((_, analytic, numeric, _),) = _directional_derivatives(family, "fixed_multipliers", slice(-1, None))
    assert abs(analytic - numeric) > 1e-3 * abs(numeric)
