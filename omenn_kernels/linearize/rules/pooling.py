"""R13, R13' and R14: pooling, means and interpolation.

R13 (average/adaptive pooling, mean and sum over dims): the value as usual; the ones
pooled the same way and renormalized to stay 1 (``S/stopgrad(S)``, padding counts).
R13' (max pooling): the value's gradient goes to the arg-max; the ones are taken at
the arg-max position.
R14 (interpolation): the ones interpolated the same way, renormalized; ``grid_sample``
with a CONST grid is an interpolation too.
R1' sums along the input (``cumsum``, ``col2im``'s sums of overlapping patches) are R13's
sums: the ones summed the same way and renormalized.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from ..registry import Rule, RuleError, arguments, register
from ..values import Live, channel_rows, channels_last, full_ones, ones_from_values, renormalized
from .conv import pair

aten = torch.ops.aten


# Ops that mix the channel dim with others (its size matters), so shared ones are expanded first.
_FULL_ONES = {aten.col2im.default}


def _pooled(op, *args, **kwargs):
    """R13/R14: ``op`` on the value; on the ones, then renormalized."""
    x, *rest = args
    if any(isinstance(a, Live) for a in rest) or any(isinstance(a, Live) for a in kwargs.values()):
        raise RuleError("a pooling parameter depends on the input", "R13 (CONST parameters)")
    value = op(x.value, *rest, **kwargs)
    ones = full_ones(x) if op in _FULL_ONES else x.ones
    return Live(value, renormalized(op(ones, *rest, **kwargs)))


class _SharedAtArgMax(torch.autograd.Function):
    """Ones shared by the channels, (N, 1, L), read at every channel's arg-max, (N, C, Lo),
    along ``dim`` -1; or (N, L, 1) read into (N, Lo, C) along ``dim`` 1 (channels-last memory).

    The backward adds each channel's gradient straight into the shared ones, where a
    gather from the expanded ones would scatter into a zero tensor of every channel and
    then sum it over them.
    """

    @staticmethod
    def forward(ctx, shared: torch.Tensor, indices: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.shape, ctx.dim = shared.shape, dim
        size = list(indices.shape)
        size[dim] = shared.shape[dim]
        return shared.expand(size).gather(dim, indices)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        return _AddedAtArgMax.apply(grad, indices, ctx.shape, ctx.dim), None, None


class _AddedAtArgMax(torch.autograd.Function):
    """The backward of :class:`_SharedAtArgMax`, itself differentiable (its backward is the gather)."""

    @staticmethod
    def forward(ctx, grad: torch.Tensor, indices: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.dim = dim
        batch = grad.shape[0]
        # Out of place: a traced explanation stays functional (see backends.direct_inductor).
        shared = grad.new_zeros(batch, shape[dim]).scatter_add(1, indices.reshape(batch, -1), grad.reshape(batch, -1))
        return shared.view(shape)

    @staticmethod
    def backward(ctx, grad_shared: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (indices,) = ctx.saved_tensors
        return _SharedAtArgMax.apply(grad_shared, indices, ctx.dim), None, None, None


def _positions_last(t: torch.Tensor) -> torch.Tensor:
    """(N, C, *spatial) as (N, C, L)."""
    return t.flatten(2)


def _unflattened(t: torch.Tensor, shape: torch.Size, dim: int) -> torch.Tensor:
    """The inverse of :func:`_positions_last` (``dim`` -1) or
    :func:`~omenn_kernels.linearize.values.channel_rows` (``dim`` 1)."""
    if dim == -1:
        return t.view(shape)
    return t.view(shape[0], *shape[2:], shape[1]).permute(0, 3, 1, 2)


_MAX_POOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


def arg_max_indices(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int],
                    dilation: list[int], ceil_mode: bool) -> torch.Tensor:
    """The flat arg-max of each window over the spatial dims of ``x`` (N, C, *spatial), as
    ``F.max_pool{1,2,3}d(..., return_indices=True)`` returns it (an empty stride: the kernel's),
    in ``x``'s memory layout (channels-last for channels-last images, whose gathers read rows
    of channels)."""
    layout = torch.channels_last if channels_last(x) else torch.contiguous_format
    return _MAX_POOL[x.dim() - 2](x, kernel, stride or None, padding, dilation, ceil_mode,
                                  return_indices=True)[1].contiguous(memory_format=layout)


def max_pooled(op, args: tuple, kwargs: dict, indices_of: Callable[..., torch.Tensor] = arg_max_indices):
    """R13': max pooling; the value and the ones are read at the arg-max, found by ``indices_of``
    (:func:`arg_max_indices`' arguments and result; the fused form passes ``omenn::max_pool_indices``,
    :mod:`omenn_kernels.ops.max_pool`).

    The value is gathered rather than taken from the pooling itself: a pooling's backward
    reads its input, so a differentiated backward (``create_graph``) would send zeros into
    the whole forward before it, and run every backward there again on them. A
    channels-last value is gathered as (N, H·W, C) rows of its memory, with channels-last
    indices, so that the result and the gradients of the backward stay channels-last without
    a copy, as ATen's pooling keeps them: the layers after the pooling run in the layout
    before it.
    """
    x, kernel, stride, padding, dilation, ceil_mode = arguments(op, args, kwargs)
    ones_from_values(x.ones)  # the arg-max decides which ones are read
    spatial = x.value.dim() - 2
    # An empty stride is the kernel's (aten's default), passed on as it is.
    indices = indices_of(x.value.detach(), pair(kernel, spatial), pair(stride, spatial) if stride else [],
                         pair(padding, spatial), pair(dilation, spatial), bool(ceil_mode))
    # Positions along one dim: (N, C, L) channels-first, (N, L, C) channels-last (views of both).
    positions, dim = (_positions_last, -1) if not channels_last(x.value) else (channel_rows, 1)
    flat = positions(indices)
    value = positions(x.value).gather(dim, flat)
    if x.ones.dim() == x.value.dim() == 4 and x.ones.shape[1] == 1 and x.value.shape[1] > 1:
        shared = positions(x.ones.expand(x.value.shape[0], 1, *x.value.shape[2:]))
        ones = _SharedAtArgMax.apply(shared, flat, dim)
    else:
        ones = positions(full_ones(x)).gather(dim, flat)
    value, ones = (_unflattened(t, indices.shape, dim) for t in (value, ones))
    if op in (aten.max_pool2d_with_indices.default, aten.max_pool3d_with_indices.default):
        return Live(value, ones), indices
    return Live(value, ones)


def _max_pool(op, *args, **kwargs):
    return max_pooled(op, args, kwargs)


register([aten.adaptive_avg_pool1d, aten.adaptive_avg_pool2d, aten._adaptive_avg_pool2d,
          aten.adaptive_avg_pool3d, aten._adaptive_avg_pool3d, aten.avg_pool1d, aten.avg_pool2d,
          aten.avg_pool3d, aten.mean.dim, aten.mean.default, aten.sum.dim_IntList,
          aten.sum.default], Rule("R13 average pooling / mean", _pooled))
register([aten.max_pool1d, aten.max_pool2d, aten.max_pool3d, aten.max_pool2d_with_indices,
          aten.max_pool3d_with_indices], Rule("R13' max pooling", _max_pool))
register([aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
          aten.upsample_bilinear2d, aten.upsample_bicubic2d, aten.upsample_linear1d,
          aten.upsample_trilinear3d, aten._upsample_bilinear2d_aa, aten._upsample_nearest_exact2d,
          aten.grid_sampler_2d, aten.grid_sampler_3d],
         Rule("R14 interpolation", _pooled))
register([aten.cumsum, aten.col2im], Rule("R1' sums along the input (R13)", _pooled))
