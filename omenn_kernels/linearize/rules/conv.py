"""R2: convolution with its bias spread over the valid positions of the receptive field.

``conv(x, K) + b·Ō`` with ``Ō[p] = S[p] / stopgrad(S[p])``, ``S[p]`` the sum of the
ones over p's receptive field (zero padding counts as 0), and ``Ō = 0`` where
``S = 0``. This is the paper's dynamic kernel ``K̃_b`` with ``s_i = Σ c_Pi``: the
bias of each output position goes in equal shares to the real input positions it
sees. Any stride, padding, dilation and groups.

Fused op ``omenn::conv2d_ones`` (2-D, ones shared per pixel;
:mod:`omenn_kernels.ops.conv_bias`): the value is the convolution with its bias, and the
backward reduces ``Σ_c dy_c·b_c`` per output position, divides by ``S`` and scatters it
over the receptive field in one kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...ops import kernels_available
from ...ops.conv_bias import conv2d_ones, cuts_patches, pair, weight_grad
from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, reached, renormalized, with_parameter_gradient

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
    if cuts_patches(per_group, weight_shape, stride, padding, dilation, 1):
        # Sums over whole patches: a reshape, whose gradient is a broadcast.
        (kernel_h, kernel_w), (height, width) = weight_shape[2:], spatial
        return per_group.reshape(batch, groups, height // kernel_h, kernel_h, width // kernel_w,
                                 kernel_w).sum((3, 5))
    window = ones.new_ones(groups, 1, *weight_shape[2:])
    return _CONV[len(spatial)](per_group, window, None, stride, padding, dilation, groups)


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
    if cuts_patches(x.value, weight.shape, stride, padding, dilation, groups):
        value = _patch_product(x.value, weight)
    else:
        value = _CONV[x.value.dim() - 2](x.value, weight, None, stride, padding, dilation, groups)
    spatial_ones = x.ones.expand(*x.ones.shape[:2], *x.value.shape[2:])
    share = renormalized(receptive_ones(spatial_ones, weight.shape, stride, padding, dilation, groups))
    if bias is not None:
        share = reached(share)
    ones = share if share.shape[1] == 1 else share.repeat_interleave(weight.shape[0] // groups, dim=1)
    if bias is not None:
        value = value + bias.view(1, -1, *([1] * (value.dim() - 2))) * ones
    return Live(value, ones)


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


def _conv_parameter_gradients(x: torch.Tensor, weight: torch.Tensor, has_bias: bool, stride, padding,
                              dilation, groups: int):
    def gradients(grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grad_weight = weight_grad(grad, x, weight, stride, padding, dilation, groups)
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
    stride, padding, dilation = pair(stride), pair(padding), pair(dilation)
    # Per-channel ones (after max pooling) enter summed over the channels: S counts them
    # all, and each channel's ones get the same 1/S share, as in the reference.
    ones = x.ones if x.ones.shape[1] == 1 else x.ones.sum(1, keepdim=True)
    ones = ones.expand(x.value.shape[0], 1, *x.value.shape[2:])
    window = ones.new_ones(1, 1, *weight.shape[2:])
    window_sum = F.conv2d(ones.detach(), window, None, stride, padding, dilation)
    if bias is not None and reached(window_sum) is not window_sum:  # R11' fills padded positions
        return _conv(op, *args, **kwargs)
    value, ones_out = conv2d_ones(x.value, ones, window_sum.float(), weight, bias, stride, padding,
                                  dilation, groups)
    if value_gradient:
        value = with_parameter_gradient(value, (weight,) if bias is None else (weight, bias),
                                        _conv_parameter_gradients(x.value.detach(), weight, bias is not None,
                                                                  stride, padding, dilation, groups))
    return Live(value, ones_out)


register([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution],
         Rule("R2 convolution", _conv, _fused_conv, fused_differentiable=True, held_multipliers=False))
