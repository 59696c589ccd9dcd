"""Memory layout of the images a CPU explanation runs on.

ATen's CPU convolutions (oneDNN) run faster on channels-last images than on contiguous
ones, which they reorder on every call; their outputs keep the layout, and so do the
fused ops after them. A CNN's explanation on the CPU therefore runs channels-last, and
hands ``C_w`` back in the layout the images came in. A ViT (whose only convolution cuts
the image into patches, a matrix product) and non-image inputs keep theirs.
"""

from __future__ import annotations

import weakref

import torch

from ..linearize.program import LinearizedProgram
from ..linearize.registry import arguments
from ..linearize.values import channels_last
from ..ops.conv_bias import cuts_patches
from .executor import BackendExplanation

_CONVOLUTIONS_2D = (torch.ops.aten.conv2d.default, torch.ops.aten.conv2d.padding)


def has_windowed_convolutions(program: LinearizedProgram) -> bool:
    """Whether the captured model has a 2-D convolution whose windows overlap or have gaps
    (a CNN's), not only one that cuts the image into patches (a ViT's patch embedding)."""
    for step in program.steps:
        if step.node.op == "call_function" and step.node.target in _CONVOLUTIONS_2D:
            x, weight, _, stride, padding, dilation, groups = arguments(step.node.target, step.node.args,
                                                                        step.node.kwargs)
            if not cuts_patches(x.meta["val"], weight.meta["val"].shape, stride, padding, dilation, groups):
                return True
    return False


def runs_channels_last(program: LinearizedProgram, x: torch.Tensor) -> bool:
    """Whether the explanation of the images ``x`` runs channels-last: where they come so, and
    on the CPU where the model is a CNN whose input has its channels at dim 1; else contiguous."""
    if program not in _IS_CNN:  # decided once per program
        _IS_CNN[program] = program.feature_dim == 1 and has_windowed_convolutions(program)
    return channels_last(x) or (x.device.type == "cpu" and x.dim() == 4 and _IS_CNN[program])


_IS_CNN: weakref.WeakKeyDictionary[LinearizedProgram, bool] = weakref.WeakKeyDictionary()


def in_layout_of(given: torch.Tensor, ran_channels_last: bool, explanation: BackendExplanation) -> BackendExplanation:
    """``explanation`` with ``C_w`` contiguous where the images ran channels-last and were
    ``given`` otherwise."""
    if not ran_channels_last or channels_last(given):
        return explanation
    return explanation._replace(weight=explanation.weight.contiguous())
