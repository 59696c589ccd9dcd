"""R2: convolution with its bias spread over the valid positions of the receptive field.

``conv(x, K) + b·Ō`` with ``Ō[p] = S[p] / stopgrad(S[p])``, ``S[p]`` the sum of the
ones over p's receptive field (zero padding counts as 0), and ``Ō = 0`` where
``S = 0``. This is the paper's dynamic kernel ``K̃_b`` with ``s_i = Σ c_Pi``: the
bias of each output position goes in equal shares to the real input positions it
sees. Any stride, padding, dilation and groups.

Fused op ``omenn::conv2d_ones`` (2-D, ones shared per pixel): the value is the
convolution with its bias (``Ō = 1`` wherever a real position is seen), and the
backward reduces ``Σ_c dy_c·b_c`` per output position, divides by ``S`` and scatters
it over the receptive field in one kernel — CPU ``csrc/conv_bias.cpp``, CUDA
``triton_kernels/conv_bias.py``. For explanations differentiable with respect to the
parameters the backward differentiates again: the input gradient through
``omenn::conv2d_input_grad``, whose own backward is a convolution and a weight
gradient (autograd's double backward of a convolution computes the weight's part as
a convolution over the batch, 2–3× slower on the CPU), and the ones' gradient through
a window sum of the single ones channel.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..fused import kernels_available
from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, renormalized, require_reached, with_parameter_gradient

aten = torch.ops.aten

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def receptive_ones(ones: torch.Tensor, weight_shape, stride, padding, dilation, groups: int) -> torch.Tensor:
    """``S``: per output position and group, the sum of the ones in its receptive field.

    Returns (N, groups, *out) — every output channel of a group shares its ``S`` — or
    (N, 1, *out) for ones shared by all channels (one per position), where ``S`` counts
    the real positions of the window once instead of once per input channel: the
    renormalized ``S/stopgrad(S)`` and its gradient per position are the same.
    """
    batch, channels, *spatial = ones.shape
    if channels == 1:
        groups = 1
    per_group = ones.reshape(batch, groups, channels // groups, *spatial).sum(2)
    if _cuts_patches(per_group, weight_shape, stride, padding, dilation, 1):
        # Sums over whole patches: a reshape, whose gradient is a broadcast.
        (kernel_h, kernel_w), (height, width) = weight_shape[2:], spatial
        return per_group.reshape(batch, groups, height // kernel_h, kernel_h, width // kernel_w,
                                 kernel_w).sum((3, 5))
    window = ones.new_ones(groups, 1, *weight_shape[2:])
    return _CONV[len(spatial)](per_group, window, None, stride, padding, dilation, groups)


def _cuts_patches(x: torch.Tensor, weight_shape, stride, padding, dilation, groups: int) -> bool:
    """Whether a 2-D convolution cuts ``x`` into whole non-overlapping patches (a ViT's patch embedding)."""
    kernel = list(weight_shape[2:])
    if x.dim() != 4 or groups != 1 or isinstance(padding, str):
        return False
    return (_pair(stride) == kernel and _pair(padding) == [0, 0] and _pair(dilation) == [1, 1]
            and x.shape[2] % kernel[0] == 0 and x.shape[3] % kernel[1] == 0)


def _patch_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A patchifying convolution as one matrix product over the patches (same math, and its
    input gradient is one product too, where oneDNN's convolution backward is ~2.7× slower)."""
    batch, channels, height, width = x.shape
    out_channels, _, kernel_h, kernel_w = weight.shape
    rows, columns = height // kernel_h, width // kernel_w
    patches = (x.reshape(batch, channels, rows, kernel_h, columns, kernel_w).permute(0, 1, 3, 5, 2, 4)
               .reshape(batch, channels * kernel_h * kernel_w, rows * columns))
    return torch.matmul(weight.reshape(out_channels, -1), patches).view(batch, out_channels, rows, columns)


def convolved(x: Live, weight: torch.Tensor, bias, stride, padding, dilation, groups: int) -> Live:
    """R2 on a LIVE input: the convolution, and the bias carried by ``Ō = S/stopgrad(S)``."""
    if _cuts_patches(x.value, weight.shape, stride, padding, dilation, groups):
        value = _patch_product(x.value, weight)
    else:
        value = _CONV[x.value.dim() - 2](x.value, weight, None, stride, padding, dilation, groups)
    spatial_ones = x.ones.expand(*x.ones.shape[:2], *x.value.shape[2:])
    share = renormalized(receptive_ones(spatial_ones, weight.shape, stride, padding, dilation, groups))
    ones = share if share.shape[1] == 1 else share.repeat_interleave(weight.shape[0] // groups, dim=1)
    if bias is not None:
        require_reached(share)
        value = value + bias.view(1, -1, *([1] * (value.dim() - 2))) * ones
    return Live(value, ones)


@torch.library.custom_op("omenn::conv2d_ones", mutates_args=())
def conv2d_ones(x: torch.Tensor, ones: torch.Tensor, window_sum: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor], stride: list[int], padding: list[int],
                dilation: list[int], groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """R2 with ones (N, 1, H, W) shared per pixel and ``S`` = ``window_sum`` (N, 1, Ho, Wo).

    Returns the convolution with its bias and the output's ones ``Ō`` (1 where S > 0).
    The backward gives the input and the ones their gradient (not the weight and bias:
    see :func:`_fused_conv`).
    """
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return value, (window_sum > 0).to(x.dtype)


@conv2d_ones.register_fake
def _conv2d_ones_fake(x, ones, window_sum, weight, bias, stride, padding, dilation, groups):
    value = F.conv2d(x, weight, bias, stride, padding, dilation, groups)
    return value, torch.empty_like(window_sum, dtype=x.dtype)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride, padding, dilation,
                 groups: int) -> torch.Tensor:
    """The weight's gradient of ``conv(x, W)`` for the output gradient ``grad`` (differentiable)."""
    return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                               [0, 0], groups, [False, True, False])[1]


@torch.library.custom_op("omenn::conv2d_input_grad", mutates_args=())
def conv2d_input_grad(grad: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, stride: list[int],
                      padding: list[int], dilation: list[int], groups: int) -> torch.Tensor:
    """The input gradient ``convᵀ(grad, W)`` of a 2-D convolution of ``x`` (read for its shape)."""
    return torch.ops.aten.convolution_backward(grad, x, weight, None, stride, padding, dilation, False,
                                               [0, 0], groups, [True, False, False])[0]


@conv2d_input_grad.register_fake
def _conv2d_input_grad_fake(grad, x, weight, stride, padding, dilation, groups):
    return torch.empty_like(x)


def _conv2d_input_grad_setup(ctx, inputs, output) -> None:
    grad, _x, weight, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
    ctx.save_for_backward(grad, weight)


def _conv2d_input_grad_grad(ctx, grad_input):
    """``convᵀ(g, W)`` is linear in ``g`` and ``W``: its backward is the convolution of the
    incoming gradient (for ``g``) and the weight gradient of that convolution (for ``W``)."""
    grad, weight = ctx.saved_tensors
    grad_grad = grad_weight = None
    if ctx.needs_input_grad[0]:
        grad_grad = F.conv2d(grad_input, weight, None, ctx.stride, ctx.padding, ctx.dilation, ctx.groups)
    if ctx.needs_input_grad[2]:
        grad_weight = _weight_grad(grad, grad_input, weight, ctx.stride, ctx.padding, ctx.dilation, ctx.groups)
    return grad_grad, None, grad_weight, None, None, None, None


conv2d_input_grad.register_autograd(_conv2d_input_grad_grad, setup_context=_conv2d_input_grad_setup)


@torch.library.custom_op("omenn::conv2d_ones_backward", mutates_args=())
def conv2d_ones_backward(grad: torch.Tensor, grad_ones: torch.Tensor, bias: torch.Tensor,
                         window_sum: torch.Tensor, input_size: list[int], kernel_size: list[int],
                         stride: list[int], padding: list[int], dilation: list[int]) -> torch.Tensor:
    """The ones' gradient (N, 1, H, W): ``(Σ_c grad_c·b_c + grad_ones)/S`` spread over each window."""
    from ...native import cpu_kernels

    return cpu_kernels().conv_bias_ones_backward(grad, bias, grad_ones, window_sum, *input_size,
                                                 *kernel_size, *stride, *padding, *dilation)


@conv2d_ones_backward.register_kernel("cuda")
def _conv2d_ones_backward_cuda(grad, grad_ones, bias, window_sum, input_size, kernel_size, stride,
                               padding, dilation):
    from triton_kernels import conv_bias_ones_backward

    return conv_bias_ones_backward(grad, bias, grad_ones, window_sum, input_size, kernel_size,
                                   stride, padding, dilation)


@conv2d_ones_backward.register_fake
def _conv2d_ones_backward_fake(grad, grad_ones, bias, window_sum, input_size, kernel_size, stride,
                               padding, dilation):
    return grad.new_empty(grad.shape[0], 1, *input_size, dtype=torch.float32)


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
    grad_grad = share * bias.to(grad.dtype).view(1, -1, 1, 1) if ctx.needs_input_grad[0] else None
    grad_grad_ones = share.sum_to_size(ctx.grad_ones_shape) if ctx.needs_input_grad[1] else None
    grad_bias = None
    if ctx.needs_input_grad[2]:  # Σ share·grad per channel as a batched product, as BatchNorm's shift
        per_channel = torch.matmul(grad.flatten(2), share.flatten(2).transpose(1, 2))
        grad_bias = per_channel.sum((0, 2)).to(bias.dtype)
    return grad_grad, grad_grad_ones, grad_bias, None, None, None, None, None, None


conv2d_ones_backward.register_autograd(_conv2d_ones_backward_grad, setup_context=_conv2d_ones_backward_setup)


def _conv2d_ones_setup(ctx, inputs, output) -> None:
    x, ones, window_sum, weight, bias, ctx.stride, ctx.padding, ctx.dilation, ctx.groups = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, ones, window_sum, weight, bias if bias is not None else weight.new_zeros(weight.shape[0]))


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
    if x.device.type == "cpu" and _cuts_patches(x, weight.shape, ctx.stride, ctx.padding, ctx.dilation, ctx.groups):
        grad_x = _patch_input_grad(grad_like_x, weight_like_x)  # ~2.7× faster than oneDNN's backward here
    else:
        # x gives only its shape: detached, the backward's graph has no edge to the forward.
        grad_x = conv2d_input_grad(grad_like_x, x.detach(), weight_like_x, ctx.stride, ctx.padding,
                                   ctx.dilation, ctx.groups)
    grad_ones_in = conv2d_ones_backward(grad.contiguous(), grad_ones.contiguous(), bias, window_sum,
                                        list(x.shape[2:]), list(weight.shape[2:]), ctx.stride,
                                        ctx.padding, ctx.dilation)
    return grad_x, grad_ones_in.to(ones.dtype), None, None, None, None, None, None, None


