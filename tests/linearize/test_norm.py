"""R3 / R3': normalizations (rules/norm.py).

BatchNorm (eval) is the per-channel affine map ``x·s + (β − μ·s)·O``; LayerNorm,
GroupNorm and RMSNorm keep the centring linear, hold ``1/σ`` (1/rms) constant, scale
by ``γ`` and carry ``β`` by ``Ō`` = the mean of the ones over the normalized dims.
Oracles are derived by hand (formulas in each test). Every γ, β and running statistic
is randomized (PyTorch initializes them to 1/0).

Tolerances (float64): 1e-11 relative, 1e-13 absolute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from omenn_kernels import UnsupportedOpError, explain
from omenn_kernels.linearize import lookup
from omenn_kernels.linearize.rules.norm import batch_norm_affine
from omenn_kernels.linearize.values import Live
from rule_checks import ATOL, DT, RTOL, Headed, assert_complete, assert_sums_to_logit, rand

aten = torch.ops.aten


def _randomize_bn(bn: nn.BatchNorm2d, seed: int) -> None:
    c = bn.num_features
    with torch.no_grad():
        bn.weight.copy_(rand(c, seed=seed))
        bn.bias.copy_(rand(c, seed=seed + 1))
        bn.running_mean.copy_(rand(c, seed=seed + 2))
        bn.running_var.copy_(rand(c, seed=seed + 3).abs() + 0.3)


def _bn_model(c=3, h=3, w=4, k=3, seed=0):
    model = Headed("bn", nn.BatchNorm2d(c, eps=1e-3), c * h * w, k).double()
    _randomize_bn(model.bn, seed)
    with torch.no_grad():
        model.head.weight.copy_(rand(k, c * h * w, seed=seed + 10))
    return model


def _bn_expected(model, target, c, h, w):
    """C_w[c] = W·s_c, C_b = Σ_c W·(β_c − μ_c s_c), s = γ/√(var + ε)."""
    bn = model.bn
    s = bn.weight.detach() / torch.sqrt(bn.running_var + bn.eps)
    shift = bn.bias.detach() - bn.running_mean * s
    g = model.head.weight[target].detach().view(c, h, w)
    return g * s.view(c, 1, 1), (g * shift.view(c, 1, 1)).sum(0)


def test_batchnorm_eval_is_affine_with_running_stats():
    c, h, w = 3, 3, 4
    model = _bn_model(c, h, w)
    x = rand(2, c, h, w, seed=40) * 2 + 1
    e = explain(model.eval(), x, 2)
    cw, cb = _bn_expected(model, 2, c, h, w)
    torch.testing.assert_close(e.weight, cw.expand(2, c, h, w), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, cb.expand(2, h, w), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, 2, rtol=1e-12)


def test_batchnorm_in_training_mode_is_explained_in_eval_semantics():
    c, h, w = 3, 3, 4
    model = _bn_model(c, h, w, seed=5)
    model.train()
    stats = {k: v.clone() for k, v in model.bn.state_dict().items()}
    x = rand(2, c, h, w, seed=41) * 3 - 1  # batch statistics far from the running ones
    e = explain(model, x, 1)
    cw, cb = _bn_expected(model, 1, c, h, w)
    torch.testing.assert_close(e.weight, cw.expand(2, c, h, w), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, cb.expand(2, h, w), rtol=RTOL, atol=ATOL)
    # The model is left as it was: still training, running statistics untouched.
    assert model.training and model.bn.training
    for key, value in model.bn.state_dict().items():
        assert torch.equal(value, stats[key]), key
    with torch.no_grad():
        eval_logit = model.eval()(x)[:, 1]
        train_logit = model.train()(x)[:, 1]
    torch.testing.assert_close(e.logit, eval_logit, rtol=1e-12, atol=1e-12)
    assert (e.logit - train_logit).abs().max() > 1e-3


def test_batch_norm_affine_unit():
    x0 = rand(2, 4, 3, 3, seed=42)
    weight, bias, mean = rand(4, seed=43), rand(4, seed=44), rand(4, seed=45)
    var = rand(4, seed=46).abs() + 0.5
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    out = batch_norm_affine(Live(x, ones), weight, bias, mean, var, 1e-5)
    s = weight / torch.sqrt(var + 1e-5)
    for ci in range(4):
        torch.testing.assert_close(out.value[:, ci].detach(), (x0[:, ci] - mean[ci]) * s[ci] + bias[ci],
                                   rtol=RTOL, atol=ATOL)
    g = rand(2, 4, 3, 3, seed=47)
    x_grad, ones_grad = torch.autograd.grad((out.value * g).sum(), [x, ones])
    torch.testing.assert_close(x_grad, g * s.view(1, 4, 1, 1), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ones_grad, g * (bias - mean * s).view(1, 4, 1, 1), rtol=RTOL, atol=ATOL)
    # R3: the ones pass unchanged.
    torch.testing.assert_close(out.ones.detach().expand(x0.shape), torch.ones_like(x0), rtol=0, atol=0)


def test_layernorm_linear_hand_derivation():
    """y_t = (x_t − mean_t)·γ/σ_t + β with σ_t held.

    ∂ŷ/∂x_t = (γ⊙g_t − mean(γ⊙g_t))/σ_t and C_b[t] = β·g_t (β·Ō, Ō the mean over C).
    """
    c, h, w, k = 4, 2, 3, 3
    ln = nn.LayerNorm(c, eps=1e-4)
    model = Headed("norm", ln, h * w * c, k, on_tokens=True).double()  # norm over C of each token
    with torch.no_grad():
        ln.weight.copy_(rand(c, seed=50))
        ln.bias.copy_(rand(c, seed=51))
        model.head.weight.copy_(rand(k, h * w * c, seed=52))
    x = rand(2, c, h, w, seed=53) * 2 + 0.5
    target = 0
    e = explain(model, x, target)
    gamma, beta = ln.weight.detach(), ln.bias.detach()
    g = model.head.weight[target].detach().view(h * w, c)
    tokens = x.flatten(2).transpose(1, 2)
    for b in range(2):
        sigma = torch.sqrt(((tokens[b] - tokens[b].mean(1, keepdim=True)) ** 2).mean(1) + 1e-4)
        gg = gamma * g
        cw = (gg - gg.mean(1, keepdim=True)) / sigma[:, None]  # (T, C)
        torch.testing.assert_close(e.weight[b], cw.T.reshape(c, h, w), rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(e.bias[b], (beta * g).sum(1).view(h, w), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, target, rtol=1e-12)


def test_rmsnorm_hand_derivation():
    """y_t = x_t·γ/rms_t with rms_t held: ∂ŷ/∂x_t = γ⊙g_t/rms_t; no bias, so C_b = 0."""
    c, h, w, k = 4, 2, 2, 2
    rms = nn.RMSNorm(c, eps=1e-5)
    model = Headed("norm", rms, h * w * c, k, on_tokens=True).double()  # norm over C of each token
    with torch.no_grad():
        rms.weight.copy_(rand(c, seed=54))
        model.head.weight.copy_(rand(k, h * w * c, seed=55))
    x = rand(2, c, h, w, seed=56) + 0.7
    e = explain(model, x, 1)
    g = model.head.weight[1].detach().view(h * w, c)
    tokens = x.flatten(2).transpose(1, 2)
    for b in range(2):
        r = torch.sqrt((tokens[b] ** 2).mean(1) + 1e-5)
        cw = rms.weight.detach() * g / r[:, None]
        torch.testing.assert_close(e.weight[b], cw.T.reshape(c, h, w), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, torch.zeros_like(e.bias), rtol=0, atol=ATOL)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-12)


def test_groupnorm_hand_derivation():
    """β_c is carried by the mean of the group's ones: spread evenly over all pixels (1/HW each)."""
    c, groups, h, w, k = 4, 2, 3, 3, 2
    model = Headed("gn", nn.GroupNorm(groups, c, eps=1e-4), c * h * w, k).double()
    with torch.no_grad():
        model.gn.weight.copy_(rand(c, seed=57))
        model.gn.bias.copy_(rand(c, seed=58))
        model.head.weight.copy_(rand(k, c * h * w, seed=59))
    x = rand(2, c, h, w, seed=60) * 1.5
    e = explain(model, x, 0)
    g = model.head.weight[0].detach().view(c, h, w)
    gamma, beta = model.gn.weight.detach(), model.gn.bias.detach()
    share = (beta.view(c, 1, 1) * g).sum() / (h * w)
    torch.testing.assert_close(e.bias, torch.full((2, h, w), share.item(), dtype=DT), rtol=RTOL, atol=ATOL)
    per = c // groups
    for b in range(2):
        for grp in range(groups):
            block = x[b, grp * per:(grp + 1) * per]
            sigma = torch.sqrt(((block - block.mean()) ** 2).mean() + 1e-4)
            gg = gamma[grp * per:(grp + 1) * per].view(per, 1, 1) * g[grp * per:(grp + 1) * per]
            torch.testing.assert_close(e.weight[b, grp * per:(grp + 1) * per], (gg - gg.mean()) / sigma,
                                       rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, 0, rtol=1e-12)


