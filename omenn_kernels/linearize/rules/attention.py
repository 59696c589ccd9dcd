"""R5, R6 and R6': gates and attention.

R5: softmax, and sigmoid / hard-sigmoid whose result multiplies a LIVE tensor, are
computed normally and then held constant (the walker decides which, from
``may_gate``; what only feeds a gate, such as ``QKᵀ``, carries no ones channel).
R6: ``Y = A·V`` with ``A`` constant: ``V`` is linear, and the ones of ``Y`` are the
ones of ``V`` (token identity, the paper's ``W̃_aug ⊗ I``).
R6': when the queries are not the value tokens (another token count) the ones of
``Y`` are the attention-weighted mean of the value tokens' ones, renormalized.

Fused op ``omenn::attention`` (R6): :mod:`omenn_kernels.ops.attention`. On the CPU,
attention whose weights of all heads fit in one chunk (:data:`_CHUNK_BYTES`) keeps the
reference form, which saves ``A`` instead of recomputing it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, ones_from_values, plain, renormalized

aten = torch.ops.aten


class _WeightedSum(torch.autograd.Function):
    """``A·V`` for the linearized network: a gradient for ``V`` only, ``dV = (dYᵀ·A)ᵀ``.

    ``A`` gets none. The explanation never needs it: ``C`` depends on ``A`` through ``dV``
    alone (the backward keeps ``A``'s graph, so explanations differentiated with respect
    to the parameters still reach it), and a Python backward cannot tell whether the
    caller asked for ``A``'s gradient, so computing it would cost a T×T product in every
    backward. ``(dYᵀ·A)ᵀ`` equals ``Aᵀ·dY``; written so, its derivative with respect to
    ``A`` is the contiguous ``dY·dV'ᵀ`` rather than a transposed product, which the
    softmax's backward would first copy.

    ``product``: the same product computed already (the model's own output, :func:`model_attention`;
    or in chunks of heads), whose numbers the result takes instead of multiplying again;
    the backward reads only ``A``.
    """

    @staticmethod
    def forward(ctx, weights: torch.Tensor, values: torch.Tensor,
                product: Optional[torch.Tensor] = None) -> torch.Tensor:
        ctx.save_for_backward(weights)
        if product is not None:
            return product.detach()
        return torch.matmul(weights, values)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, torch.Tensor, None]:
        (weights,) = ctx.saved_tensors
        return None, torch.matmul(grad.transpose(-2, -1), weights).transpose(-2, -1), None


def attended(weights: torch.Tensor, values: Live, queries_are_tokens: bool = True,
             softmax_rows: bool = False, product: torch.Tensor | None = None) -> Live:
    """``A·V`` for constant attention weights ``A`` (…, Tq, Tk) and LIVE ``V`` (…, Tk, E).

    R6 (token identity) when the queries are the value tokens — computed from the
    input and as many — else R6'. ``product``: ``A·V`` computed already, whose numbers the
    value takes (:class:`_WeightedSum`). ``softmax_rows``: every row of ``A`` is a softmax
    (positive weights summing to 1), so R6' ones have a zero only where ``V``'s have one.
    """
    value = _WeightedSum.apply(weights, values.value, product)
    if queries_are_tokens and weights.shape[-1] == weights.shape[-2]:
        ones = values.ones  # R6: token identity
    else:
        ones_from_values(values.ones if softmax_rows else None)
        ones = renormalized(torch.matmul(weights, values.ones))  # R6'
    return Live(value, ones)


_CHUNK_BYTES = 1 << 20  # on the CPU, T×T blocks of about this size stay in cache


def _head_chunks(heads: int, tq: int, tk: int, like: torch.Tensor) -> list[slice]:
    """Slices of the flattened (batch·heads) dimension for attention in chunks: one on
    accelerators (a launch per chunk would cost more) and in a traced graph (whose compiler
    blocks the loops itself, where writes into slices of a buffer become scatters), blocks
    of ~1 MiB on the CPU."""
    whole = like.device.type != "cpu" or get_proxy_mode() is not None
    step = heads if whole else max(1, _CHUNK_BYTES // (tq * tk * like.element_size()))
    return [slice(start, min(start + step, heads)) for start in range(0, heads, step)]


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


def _weights_and_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``A = softmax(QKᵀ·s)`` and ``A·V`` (no autograd) for (heads, T, E) rows (:func:`_rows`),
    the scores only ever one chunk of heads at a time (:func:`_head_chunks`)."""
    heads, tq, tk = q.shape[0], q.shape[1], k.shape[1]
    chunks = _head_chunks(heads, tq, tk, q)
    if len(chunks) == 1:
        weights = torch.softmax(torch.matmul(q * scale, k.transpose(-2, -1)), -1)
        return weights, torch.matmul(weights, v)
    weights, out = q.new_empty(heads, tq, tk), q.new_empty(heads, tq, v.shape[-1])
    for rows in chunks:
        torch.softmax(torch.matmul(q[rows] * scale, k[rows].transpose(-2, -1)), -1, out=weights[rows])
        torch.matmul(weights[rows], v[rows], out=out[rows])
    return weights, out


