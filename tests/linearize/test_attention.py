"""R5, R6, R6': gates and attention (rules/attention.py, and A·V written out in rules/linear.py).

The oracle is a hand-written forward: the attention weights ``A`` are computed by an
explicit softmax (max-shifted exponentials) from the query/key projections and then
*detached*; everything else (the value and output projections, the head) is linear,
so ``C_w`` is the gradient of that forward. ``C_b`` is written out by loops:

* the value bias ``b_v`` goes through ``A`` (the paper's ``W̃_v^T ⊗ A``):
  pixel s gets ``Σ_h Σ_t A_h[t, s] · (b_v,h · G[t, h])``;
* a bias added *after* ``A·V`` (the output projection) is carried by ``O_Y``:
  in self-attention that is ``O_V`` (token identity, R6): token t gets ``b_p · g[t]``;
  with learned (CONST) queries, i.e. class / cross attention (R6'), the
  attention-weighted mean of the value tokens' ones:
  pixel s gets ``Σ_q (b_p · g[q]) · mean_h A_h[q, s]``;
* the query/key biases contribute nothing (Q and K feed a gate only).

Tolerances (float64): 1e-10 relative, 1e-13 absolute.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import Explainer, explain
from omenn_kernels.linearize.rules import attention
from omenn_kernels.linearize.rules.attention import attended, attention_weights
from omenn_kernels.linearize.values import Gate, Live
from rule_checks import (ATOL, DT, SqueezeExcite, assert_complete, assert_sums_to_logit, rand, randomize,
                         tokens)

RTOL = 1e-10  # looser than rule_checks.RTOL (see the module docstring)
H, W = 2, 3
T = H * W


class Attention(nn.Module):
    """Multi-head attention on pixel tokens, then an output projection and a bias-free head.

    ``queries``: None for self-attention, or a number of learned (CONST) queries (R6').
    """

    def __init__(self, c_in=3, heads=2, kv_heads=None, d=2, e_out=4, classes=3, sdpa=True,
                 mask=None, causal=False, queries=None, value_bias=True, proj_bias=True):
        super().__init__()
        kv_heads = kv_heads or heads
        self.heads, self.kv_heads, self.d = heads, kv_heads, d
        self.sdpa, self.causal = sdpa, causal
        self.q = nn.Linear(c_in, heads * d)
        self.k = nn.Linear(c_in, kv_heads * d)
        self.v = nn.Linear(c_in, kv_heads * d, bias=value_bias)
        self.proj = nn.Linear(heads * d, e_out, bias=proj_bias)
        tq = T if queries is None else queries
        self.query = None if queries is None else nn.Parameter(torch.zeros(1, heads, queries, d))
        self.head = nn.Linear(tq * e_out, classes, bias=False)
        self.register_buffer("mask", mask)

    repeat = "expand"

    def _share_heads(self, y):
        """(B, kv_heads, T, d) -> (B, heads, T, d), kv head j serving query heads j·r … j·r + r − 1."""
        r = self.heads // self.kv_heads
        if self.repeat == "repeat_interleave":
            return y.repeat_interleave(r, 1)
        b, _, t, d = y.shape
        return y[:, :, None].expand(b, self.kv_heads, r, t, d).reshape(b, self.heads, t, d)

    def forward(self, x):
        t = tokens(x)
        b = t.shape[0]
        split = lambda y, n: y.view(b, -1, n, self.d).transpose(1, 2)  # noqa: E731
        q = split(self.q(t), self.heads) if self.query is None else self.query.expand(b, -1, -1, -1)
        k, v = split(self.k(t), self.kv_heads), split(self.v(t), self.kv_heads)
        gqa = self.kv_heads != self.heads
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, is_causal=self.causal,
                                               enable_gqa=gqa)
        else:
            if gqa:
                k, v = self._share_heads(k), self._share_heads(v)
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.d))
            if self.mask is not None:
                scores = scores + self.mask
            y = scores.softmax(-1) @ v
        y = y.transpose(1, 2).reshape(b, -1, self.heads * self.d)
        return self.head(self.proj(y).flatten(1))


def _hand_softmax(scores: torch.Tensor) -> torch.Tensor:
    e = torch.exp(scores - scores.max(-1, keepdim=True).values)
    return e / e.sum(-1, keepdim=True)


def hand_explanation(model: Attention, x: torch.Tensor, target: int):
    """(C_w, C_b) of the model by the hand-written oracle described in the module docstring."""
    p = {n: v.detach() for n, v in model.named_parameters()}

    def lin(y, name):
        return y @ p[name + ".weight"].T + (p[name + ".bias"] if name + ".bias" in p else 0)

    h, hk, d = model.heads, model.kv_heads, model.d
    rep = h // hk
    xg = x.clone().requires_grad_(True)
    t = tokens(xg)
    b = t.shape[0]
    k = lin(t, "k").view(b, T, hk, d).permute(0, 2, 1, 3)
    v = lin(t, "v").view(b, T, hk, d).permute(0, 2, 1, 3)
    if model.query is None:
        q = lin(t, "q").view(b, T, h, d).permute(0, 2, 1, 3)
    else:
        q = p["query"].expand(b, h, -1, d)
    tq = q.shape[2]
    kr = torch.stack([k[:, j // rep] for j in range(h)], 1)
    vr = torch.stack([v[:, j // rep] for j in range(h)], 1)
    scores = torch.einsum("bhtd,bhsd->bhts", q, kr) / math.sqrt(d)
    if model.causal:
        allowed = torch.tensor([[s <= i for s in range(T)] for i in range(tq)])
        scores = scores.masked_fill(~allowed, float("-inf"))
    if model.mask is not None:
        mask = model.mask
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    a = _hand_softmax(scores).detach()
    y = torch.einsum("bhts,bhsd->bhtd", a, vr).permute(0, 2, 1, 3).reshape(b, tq, h * d)
    out = lin(lin(y, "proj").flatten(1), "head")
    (cw,) = torch.autograd.grad(out[:, target].sum(), xg)

    g_out = p["head.weight"][target].view(tq, -1)          # ∂ŷ/∂Z[q, e]
    g_y = g_out @ p["proj.weight"]                          # ∂ŷ/∂Y[q, h·d]
    cross = model.query is not None  # the queries are not the value tokens: R6'
    cb = torch.zeros(b, T, dtype=DT)
    bv = p.get("v.bias")
    bp = p.get("proj.bias")
    for i in range(b):
        for hh in range(h):
            kv = hh // rep
            for qi in range(tq):
                for s in range(T):
                    if bv is not None:
                        share = (bv[kv * d:(kv + 1) * d] * g_y[qi, hh * d:(hh + 1) * d]).sum()
                        cb[i, s] += a[i, hh, qi, s] * share
                    if bp is not None and cross:
                        cb[i, s] += (bp * g_out[qi]).sum() * a[i, hh, qi, s] / h
        if bp is not None and not cross:
            cb[i] += (bp * g_out).sum(1)
    return cw.detach(), cb.view(b, H, W), a


def _check(model: Attention, x: torch.Tensor, target: int):
    e = explain(model, x, target)
    cw, cb, a = hand_explanation(model, x, target)
    torch.testing.assert_close(e.weight, cw, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e.bias, cb, rtol=RTOL, atol=ATOL)
    assert_complete(e, model, x, target, rtol=1e-10)
    return e, a


def _input(seed: int, batch: int = 2) -> torch.Tensor:
    return rand(batch, 3, H, W, seed=seed, scale=1.5)


def test_sdpa_and_written_out_attention_agree():
    sdpa = randomize(Attention(sdpa=True), seed=1).double()
    written = Attention(sdpa=False).double()
    written.load_state_dict(sdpa.state_dict())
    x = _input(2)
    e1, a = _check(sdpa, x, 1)
    e2, _ = _check(written, x, 1)
    torch.testing.assert_close(e1.weight, e2.weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e1.bias, e2.bias, rtol=RTOL, atol=ATOL)
    assert a.std() > 0.05  # the attention is far from uniform: mixing matters


def test_bias_after_attention_goes_to_its_own_token():
    """R6 O_Y = O_V: a bias added after A·V is not mixed by A (only the proj bias here)."""
    model = randomize(Attention(value_bias=False), seed=3).double()
    x = _input(4)
    e, a = _check(model, x, 0)
    g_out = model.head.weight[0].detach().view(T, -1)
    own = (model.proj.bias.detach() * g_out).sum(1).view(H, W)
    torch.testing.assert_close(e.bias, own.expand(2, H, W), rtol=RTOL, atol=ATOL)
    # Had A mixed it, the shares would differ from the token's own by a visible amount.
    mixed = torch.einsum("bhts,t->bs", a, own.flatten()) / model.heads
    assert (mixed.view(2, H, W) - own).abs().max() > 1e-2


def test_value_bias_goes_through_attention_weights():
    """The value bias is part of V = X W_v + b_v·Ō: A mixes it (the paper's W̃_v^T ⊗ A)."""
    model = randomize(Attention(proj_bias=False), seed=5).double()
    x = _input(6)
    e, a = _check(model, x, 2)
    # Not the token-identity share: the two differ for a non-uniform A.
    g_y = model.head.weight[2].detach().view(T, -1) @ model.proj.weight.detach()
    own = (model.v.bias.detach() * g_y).sum(1).view(H, W)
    assert (e.bias - own).abs().max() > 1e-2


@pytest.mark.parametrize("queries", [1, 2])
def test_cross_attention_ones_are_attention_weighted_mean(queries):
    """R6': learned queries (Tq != Tk): a bias after A·V is spread by the attention weights."""
    model = randomize(Attention(queries=queries, value_bias=False), seed=7 + queries, scale=1.2).double()
    x = _input(8)
    e, a = _check(model, x, 1)
    g_out = model.head.weight[1].detach().view(queries, -1)
    per_query = (model.proj.bias.detach() * g_out).sum(1)  # (Tq,)
    expected = torch.einsum("bhqs,q->bs", a, per_query) / model.heads
    torch.testing.assert_close(e.bias, expected.view(2, H, W), rtol=RTOL, atol=ATOL)


def test_learned_queries_as_many_as_tokens_use_weighted_mean():
    model = randomize(Attention(queries=T, value_bias=False), seed=10, scale=1.2).double()
    _check(model, _input(9), 1)


def test_cross_attention_with_value_bias():
    model = randomize(Attention(queries=1), seed=11, scale=1.2).double()
    _check(model, _input(12, batch=3), 0)


def test_attended_unit_identity_and_weighted_mean():
    g = torch.Generator().manual_seed(13)
    values0 = torch.randn(2, 5, 3, generator=g, dtype=DT)
    for tq in (5, 2):
        a = torch.softmax(torch.randn(2, tq, 5, generator=g, dtype=DT) * 2, -1)
        ones = torch.ones_like(values0, requires_grad=True)
        values = values0.clone().requires_grad_(True)
        out = attended(a, Live(values, ones))
        torch.testing.assert_close(out.value.detach(), torch.einsum("bqs,bse->bqe", a, values0),
                                   rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(out.ones.detach().expand(2, tq, 3), torch.ones(2, tq, 3, dtype=DT),
                                   rtol=1e-14, atol=1e-14)
        up = torch.randn(2, tq, 3, generator=g, dtype=DT)
        (ones_grad,) = torch.autograd.grad((out.ones * up).sum(), ones)
        if tq == 5:  # R6: token identity
            torch.testing.assert_close(ones_grad, up, rtol=RTOL, atol=ATOL)
        else:  # R6': Aᵀ·up
            torch.testing.assert_close(ones_grad, torch.einsum("bqs,bqe->bse", a, up), rtol=RTOL, atol=ATOL)


def test_float_attention_mask():
    mask = rand(T, T, seed=14, scale=2.0)
    model = randomize(Attention(mask=mask), seed=15).double()
    _check(model, _input(16), 2)


def test_bool_attention_mask():
    allowed = rand(T, T, seed=17) > 0
    allowed |= torch.eye(T, dtype=torch.bool)
    model = randomize(Attention(mask=allowed), seed=18).double()
    model.mask = allowed  # randomize leaves bool buffers alone; keep the mask as drawn
    _, a = _check(model, _input(19), 0)
    assert (a[:, :, ~allowed] == 0).all()


def test_causal_attention():
    model = randomize(Attention(causal=True), seed=20).double()
    _, a = _check(model, _input(21), 1)
    assert (a.triu(1) == 0).all()


@pytest.mark.parametrize("variant", [
    "sdpa",
    "written_expand",
    "written_repeat_interleave",
])
def test_grouped_query_attention(variant):
    model = randomize(Attention(heads=4, kv_heads=2, sdpa=variant == "sdpa"), seed=22).double()
    model.repeat = variant.split("_", 1)[-1]
    _check(model, _input(23), 2)


# ----------------------------------------------------------------------------- gates (R5)


class SENet(nn.Module):
    def __init__(self, gate: str):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.se = SqueezeExcite(4, 2, gate)
        self.head = nn.Linear(4 * H * W, 3)

    def forward(self, x):
        return self.head(self.se(F.relu(self.conv(x))).flatten(1))


@pytest.mark.parametrize("gate", ["sigmoid", "hardsigmoid"])
def test_squeeze_excitation_gate_gets_no_gradient(gate):
    model = randomize(SENet(gate), seed=24, scale=1.0).double()
    with torch.no_grad():  # keep the hard-sigmoid off its flat parts, so the gate has a gradient
        for q in model.se.parameters():
            q.mul_(0.3)
    x = _input(25)
    e = explain(model, x, 1)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-10)
    # Hand-written forward with the gate detached (ReLU's ξ is its derivative).
    p = {n: v.detach() for n, v in model.named_parameters()}
    xg = x.clone().requires_grad_(True)
    h = F.relu(F.conv2d(xg, p["conv.weight"], p["conv.bias"], padding=1))
    gate_value = model.se.weights(h.detach()).detach()
    out = (h * gate_value).flatten(1) @ p["head.weight"].T + p["head.bias"]
    (cw,) = torch.autograd.grad(out[:, 1].sum(), xg)
    torch.testing.assert_close(e.weight, cw, rtol=RTOL, atol=ATOL)
    # With gradient through the gate, the result would differ.
    hg = F.relu(model.conv(xg))
    (full,) = torch.autograd.grad(model.head(model.se(hg).flatten(1))[:, 1].sum(), xg)
    assert (full - cw).abs().max() > 1e-4


class _Swish(nn.Module):
    def __init__(self, written: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = (lambda y: y * torch.sigmoid(y)) if written else nn.SiLU()
        self.head = nn.Linear(4 * H * W, 3)

    def forward(self, x):
        return self.head(self.act(self.conv(x)).flatten(1))


def test_silu_written_as_gate_equals_silu():
    silu = randomize(_Swish(False), seed=26, scale=1.0).double()
    written = _Swish(True).double()
    written.load_state_dict(silu.state_dict())
    x = _input(27)
    e1, e2 = explain(silu, x, 0), explain(written, x, 0)
    torch.testing.assert_close(e1.weight, e2.weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(e1.bias, e2.bias, rtol=RTOL, atol=ATOL)
    # Both are y·stopgrad(σ(y)): C_w is the gradient of that hand-written forward.
    xg = x.clone().requires_grad_(True)
    y = silu.conv(xg)
    out = silu.head((y * torch.sigmoid(y).detach()).flatten(1))
    (cw,) = torch.autograd.grad(out[:, 0].sum(), xg)
    torch.testing.assert_close(e1.weight, cw, rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e2, silu, x, 0, rtol=1e-10)


def test_attended_with_a_product_takes_its_numbers_and_differentiates_as_without():
    """Given the model's ``A·V̄`` (``model_result``: a total parameter gradient) ``A·V``'s value is
    its numbers, not a second T×T product; its derivatives, first and second order (through ``A``
    and the held values), are those of the product itself (rtol 1e-12)."""
    g = torch.Generator().manual_seed(17)
    scores = torch.randn(2, 5, 5, generator=g, dtype=DT).requires_grad_(True)
    values0 = torch.randn(2, 5, 3, generator=g, dtype=DT)
    held_scale = torch.ones((), dtype=DT, requires_grad=True)
    up, down, down_held = (torch.randn(2, 5, 3, generator=g, dtype=DT) for _ in range(3))
    results = []
    for with_product in (True, False):
        weights = torch.softmax(scores, -1)
        values = values0.clone().requires_grad_(True)
        product = torch.matmul(weights, values0 * held_scale)
        out = attended(weights, Live(values, torch.ones(2, 5, 1, dtype=DT)),
                       product=product if with_product else None)
        if with_product:
            assert torch.equal(out.value, product)
        (grad_values,) = torch.autograd.grad((out.value * up).sum(), values, create_graph=True)
        second = (grad_values * down).sum() + (product * down_held).sum()
        results.append((out.value, grad_values, *torch.autograd.grad(second, [scores, held_scale])))
    for with_product, without in zip(*results):
        torch.testing.assert_close(with_product, without, rtol=1e-12, atol=1e-12)


def _held_sdpa(query, key, values) -> list:
    """What the executor gives the SDPA rule: its arguments' held values (no mask, no dropout)."""
    return [query, key, values, None, 0.0, False, None, False]


@pytest.mark.parametrize("chunk_bytes", [450, 1 << 20], ids=["chunks_of_two_heads", "one_chunk"])
@pytest.mark.parametrize("readouts", [1, 2])
@pytest.mark.parametrize("terms", ["both", "explanation", "held"])
def test_sdpa_with_held_values_equals_the_weights_written_out_to_second_order(monkeypatch, chunk_bytes, readouts,
                                                                             terms):
    """Self-attention with held Q, K, V that follow the parameters (a total parameter gradient),
    the model's output and weights given by the held pass (``model_attention``, SDPA's numbers):
    the rule takes both; against ``A`` written out with autograd: the value, the explanation's
    ``dV`` and the second-order gradients with respect to Q, K and the held V (rtol 1e-12), for
    one read-out and two, with the model output's gradient, the explanation's, or both; the
    model's attention in chunks of heads and in one."""
    monkeypatch.setattr(attention, "_CHUNK_BYTES", chunk_bytes)  # 5×5 float64 weights: 200 bytes a head
    g = torch.Generator().manual_seed(19)
    shape = (2, 3, 5, 4)  # 6 heads of 5 tokens

    def randn(*size):
        return torch.randn(*size, generator=g, dtype=DT)

    query, key, held = (randn(*shape).requires_grad_(True) for _ in range(3))
    values0, ones = held.detach(), torch.ones(2, 3, 5, 1, dtype=DT)  # the held values' numbers
    ups, downs = [randn(*shape) for _ in range(readouts)], [randn(*shape) for _ in range(readouts)]
    down_held = randn(*shape)
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    results = []
    for written_out in (False, True):
        values = values0.clone().requires_grad_(True)
        if written_out:
            weights = attention_weights(query, key, None, False, None, False)
            out, model_output = attended(weights, Live(values, ones)), torch.matmul(weights, held)
        else:
            model_output, model_result = attention.model_attention(query, key, held)
            torch.testing.assert_close(model_output, F.scaled_dot_product_attention(query, key, held),
                                       rtol=1e-12, atol=1e-12)
            out = attention._sdpa(sdpa, Gate(query), Gate(key), Live(values, ones),
                                  held=_held_sdpa(query, key, held), model_result=model_result)
            assert torch.equal(out.value, model_output)
        loss = 0.0
        if terms != "held":
            for up, down in zip(ups, downs):
                (grad_values,) = torch.autograd.grad((out.value * up).sum(), values, create_graph=True)
                loss = loss + (grad_values * down).sum()
        if terms != "explanation":
            loss = loss + (model_output * down_held).sum()
        results.append((out.value, *torch.autograd.grad(loss, [query, key, held], allow_unused=True,
                                                        materialize_grads=True)))
    for rule, written in zip(*results):
        torch.testing.assert_close(rule, written, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("chunk_bytes", [450, 1 << 20], ids=["chunks_of_two_heads", "one_chunk"])
def test_sdpa_with_constant_weights_in_chunks_equals_the_weights_written_out(monkeypatch, chunk_bytes):
    """Constant Q and K (first-order explanations, fixed multipliers): the weights and ``A·V`` are
    computed in chunks of heads; the value, ``dV`` and the second-order gradient through ``dV``
    equal those of ``A`` written out (rtol 1e-12)."""
    monkeypatch.setattr(attention, "_CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(23)
    shape = (2, 3, 5, 4)
    query, key, values0, up, down = (torch.randn(*shape, generator=g, dtype=DT) for _ in range(5))
    up_scale = torch.ones((), dtype=DT, requires_grad=True)  # the incoming gradient follows a parameter
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    results = []
    for written_out in (False, True):
        values = values0.clone().requires_grad_(True)
        live = Live(values, torch.ones(2, 3, 5, 1, dtype=DT))
        out = (attended(attention_weights(query, key, None, False, None, False), live) if written_out
               else attention._sdpa(sdpa, Gate(query), Gate(key), live, held=_held_sdpa(query, key, values0)))
        (grad_values,) = torch.autograd.grad((out.value * up * up_scale).sum(), values, create_graph=True)
        results.append((out.value, grad_values, *torch.autograd.grad((grad_values * down).sum(), up_scale)))
    for chunked, written in zip(*results):
        torch.testing.assert_close(chunked, written, rtol=1e-12, atol=1e-12)


def test_third_derivative_through_the_model_attention_is_refused():
    """The model's attention in chunks differentiates twice (an explanation inside a loss), and
    refuses a third differentiation rather than return one that misses terms."""
    g = torch.Generator().manual_seed(29)
    query, key, held = (torch.randn(1, 2, 4, 3, generator=g, dtype=DT).requires_grad_(True) for _ in range(3))

    def second_order_loss() -> torch.Tensor:
        values = held.detach().clone().requires_grad_(True)
        output, model_result = attention.model_attention(query, key, held)
        out = attention._sdpa(torch.ops.aten.scaled_dot_product_attention.default, Gate(query), Gate(key),
                              Live(values, torch.ones(1, 2, 4, 1, dtype=DT)), held=_held_sdpa(query, key, held),
                              model_result=model_result)
        (grad_values,) = torch.autograd.grad(out.value.square().sum(), values, create_graph=True)
        return grad_values.square().sum() + output.sum()

    assert all(bool(torch.isfinite(d).all()) for d in torch.autograd.grad(second_order_loss(), [query, key]))
    (grad_query,) = torch.autograd.grad(second_order_loss(), [query], create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad_query.sum().backward()


def _fully_masked_rows(form: str) -> torch.Tensor:
    """A (T, T) mask with query rows 0 and 3 allowed no key: boolean, additive (``-inf``), or a
    sliding window of two keys over a left-padded causal sequence (padding keys 0 and 1)."""
    if form == "sliding window":
        i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
        return (j <= i) & (j > i - 2) & (j >= 2)  # rows 0 and 1 see padding only
    allowed = rand(T, T, seed=40) > -0.5
    allowed[[0, 3]] = False
    if form == "boolean":
        return allowed
    return torch.zeros(T, T, dtype=DT).masked_fill(~allowed, float("-inf")) + rand(T, T, seed=41)


@pytest.mark.parametrize("backend", ["reference", "fused", "compiled"])
@pytest.mark.parametrize("form", ["boolean", "additive", "sliding window"])
def test_fully_masked_query_rows_get_zero_weights_as_in_sdpa(form, backend, monkeypatch):
    """SDPA gives a query row whose every key is masked the weights 0 (its output 0); softmax of
    a row of ``-inf`` would be NaN, and NaN weights make the whole explanation NaN through the
    backward. Every backend: finite maps that sum to the model's own logit."""
    from omenn_kernels.backends import compiled

    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    mask = _fully_masked_rows(form)
    model = randomize(Attention(mask=mask.clone()), seed=42).double()
    model.mask = mask  # randomize draws float buffers anew; keep the mask as drawn
    x = _input(43)
    with torch.no_grad():
        logits = model(x)
    assert torch.isfinite(logits).all()
    weights = attention_weights(rand(2, 2, T, 2, seed=44), rand(2, 2, T, 2, seed=45), mask, False, None, False)
    masked_rows = [0, 1] if form == "sliding window" else [0, 3]
    assert torch.isfinite(weights).all() and (weights[..., masked_rows, :] == 0).all()
    explainer = Explainer(model, backend=backend)
    for _ in range(2):  # compiled, then replayed
        e = explainer(x, 1)
        assert torch.isfinite(e.weight).all() and torch.isfinite(e.bias).all()
        torch.testing.assert_close(e.contribution.sum((1, 2)), logits[:, 1], rtol=RTOL, atol=ATOL)
