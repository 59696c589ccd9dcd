"""Fused op ``omenn::linear_ones``: R1's ``xWᵀ + b·Ō`` with a backward over the receiving features.

It runs ``F.linear`` and ``addmm(b, x, W)`` (``Conv1D`` layers) alike.

``Ō`` is the mean of the ones over the contracted (last) dimension. The backward
multiplies only the output features ``start:stop`` that can receive a gradient (decided
by the graph walker, :mod:`omenn_kernels.linearize.receiving`): for a fused ``qkv``
projection whose query and key thirds feed only the attention weights, ``dX = dY·W``
shrinks to the value third, one of the three products a gradient computes there.
``omenn::linear_input_grad`` (that product) differentiates again over the same
features, so explanations differentiable with respect to the parameters run it too. Without
a bias the backward does no ones work beyond passing on the ones' own gradient.

Where the executor gives the model's own result (``model_result``: a total parameter
gradient, whose held pass is the model's forward) the value takes its numbers, and only
that backward is the op's (:class:`_LinearOfModel`).

Kernels: aten's matrix products on every device; on the CPU the forward's calls are made
from C++ (``omenn::linear_ones_cpu``, ``csrc/linear_ones.cpp``), which a compiled
explanation calls without the Python of this op. Reference: the rules' ``_linear`` and ``_addmm``
(:mod:`omenn_kernels.linearize.rules.linear`), ``F.linear`` with autograd.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from ..linearize.registry import arguments
from ..linearize.values import Live, reached
from ..native import available, define_cpu_op
from . import constants, fuse, fused_op


def output_ones(ones: torch.Tensor) -> torch.Tensor:
    """``Ō``, the output's ones: the mean of the input ones over the contracted (last) dimension."""
    return ones.mean(-1, keepdim=True)


