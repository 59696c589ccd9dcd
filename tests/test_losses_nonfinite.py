"""Stored reference maps that cannot be compared are refused by the attribution losses.

A store's failed rows hold NaN (and a float16 store holds Inf where a value overflowed):
compared with them the loss would be NaN. Maps of another shape than the batch's are
refused before the model is explained. float64 small models of tests/differentiable.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from omenn_kernels import explain
from omenn_kernels.errors import InputError
from omenn_kernels.losses import attribution_consistency, attribution_distillation, attribution_map

sys.path.insert(0, str(Path(__file__).parent / "differentiable"))
from differentiable_models import DT, MODELS  # noqa: E402

LOSSES = {"consistency": attribution_consistency, "distillation": attribution_distillation}


def _model_batch_and_stored_maps(batch: int = 5) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor]:
    model, _ = MODELS["cnn"]()
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(batch, 3, 8, 8, dtype=DT, generator=generator)
    target = torch.randint(0, 5, (batch,), generator=generator)
    stored = attribution_map(explain(model, x, target), x, "contribution")
    # another model's maps: a reference whose loss is not zero
    stored = stored + 0.1 * torch.randn(stored.shape, dtype=DT, generator=generator)
    return model, x, target, stored


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_stored_maps_with_failed_rows_are_refused_naming_the_rows(loss):
    model, x, target, stored = _model_batch_and_stored_maps()
    assert torch.isfinite(LOSSES[loss](model, stored, x, target).loss)
    failed = stored.clone()
    failed[1] = float("nan")  # a failed row of a store: all NaN
    failed[3, 2, 4] = float("inf")  # a float16 overflow
    with pytest.raises(InputError, match=r"NaN or Inf in 2 of 5 rows \(batch rows 1, 3\)"):
        LOSSES[loss](model, failed, x, target)


def test_many_non_finite_rows_are_counted_and_the_first_ones_named():
    model, x, target, stored = _model_batch_and_stored_maps(batch=10)
    stored[:, 0, 0] = float("nan")
    with pytest.raises(InputError, match=r"in 10 of 10 rows \(batch rows 0, 1, 2, 3, 4, 5, 6, 7, … \(2 more\)\)"):
        attribution_consistency(model, stored, x, target)


@pytest.mark.parametrize("shape", [(5, 9, 8), (4, 8, 8), (5, 1, 8, 8)], ids=["height", "batch", "channel"])
def test_stored_maps_of_another_shape_are_refused_with_both_shapes(shape):
    model, x, target, _ = _model_batch_and_stored_maps()
    stored = torch.rand(shape, dtype=DT, generator=torch.Generator().manual_seed(3)) + 0.5
    message = re.escape(f"stored reference maps have shape {shape}") + ".*" + re.escape("(B, H, W) = (5, 8, 8)")
    with pytest.raises(InputError, match=message):
        attribution_distillation(model, stored, x, target, distance="mse")
