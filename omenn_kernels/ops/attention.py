"""Fused op ``omenn::attention``: R6's ``softmax(QKᵀ·scale + bias)·V`` with the weights held.

The forward is flash attention that saves the log-sum-exp; the backward computes only
``dV = Pᵀ·dO`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed block by block: no
``dQ``, no ``dK``, no Δ pre-pass, and no ``T×T`` tensor in either direction (on CUDA).

Cost per head: forward ``2·Tq·Tk·(D + Dv)`` FLOPs (``QKᵀ`` and ``P·V``), backward the
same (``QKᵀ`` recomputed and ``Pᵀ·dO``): two of the five products of a full flash
backward.

Kernels: CUDA ``triton_kernels/attention.py``. On the CPU the op runs its reference math
(below, in PyTorch); the rule does not choose it there.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op


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


@triton_op("omenn::attention", mutates_args=())
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(softmax(QKᵀ·scale + bias)·V, logsumexp)`` with the weights held constant (R6)."""
    if q.device.type == "cuda":
        from triton_kernels.attention import attention_forward

        return attention_forward(q, k, v, scale, bias)
    return reference(q, k, v, bias, scale)


@triton_op("omenn::attention_backward_dv", mutates_args=())
def attention_backward_dv(q: torch.Tensor, k: torch.Tensor, grad: torch.Tensor, lse: torch.Tensor,
                          bias: Optional[torch.Tensor], scale: float) -> torch.Tensor:
    """``dV = Pᵀ·grad`` with ``P = exp(QKᵀ·scale + bias − lse)`` recomputed."""
    if q.device.type == "cuda":
        from triton_kernels.attention import attention_backward_dv as kernel

        return kernel(q, k, grad, lse, scale, bias)
    return reference_backward_dv(q, k, grad, lse, bias, scale)


def _attention_setup(ctx, inputs, output) -> None:
    q, k, _v, bias, ctx.scale = inputs
    ctx.save_for_backward(q, k, output[1], *([bias] if bias is not None else []))


def _attention_grad(ctx, grad, _grad_lse):
    q, k, lse, *bias = ctx.saved_tensors
    dv = attention_backward_dv(q, k, grad.contiguous(), lse, bias[0] if bias else None, ctx.scale)
    return None, None, dv, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)
