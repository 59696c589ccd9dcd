"""The ones checks (where a bias meets positions only zero padding reaches, R11') are decided once
per input shape.

The input's ones are all 1 and most rules compute ones from ones and shapes alone, so what
a forward found at each bias holds for every input of its shape, and later forwards replay
it without reading the ones (no device sync: see ``tests/test_dispatch_counts.py``). Where
the ones depend on values (max pooling reads them at the arg-max, R6' attention weights
them), the checks keep running on every call as long as a zero could move with the values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from omenn_kernels import Explainer
from rule_checks import DT, assert_sums_to_logit, randomize


def _pooled_after_padding() -> nn.Module:
    """Zero padding, then max pooling whose corner windows hold one real pixel and three padded
    ones, then a convolution with a bias: the bias meets a zero exactly where the real pixel is
    not the window's maximum (and is then spread over the real positions, R11')."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.ZeroPad2d(1), nn.MaxPool2d(2), nn.Conv2d(3, 4, 1), nn.Flatten(), nn.Linear(36, 5))
    return randomize(model, seed=1, scale=0.5).double()


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_zero_that_moves_with_the_values_is_checked_at_every_call(backend):
    model = _pooled_after_padding()
    explainer = Explainer(model, backend=backend)
    positive = torch.rand(1, 3, 4, 4, dtype=DT) + 0.1  # every real pixel beats the padding's 0
    for x in (positive, -positive, positive):  # the corner maxima of -positive are padding
        assert_sums_to_logit(explainer(x, 2), model, x, 2, rtol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_a_shape_whose_bias_meets_padding_replays_its_fill_without_reading(backend):
    model = randomize(nn.Sequential(nn.Conv2d(2, 2, 1, padding=1), nn.Flatten(), nn.Linear(72, 3)), 3,
                      scale=0.5).double()
    explainer = Explainer(model, backend=backend)
    x = torch.randn(1, 2, 4, 4, dtype=DT)
    with _HostReads() as first:
        explainer(x, 0)
    with _HostReads() as second:
        e = explainer(x, 0)
    assert first.count > second.count == 1  # the input's finiteness check alone
    assert_sums_to_logit(e, model, x, 0, rtol=1e-12)


class _HostReads(TorchDispatchMode):
    """Counts reads of tensor values into Python (``aten._local_scalar_dense``: a device sync on GPUs)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_checks_are_skipped_once_a_shape_passed(backend):
    model = randomize(nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                                    nn.Linear(16, 5)), 2, scale=0.5).double()
    explainer = Explainer(model, backend=backend)
    with _HostReads() as first:
        explainer(torch.randn(2, 3, 4, 4, dtype=DT), 1)
    x = torch.randn(2, 3, 4, 4, dtype=DT)
    with _HostReads() as second:
        e = explainer(x, 1)
    assert first.count > second.count == 1  # the input's finiteness check alone
    assert_sums_to_logit(e, model, x, 1, rtol=1e-12)
