"""Fused op ``omenn::attention``: R6's ``softmax(QKᵀ·scale + bias)·V`` with the weights held.

The forward is flash attention that saves the log-sum-exp; the backward computes only
``dV = Pᵀ·dO`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed block by block: no
``dQ``, no ``dK``, no Δ pre-pass, and no ``T×T`` tensor of all heads in either direction.

Cost per head: forward ``2·Tq·Tk·(D + Dv)`` FLOPs (``QKᵀ`` and ``P·V``), backward the
same (``QKᵀ`` recomputed and ``Pᵀ·dO``): two of the five products of a full flash
backward.

Kernels: CUDA ``triton_kernels/attention.py``. CPU (``omenn::attention_cpu`` and
``omenn::attention_backward_dv_cpu``, opaque to Inductor): ATen's flash attention for the
forward, and ``P`` recomputed over chunks of heads of about :data:`CHUNK_BYTES` for
``dV``. A fully masked row (every key at ``-inf``) gives ``0`` and ``lse = -inf``.
"""

from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
from torch.library import triton_op
from torch.utils.flop_counter import (flop_registry, register_flop_formula, sdpa_backward_flop_count,
                                      sdpa_flop_count)

CHUNK_BYTES = 1 << 20
"""On the CPU, ``P`` is recomputed for as many heads at a time as fit in about this many
bytes (float32), blocks that stay in cache."""


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


def _as_4d(bias: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if bias is None else bias.view((1,) * (4 - bias.dim()) + tuple(bias.shape))


def _head_blocks(batch: int, heads: int, tq: int, tk: int) -> Iterator[tuple[slice, slice]]:
    """(batch, head) slices covering (B, H), each about :data:`CHUNK_BYTES` of float32 ``P``."""
    per_block = max(1, CHUNK_BYTES // max(1, 4 * tq * tk))
    if per_block >= heads:
        images = per_block // heads
        for b in range(0, batch, images):
            yield slice(b, min(b + images, batch)), slice(0, heads)
    else:
        for b in range(batch):
            for h in range(0, heads, per_block):
                yield slice(b, b + 1), slice(h, min(h + per_block, heads))


def _scores_of_block(q: torch.Tensor, k: torch.Tensor, bias: Optional[torch.Tensor], scale: float,
                     work: torch.dtype) -> torch.Tensor:
    """``QKᵀ·scale + bias`` of one block of heads, in the accumulation dtype ``work`` (Q scaled:
    T·D products, not T·T)."""
    scores = torch.matmul(q.to(work) * scale, k.to(work).transpose(-2, -1))
    return scores if bias is None else scores.add_(bias)


def _probabilities_in_place(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``P = exp(scores − lse)`` written over ``scores``; a fully masked row (``lse = -inf``,
    every score ``-inf``) is 0."""
    return scores.sub_(lse.masked_fill(torch.isneginf(lse), 0.0).unsqueeze(-1)).exp_()


def _cpu_forward_in_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                           scale: float, out: torch.Tensor, lse: torch.Tensor) -> None:
    """The forward over blocks of heads, where ATen's flash attention does not apply."""
    (batch, heads, tq, _), tk, work = q.shape, k.shape[-2], _lse_dtype(q.dtype)
    for b, h in _head_blocks(batch, heads, tq, tk):
        block_bias = None if bias is None else bias.expand(batch, heads, tq, tk)[b, h]
        scores = _scores_of_block(q[b, h], k[b, h], block_bias, scale, work)
        lse[b, h] = block_lse = torch.logsumexp(scores, dim=-1)
        out[b, h] = torch.matmul(_probabilities_in_place(scores, block_lse), v[b, h].to(work))


@torch.library.custom_op("omenn::attention_cpu", mutates_args=())
def _attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    (batch, heads, tq, _), tk, dv = q.shape, k.shape[-2], v.shape[-1]
    # (B, T, H, Dv)-major: the layout in which the model's next reshape (heads → features) is a view.
    out = q.new_empty(batch, tq, heads, dv).transpose(1, 2)
    lse = q.new_empty(batch, heads, tq, dtype=_lse_dtype(q.dtype))
    bias = _as_4d(bias)
    if tq == 0:
        return out, lse
    if tk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if dv != q.shape[-1]:  # ATen's flash attention wants one head size
        _cpu_forward_in_blocks(q, k, v, bias, scale, out, lse)
        return out, lse
    # ATen's float64 kernel misreads a float32 mask at head sizes of 64 and more: give it float64.
    mask = bias.double() if bias is not None and q.dtype == torch.float64 else bias
    flash_out, flash_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    out.copy_(flash_out)
    lse.copy_(flash_lse)
    if bias is not None:  # ATen gives a fully masked row lse 0 (and output 0)
        lse.masked_fill_(torch.isneginf(bias).all(-1).expand_as(lse), float("-inf"))
    return out, lse


@_attention_cpu.register_fake
def _(q, k, v, bias, scale):
    (batch, heads, tq, _), dv = q.shape, v.shape[-1]
    return (q.new_empty(batch, tq, heads, dv).transpose(1, 2),
            q.new_empty(batch, heads, tq, dtype=_lse_dtype(q.dtype)))


@torch.library.custom_op("omenn::attention_backward_dv_cpu", mutates_args=())
def _attention_backward_dv_cpu(q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                               bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    (batch, heads, tq, _), tk = q.shape, k.shape[-2]
    dv = grad.new_empty(batch, heads, tk, grad.shape[-1])
    if tq == 0 or tk == 0:
        return dv.zero_()
    work, bias = _lse_dtype(q.dtype), _as_4d(bias)
    for b, h in _head_blocks(batch, heads, tq, tk):
        block_bias = None if bias is None else bias.expand(batch, heads, tq, tk)[b, h]
        scores = _scores_of_block(q[b, h], k[b, h], block_bias, scale, work)
        weights = _probabilities_in_place(scores, lse[b, h].to(work))
        dv[b, h] = torch.matmul(weights.transpose(-2, -1), grad[b, h].to(work))
    return dv


@_attention_backward_dv_cpu.register_fake
def _(q, k, grad, lse, bias, scale):
    return grad.new_empty(q.shape[0], q.shape[1], k.shape[-2], grad.shape[-1])


# --------------------------------------------------------------------------- the op


@triton_op("omenn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(QKᵀ·scale + bias)·V, logsumexp)`` with the weights held constant (R6).

    ``q``, ``k``, ``v``: (B, H, T, D); ``bias``: additive, broadcastable to (B, H, Tq, Tk)."""
    if q.device.type == "cuda":
        from triton_kernels.attention import attention_forward

        return attention_forward(q, k, v, scale, bias)
    return _attention_cpu(q, k, v, bias, scale)


@triton_op("omenn::attention_backward_dv", mutates_args=())
def attention_backward_dv(q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                          bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``dV = Pᵀ·grad`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed."""
    if q.device.type == "cuda":
        from triton_kernels.attention import attention_backward_dv as kernel

        return kernel(q, k, grad, lse, scale, bias)
    return _attention_backward_dv_cpu(q, k, grad, lse, bias, scale)


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
    ctx.save_for_backward(q, k, output[1], *([bias] if bias is not None else []))


def _attention_grad(ctx, grad, _grad_lse):
    q, k, lse, *bias = ctx.saved_tensors
    dv = attention_backward_dv(q, k, grad.contiguous(), lse, bias[0] if bias else None, ctx.scale)
    return None, None, dv, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)
