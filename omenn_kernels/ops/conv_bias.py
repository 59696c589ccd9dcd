"""Fused op ``omenn::conv2d_ones``: R2's convolution with its bias spread over the ones.

The ones are shared per pixel (N, 1, H, W) and ``S`` (``window_sum``, N, 1, Ho, Wo) is
the number of real input positions in each output position's receptive field. The value
is the convolution with its bias (``Ō = 1`` wherever a real position is seen); the
backward gives the input ``convᵀ(dy, W)`` and the ones ``(Σ_c dy_c·b_c + dŌ)/S`` spread
over each receptive field, in one kernel (``omenn::conv2d_ones_backward``). A bias-free
convolution does no work for its own bias: its ones' backward reads ``dŌ`` alone, never ``dy``.

Cost of the ones' backward: one read of ``dy`` (C·Ho·Wo per image) and one write of
H·W values, against the reference's full-shape product ``b·Ō``, its gradient and a
window-sum convolution. A channels-last ``dy`` holds one row of channels per position:
its sum over channels is one matrix-vector product over those rows, read in place.

For explanations differentiable with respect to the parameters the backward
differentiates again: the input gradient through ``omenn::conv2d_input_grad``, whose own
backward is a convolution and a weight gradient (autograd's double backward of a
convolution computes the weight's part as a convolution over the batch, which is slower
on the CPU), and the ones' gradient through a window sum of the single ones channel.

Kernels: CPU ``csrc/conv_bias.cpp`` (through ``omenn::conv2d_ones_backward_cpu``), CUDA
``triton_kernels/conv_bias.py``; on the CPU a compiled explanation runs the convolution and its
input gradient through ``csrc/conv_packed.cpp`` where the kernel is a constant (see
:mod:`~omenn_kernels.backends.packed_weights`). Reference: the rule's
:func:`~omenn_kernels.linearize.rules.conv.convolved`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from ..linearize.registry import arguments
from ..linearize.rules.conv import cuts_patches, pair
from ..linearize.values import Live, channel_rows, channels_last
from ..native import define_cpu_op
from . import constants, fills_padding, fuse, fused_op, kernels_available


def output_ones(window_sum: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``Ō``, the output's ones: 1 where the receptive field holds a valid position (``S > 0``)."""
    return (window_sum > 0).to(dtype)