def attention_weights(query, key, mask, is_causal: bool, scale, enable_gqa: bool) -> torch.Tensor:
    """``softmax(QKᵀ·scale + mask)`` from plain (constant) tensors, as SDPA computes it: a query
    row whose every key is masked (a left-padded position under a causal mask) gets weights 0,
    where ``softmax`` of a row of ``-inf`` is NaN."""
    query, key, mask = plain(query), plain(key), plain(mask)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query * scale, key.transpose(-2, -1))  # scaling Q: T·d products, not T·T
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is None:  # every row keeps a key
        return torch.softmax(scores, -1)
    scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return aten._safe_softmax.default(scores, -1)


class _ModelAttention(torch.autograd.Function):
    """SDPA's ``A·V`` with ``A = softmax(QKᵀ·s)``, returning ``A`` too, each block of heads computed
    (forward and backward) while it stays in cache on the CPU (:func:`_head_chunks`). ``A``'s
    gradient (from the explanation's ``dV = Aᵀ·dY``, differentiated again) and the output's are
    added block by block before one softmax backward. Not differentiable a third time."""

    @staticmethod
    def forward(ctx, query: torch.Tensor, key: torch.Tensor, values: torch.Tensor, scale: float):
        q, k, v = _rows(query), _rows(key), _rows(values)
        weights, out = _weights_and_product(q, k, v, scale)
        ctx.scale, ctx.shapes = scale, (query.shape, key.shape, values.shape)
        ctx.save_for_backward(q, k, v, weights)
        batch = query.shape[:-2]
        return weights.view(*batch, *weights.shape[-2:]), out.view(*batch, *out.shape[-2:])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_weights: torch.Tensor, grad_out: torch.Tensor):
        q, k, v, weights = ctx.saved_tensors
        grad_weights, grad_out = _rows(grad_weights), _rows(grad_out)  # materialized: zeros where unused
        grad_q, grad_k, grad_v = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for rows in _head_chunks(*weights.shape, q):
            a, product_grad = weights[rows], grad_out[rows]
            grad_a = torch.baddbmm(grad_weights[rows], product_grad, v[rows].transpose(-2, -1))
            torch.bmm(a.transpose(-2, -1), product_grad, out=grad_v[rows])
            grad_scores = a * (grad_a - (grad_a * a).sum(-1, keepdim=True)) * ctx.scale
            torch.bmm(grad_scores, k[rows], out=grad_q[rows])
            torch.bmm(grad_scores.transpose(-2, -1), q[rows], out=grad_k[rows])
        return (*(g.view(shape) for g, shape in zip((grad_q, grad_k, grad_v), ctx.shapes)), None)