def value_and_ones(x: torch.Tensor, ones: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                   start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_ones` in aten ops (its implementation, and its trace in a compiled explanation)."""
    ones_bar = output_ones(ones)
    if bias is None:
        return F.linear(x, weight), ones_bar
    # b·Ō written first and the product accumulated onto it (β = 1): one pass over the
    # output besides the product's, as F.linear's copy of its bias.
    value = ones_bar.expand(*x.shape[:-1], 1) * bias
    value.view(-1, weight.shape[0]).addmm_(x.reshape(-1, x.shape[-1]), weight.t())
    return value, ones_bar


def _value_and_ones_like(x, ones, weight, bias, *_receiving):
    """The outputs' shapes (the fake of both ops)."""
    return x.new_empty(*x.shape[:-1], weight.shape[0]), ones.new_empty(*ones.shape[:-1], 1)


# :func:`value_and_ones` from C++, without autograd (the gradient is linear_ones').
linear_ones_cpu = define_cpu_op("linear_ones_cpu(Tensor x, Tensor ones, Tensor weight, Tensor? bias) "
                                "-> (Tensor, Tensor)", _value_and_ones_like)


def value_and_ones_cpu(x: torch.Tensor, ones: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                       start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linear_ones` as the C++ op (its trace in a compiled explanation on the CPU)."""
    return linear_ones_cpu(x, ones, weight, bias)


@fused_op("omenn::linear_ones")
def linear_ones(x: torch.Tensor, ones: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """R1 ``(xWᵀ + b·Ō, Ō)`` with ``Ō`` the mean of ``ones`` over the last dim (1 wherever used).

    Only output features ``start:stop`` receive a gradient (the others feed only gates).
    """
    if x.device.type == "cpu" and available():
        return linear_ones_cpu(x, ones, weight, bias)
    return value_and_ones(x, ones, weight, bias, start, stop)


linear_ones.register_fake(_value_and_ones_like)


# FLOPs for torch.utils.flop_counter: the forward's product over every output feature, the
# input gradient's over the receiving ones.
@register_flop_formula([torch.ops.omenn.linear_ones, torch.ops.omenn.linear_ones_cpu])
def _linear_ones_flops(x_shape, _ones, w_shape, *_args, out_shape, **_kwargs) -> int:
    return 2 * math.prod(x_shape) * w_shape[0]


def _linear_ones_setup(ctx, inputs, output) -> None:
    _x, ones, weight, bias, ctx.start, ctx.stop = inputs
    ctx.ones_shape = ones.shape
    ctx.save_for_backward(weight, bias)


def input_grad(grad: torch.Tensor, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """:func:`linear_input_grad` in aten ops (its implementation, and its trace in a compiled explanation)."""
    if start == 0 and stop == weight.shape[0]:
        return grad.matmul(weight)
    # Views, where indexing would copy the gradient; one matrix product over the flattened
    # positions (a row-strided view), where matmul would broadcast the weight over a batch.
    receiving = grad.narrow(-1, start, stop - start)
    product = receiving.reshape(-1, stop - start).mm(weight.narrow(0, start, stop - start))
    return product.view(*grad.shape[:-1], weight.shape[1])


@fused_op("omenn::linear_input_grad")
def linear_input_grad(grad: torch.Tensor, weight: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """``grad·W`` over the output features ``start:stop``, the only ones that receive a gradient."""
    return input_grad(grad, weight, start, stop)


@linear_input_grad.register_fake
def _linear_input_grad_fake(grad, weight, start, stop):
    return grad.new_empty(*grad.shape[:-1], weight.shape[1])


@register_flop_formula(torch.ops.omenn.linear_input_grad)
def _linear_input_grad_flops(grad_shape, w_shape, start, stop, *, out_shape, **_kwargs) -> int:
    return 2 * math.prod(grad_shape[:-1]) * (stop - start) * w_shape[1]


def _linear_input_grad_setup(ctx, inputs, output) -> None:
    grad, weight, ctx.start, ctx.stop = inputs
    ctx.save_for_backward(grad, weight)


def _linear_input_grad_grad(ctx, grad_input):
    """``g·W`` is linear in ``g`` and ``W``: ``dg = dX·Wᵀ`` (every feature: a gradient that is 0
    may still change with the parameters) and ``dW = gᵀ·dX``, whose rows are 0 where ``g`` is."""
    grad, weight = ctx.saved_tensors
    grad_grad = grad_input.matmul(weight.transpose(0, 1)) if ctx.needs_input_grad[0] else None
    grad_weight = None
    if ctx.needs_input_grad[1]:
        rows = slice(ctx.start, ctx.stop)
        product = grad[..., rows].flatten(0, -2).transpose(0, 1).matmul(grad_input.flatten(0, -2))
        if ctx.stop - ctx.start == weight.shape[0]:
            grad_weight = product
        else:
            grad_weight = torch.zeros_like(weight)
            grad_weight[rows] = product
    return grad_grad, grad_weight, None, None


linear_input_grad.register_autograd(_linear_input_grad_grad, setup_context=_linear_input_grad_setup)


def _linear_ones_grad(ctx, grad, grad_ones_bar):
    weight, bias = ctx.saved_tensors
    grad_x = linear_input_grad(grad, weight, ctx.start, ctx.stop)
    grad_bar = grad_ones_bar
    if bias is not None:
        receiving = ctx.stop - ctx.start
        if receiving < bias.shape[0]:  # the other features receive no gradient: Σ_c dy_c·b_c skips them
            grad, bias = grad.narrow(-1, ctx.start, receiving), bias.narrow(0, ctx.start, receiving)
        # Ō has the ones' shape but its last dim (1): shared along leading dims where the ones are.
        ones_bar_shape = (*ctx.ones_shape[:-1], 1)
        grad_bar = grad.matmul(bias).unsqueeze(-1).sum_to_size(ones_bar_shape) + grad_ones_bar
    return grad_x, (grad_bar / ctx.ones_shape[-1]).expand(ctx.ones_shape), None, None, None, None


linear_ones.register_autograd(_linear_ones_grad, setup_context=_linear_ones_setup)


def _can_fuse(op, *args, **kwargs) -> bool:
    x, weight, bias = arguments(op, args, kwargs)[:3]
    return isinstance(x, Live) and constants(weight, bias)


def _can_fuse_addmm(op, *args, **kwargs) -> bool:
    """``addmm(b, x, W)`` is ``F.linear(x, Wᵀ, b)`` where it scales neither term and ``b`` is one bias per feature."""
    bias, x, weight, beta, alpha = arguments(op, args, kwargs)
    return isinstance(x, Live) and constants(weight, bias) and beta == 1 and alpha == 1 and bias.dim() == 1


class _LinearOfModel(torch.autograd.Function):
    """R1's value with the numbers of the model's own ``x̄·Wᵀ + b`` (``model_result``, equal up to
    rounding).

    Where the held pass is the model's forward (a total parameter gradient) the model's
    linear has run already; the linearized value needs only its backward, ``dX = dY·W``
    (``omenn::linear_input_grad``, which differentiates again) and ``dŌ = dY·b``, so its own
    product is not computed. ``W`` and ``b`` get their gradient through the model's output
    and through that backward.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, ones_bar: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                held_output: torch.Tensor, receiving: tuple[int, int]) -> torch.Tensor:
        ctx.save_for_backward(weight, bias)
        ctx.ones_shape, ctx.receiving = ones_bar.shape, receiving
        return held_output.detach()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, bias = ctx.saved_tensors
        grad_ones_bar = None
        if bias is not None:
            grad_ones_bar = grad.matmul(bias.to(grad.dtype)).unsqueeze(-1).sum_to_size(ctx.ones_shape)
        return linear_input_grad(grad, weight, *ctx.receiving), grad_ones_bar, None, None, None, None


