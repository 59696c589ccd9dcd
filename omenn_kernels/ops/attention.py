"""Fused op ``omenn::attention``: R6's ``softmax(QKᵀ·scale + bias)·V`` with the weights held.

The forward is flash attention that saves the log-sum-exp; the backward computes only
``dV = Pᵀ·dO`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed block by block: no
``dQ``, no ``dK``, no Δ pre-pass, and no ``T×T`` tensor of all heads in either direction.

Cost per head: forward ``2·Tq·Tk·(D + Dv)`` FLOPs (``QKᵀ`` and ``P·V``), backward the
same (``QKᵀ`` recomputed and ``Pᵀ·dO``): two of the five products of a full flash
backward. ``dV`` differentiates again with respect to ``dO`` (the forward on the new
values), for explanations differentiated with respect to the parameters with the weights
held (``fixed_multipliers``).

Kernels: CUDA ``triton_kernels/attention.py``. CPU ``csrc/attention.cpp``
(``omenn::attention_cpu`` and ``omenn::attention_backward_dv_cpu``, opaque to Inductor):
one (batch, head) per task, ``P`` for four query rows at a time, in cache. A fully
masked row (every key at ``-inf``) gives ``0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.utils.flop_counter import (flop_registry, register_flop_formula, sdpa_backward_flop_count,
                                      sdpa_flop_count)

from ..linearize.registry import arguments
from ..linearize.rules import attention as attention_rules
from ..linearize.values import Gate, Live
from ..native import define_cpu_op
from . import fuse, fused_op, kernels_available


def _scores(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
    return scores if bias is None else scores + bias.float()


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(QKᵀ·scale + bias)·V, logsumexp)`` in PyTorch, the weights written out."""
    scores = _scores(q, k, bias, scale)
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(weights.to(v.dtype), v), lse