def value_and_ones(x: torch.Tensor, ones: torch.Tensor, window_sum: torch.Tensor, weight: torch.Tensor,
                   bias: Optional[torch.Tensor], stride: list[int], padding: list[int], dilation: list[int],
                   groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv2d_ones` in aten ops (its implementation, and its trace in a compiled explanation)."""
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return value, output_ones(window_sum, x.dtype)


@fused_op("omenn::conv2d_ones")
def conv2d_ones(x: torch.Tensor, ones: torch.Tensor, window_sum: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], stride: list[int], padding: list[int],
                dilation: list[int], groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """R2 with ones (N, 1, H, W) shared per pixel and ``S`` = ``window_sum`` (N, 1, Ho, Wo).

    Returns the convolution with its bias and the output's ones ``Ō`` (1 where S > 0).
    The backward gives the input and the ones their gradient (not the weight and bias:
    the rule, :mod:`omenn_kernels.linearize.rules.conv`, gives them theirs where asked).
    """
    return value_and_ones(x, ones, window_sum, weight, bias, stride, padding, dilation, groups)


@conv2d_ones.register_fake
def _conv2d_ones_fake(x, ones, window_sum, weight, bias, stride, padding, dilation, groups):
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return value, torch.empty_like(window_sum, dtype=x.dtype)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation,
                 groups: int) -> torch.Tensor:
    """The weight's gradient of ``conv(x, W)`` for the output gradient ``grad`` (differentiable)."""
    return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                               [0, 0], groups, [False, True, False])[1]


def input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: list[int],
               padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """:func:`conv2d_input_grad` in aten ops (its implementation, and its trace in a compiled explanation)."""
    return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                               [0, 0], groups, [True, False, False])[0]


def _packed_value_like(x, weight, bias, stride, padding, dilation, groups, channels_last):
    size = [(n + 2 * p - d * (k - 1) - 1) // s + 1
            for n, k, s, p, d in zip(x.shape[2:], weight.shape[2:], stride, padding, dilation)]
    return torch.empty(x.shape[0], weight.shape[0], *size, dtype=x.dtype, device=x.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def _packed_input_grad_like(grad, weight, input_size, stride, padding, dilation, groups, channels_last):
    return torch.empty(grad.shape[0], weight.shape[1] * groups, *input_size, dtype=grad.dtype, device=grad.device,
                       memory_format=torch.channels_last if channels_last else torch.contiguous_format)


# A float32 convolution (with its bias) and its input gradient through oneDNN, each weight
# reordered into oneDNN's layout once per weight version (csrc/conv_packed.cpp); the output
# channels-last or contiguous as asked. A compiled explanation on the CPU calls them for the
# convolutions whose weights it holds constant (:mod:`omenn_kernels.backends.packed_weights`).
conv2d_packed_cpu = define_cpu_op("conv2d_packed_cpu(Tensor x, Tensor weight, Tensor? bias, int[] stride, "
                                  "int[] padding, int[] dilation, int groups, bool channels_last) -> Tensor",
                                  _packed_value_like)
conv2d_input_grad_packed_cpu = define_cpu_op(
    "conv2d_input_grad_packed_cpu(Tensor grad, Tensor weight, int[] input_size, int[] stride, int[] padding, "
    "int[] dilation, int groups, bool channels_last) -> Tensor", _packed_input_grad_like)


# FLOPs for torch.utils.flop_counter (and the compiled backend's choice of wrapper): the
# convolution's products; an input gradient costs those of the convolution whose output
# has the gradient's shape. The ones' backward is elementwise.
@register_flop_formula(torch.ops.omenn.conv2d_ones)
def _conv2d_ones_flops(x_shape, _ones, _window_sum, w_shape, *_args, out_shape, **_kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape[0])


@register_flop_formula(torch.ops.omenn.conv2d_packed_cpu)
def _conv2d_packed_flops(x_shape, w_shape, *_args, out_shape, **_kwargs) -> int:
    return conv_flop_count(x_shape, w_shape, out_shape)


@register_flop_formula(torch.ops.omenn.conv2d_input_grad_packed_cpu)
def _conv2d_input_grad_packed_flops(grad_shape, w_shape, *_args, out_shape, **_kwargs) -> int:
    return conv_flop_count(grad_shape, w_shape, grad_shape)


@fused_op("omenn::conv2d_input_grad")
def conv2d_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: list[int],
                      padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """The input gradient ``convᵀ(grad, W)`` of a 2-D convolution of ``x`` (read for its shape)."""
    return input_grad(grad, x, weight, stride, padding, dilation, groups)


@conv2d_input_grad.register_fake
def _conv2d_input_grad_fake(grad, x, weight, stride, padding, dilation, groups):
    return torch.empty_like(x)


@register_flop_formula(torch.ops.omenn.conv2d_input_grad)
def _conv2d_input_grad_flops(grad_shape, _x_shape, w_shape, *_args, out_shape, **_kwargs) -> int:
    return conv_flop_count(grad_shape, w_shape, grad_shape)


def _conv2d_input_grad_setup(ctx, inputs, output) -> None:
    grad, _x, weight, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
    ctx.save_for_backward(grad, weight)


def _conv2d_input_grad_grad(ctx, grad_input):
    """``convᵀ(g, W)`` is linear in ``g`` and ``W``: its backward is the convolution of the
    incoming gradient (for ``g``) and the weight gradient of that convolution (for ``W``)."""
    grad, weight = ctx.saved_tensors
    rows = channels_last(grad)
    if rows != channels_last(grad_input):
        # Laid out as grad (a channels-last explanation's images' gradient comes back contiguous):
        # oneDNN's weight gradient of two layouts reorders both, which costs far more than this copy.
        grad_input = grad_input.contiguous(memory_format=torch.channels_last if rows else torch.contiguous_format)
    grad_grad = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_grad = F.conv2d(grad_input, weight, None, ctx.stride, ctx.padding, ctx.dilation, ctx.groups)
    if ctx.needs_input_grad[2]:
        grad_weight = weight_grad(grad, grad_input, weight, ctx.stride, ctx.padding, ctx.dilation, ctx.groups)
    return grad_grad, None, grad_weight, None, None, None, None


conv2d_input_grad.register_autograd(_conv2d_input_grad_grad, setup_context=_conv2d_input_grad_setup)


def _ones_dtype(grad: torch.Tensor) -> torch.dtype:
    """The C++ kernel's accumulation (and result) type: float64 for float64 gradients, else float32."""
    return torch.float64 if grad.dtype == torch.float64 else torch.float32


def _ones_gradient_fake(grad, grad_ones, bias, window_sum, input_size, kernel_size, stride, padding, dilation):
    return grad.new_empty(grad.shape[0], 1, *input_size, dtype=_ones_dtype(grad))


_conv2d_ones_backward_cpu = define_cpu_op(
    "conv2d_ones_backward_cpu(Tensor grad, Tensor grad_ones, Tensor? bias, Tensor window_sum, int[] input_size, "
    "int[] kernel_size, int[] stride, int[] padding, int[] dilation) -> Tensor", _ones_gradient_fake)


@fused_op("omenn::conv2d_ones_backward", triton=True)
def conv2d_ones_backward(grad: torch.Tensor, grad_ones: torch.Tensor, bias: Optional[torch.Tensor],
                         window_sum: torch.Tensor, input_size: list[int], kernel_size: list[int],
                         stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The ones' gradient (N, 1, H, W): ``(Σ_c grad_c·b_c + grad_ones)/S`` spread over each window.

    Without a bias the sum over channels is absent and ``grad`` gives only its shape."""
    if grad.device.type == "cuda":
        from ..triton_kernels.conv_bias import conv_bias_ones_backward

        return conv_bias_ones_backward(grad, bias, grad_ones, window_sum, input_size, kernel_size,
                                       stride, padding, dilation)
    return _conv2d_ones_backward_cpu(grad, grad_ones, bias, window_sum, input_size, kernel_size, stride,
                                     padding, dilation)


def ones_gradient_summed_in_aten(grad: torch.Tensor, grad_ones: torch.Tensor, bias: Optional[torch.Tensor],
                                 window_sum: torch.Tensor, input_size: list[int], kernel_size: list[int],
                                 stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """:func:`conv2d_ones_backward` as a compiled explanation on the CPU traces it: the sum over
    channels ``Σ_c grad_c·b_c`` in aten, which the compiler computes in the kernel that produces
    ``grad`` (in the layout it has), and the C++ op without a bias for the rest, which then never
    reads ``grad`` (no contiguous copy of it)."""
    if bias is not None:
        dtype = _ones_dtype(grad)
        summed = (grad.to(dtype) * bias.to(dtype).view(1, -1, 1, 1)).sum(1, keepdim=True)
        grad_ones = summed + grad_ones.to(dtype)
    return _conv2d_ones_backward_cpu(grad, grad_ones, None, window_sum, input_size, kernel_size, stride, padding,
                                     dilation)


def _conv2d_ones_backward_setup(ctx, inputs, output) -> None:
    grad, grad_ones, bias, window_sum, _size, ctx.kernel_size, ctx.stride, ctx.padding, ctx.dilation = inputs
    ctx.grad_ones_shape = grad_ones.shape
    ctx.save_for_backward(grad, bias, window_sum)


def _conv2d_ones_backward_grad(ctx, grad_ones_in):
    """The ones' gradient is linear in ``grad``, ``grad_ones`` and ``bias``: its backward sums the
    incoming gradient over each window, divides by ``S`` (the bias share) and hands it back."""
    grad, bias, window_sum = ctx.saved_tensors
    window = grad_ones_in.new_ones(1, 1, *ctx.kernel_size)
    gathered = F.conv2d(grad_ones_in, window, None, ctx.stride, ctx.padding, ctx.dilation)
    empty = window_sum == 0
    share = torch.where(empty, 0.0, gathered / torch.where(empty, 1.0, window_sum)).to(grad.dtype)
    # In channels-last memory a position's channels are one row: (N·H·W, C) is a view.
    rows = channels_last(grad)
    grad_grad = None
    if ctx.needs_input_grad[0] and bias is not None:
        if rows:  # laid out as grad, so that it adds to grad's other gradients without a copy
            grad_grad = (share.permute(0, 2, 3, 1) * bias.to(grad.dtype)).permute(0, 3, 1, 2)
        else:
            grad_grad = share * bias.to(grad.dtype).view(1, -1, 1, 1)
    grad_grad_ones = share.sum_to_size(ctx.grad_ones_shape) if ctx.needs_input_grad[1] else None
    grad_bias = None
    if ctx.needs_input_grad[2]:  # Σ share·grad per channel as a product, as BatchNorm's shift
        if rows:
            grad_bias = torch.mv(channel_rows(grad).flatten(0, 1).t(), share.flatten())
        else:
            grad_bias = torch.matmul(grad.flatten(2), share.flatten(2).transpose(1, 2)).sum((0, 2))
        grad_bias = grad_bias.to(bias.dtype)
    return grad_grad, grad_grad_ones, grad_bias, None, None, None, None, None, None


conv2d_ones_backward.register_autograd(_conv2d_ones_backward_grad, setup_context=_conv2d_ones_backward_setup)


def _conv2d_ones_setup(ctx, inputs, output) -> None:
    x, ones, window_sum, weight, bias, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
    ctx.save_for_backward(x, ones, window_sum, weight, bias)


def _patch_input_grad(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The input gradient of a patchifying convolution as one matrix product, patches put back in place."""
    batch, out_channels, rows, columns = grad.shape
    in_channels, kernel_h, kernel_w = weight.shape[1:]
    patches = grad.permute(0, 2, 3, 1).reshape(-1, out_channels) @ weight.reshape(out_channels, -1)
    return (patches.view(batch, rows, columns, in_channels, kernel_h, kernel_w)
            .permute(0, 3, 1, 4, 2, 5).reshape(batch, in_channels, rows * kernel_h, columns * kernel_w))


def _conv2d_ones_grad(ctx, grad, grad_ones):
    x, ones, window_sum, weight, bias = ctx.saved_tensors
    # Under autocast the saved input, the weight and the incoming gradient may differ in
    # dtype; the CPU convolution backward needs them equal.
    grad_like_x, weight_like_x = grad.to(x.dtype), weight.to(x.dtype)
    if x.device.type == "cpu" and cuts_patches(x, weight.shape, ctx.stride, ctx.padding, ctx.dilation, ctx.groups):
        grad_x = _patch_input_grad(grad_like_x, weight_like_x)  # one product, not a convolution backward
    else:
        # x gives only its shape: detached, the backward's graph has no edge to the forward.
        grad_x = conv2d_input_grad(grad_like_x, x.detach(), weight_like_x, ctx.stride, ctx.padding,
                                   ctx.dilation, ctx.groups)
    # The C++ kernel copies a strided grad itself, and only where it reads it (a bias).
    needs_contiguous = bias is not None and grad.device.type != "cpu"
    grad_ones_in = conv2d_ones_backward(grad.contiguous() if needs_contiguous else grad, grad_ones.contiguous(),
                                        bias, window_sum,
                                        list(x.shape[2:]), list(weight.shape[2:]), ctx.stride,
                                        ctx.padding, ctx.dilation)
    return grad_x, grad_ones_in.to(ones.dtype), None, None, None, None, None, None, None


conv2d_ones.register_autograd(_conv2d_ones_grad, setup_context=_conv2d_ones_setup)


def _can_fuse(op, *args, **kwargs) -> bool:
    """2-D convolutions with ones shared per pixel (or per channel without groups) and constant
    weights, where a kernel exists."""
    x, weight, bias, _stride, padding, _dilation, groups = arguments(op, args, kwargs)
    return (op is torch.ops.aten.conv2d.default and isinstance(x, Live) and x.value.dim() == 4
            and x.ones.dim() == 4 and (x.ones.shape[1] == 1 or groups == 1)
            and kernels_available(x.value) and not isinstance(padding, str) and constants(weight, bias))


class _ConvOfModel(torch.autograd.Function):
    """:func:`conv2d_ones` with the numbers of the model's own convolution (``model_result``, equal
    up to rounding) for its value, and the op's backward: where the held pass is the model's
    forward (a total parameter gradient) the convolution has run already, so it is not
    computed again. The kernel and bias get their gradient through the model's output."""

    @staticmethod
    def forward(ctx, x, ones, window_sum, weight, bias, stride, padding, dilation, groups, result):
        _conv2d_ones_setup(ctx, (x, ones, window_sum, weight, bias, stride, padding, dilation, groups), None)
        return result.detach(), output_ones(window_sum, x.dtype)

    @staticmethod
    def backward(ctx, grad, grad_ones):
        return *_conv2d_ones_grad(ctx, grad, grad_ones), None


def _fused(op, *args, model_result: torch.Tensor | None = None, **kwargs):
    """R2 through ``omenn::conv2d_ones`` for 2-D convolutions with ones shared per pixel; its value
    from the model's result where the executor gives it (:class:`_ConvOfModel`)."""
    x, weight, bias, stride, padding, dilation, groups = arguments(op, args, kwargs)
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    # Per-channel ones (after max pooling) enter summed over the channels: S counts them
    # all, and each channel's ones get the same 1/S share, as in the reference.
    ones = x.ones if x.ones.shape[1] == 1 else x.ones.sum(1, keepdim=True)
    ones = ones.expand(x.value.shape[0], 1, *x.value.shape[2:])
    window = ones.new_ones(1, 1, *weight.shape[2:])
    window_sum = F.conv2d(ones.detach(), window, None, stride, padding, dilation)
    if bias is not None and fills_padding(window_sum):
        return None
    conv = conv2d_ones if model_result is None else \
        lambda *operands: _ConvOfModel.apply(*operands, model_result)
    value, ones_out = conv(x.value, ones, window_sum.float(), weight, bias, stride, padding, dilation, groups)
    return Live(value, ones_out)


fuse([torch.ops.aten.conv2d], _can_fuse, _fused)
