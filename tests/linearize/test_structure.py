"""R10–R12: structure, padding, and constants joined to LIVE tensors (rules/structure.py).

Oracles:
* class / register / distillation tokens (R12): the constants' contribution is
  computed by a hand-written forward (attention weights detached, the tokens as
  autograd leaves) and must be spread evenly over the sample's pixels;
* padding: explicit loops over a conv's taps, mapping each tap of the padded image to
  its source pixel (zero padding: none; reflect / replicate / circular: the
  reflected / clamped / wrapped pixel);
* pure selection ops (roll, flip, split, chunk, unbind, gather, index): a scalar
  added after them is carried to the selected source pixels, ``C_b = c·Σ_ch ∂ŷ/∂x``.

Tolerances (float64): 1e-11 relative, 1e-13 absolute.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import UnsupportedOpError, explain
from rule_checks import ATOL, DT, RTOL, assert_complete, gradient, rand, randomize


# ----------------------------------------------------------------------------- R12 tokens


class _TokenViT(nn.Module):
    """Pixel tokens → embed (no bias) → [cls, dist, tokens, registers] → one attention → cls."""

    def __init__(self, c=3, e=4, registers=2):
        super().__init__()
        self.embed = nn.Linear(c, e, bias=False)
        self.cls = nn.Parameter(torch.zeros(1, 1, e))
        self.dist = nn.Parameter(torch.zeros(1, 1, e))
        self.reg = nn.Parameter(torch.zeros(1, registers, e))
        self.q = nn.Linear(e, e)  # its bias only shapes the gate: no contribution
        self.k = nn.Linear(e, e)
        self.v = nn.Linear(e, e, bias=False)
        self.head = nn.Linear(2 * e, 3, bias=False)

    def forward(self, x, consts=None):
        t = self.embed(x.flatten(2).transpose(1, 2))
        b = t.shape[0]
        cls, dist, reg = consts if consts is not None else (self.cls, self.dist, self.reg)
        t = torch.cat([cls.expand(b, -1, -1), dist.expand(b, -1, -1), t, reg.expand(b, -1, -1)], 1)
        y = F.scaled_dot_product_attention(self.q(t), self.k(t), self.v(t))
        return self.head(torch.cat([y[:, 0], y[:, 1]], -1))


def _hand_vit(model: _TokenViT, x, consts, target):
    """The model's forward with the attention weights detached (an explicit softmax)."""
    p = {n: v.detach() for n, v in model.named_parameters()}
    t = x.flatten(2).transpose(1, 2) @ p["embed.weight"].T
    b = t.shape[0]
    cls, dist, reg = consts
    t = torch.cat([cls.expand(b, -1, -1), dist.expand(b, -1, -1), t, reg.expand(b, -1, -1)], 1)
    q = t @ p["q.weight"].T + p["q.bias"]
    k = t @ p["k.weight"].T + p["k.bias"]
    s = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    a = torch.exp(s - s.max(-1, keepdim=True).values)
    a = (a / a.sum(-1, keepdim=True)).detach()
    y = a @ (t @ p["v.weight"].T)
    return (torch.cat([y[:, 0], y[:, 1]], -1) @ p["head.weight"].T)[:, target]


def test_class_register_distillation_tokens_spread_per_sample():
    model = randomize(_TokenViT(), seed=1, scale=1.0).double()
    with torch.no_grad():  # a softer attention, so that the constant tokens get weight
        model.q.weight.mul_(0.3)
        model.k.weight.mul_(0.3)
    x = torch.stack([rand(3, 2, 3, seed=2), rand(3, 2, 3, seed=3) * 2 + 1])
    target = 1
    e = explain(model, x, target)
    assert_complete(e, model, x, target)
    consts = [model.cls.detach().clone().requires_grad_(True), model.dist.detach().clone().requires_grad_(True),
              model.reg.detach().clone().requires_grad_(True)]
    xg = x.clone().requires_grad_(True)
    contributions = []
    for i in range(2):  # per sample: the model is linear in (x, constants) once A is held
        out = _hand_vit(model, xg, consts, target)[i]
        grads = torch.autograd.grad(out, [xg, *consts])
        contributions.append(sum((g * c).sum() for g, c in zip(grads[1:], consts)).detach())
        torch.testing.assert_close(e.weight[i], grads[0][i], rtol=RTOL, atol=ATOL)
    for i in range(2):
        torch.testing.assert_close(e.bias[i], torch.full((2, 3), contributions[i].item() / 6, dtype=DT),
                                   rtol=RTOL, atol=ATOL)
    # Each sample has its own share (a batch-wide mean would give both the same).
    assert abs(contributions[0] - contributions[1]) > 1e-2


