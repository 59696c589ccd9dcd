"""R2: convolution with its bias spread over the valid positions of the receptive field.

``conv(x, K) + b·Ō`` with ``Ō[p] = S[p] / stopgrad(S[p])``, ``S[p]`` the sum of the
ones over p's receptive field (zero padding counts as 0), and ``Ō = 0`` where
``S = 0``. This is the paper's dynamic kernel ``K̃_b`` with ``s_i = Σ c_Pi``: the
bias of each output position goes in equal shares to the real input positions it
sees. Any stride, padding, dilation and groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, renormalized, require_reached

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
    window = ones.new_ones(groups, 1, *weight_shape[2:])
    return _CONV[len(spatial)](per_group, window, None, stride, padding, dilation, groups)


def convolved(x: Live, weight: torch.Tensor, bias, stride, padding, dilation, groups: int) -> Live:
    """R2 on a LIVE input: the convolution, and the bias carried by ``Ō = S/stopgrad(S)``."""
    conv = _CONV[x.value.dim() - 2]
    value = conv(x.value, weight, None, stride, padding, dilation, groups)
    spatial_ones = x.ones.expand(*x.ones.shape[:2], *x.value.shape[2:])
    share = renormalized(receptive_ones(spatial_ones, weight.shape, stride, padding, dilation, groups))
    ones = share if share.shape[1] == 1 else share.repeat_interleave(weight.shape[0] // groups, dim=1)
    if bias is not None:
        require_reached(share)
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


register([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution], Rule("R2 convolution", _conv))
