"""Where the fused ops of the rules can run.

CPU tensors run the C++ kernels of ``csrc/`` (built on first use), CUDA tensors the
Triton kernels of ``triton_kernels/``. Where neither is available the rules fall
back to their reference math, with one warning naming the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch


@functools.cache
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        warnings.warn("omenn_kernels: triton is not installed; the fused backend runs the "
                      "reference math on CUDA", RuntimeWarning, stacklevel=3)
        return False
    return True


def kernels_available(tensor: torch.Tensor) -> bool:
    """Whether a fused kernel exists for ``tensor``'s device (CPU: C++, CUDA: Triton)."""
    if tensor.device.type == "cpu":
        from ..native import available

        return available()
    if tensor.device.type == "cuda":
        return _triton_available()
    return False