class _CoordChannel(nn.Module):
    """cat([x, a constant map], dim=1) → flatten → Linear without bias (CoordConv-like)."""

    def __init__(self, c, h, w):
        super().__init__()
        self.coord = nn.Parameter(rand(1, 1, h, w, seed=4))
        self.head = nn.Linear((c + 1) * h * w, 2, bias=False)

    def forward(self, x):
        return self.head(torch.cat([x, self.coord.expand(x.shape[0], -1, -1, -1)], 1).flatten(1))


def test_constant_channel_joined_along_channels():
    c, h, w = 2, 3, 3
    model = randomize(_CoordChannel(c, h, w), seed=5).double()
    x = rand(2, c, h, w, seed=6)
    e = explain(model, x, 0)
    assert_complete(e, model, x, 0)
    g = model.head.weight[0].detach().view(c + 1, h, w)
    total = (g[c] * model.coord.detach()[0, 0]).sum()
    torch.testing.assert_close(e.bias, torch.full((2, h, w), total.item() / (h * w), dtype=DT),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.weight, g[:c].expand(2, c, h, w), rtol=RTOL, atol=ATOL)


class _PadThenCoord(nn.Module):
    def __init__(self):
        super().__init__()
        self.coord = nn.Parameter(rand(1, 1, 5, 5, seed=7))
        self.head = nn.Linear(2 * 5 * 5, 2, bias=False)

    def forward(self, x):
        y = F.pad(x, (1, 1, 1, 1))
        return self.head(torch.cat([y, self.coord.expand(x.shape[0], -1, -1, -1)], 1).flatten(1))


def test_constant_joined_to_zero_padded_tensor_keeps_its_value():
    model = randomize(_PadThenCoord(), seed=8).double()
    x = rand(2, 1, 3, 3, seed=9)
    try:
        e = explain(model, x, 1)
    except UnsupportedOpError:
        return  # a clear refusal (as for a conv bias only padding reaches) is acceptable
    assert_complete(e, model, x, 1)


# ----------------------------------------------------------------------------- padding


def _source(i, n, mode):
    """Source index of padded coordinate i (may be out of range) for an axis of size n."""
    if 0 <= i < n:
        return i
    if mode == "zeros":
        return None
    if mode == "reflect":
        return -i if i < 0 else 2 * (n - 1) - i
    if mode == "replicate":
        return min(max(i, 0), n - 1)
    return i % n  # circular


class _PadConv(nn.Module):
    """F.pad (any mode) → Conv2d with bias (no padding of its own) → head without bias."""

    def __init__(self, pad, mode, c=2, h=5, w=6, k=3, stride=1):
        super().__init__()
        self.pad, self.mode = pad, mode
        self.conv = nn.Conv2d(c, 3, k, stride=stride)
        ho = (h + pad[2] + pad[3] - k) // stride + 1
        wo = (w + pad[0] + pad[1] - k) // stride + 1
        self.out = (3, ho, wo)
        self.head = nn.Linear(3 * ho * wo, 3, bias=False)

    def forward(self, x):
        if self.mode == "zeros":
            y = F.pad(x, self.pad)
        else:
            y = F.pad(x, self.pad, mode=self.mode)
        return self.head(self.conv(y).flatten(1))


