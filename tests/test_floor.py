"""bench/floor.py: its input × gradient formula against the FLOPs autograd actually spends."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import timm

_SPEC = importlib.util.spec_from_file_location("floor", Path(__file__).resolve().parents[1] / "bench" / "floor.py")
floor = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(floor)


@pytest.mark.parametrize("name", ["vit_base_patch16_224", "resnet50"])
def test_input_x_gradient_flops_equal_a_counted_forward_and_input_backward(name):
    """Meta device, batch 2: ``F + L + C + 2A`` equals what the flop counter sees autograd do."""
    row = floor.counts(name, 2, torch.float32)
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    x = torch.empty(2, 3, 224, 224, device="meta", requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        model(x)[:, 0].sum().backward()  # (autograd.grad is refused under the counter's module hooks)
    assert row["flops"]["input_x_gradient"] == pytest.approx(counter.get_total_flops(), rel=1e-9)
    if name.startswith("vit"):  # the value third of each qkv, dV alone: 0.892 of the products
        assert row["parts"]["qkv"] > 0 and row["flops"]["omenn"] / row["flops"]["input_x_gradient"] == \
            pytest.approx(0.892, abs=1e-3)
    else:
        assert row["parts"]["qkv"] == 0 and row["flops"]["omenn"] == row["flops"]["input_x_gradient"]
    assert row["bytes"]["omenn"] > row["bytes"]["input_x_gradient"] > row["bytes"]["forward"] > 0
