"""Op ``omenn::max_pool_indices``: R13''s arg-max of a max pooling, from ATen's pooling.

The rule (:func:`~omenn_kernels.linearize.rules.pooling.max_pooled`) reads the value and
the ones at each window's arg-max (:func:`~omenn_kernels.linearize.rules.pooling.arg_max_indices`). Traced as aten, the pooling's arg-max is code that
Inductor generates itself: scalar loops over each window, repeated in every kernel that
reads the indices. As an op of its own it runs once per call, as ATen's pooling (vectorized over the
channels in channels-last memory on the CPU), and compiled code reads its indices from
memory. The indices are integers: the op has no gradient.

Kernels: ATen's max pooling on every device, called from C++ on the CPU where a compiled
explanation calls it (``omenn::max_pool_indices_cpu``, ``csrc/max_pool.cpp``: the same calls,
without the Python of a call). Reference: ``F.max_pool{1,2,3}d(..., return_indices=True)``,
the same call. The rule's fused form reads its indices from this op on every device.
"""

from __future__ import annotations

import torch

from ..linearize.rules.pooling import arg_max_indices, max_pooled
from ..linearize.values import channels_last
from ..native import define_cpu_op
from . import fuse

_CHANNELS_LAST_FROM = 16  # channels; with fewer (an RGB image) the copy costs more than it saves


def indices(x: torch.Tensor, kernel: list[int], stride: list[int], padding: list[int], dilation: list[int],
            ceil_mode: bool) -> torch.Tensor:
    """:func:`~omenn_kernels.linearize.rules.pooling.arg_max_indices` (this op's implementation and
    fake), from channels-last memory on the CPU."""
    layout = torch.channels_last if channels_last(x) else torch.contiguous_format
    if x.device.type == "cpu" and x.dim() == 4 and x.shape[1] >= _CHANNELS_LAST_FROM:
        # ATen's CPU max pooling vectorizes over channels only in channels-last memory, where it
        # is faster, copy included, with the same arg-max (the first).
        x = x.contiguous(memory_format=torch.channels_last)
    return arg_max_indices(x, kernel, stride, padding, dilation, ceil_mode).contiguous(memory_format=layout)


# Defined through torch.library's plain registration (no autograd layer, no checks per call):
# the indices are integers, and at small sizes the call costs more than the pooling.
_LIBRARY = torch.library.Library("omenn", "FRAGMENT")
_LIBRARY.define("max_pool_indices(Tensor x, int[] kernel, int[] stride, int[] padding, int[] dilation, "
                "bool ceil_mode) -> Tensor")
_LIBRARY.impl("max_pool_indices", indices, "CompositeExplicitAutograd")
torch.library.register_fake("omenn::max_pool_indices", indices, lib=_LIBRARY)
# The flat arg-max of each window over the spatial dims of x (N, C, *spatial), as
# F.max_pool{1,2,3}d(..., return_indices=True) returns it (an empty stride: the kernel's), in
# x's memory layout.
max_pool_indices = torch.ops.omenn.max_pool_indices.default

# The same indices from C++ (csrc/max_pool.cpp); a compiled explanation on the CPU calls it.
max_pool_indices_cpu = define_cpu_op("max_pool_indices_cpu(Tensor x, int[] kernel, int[] stride, int[] padding, "
                                     "int[] dilation, bool ceil_mode) -> Tensor", indices)


fuse([torch.ops.aten.max_pool1d, torch.ops.aten.max_pool2d, torch.ops.aten.max_pool3d,
      torch.ops.aten.max_pool2d_with_indices, torch.ops.aten.max_pool3d_with_indices],
     lambda op, *args, **kwargs: True,
     lambda op, *args, **kwargs: max_pooled(op, args, kwargs, max_pool_indices))