@pytest.mark.parametrize("mode,pad,stride", [
    ("zeros", (1, 1, 1, 1), 1),
    ("zeros", (0, 2, 1, 0), 2),
    ("reflect", (1, 1, 1, 1), 1),
    ("reflect", (2, 0, 1, 2), 2),
    ("replicate", (1, 2, 2, 1), 1),
    ("circular", (1, 1, 2, 1), 1),
])
def test_padding_routes_conv_bias(mode, pad, stride):
    c, h, w, k = 2, 5, 6, 3
    model = randomize(_PadConv(pad, mode, c, h, w, k, stride), seed=10).double()
    x = rand(2, c, h, w, seed=11)
    target = 2
    e = explain(model, x, target)
    assert_complete(e, model, x, target)
    torch.testing.assert_close(e.weight, gradient(model, x, target), rtol=RTOL, atol=ATOL)
    g = model.head.weight[target].detach().view(model.out)
    bias = model.conv.bias.detach()
    expected = torch.zeros(h, w, dtype=DT)
    for j, oy, ox in itertools.product(range(3), range(model.out[1]), range(model.out[2])):
        taps = []
        for ky, kx in itertools.product(range(k), range(k)):
            sy = _source(oy * stride + ky - pad[2], h, mode)
            sx = _source(ox * stride + kx - pad[0], w, mode)
            if sy is not None and sx is not None:
                taps.append((sy, sx))
        for q in taps:  # one share per real tap (a reflected pixel can be seen twice)
            expected[q] += bias[j] * g[j, oy, ox] / len(taps)
    torch.testing.assert_close(e.bias, expected.expand(2, h, w), rtol=RTOL, atol=ATOL)


def test_non_zero_constant_padding_is_refused():
    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(2 * 4 * 4, 2)

        def forward(self, x):
            return self.head(F.pad(x, (1, 1, 1, 1), value=0.5).flatten(1))

    with pytest.raises(UnsupportedOpError) as info:
        explain(Padded().double(), rand(1, 2, 2, 2, seed=12), 0)
    assert info.value.op in ("aten.pad.default", "aten.constant_pad_nd.default")
    assert "R11" in info.value.rule_kind


# ----------------------------------------------------------------------------- R10 selection


class _Selections(nn.Module):
    """Pure selection ops on the image, a scalar constant added to each, a bias-free head."""

    def __init__(self, b, c, h, w):
        super().__init__()
        g = torch.Generator().manual_seed(13)
        self.register_buffer("gather_index", torch.randint(0, h * w, (1, c, 5), generator=g))
        self.register_buffer("rows", torch.tensor([2, 0, 2]))
        self.shift = nn.Parameter(torch.tensor(0.0))
        parts = self._parts(torch.zeros(b, c, h, w))
        self.head = nn.Linear(sum(p[0].numel() for p in parts), 3, bias=False)

    def _parts(self, x):
        b = x.shape[0]
        first, rest = torch.split(x, [1, x.shape[1] - 1], dim=1)
        top, bottom = torch.chunk(x, 2, dim=2)
        channels = torch.unbind(x, dim=1)
        return [
            torch.roll(x, shifts=(1, 2), dims=(2, 3)),
            torch.flip(x, dims=(3,)),
            rest, first.transpose(2, 3),
            bottom,
            channels[1] - 0.0,
            torch.gather(x.flatten(2), 2, self.gather_index.expand(b, -1, -1)),
            x[:, :, self.rows],
            x[:, 0, 1:, ::2],
            x.permute(0, 3, 1, 2).reshape(b, -1, 2),
            top.unsqueeze(1).squeeze(1).contiguous(),
        ]

    def forward(self, x):
        return self.head(torch.cat([(p + self.shift).flatten(1) for p in self._parts(x)], 1))


def test_selection_ops_complete_and_route_constants():
    b, c, h, w = 2, 2, 4, 3
    model = randomize(_Selections(b, c, h, w), seed=14).double()
    x = rand(b, c, h, w, seed=15)
    e = explain(model, x, 0)
    assert_complete(e, model, x, 0)
    grad = gradient(model, x, 0)
    torch.testing.assert_close(e.weight, grad, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, model.shift.item() * grad.sum(1), rtol=RTOL, atol=ATOL)
