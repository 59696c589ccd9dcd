"""Fused op ``omenn::batch_norm_ones``: R3's eval-mode BatchNorm ``x·s + b'·O`` with ones per pixel.

``s = γ/√(var+ε)`` and ``b' = β − mean·s`` are per-channel constants. The value is
``x·s + b'`` (the ones are 1 wherever a shift is added); the backward gives the input
``dy·s`` and ones shared per pixel ``Σ_c dy·b'`` as one batched vector-matrix product,
instead of the reference's broadcast products and their gradients. The backward is
made of differentiable products with ``s`` and ``b'``, so explanations differentiable
with respect to the parameters run it too.

Where R11' fills padded positions the rule's reference math runs.

Kernels: aten on every device. Reference: the rule's ``batch_norm_affine``
(:mod:`omenn_kernels.linearize.rules.norm`).
"""

from __future__ import annotations

import torch

from ..linearize.registry import arguments
from ..linearize.rules.norm import affine_of, channel_view
from ..linearize.values import Live
from . import fills_padding, fuse, fused_op


def value(x: torch.Tensor, ones: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """:func:`batch_norm_ones` in aten ops (its implementation, and its trace in a compiled explanation)."""
    return x * channel_view(scale, x) + channel_view(shift, x)


@fused_op("omenn::batch_norm_ones")
def batch_norm_ones(x: torch.Tensor, ones: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor) -> torch.Tensor:
    """R3's value ``x·s + b'`` (the ones are 1 wherever they are used).

    Rounded as the reference rounds it (no fused multiply-add): a last-bit difference
    can flip a later ReLU whose input is within rounding of 0.
    """
    return value(x, ones, scale, shift)


@batch_norm_ones.register_fake
def _batch_norm_ones_fake(x, ones, scale, shift):
    return torch.empty_like(x)


def _batch_norm_ones_setup(ctx, inputs, output) -> None:
    _x, ones, scale, shift = inputs
    ctx.ones_shape = ones.shape
    ctx.save_for_backward(scale, shift)


def gradients(grad: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`batch_norm_ones_backward` in aten ops (its implementation, and its trace in a compiled explanation)."""
    grad_x = grad * channel_view(scale, grad)
    # Σ_c dy·b' per pixel as one batched vector-matrix product: a 1×1 convolution to a
    # single channel takes ATen's slow CPU path.
    per_pixel = torch.matmul(shift.to(grad.dtype), grad.flatten(2))
    return grad_x, per_pixel.view(grad.shape[0], 1, *grad.shape[2:])


@fused_op("omenn::batch_norm_ones_backward")
def batch_norm_ones_backward(grad: torch.Tensor, scale: torch.Tensor,
                             shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R3's backward with ones shared per pixel: ``dy·s`` and ``Σ_c dy·b'`` (N, 1, H, W)."""
    return gradients(grad, scale, shift)


@batch_norm_ones_backward.register_fake
def _batch_norm_ones_backward_fake(grad, scale, shift):
    return torch.empty_like(grad), grad.new_empty(grad.shape[0], 1, *grad.shape[2:])


def _batch_norm_ones_backward_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _batch_norm_ones_backward_grad(ctx, grad_grad_x, grad_grad_ones):
    """Linear in ``dy``, ``s`` and ``b'``: ``d(dy) = ddx·s + b'·ddo`` in one product-sum (and
    in the input's memory layout, where autograd's outer product of ``b'`` would be
    channels-last), ``ds = Σ ddx·dy`` and ``db' = Σ dy·ddo``."""
    grad, scale, shift = ctx.saved_tensors
    grad_grad = grad_scale = grad_shift = None
    if ctx.needs_input_grad[0]:
        grad_grad = torch.addcmul(grad_grad_x * channel_view(scale, grad),
                                  channel_view(shift, grad).to(grad.dtype), grad_grad_ones)
    if ctx.needs_input_grad[1]:
        grad_scale = (grad_grad_x * grad).sum((0, 2, 3)).to(scale.dtype)
    if ctx.needs_input_grad[2]:
        per_channel = torch.matmul(grad.flatten(2), grad_grad_ones.flatten(1).unsqueeze(-1))
        grad_shift = per_channel.sum((0, 2)).to(shift.dtype)
    return grad_grad, grad_scale, grad_shift


batch_norm_ones_backward.register_autograd(_batch_norm_ones_backward_grad,
                                           setup_context=_batch_norm_ones_backward_setup)


def _batch_norm_ones_grad(ctx, grad):
    scale, shift = ctx.saved_tensors
    if len(ctx.ones_shape) == 4 and ctx.ones_shape[1] == 1:  # ones shared by the channels
        grad_x, grad_ones = batch_norm_ones_backward(grad, scale, shift)
        return grad_x, grad_ones.sum_to_size(ctx.ones_shape), None, None
    grad_x = grad * channel_view(scale, grad)
    if len(ctx.ones_shape) > 1 and ctx.ones_shape[1] == 1:
        grad_ones = (grad * channel_view(shift, grad)).sum(1, keepdim=True)
    else:
        grad_ones = grad * channel_view(shift, grad)
    return grad_x, grad_ones.sum_to_size(ctx.ones_shape), None, None


batch_norm_ones.register_autograd(_batch_norm_ones_grad, setup_context=_batch_norm_ones_setup)


def _fused(op, *args, **kwargs):
    x, weight, bias, mean, var, _momentum, eps = arguments(op, args, kwargs)
    if fills_padding(x.ones):
        return None
    scale, shift = affine_of(weight, bias, mean, var, eps)
    empty = x.value.new_empty(0)
    return Live(batch_norm_ones(x.value, x.ones, scale, shift), x.ones), empty, empty


fuse([torch.ops.aten._native_batch_norm_legit_no_training], lambda op, *args, **kwargs: True, _fused)
