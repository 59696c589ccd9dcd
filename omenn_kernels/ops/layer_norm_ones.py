"""Fused op ``omenn::layer_norm_ones``: R3' for a LayerNorm over the last dim.

``y = (x − mean)·stopgrad(1/σ)·γ + β·Ō``, with ``Ō`` the mean of the ones over the
normalized (last) dimension. The value is ATen's LayerNorm with ``γ`` (the model's own
kernel, one pass) plus ``β·Ō``; ``1/σ`` is an output of its own, held. The backward is then
the centring's and the scale's alone:

    dx = (g − mean(g))·(1/σ),   g = dy·γ        dŌ = Σ_c dy_c·β_c

two passes over ``dy`` and a row mean, where the reference's autograd takes one pass per
product of its formula. The backward is made of differentiable products with ``γ`` and
``β``, so explanations differentiable with respect to the parameters (fixed multipliers)
run it too; a total gradient, whose ``1/σ`` follows the parameters, runs the reference.

Kernels: aten on every device. Reference: the rule's ``normalized``
(:mod:`omenn_kernels.linearize.rules.norm`), with autograd.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..linearize.registry import arguments
from ..linearize.rules.norm import as_op_result
from ..linearize.values import Live
from . import constants, fills_padding, fuse, fused_op


def value_and_ones(x: torch.Tensor, ones: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                   eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`layer_norm_ones` in aten ops (its implementation, its fake, and its trace in a
    compiled explanation)."""
    normed, _mean, inverse_scale = torch.native_layer_norm(x, x.shape[-1:], weight, None, eps)
    ones_bar = ones.mean(-1, keepdim=True)
    value = normed if bias is None else torch.addcmul(normed, ones_bar, bias)
    return value, ones_bar, inverse_scale


@fused_op("omenn::layer_norm_ones")
def layer_norm_ones(x: torch.Tensor, ones: torch.Tensor, weight: Optional[torch.Tensor],
                    bias: Optional[torch.Tensor], eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """R3' over the last dim: ``((x − mean)·(1/σ)·γ + β·Ō, Ō, 1/σ)``, ``1/σ`` held (no gradient)."""
    return value_and_ones(x, ones, weight, bias, eps)


layer_norm_ones.register_fake(value_and_ones)


def _layer_norm_ones_setup(ctx, inputs, output) -> None:
    _x, ones, weight, bias, _eps = inputs
    ctx.ones_shape = ones.shape
    # Detached: 1/σ is held, so differentiating the backward must not reach the forward through it.
    ctx.save_for_backward(weight, bias, output[2].detach())


def _layer_norm_ones_grad(ctx, grad, grad_ones_bar, _grad_inverse_scale):
    weight, bias, inverse_scale = ctx.saved_tensors
    g = grad if weight is None else grad * weight
    # (g − mean(g))·(1/σ) as one pass: g·(1/σ) − mean(g)·(1/σ), the second term one per row.
    grad_x = torch.addcmul(-(g.mean(-1, keepdim=True) * inverse_scale), g, inverse_scale)
    grad_bar = grad_ones_bar
    if bias is not None:
        # Ō has the ones' shape but its last dim (1): shared along leading dims where the ones are.
        grad_bar = grad.matmul(bias.to(grad.dtype)).unsqueeze(-1).sum_to_size(grad_ones_bar.shape) + grad_ones_bar
    return grad_x, (grad_bar / ctx.ones_shape[-1]).expand(ctx.ones_shape), None, None, None


layer_norm_ones.register_autograd(_layer_norm_ones_grad, setup_context=_layer_norm_ones_setup)


def _can_fuse(op, *args, held: list, **kwargs) -> bool:
    """One normalized dim, constant ``γ`` and ``β``, and ``1/σ`` held with respect to the parameters
    too (a held value without a gradient: first-order or fixed multipliers)."""
    x, shape, weight, bias = arguments(op, args, kwargs)[:4]
    return len(shape) == 1 and not held[0].requires_grad and constants(weight, bias)


def _fused(op, *args, **kwargs):
    """R3' through ``omenn::layer_norm_ones`` over one normalized dim, where ``1/σ`` is held
    with respect to the parameters too (first-order or fixed multipliers)."""
    x, shape, weight, bias, eps = arguments(op, args, kwargs)[:5]
    ones_bar = x.ones.mean(-1, keepdim=True)
    if bias is not None and fills_padding(ones_bar):
        return None
    ones = x.ones if x.ones.dim() == x.value.dim() else x.ones.expand(x.value.shape)
    value, ones_bar, _inverse_scale = layer_norm_ones(x.value, ones, weight, bias, eps)
    return as_op_result(op, x, Live(value, ones_bar))


fuse([torch.ops.aten.layer_norm, torch.ops.aten.native_layer_norm], _can_fuse, _fused)
