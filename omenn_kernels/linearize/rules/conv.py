"""R2: convolution with its bias spread over the valid positions of the receptive field.

``conv(x, K) + b·Ō`` with ``Ō[p] = S[p] / stopgrad(S[p])``, ``S[p]`` the sum of the
ones over p's receptive field (zero padding counts as 0), and ``Ō = 0`` where
``S = 0``. This is the paper's dynamic kernel ``K̃_b`` with ``s_i = Σ c_Pi``: the
bias of each output position goes in equal shares to the real input positions it
sees. Any stride, padding, dilation and groups.

Fused op ``omenn::conv2d_ones`` (2-D, ones shared per pixel):
:mod:`omenn_kernels.ops.conv_bias`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, reached, renormalized

aten = torch.ops.aten

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def pair(value, dims: int = 2) -> list[int]:
    """An int or a sequence as a list of ``dims`` ints (a convolution's stride, padding, ...)."""
    return list(value) * (dims // len(value)) if isinstance(value, (list, tuple)) else [value] * dims


def cuts_patches(x: torch.Tensor, weight_shape, stride, padding, dilation, groups: int) -> bool:
    """Whether a 2-D convolution cuts ``x`` into whole non-overlapping patches (a ViT's patch embedding)."""
    kernel = list(weight_shape[2:])
    if x.dim() != 4 or groups != 1 or isinstance(padding, str):
        return False
    return (pair(stride) == kernel and pair(padding) == [0, 0] and pair(dilation) == [1, 1]
            and x.shape[2] % kernel[0] == 0 and x.shape[3] % kernel[1] == 0)


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


def _conv(op, *args, model_result: torch.Tensor | None = None, **kwargs):
    """R2; the reference computes the convolution itself, whatever ``model_result`` gives (its fused
    form takes it)."""
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


register([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution],
         Rule("R2 convolution", _conv, takes_model_result=True))