conv2d_ones.register_autograd(_conv2d_ones_grad, setup_context=_conv2d_ones_setup)


def _conv(op, *args, **kwargs):
    bound = arguments(op, args, kwargs)
    if op is aten.convolution.default:
        x, weight, bias, stride, padding, dilation, transposed, _output_padding, groups = bound
        if transposed:
            raise RuleError("transposed convolution", "R2 for transposed convolutions (not implemented)")
    else:
        x, weight, bias, stride, padding, dilation, groups = bound
    if not isinstance(x, Live) or isinstance(weight, (Live, Gate)) or isinstance(bias, (Live, Gate)):
        raise RuleError("the kernel or bias of a convolution depends on the input",
                        "R2 (CONST kernel and bias)")
    return convolved(x, weight, bias, stride, padding, dilation, groups)


def _pair(value, dims: int = 2) -> list[int]:
    return list(value) * (dims // len(value)) if isinstance(value, (list, tuple)) else [value] * dims


def _conv_parameter_gradients(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, stride, padding,
                              dilation, groups: int):
    def gradients(grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grad_weight = _weight_grad(grad, x, weight, stride, padding, dilation, groups)
        return (grad_weight, grad.sum((0, 2, 3))) if has_bias else (grad_weight,)
    return gradients


def _fused_conv(op, *args, value_gradient: bool = False, **kwargs):
    """R2 through ``omenn::conv2d_ones`` for 2-D convolutions with ones shared per pixel.

    ``value_gradient`` (see :class:`Rule`): the value also carries the weight's and the
    bias's gradient (``Ō`` is 1 wherever a bias is added), on a node of its own.
    """
    bound = arguments(op, args, kwargs)
    x = bound[0]
    _, weight, bias, stride, padding, dilation, groups = bound
    fusable = (op is aten.conv2d.default and isinstance(x, Live) and x.value.dim() == 4
               and x.ones.dim() == 4 and (x.ones.shape[1] == 1 or groups == 1)
               and kernels_available(x.value) and not isinstance(padding, str)
               and not isinstance(weight, (Live, Gate)) and not isinstance(bias, (Live, Gate)))
    if not fusable:
        return _conv(op, *args, **kwargs)
    stride, padding, dilation = _pair(stride), _pair(padding), _pair(dilation)
    # Per-channel ones (after max pooling) enter summed over the channels: S counts them
    # all, and each channel's ones get the same 1/S share, as in the reference.
    ones = x.ones if x.ones.shape[1] == 1 else x.ones.sum(1, keepdim=True)
    ones = ones.expand(x.value.shape[0], 1, *x.value.shape[2:])
    window = ones.new_ones(1, 1, *weight.shape[2:])
    window_sum = F.conv2d(ones.detach(), window, None, stride, padding, dilation)
    if bias is not None:
        require_reached(window_sum)
    value, ones_out = conv2d_ones(x.value, ones, window_sum.float(), weight, bias, stride, padding,
                                  dilation, groups)
    if value_gradient:
        value = with_parameter_gradient(value, (weight,) if bias is None else (weight, bias),
                                        _conv_parameter_gradients(x.value.detach(), weight, bias is not None,
                                                                  stride, padding, dilation, groups))
    return Live(value, ones_out)


register([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution],
         Rule("R2 convolution", _conv, _fused_conv, fused_differentiable=True, held_multipliers=False))
