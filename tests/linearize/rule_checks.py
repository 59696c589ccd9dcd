"""Helpers shared by the per-rule tests of this directory: seeded data, small models, checks.

Not a test module: the test files import it as ``rule_checks`` (pytest's default
``prepend`` import mode puts this directory on ``sys.path``).

Default tolerances (float64): 1e-11 relative, 1e-13 absolute; a test module that needs
other ones says so next to its own constants.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DT = torch.float64
RTOL = 1e-11
ATOL = 1e-13


# ----------------------------------------------------------------------------- data


def rand(*shape, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=DT) * scale


def randomize(model: nn.Module, seed: int, scale: float = 0.8) -> nn.Module:
    """Every parameter ~ N(0, scale²), then every floating-point buffer ~ N(0, 1), from one generator.

    Integer and bool buffers (indices, boolean masks) are left as they are.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
        for b in model.buffers():
            if b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype))
    return model


def tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) -> (B, HW, C): one token per pixel."""
    return x.flatten(2).transpose(1, 2)


# ----------------------------------------------------------------------------- models


class Headed(nn.Module):
    """``head(body(x).flatten(1))`` with a bias-free Linear head: the body's biases are the only ones.

    The body is registered under ``name`` (so errors and parameters name it so); with
    ``on_tokens`` it sees the pixel tokens (B, HW, C) instead of the image.
    """

    def __init__(self, name: str, body: nn.Module, features: int, classes: int, on_tokens: bool = False):
        super().__init__()
        self.body_name, self.on_tokens = name, on_tokens
        setattr(self, name, body)
        self.head = nn.Linear(features, classes, bias=False)

    def forward(self, x):
        body = getattr(self, self.body_name)
        return self.head(body(tokens(x) if self.on_tokens else x).flatten(1))


class SqueezeExcite(nn.Module):
    """``x · gate(fc2(relu(fc1(mean_hw x))))``: the gate branch is a GATE (R5), ``x`` stays LIVE."""

    def __init__(self, c: int, hidden: int, gate: str):
        super().__init__()
        self.fc1 = nn.Conv2d(c, hidden, 1)
        self.fc2 = nn.Conv2d(hidden, c, 1)
        self.gate = gate

    def weights(self, x):
        s = self.fc2(F.relu(self.fc1(x.mean((2, 3), keepdim=True))))
        return torch.sigmoid(s) if self.gate == "sigmoid" else F.hardsigmoid(s)

    def forward(self, x):
        return x * self.weights(x)


# ----------------------------------------------------------------------------- checks


def gradient(model, x, target):
    """∂ model(x)[:, target].sum() / ∂x by autograd on the model itself."""
    xg = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(xg)[:, target].sum(), xg)
    return grad


def assert_written_out(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """``actual`` equals a written-out form: ``rtol=1e-9``, ``atol=1e-12·max|expected|``."""
    expected = expected.detach()
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12 * float(expected.abs().max()))


def on_both_backends(model: nn.Module, x: torch.Tensor, target: int, **kwargs):
    """The reference explanation, after checking the fused backend's against it and its completeness
    (``|Σ C − ŷ| / |ŷ| ≤ 1e-10``)."""
    from omenn_kernels import explain

    reference = explain(model, x, target, backend="reference", **kwargs)
    fused = explain(model, x, target, backend="fused", **kwargs)
    assert_written_out(fused.contribution, reference.contribution)
    assert_written_out(fused.weight, reference.weight)
    assert float(reference.completeness_error().max()) <= 1e-10
    return reference


def assert_sums_to_logit(e, model, x, target, rtol: float):
    """Σ_hw C equals the model's own output (relative ``rtol``, absolute 1e-12)."""
    torch.testing.assert_close(e.contribution.sum((1, 2)), model(x)[:, target].detach(), rtol=rtol, atol=1e-12)


def assert_complete(e, model, x, target, rtol: float = 1e-11):
    """``e.logit`` is the model's output (1e-12) and Σ_hw C sums to it (relative ``rtol``, absolute 1e-12)."""
    logits = model(x).detach()
    torch.testing.assert_close(e.logit, logits[:, target], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(e.contribution.sum((1, 2)), logits[:, target], rtol=rtol, atol=1e-12)