class _NormStack(nn.Module):
    """Conv → LayerNorm over (C, H, W) → GELU → GroupNorm → tokens → RMSNorm → LayerNorm → head."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.ln_chw = nn.LayerNorm([4, 4, 4])
        self.gn = nn.GroupNorm(2, 4)
        self.rms = nn.RMSNorm(4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = self.gn(nn.functional.gelu(self.ln_chw(self.conv(x))))
        t = self.ln(self.rms(y.flatten(2).transpose(1, 2)))
        return self.head(t.mean(1))


def test_norms_complete_in_a_stack():
    torch.manual_seed(3)
    model = _NormStack().double()
    g = torch.Generator().manual_seed(61)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * 0.7 + 0.2)
    x = rand(3, 3, 4, 4, seed=62)
    e = explain(model, x, 2)
    assert_complete(e, model, x, 2, rtol=1e-10)
    assert e.bias.abs().max() > 1e-2


@pytest.mark.parametrize("op", [aten.layer_norm.default, aten.native_layer_norm.default])
def test_layer_norm_rule_ones_gradient(op):
    """Unit level: ∂/∂O[t, c] = Σ_d β_d g[t, d] / C; centring gets the gradient, 1/σ does not."""
    x0, gamma, beta = rand(3, 5, seed=63) * 2, rand(5, seed=64), rand(5, seed=65)
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    out = lookup(op).reference(op, Live(x, ones), [5], gamma, beta, 1e-5, held=[x0, [5], gamma, beta, 1e-5])
    if isinstance(out, tuple):
        out = out[0]
    torch.testing.assert_close(out.value.detach(), nn.functional.layer_norm(x0, [5], gamma, beta, 1e-5),
                               rtol=RTOL, atol=ATOL)
    g = rand(3, 5, seed=66)
    x_grad, ones_grad = torch.autograd.grad((out.value * g).sum(), [x, ones])
    torch.testing.assert_close(ones_grad, ((g * beta).sum(1, keepdim=True) / 5).expand(3, 5), rtol=RTOL, atol=ATOL)
    sigma = torch.sqrt(x0.var(1, unbiased=False, keepdim=True) + 1e-5)
    gg = gamma * g
    torch.testing.assert_close(x_grad, (gg - gg.mean(1, keepdim=True)) / sigma, rtol=RTOL, atol=ATOL)


class _PadThenBN(nn.Module):
    """Zero padding then BatchNorm: the real BN adds its shift β − μ·s at the padded positions too."""

    def __init__(self):
        super().__init__()
        self.bn = nn.BatchNorm2d(2)
        self.head = nn.Linear(2 * 4 * 4, 2)

    def forward(self, x):
        return self.head(self.bn(nn.functional.pad(x, (1, 1, 1, 1))).flatten(1))


def test_batchnorm_shift_after_zero_padding_is_not_dropped():
    model = _PadThenBN().double()
    _randomize_bn(model.bn, seed=70)
    x = rand(2, 2, 2, 2, seed=71)
    try:
        e = explain(model.eval(), x, 0)
    except UnsupportedOpError:
        return  # a clear refusal, as for a conv bias only padding reaches, is acceptable
    torch.testing.assert_close(e.logit, model(x)[:, 0].detach(), rtol=1e-12, atol=1e-12)
