"""R5, R6 and R6': gates and attention.

R5: softmax, and sigmoid / hard-sigmoid whose result multiplies a LIVE tensor, are
computed normally and then held constant (the walker decides which, from
``may_gate``; what only feeds a gate, such as ``QKᵀ``, carries no ones channel).
R6: ``Y = A·V`` with ``A`` constant: ``V`` is linear, and the ones of ``Y`` are the
ones of ``V`` (token identity, the paper's ``W̃_aug ⊗ I``).
R6': when the queries are not the value tokens (another token count) the ones of
``Y`` are the attention-weighted mean of the value tokens' ones, renormalized.
"""

from __future__ import annotations

import math

import torch

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, plain, renormalized

aten = torch.ops.aten


def attended(weights: torch.Tensor, values: Live, queries_are_tokens: bool = True) -> Live:
    """``A·V`` for constant attention weights ``A`` (…, Tq, Tk) and LIVE ``V`` (…, Tk, E).

    R6 (token identity) when the queries are the value tokens — computed from the
    input and as many — else R6'.
    """
    value = torch.matmul(weights, values.value)
    if queries_are_tokens and weights.shape[-1] == weights.shape[-2]:
        ones = values.ones  # R6: token identity
    else:
        ones = renormalized(torch.matmul(weights, values.ones))  # R6'
    return Live(value, ones)


def attention_weights(query, key, mask, is_causal: bool, scale, enable_gqa: bool) -> torch.Tensor:
    """``softmax(QKᵀ·scale + mask)`` from plain (constant) tensors, as SDPA computes it."""
    query, key, mask = plain(query), plain(key), plain(mask)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = torch.matmul(query, key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.softmax(scores, dim=-1)


def _sdpa(op, *args, **kwargs):
    """R6 for ``scaled_dot_product_attention``: Q, K and the mask only feed the gate."""
    query, key, value, mask, dropout, is_causal, scale, enable_gqa = arguments(op, args, kwargs)
    if dropout:
        raise RuleError("attention dropout is random", "R6 (eval-mode attention)")
    if not isinstance(value, Live):
        raise RuleError("the values of the attention do not depend on the input", "R6")
    weights = attention_weights(query, key, mask, is_causal, scale, enable_gqa)
    if enable_gqa and value.value.shape[-3] != weights.shape[-3]:
        repeat = weights.shape[-3] // value.value.shape[-3]
        ones = value.ones if value.ones.shape[-3] == 1 else value.ones.repeat_interleave(repeat, dim=-3)
        value = Live(value.value.repeat_interleave(repeat, dim=-3), ones)
    return attended(weights, value, queries_are_tokens=isinstance(query, (Live, Gate)))


def _softmax_outside_gate(op, *args, **kwargs):
    raise RuleError("a softmax result is used as a LIVE value (not as weights multiplying a "
                    "LIVE tensor)", "R5 (softmax only as a gate; explain logits, not probabilities)")


register([aten.scaled_dot_product_attention],
         Rule("R6 attention", _sdpa, gate_args=(0, 1, 3)))
register([aten.softmax, aten._softmax, aten._safe_softmax],
         Rule("R5 gate", _softmax_outside_gate, may_gate=True, live=False))
