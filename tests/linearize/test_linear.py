"""R1: linear maps and matrix products with a CONST operand (rules/linear.py).

``y = xW + b·Ō`` with ``Ō`` the mean of the ones over the contracted dimension. For
tokens (one per pixel), a Linear's bias therefore goes to the token's own pixel; a
product that contracts the token dimension spreads it over the contracted tokens.
The oracles are hand-written sums over the read-out weights.

Tolerances (float64): 1e-11 relative, 1e-13 absolute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from omenn_kernels import UnsupportedOpError, explain
from omenn_kernels.linearize import lookup
from omenn_kernels.linearize.values import Live
from rule_checks import ATOL, DT, RTOL, Headed, assert_sums_to_logit, rand, tokens

aten = torch.ops.aten


def test_token_bias_goes_to_its_own_token():
    c, d, h, w, k = 3, 5, 3, 4, 4
    model = Headed("fc", nn.Linear(c, d), h * w * d, k, on_tokens=True).double()  # tokens → Linear(C, D) → head
    with torch.no_grad():
        model.fc.weight.copy_(rand(d, c, seed=1))
        model.fc.bias.copy_(rand(d, seed=2))
        model.head.weight.copy_(rand(k, h * w * d, seed=3))
    x = rand(2, c, h, w, seed=4)
    target = 3
    e = explain(model, x, target)
    g = model.head.weight[target].detach().view(h * w, d)  # ∂ŷ/∂y[t, d]
    b = model.fc.bias.detach()
    expected = torch.stack([sum(b[j] * g[t, j] for j in range(d)) for t in range(h * w)]).view(h, w)
    for i in range(2):
        torch.testing.assert_close(e.bias[i], expected, rtol=RTOL, atol=ATOL)
    # C_w: ∂ŷ/∂x[c, t] = Σ_d W[d, c] g[t, d], written as loops.
    wt = model.fc.weight.detach()
    cw = torch.zeros(c, h * w, dtype=DT)
    for t in range(h * w):
        for ci in range(c):
            cw[ci, t] = sum(wt[j, ci] * g[t, j] for j in range(d))
    torch.testing.assert_close(e.weight, cw.view(1, c, h, w).expand(2, c, h, w), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, target, rtol=1e-12)


def test_linear_rule_ones_gradient_is_bias_over_features():
    """Unit level: ∂/∂O[n, c] = Σ_d b_d g[n, d] / C (Ō = mean over the contracted features)."""
    x0, w, b = rand(4, 3, seed=5), rand(2, 3, seed=6), rand(2, seed=7)
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    out = lookup(aten.linear.default).reference(aten.linear.default, Live(x, ones), w, b)
    torch.testing.assert_close(out.value.detach(), x0 @ w.T + b, rtol=RTOL, atol=ATOL)
    g = rand(4, 2, seed=8)
    x_grad, ones_grad = torch.autograd.grad((out.value * g).sum(), [x, ones])
    torch.testing.assert_close(x_grad, g @ w, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ones_grad, ((g * b).sum(1, keepdim=True) / 3).expand(4, 3), rtol=RTOL, atol=ATOL)


class _RightConstant(nn.Module):
    """Tokens @ W (a parameter) + c (a constant added, R7'), then a head without bias."""

    def __init__(self, c: int, d: int, t: int, k: int):
        super().__init__()
        self.w = nn.Parameter(rand(c, d, seed=10))
        self.c = nn.Parameter(rand(d, seed=11))
        self.head = nn.Linear(t * d, k, bias=False)

    def forward(self, x):
        return self.head((torch.matmul(tokens(x), self.w) + self.c).flatten(1))


class _LeftConstant(nn.Module):
    """M (a parameter, T'×T) @ tokens: mixes tokens; + c; head without bias."""

    def __init__(self, c: int, t_out: int, t: int, k: int):
        super().__init__()
        self.m = nn.Parameter(rand(t_out, t, seed=12))
        self.c = nn.Parameter(rand(c, seed=13))
        self.head = nn.Linear(t_out * c, k, bias=False)

    def forward(self, x):
        return self.head((torch.matmul(self.m, tokens(x)) + self.c).flatten(1))


def test_matmul_constant_on_the_right():
    c, d, h, w, k = 3, 4, 2, 3, 2
    model = _RightConstant(c, d, h * w, k).double()
    with torch.no_grad():
        model.head.weight.copy_(rand(k, h * w * d, seed=14))
    x = rand(2, c, h, w, seed=15)
    e = explain(model, x, 1)
    g = model.head.weight[1].detach().view(h * w, d)
    cst = model.c.detach()
    # The constant added to token t's features is carried by token t's ones.
    expected = (g * cst).sum(1).view(h, w)
    torch.testing.assert_close(e.bias, expected.expand(2, h, w), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.weight, (g @ model.w.detach().T).T.reshape(1, c, h, w).expand(2, c, h, w),
                               rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-12)


def test_matmul_constant_on_the_left_spreads_over_contracted_tokens():
    c, t_out, h, w, k = 3, 2, 2, 3, 2
    model = _LeftConstant(c, t_out, h * w, k).double()
    with torch.no_grad():
        model.head.weight.copy_(rand(k, t_out * c, seed=16))
    x = rand(2, c, h, w, seed=17)
    e = explain(model, x, 0)
    g = model.head.weight[0].detach().view(t_out, c)
    total = (g * model.c.detach()).sum()
    # Ō of M @ X is the mean over the T contracted tokens: every pixel gets total / T.
    torch.testing.assert_close(e.bias, torch.full((2, h, w), (total / (h * w)).item(), dtype=DT),
                               rtol=RTOL, atol=ATOL)
    m = model.m.detach()
    cw = torch.einsum("oc,ot->ct", g, m)  # ∂ŷ/∂x[c, t] = Σ_o g[o, c] M[o, t]
    torch.testing.assert_close(e.weight, cw.reshape(1, c, h, w).expand(2, c, h, w), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, 0, rtol=1e-12)


class _Addmm(nn.Module):
    def __init__(self, n: int, k: int):
        super().__init__()
        self.w = nn.Parameter(rand(n, k, seed=20))
        self.b = nn.Parameter(rand(k, seed=21))

    def forward(self, x):
        return torch.addmm(self.b, x.flatten(1), self.w, beta=0.5, alpha=2.0)


def test_addmm_with_beta_alpha():
    c, h, w, k = 2, 3, 3, 4
    model = _Addmm(c * h * w, k).double()
    x = rand(2, c, h, w, seed=22)
    e = explain(model, x, 3)
    # beta·b[t] is spread evenly over the C·H·W contracted inputs: per pixel beta·b[t]/(H·W).
    share = 0.5 * model.b[3].item() / (h * w)
    torch.testing.assert_close(e.bias, torch.full((2, h, w), share, dtype=DT), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.weight, (2.0 * model.w[:, 3].detach()).view(1, c, h, w).expand(2, c, h, w),
                               rtol=RTOL, atol=ATOL)
    expected = 0.5 * model.b[3] + 2.0 * x.flatten(1) @ model.w[:, 3]
    torch.testing.assert_close(e.logit, expected.detach(), rtol=1e-12, atol=1e-12)
    assert_sums_to_logit(e, model, x, 3, rtol=1e-12)


def test_batched_matmul_rule_unit():
    """bmm with a CONST right factor: ones averaged over the contracted (last) dimension."""
    x0, w = rand(2, 3, 4, seed=23), rand(2, 4, 5, seed=24)
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    out = lookup(aten.bmm.default).reference(aten.bmm.default, Live(x, ones), w)
    torch.testing.assert_close(out.value.detach(), torch.einsum("bti,bio->bto", x0, w), rtol=RTOL, atol=ATOL)
    g = rand(2, 3, 5, seed=25)
    (ones_grad,) = torch.autograd.grad((out.ones * g).sum(), ones)
    torch.testing.assert_close(ones_grad, (g.sum(-1, keepdim=True) / 4).expand(2, 3, 4), rtol=RTOL, atol=ATOL)


def test_product_of_two_live_matrices_is_refused():
    class Gram(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(9, 2)

        def forward(self, x):
            t = tokens(x)
            return self.head((t.transpose(1, 2) @ t).flatten(1))

    with pytest.raises(UnsupportedOpError) as info:
        explain(Gram().double(), rand(1, 3, 2, 2, seed=26), 0)
    assert info.value.op.startswith("aten.") and ("matmul" in info.value.op or "bmm" in info.value.op)
    assert "R9" in info.value.rule_kind


class _VectorProducts(nn.Module):
    """Tokens @ v and u @ tokens with 1-D constant vectors (aten.matmul stays in the graph)."""

    def __init__(self, c: int, t: int):
        super().__init__()
        self.v = nn.Parameter(rand(c, seed=27))
        self.u = nn.Parameter(rand(t, seed=28))
        self.head = nn.Linear(t + c, 2, bias=False)

    def forward(self, x):
        t = tokens(x)
        return self.head(torch.cat([t @ self.v, self.u @ t], 1))


def test_matmul_with_constant_vector():
    c, h, w = 3, 2, 2
    model = _VectorProducts(c, h * w).double()
    x = rand(2, c, h, w, seed=29)
    e = explain(model, x, 1)
    g = model.head.weight[1].detach()
    # ŷ = Σ_t g_t (x_t · v) + Σ_c g_{T+c} (u · x[:, c]): C_w[c, t] = g_t v_c + g_{T+c} u_t.
    cw = torch.outer(model.v.detach(), g[:h * w]) + torch.outer(g[h * w:], model.u.detach())
    torch.testing.assert_close(e.weight, cw.reshape(1, c, h, w).expand(2, c, h, w), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-12)


def test_fused_linear_with_a_held_output_takes_its_numbers_and_the_rule_derivatives():
    """Given the model's ``x̄·Wᵀ + b`` (``model_result``: a total parameter gradient) the fused
    rule's value is its numbers, not a second product; its derivatives, first and second order,
    are the reference rule's (rtol 1e-12)."""
    x0 = rand(2, 5, 4, seed=21)
    weight = rand(3, 4, seed=22).requires_grad_(True)
    bias = rand(3, seed=23).requires_grad_(True)
    held_scale = torch.ones((), dtype=DT, requires_grad=True)  # the held values follow a parameter
    up, down_x, down_ones, down_held = (rand(*shape, seed=s) for s, shape in
                                        ((24, (2, 5, 3)), (25, (2, 5, 4)), (26, (2, 5, 1)), (27, (2, 5, 3))))
    rule = lookup(aten.linear.default)
    results = []
    for fused in (True, False):
        value = x0.clone().requires_grad_(True)
        ones = torch.ones(2, 5, 1, dtype=DT, requires_grad=True)
        held = x0 * held_scale
        model_output = torch.nn.functional.linear(held, weight, bias)
        run = rule.fused if fused else rule.reference
        out = run(aten.linear.default, Live(value, ones), weight, bias,
                  **({"model_result": model_output} if fused else {}))
        if fused:
            assert torch.equal(out.value, model_output)
        grad_x, grad_ones = torch.autograd.grad((out.value * up).sum(), [value, ones], create_graph=True)
        second = (grad_x * down_x).sum() + (grad_ones * down_ones).sum() + (model_output * down_held).sum()
        results.append((out.value, grad_x, grad_ones, *torch.autograd.grad(second, [weight, bias, held_scale])))
    for fused, reference in zip(*results):
        torch.testing.assert_close(fused, reference, rtol=1e-12, atol=1e-12)