def model_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """SDPA as the held pass runs it for the rule (``Rule.model_form``): ``A·V`` with the weights ``A``
    written out, and both for the rule, which then computes neither again; autograd adds the two
    gradients of ``A`` (the model's output's and the explanation's) before one softmax backward
    (:class:`_ModelAttention` for self-attention without a mask)."""
    if (attn_mask is None and not is_causal and query.shape == key.shape == value.shape
            and not torch.is_autocast_enabled(query.device.type)):  # chunks write into buffers of one dtype
        weights, output = _ModelAttention.apply(query, key, value,
                                                1.0 / math.sqrt(query.shape[-1]) if scale is None else scale)
        return output, (output, weights)
    weights = attention_weights(query, key, attn_mask, is_causal, scale, enable_gqa)
    if enable_gqa and value.shape[-3] != weights.shape[-3]:
        value = value.repeat_interleave(weights.shape[-3] // value.shape[-3], dim=-3)
    output = torch.matmul(weights, value)
    return output, (output, weights)


def _sdpa(op, *args, held: list, model_result: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs):
    """R6 for ``scaled_dot_product_attention``: Q, K and the mask only feed the gate, whose
    weights come from their held values (or with the model's output from the held pass,
    ``model_result``: :func:`model_attention`)."""
    query, key, value, mask, dropout, is_causal, scale, enable_gqa = arguments(op, args, kwargs)
    if dropout:
        raise RuleError("attention dropout is random", "R6 (eval-mode attention)")
    if not isinstance(value, Live):
        raise RuleError("the values of the attention do not depend on the input", "R6")
    q, k, mask = held[0], held[1], held[3]
    if enable_gqa and value.value.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // value.value.shape[-3]
        ones = value.ones if value.ones.shape[-3] == 1 else value.ones.repeat_interleave(repeat, dim=-3)
        value = Live(value.value.repeat_interleave(repeat, dim=-3), ones)
    queries_are_tokens = isinstance(query, (Live, Gate))
    if model_result is not None:
        product, weights = model_result
        return attended(weights, value, queries_are_tokens, softmax_rows=True, product=product)
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if (mask is None and not is_causal and queries_are_tokens and q.shape[-2] == k.shape[-2]
            and q.shape[:-2] == k.shape[:-2] == value.value.shape[:-2]
            and not q.requires_grad and not k.requires_grad  # constant weights: the product in chunks too
            and not torch.is_autocast_enabled(q.device.type)):  # chunks write into buffers of one dtype
        with torch.no_grad():
            weights, product = _weights_and_product(_rows(q), _rows(k), _rows(value.value), scale)
        shape = q.shape[:-1]
        value_out = _WeightedSum.apply(weights.view(*shape, k.shape[-2]), value.value,
                                       product.view(*shape, value.value.shape[-1]))
        return Live(value_out, value.ones)
    weights = attention_weights(q, k, mask, is_causal, scale, False)
    return attended(weights, value, queries_are_tokens, softmax_rows=True)


def weights_fit_one_chunk(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the CPU would hold all heads' float32 weights in one chunk: then saving them
    costs no more than recomputing them for ``dV``, and little memory."""
    return q.device.type == "cpu" and q[..., 0].numel() * k.shape[-2] * 4 <= _CHUNK_BYTES


def _softmax_outside_gate(op, *args, **kwargs):
    raise RuleError("a softmax result is used as a LIVE value (not as weights multiplying a "
                    "LIVE tensor)", "R5 (softmax only as a gate; explain logits, not probabilities)")


register([aten.scaled_dot_product_attention],
         Rule("R6 attention", _sdpa, gate_args=(0, 1, 3), held_args=(0, 1, 3),
              takes_model_result=True, model_form=model_attention))
register([aten.softmax, aten._softmax, aten._safe_softmax],
         Rule("R5 gate", _softmax_outside_gate, may_gate=True, live=False))