def reference_backward_dv(q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                          bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``dV = Pᵀ·grad`` in PyTorch, ``P`` recomputed from ``lse``."""
    weights = torch.exp(_scores(q, k, bias, scale) - lse.unsqueeze(-1)).nan_to_num(0.0)
    return torch.matmul(weights.transpose(-2, -1), grad.float()).to(grad.dtype)


# --------------------------------------------------------------------------- CPU


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _attention_cpu_like(q, k, v, bias, scale):
    (batch, heads, tq, _), dv = q.shape, v.shape[-1]
    # (B, T, H, Dv)-major: the layout in which the model's next reshape (heads → features) is a view.
    return (q.new_empty(batch, tq, heads, dv).transpose(1, 2),
            q.new_empty(batch, heads, tq, dtype=_lse_dtype(q.dtype)))


def _attention_backward_dv_cpu_like(q, k, grad, lse, bias, scale):
    return grad.new_empty(q.shape[0], q.shape[1], k.shape[-2], grad.shape[-1])


# ``csrc/attention.cpp``: one (batch, head) per task, ``P`` for four query rows at a time.
attention_cpu = define_cpu_op("attention_cpu(Tensor q, Tensor k, Tensor v, Tensor? bias, float scale) "
                              "-> (Tensor, Tensor)", _attention_cpu_like)
attention_backward_dv_cpu = define_cpu_op("attention_backward_dv_cpu(Tensor q, Tensor k, Tensor grad, "
                                          "Tensor lse, Tensor? bias, float scale) -> Tensor",
                                          _attention_backward_dv_cpu_like)


# --------------------------------------------------------------------------- the op


@fused_op("omenn::attention", triton=True)
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(QKᵀ·scale + bias)·V, logsumexp)`` with the weights held constant (R6).

    ``q``, ``k``, ``v``: (B, H, T, D); ``bias``: additive, broadcastable to (B, H, Tq, Tk)."""
    if q.device.type == "cuda":
        from ..triton_kernels.attention import attention_forward

        return attention_forward(q, k, v, scale, bias)
    return attention_cpu(q, k, v, bias, scale)


@fused_op("omenn::attention_backward_dv", triton=True)
def attention_backward_dv(q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                          bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``dV = Pᵀ·grad`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed."""
    if q.device.type == "cuda":
        from ..triton_kernels.attention import attention_backward_dv as kernel

        return kernel(q, k, grad, lse, scale, bias)
    return attention_backward_dv_cpu(q, k, grad, lse, bias, scale)


# FLOPs for torch.utils.flop_counter: the scores ``QKᵀ`` and ``P·V``; the backward recomputes
# the scores and multiplies ``Pᵀ·grad``.
@register_flop_formula([torch.ops.omenn.attention, torch.ops.omenn.attention_cpu])
def _attention_flops(q_shape, k_shape, v_shape, *_args, out_shape, **_kwargs) -> int:
    return 2 * math.prod(q_shape[:-1]) * k_shape[-2] * (q_shape[-1] + v_shape[-1])


@register_flop_formula([torch.ops.omenn.attention_backward_dv, torch.ops.omenn.attention_backward_dv_cpu])
def _attention_backward_dv_flops(q_shape, k_shape, grad_shape, *_args, out_shape, **_kwargs) -> int:
    return 2 * math.prod(q_shape[:-1]) * k_shape[-2] * (q_shape[-1] + grad_shape[-1])


# torch counts no FLOPs for its own CPU flash attention (the model's attention, and a plain
# training step's, on the CPU): the same formulas as for its CUDA flash attention, so that
# FlopCounterMode compares an explanation with the model's own forward and backward.
_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
if _CPU_FLASH not in flop_registry:
    @register_flop_formula(_CPU_FLASH)
    def _cpu_flash_flops(q_shape, k_shape, v_shape, *_args, out_shape, **_kwargs) -> int:
        return sdpa_flop_count(q_shape, k_shape, v_shape)
if _CPU_FLASH_BACKWARD not in flop_registry:
    @register_flop_formula(_CPU_FLASH_BACKWARD)
    def _cpu_flash_backward_flops(grad_shape, q_shape, k_shape, v_shape, *_args, out_shape, **_kwargs) -> int:
        return sdpa_backward_flop_count(grad_shape, q_shape, k_shape, v_shape)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, _v, bias, ctx.scale = inputs
    # lse detached: it only locates the weights, so a differentiated backward sends nothing
    # back into this forward through it (which would run this backward once more).
    ctx.save_for_backward(q, k, output[1].detach(), *([bias] if bias is not None else []))


def _attention_grad(ctx, grad, _grad_lse):
    q, k, lse, *bias = ctx.saved_tensors
    dv = attention_backward_dv(q, k, grad.contiguous(), lse, bias[0] if bias else None, ctx.scale)
    return None, None, dv, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def _attention_backward_dv_setup(ctx, inputs, output) -> None:
    q, k, _grad, _lse, bias, ctx.scale = inputs
    ctx.save_for_backward(q, k, *([bias] if bias is not None else []))


def _attention_backward_dv_grad(ctx, grad_dv):
    """``dV = Pᵀ·grad`` is linear in ``grad``, with adjoint ``P·ddV``: the forward with ``ddV``
    as the values. This is what an explanation differentiated with respect to the
    parameters needs with its attention weights held fixed (``Q`` and ``K`` constant)."""
    if ctx.needs_input_grad[0] or ctx.needs_input_grad[1]:
        raise RuntimeError("omenn::attention_backward_dv is differentiable with respect to grad only; "
                           "attention weights that follow the parameters take the reference rule")
    q, k, *bias = ctx.saved_tensors
    grad_grad, _ = attention(q, k, grad_dv, bias[0] if bias else None, ctx.scale)
    return None, None, grad_grad, None, None, None


attention_backward_dv.register_autograd(_attention_backward_dv_grad, setup_context=_attention_backward_dv_setup)


def additive_mask(mask, is_causal: bool, tq: int, tk: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """SDPA's boolean / float mask and causal flag as one additive float bias (or None)."""
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=torch.float32, device=like.device).masked_fill(
            ~mask, float("-inf")) if mask.dtype == torch.bool else mask.float()
    if is_causal:
        causal = torch.ones(tq, tk, dtype=torch.bool, device=like.device).tril()
        causal_bias = torch.zeros(tq, tk, device=like.device).masked_fill(~causal, float("-inf"))
        bias = causal_bias if bias is None else bias + causal_bias
    return bias


def _can_fuse(op, *args, held: list, **kwargs) -> bool:
    """Self-attention over LIVE or gated queries, where a kernel exists; on the CPU only weights that
    do not fit in one chunk (smaller ones keep the reference form, which saves ``A`` instead of
    recomputing it). Weights that follow the parameters (held ``Q`` and ``K`` with a gradient: a
    total parameter gradient) run the reference: the op's ``dV`` differentiates again only with
    ``Q`` and ``K`` held."""
    query, key, value, _mask, dropout = arguments(op, args, kwargs)[:5]
    q, k = held[0], held[1]
    return (isinstance(value, Live) and isinstance(query, (Live, Gate)) and not dropout
            and kernels_available(value.value) and not q.requires_grad and not k.requires_grad
            and q.shape[-2] == k.shape[-2] and q.dim() == 4 and not attention_rules.weights_fit_one_chunk(q, k))


def _fused(op, *args, held: list, **kwargs) -> Live:
    """R6 through :func:`attention`."""
    _query, _key, value, _mask, _dropout, is_causal, scale, enable_gqa = arguments(op, args, kwargs)
    q, k, mask = held[0], held[1], held[3]
    v, ones = value.value, value.ones
    if enable_gqa and k.shape[-3] != q.shape[-3]:
        repeat = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
        ones = ones if ones.shape[-3] == 1 else ones.repeat_interleave(repeat, dim=-3)
    bias = additive_mask(mask, is_causal, q.shape[-2], k.shape[-2], q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    # The op keeps Q and K for dV: compact copies, so that a fused qkv projection's output
    # (with its value third) is not kept alive through the backward.
    out, _ = attention(q.contiguous(), k.contiguous(), v, bias, scale)
    return Live(out, ones)


fuse([torch.ops.aten.scaled_dot_product_attention], _can_fuse, _fused)