def _linear_ones_of(x: Live, weight: torch.Tensor, bias: torch.Tensor | None, receiving: tuple[int, int] | None,
                    model_result: torch.Tensor | None) -> Live:
    """R1 through ``omenn::linear_ones``; from the model's result where the executor gives it
    (:class:`_LinearOfModel`). The backward multiplies only the ``receiving`` block of output
    features (see :class:`~omenn_kernels.linearize.registry.Rule`); without a bias it does
    no ones work. The op is given ``Ō`` (its mean over a last dim of 1 is ``Ō``), filled by
    R11' where a bias meets positions that only padding reaches."""
    block = receiving if receiving is not None else (0, weight.shape[0])
    ones_bar = x.ones.mean(-1, keepdim=True)
    if bias is not None:
        ones_bar = reached(ones_bar)
    if model_result is not None:
        return Live(_LinearOfModel.apply(x.value, ones_bar, weight, bias, model_result, block), ones_bar)
    value, ones_bar = linear_ones(x.value, ones_bar, weight, bias, *block)
    return Live(value, ones_bar)


def _fused(op, *args, receiving: tuple[int, int] | None = None, model_result: torch.Tensor | None = None,
           **kwargs):
    """``F.linear`` through :func:`_linear_ones_of`."""
    x, weight, bias = arguments(op, args, kwargs)
    return _linear_ones_of(x, weight, bias, receiving, model_result)


def _fused_addmm(op, *args, receiving: tuple[int, int] | None = None, model_result: torch.Tensor | None = None,
                 **kwargs):
    """``addmm(b, x, W)`` (a ``Conv1D`` layer) as ``F.linear(x, Wᵀ, b)`` through :func:`_linear_ones_of`."""
    bias, x, weight = arguments(op, args, kwargs)[:3]
    return _linear_ones_of(x, weight.t(), bias, receiving, model_result)


fuse([torch.ops.aten.linear], _can_fuse, _fused)
fuse([torch.ops.aten.addmm], _can_fuse_addmm, _fused_addmm)
