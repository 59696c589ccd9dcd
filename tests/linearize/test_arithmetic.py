"""R7, R7', R8, R9: sums, constants added or multiplied, products (rules/arithmetic.py).

Models work on pixel tokens (B, T, C) and end in a bias-free Linear head, so
``g[t, d] = ∂ŷ/∂y[t, d]`` is a row of the head's weight and every expected ``C_w`` and
``C_b`` is a hand-written sum over it.

Tolerances (float64): 1e-11 relative, 1e-13 absolute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from omenn_kernels import UnsupportedOpError, explain
from omenn_kernels.linearize import lookup
from omenn_kernels.linearize.values import Live
from rule_checks import ATOL, DT, RTOL, assert_complete, rand, tokens

aten = torch.ops.aten
C, H, W = 3, 2, 3
T = H * W


def _as_image(per_token_channel: torch.Tensor) -> torch.Tensor:
    """(T, C) -> (C, H, W), the inverse of tokens() for one sample."""
    return per_token_channel.T.reshape(C, H, W)


class _TokenModel(nn.Module):
    """tokens → body(tokens) → flatten → Linear without bias."""

    def __init__(self, body, seed: int, **params):
        super().__init__()
        self.body = body
        for name, value in params.items():
            setattr(self, name, nn.Parameter(value))
        self.head = nn.Linear(T * C, 3, bias=False)
        with torch.no_grad():
            self.head.weight.copy_(rand(3, T * C, seed=seed))

    def forward(self, x):
        return self.head(self.body(self, tokens(x)).flatten(1))


def _explain(model, seed=0, target=1):
    x = rand(2, C, H, W, seed=100 + seed, scale=1.3)
    e = explain(model, x, target)
    assert_complete(e, model, x, target)
    return e, model.head.weight[target].detach().view(T, C), x


def test_residual_averages_the_ones():
    """y = x + M·x (M mixes tokens), then + c: O_y = (O_x + mean_tokens O_x)/2 carries c."""
    m, c = rand(T, T, seed=1), rand(C, seed=2)
    model = _TokenModel(lambda s, t: (t + torch.matmul(s.m, t)) + s.c, seed=3, m=m, c=c).double()
    e, g, _ = _explain(model)
    # ∂/∂O[s, d] = c_d (g[s, d]/2 + Σ_t g[t, d]/(2T)); C_b sums over d.
    expected = torch.stack([sum(c[d] * (g[s, d] / 2 + g[:, d].sum() / (2 * T)) for d in range(C))
                            for s in range(T)]).view(H, W)
    torch.testing.assert_close(e.bias, expected.expand(2, H, W), rtol=RTOL, atol=ATOL)
    # Neither "the left operand's ones" nor "the right operand's ones" alone.
    own = (c * g).sum(1).view(H, W)
    spread = torch.full((H, W), (c * g).sum().item() / T, dtype=DT)
    assert (expected - own).abs().max() > 1e-2 and (expected - spread).abs().max() > 1e-2
    # C_w: ∂ŷ/∂x[s, d] = g[s, d] + Σ_t M[t, s] g[t, d].
    cw = g + m.T @ g
    torch.testing.assert_close(e.weight, _as_image(cw).expand(2, C, H, W), rtol=RTOL, atol=ATOL)


def test_subtraction_with_alpha_of_live_tensors():
    m, c = rand(T, T, seed=4), rand(C, seed=5)
    model = _TokenModel(lambda s, t: torch.sub(torch.matmul(s.m, t), t, alpha=0.5) + s.c,
                        seed=6, m=m, c=c).double()
    e, g, _ = _explain(model, seed=1)
    expected = torch.stack([sum(c[d] * (g[s, d] / 2 + g[:, d].sum() / (2 * T)) for d in range(C))
                            for s in range(T)]).view(H, W)
    torch.testing.assert_close(e.bias, expected.expand(2, H, W), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.weight, _as_image(m.T @ g - 0.5 * g).expand(2, C, H, W), rtol=RTOL, atol=ATOL)


def test_add_rule_unit_ones_average():
    a0, b0 = rand(2, 4, seed=7), rand(2, 4, seed=8)
    oa = torch.ones_like(a0, requires_grad=True)
    ob = torch.ones_like(b0, requires_grad=True)
    out = lookup(aten.add.Tensor).reference(aten.add.Tensor, Live(a0, oa), Live(b0, ob))
    torch.testing.assert_close(out.value, a0 + b0, rtol=0, atol=0)
    up = rand(2, 4, seed=9)
    ga, gb = torch.autograd.grad((out.ones * up).sum(), [oa, ob])
    torch.testing.assert_close(ga, up / 2, rtol=0, atol=0)
    torch.testing.assert_close(gb, up / 2, rtol=0, atol=0)


def test_positional_embedding_carried_by_token_ones():
    pos = rand(T, C, seed=10)
    model = _TokenModel(lambda s, t: t + s.pos, seed=11, pos=pos).double()
    e, g, _ = _explain(model, seed=2)
    torch.testing.assert_close(e.bias, (pos * g).sum(1).view(H, W).expand(2, H, W), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.weight, _as_image(g).expand(2, C, H, W), rtol=RTOL, atol=ATOL)


def test_constant_minus_live_and_negation():
    c = rand(C, seed=12)
    model = _TokenModel(lambda s, t: (1.5 - t) + (-t) * 0.25 - s.c, seed=13, c=c).double()
    e, g, _ = _explain(model, seed=3)
    torch.testing.assert_close(e.weight, _as_image(-1.25 * g).expand(2, C, H, W), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, ((1.5 - c) * g).sum(1).view(H, W).expand(2, H, W), rtol=RTOL, atol=ATOL)


def test_scaling_by_constants_keeps_the_ones():
    """Layer scale (a parameter), a Python scalar and divisions: values scale, ones do not."""
    gamma, d, c = rand(C, seed=14), rand(C, seed=15).abs() + 0.5, rand(C, seed=16)
    model = _TokenModel(lambda s, t: ((t * s.gamma) * 0.5 + s.c) / s.d / 3.0,
                        seed=17, gamma=gamma, d=d, c=c).double()
    e, g, _ = _explain(model, seed=4)
    torch.testing.assert_close(e.weight, _as_image(g * gamma * 0.5 / d / 3.0).expand(2, C, H, W),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, (g * c / d / 3.0).sum(1).view(H, W).expand(2, H, W), rtol=RTOL, atol=ATOL)


def test_division_with_rounding_is_refused():
    model = _TokenModel(lambda s, t: torch.div(t, 2.0, rounding_mode="floor"), seed=18).double()
    with pytest.raises(UnsupportedOpError) as info:
        _explain(model)
    assert info.value.op == "aten.div.Tensor_mode"


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(C, C)

    def forward(self, t):
        return t * self.fc(t)


class _Product(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = _Inner()
        self.head = nn.Linear(T * C, 2)

    def forward(self, x):
        return self.head(self.block(tokens(x)).flatten(1))


def test_product_of_two_live_tensors_is_refused():
    with pytest.raises(UnsupportedOpError) as info:
        explain(_Product().double(), rand(1, C, H, W, seed=19), 0)
    err = info.value
    assert err.op == "aten.mul.Tensor"
    assert err.module_path == "block"
    assert "R9" in err.rule_kind
    assert "aten.mul.Tensor" in str(err) and "block" in str(err)


def test_square_is_refused():
    model = _TokenModel(lambda s, t: t * t, seed=20).double()
    with pytest.raises(UnsupportedOpError) as info:
        _explain(model)
    assert info.value.op == "aten.mul.Tensor"


def test_dividing_by_a_live_tensor_is_refused():
    c = rand(T, C, seed=21).abs() + 1
    model = _TokenModel(lambda s, t: torch.div(s.c, t), seed=22, c=c).double()
    with pytest.raises(UnsupportedOpError) as info:
        _explain(model)
    assert info.value.op == "aten.div.Tensor"


def test_adding_a_gate_is_refused():
    """A softmax is only a gate (it multiplies); adding it to a LIVE tensor has no linear form."""
    model = _TokenModel(lambda s, t: t + t.softmax(-1), seed=23).double()
    with pytest.raises(UnsupportedOpError) as info:
        _explain(model)
    assert info.value.op == "aten.add.Tensor"
    assert "R5" in info.value.rule_kind


class _PadThenConstant(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Parameter(rand(2, 4, 4, seed=24))
        self.head = nn.Linear(2 * 4 * 4, 2)

    def forward(self, x):
        return self.head((nn.functional.pad(x, (1, 1, 1, 1)) + self.c).flatten(1))


def test_constant_added_after_zero_padding_is_not_dropped():
    model = _PadThenConstant().double()
    x = rand(2, 2, 2, 2, seed=25)
    try:
        e = explain(model, x, 0)
    except UnsupportedOpError:
        return  # a clear refusal (as for a conv bias only padding reaches) is acceptable
    torch.testing.assert_close(e.logit, model(x)[:, 0].detach(), rtol=1e-12, atol=1e-12)
