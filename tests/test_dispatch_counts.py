"""Deterministic performance counts: aten ops dispatched and device→host syncs per explanation.

Counted with a ``TorchDispatchMode`` on the CPU, batch 1, after a warm-up call (capture
excluded), for one explanation and for one eager input × gradient of the same model.
Timings on shared machines are noise; these counts are not, so they are kept as a test:
it fails when a count grows past its committed value. Lower a committed value when a
change lowers its count.
"""

from __future__ import annotations

import collections

import pytest
import timm
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omenn_kernels import Explainer, models
from omenn_kernels.testing import randomize_

SYNC = torch.ops.aten._local_scalar_dense.default
# The input's finiteness check (api._check_input) is the one host read left per call.
MAX_SYNCS = 1
# (model, backend) → aten ops dispatched per explanation, at most.
COMMITTED_OPS = {
    ("parts_vit", "reference"): 1090, ("parts_vit", "fused"): 940,
    ("parts_cnn", "reference"): 673, ("parts_cnn", "fused"): 429,
    ("vit_base_patch16_224", "reference"): 3110, ("vit_base_patch16_224", "fused"): 2735,
    ("resnet50", "reference"): 3492, ("resnet50", "fused"): 1861,
}


class _Counted(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func] += 1
        return func(*args, **(kwargs or {}))


def _model(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    if name.startswith("parts_"):
        return models.load_pretrained(name).eval(), torch.rand(1, 3, 96, 96)
    return randomize_(timm.create_model(name).eval()), torch.rand(1, 3, 224, 224)


def _input_times_gradient(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    model(x)[:, 3].sum().backward()
    return x.grad * x


@pytest.mark.parametrize("name", ["parts_vit", "parts_cnn", "vit_base_patch16_224", "resnet50"])
def test_ops_and_syncs_per_explanation(name):
    model, x = _model(name)
    _input_times_gradient(model, x)
    with _Counted() as gradient:
        _input_times_gradient(model, x)
    for backend in ("reference", "fused"):
        explainer = Explainer(model, backend=backend)
        explainer(x, 3)
        with _Counted() as explanation:
            explainer(x, 3)
        ops = sum(explanation.ops.values())
        ratio = ops / sum(gradient.ops.values())
        assert explanation.ops[SYNC] <= MAX_SYNCS, (backend, explanation.ops[SYNC])
        assert ops <= COMMITTED_OPS[name, backend], (
            f"{name} on {backend}: {ops} aten ops per explanation ({ratio:.2f}× input × gradient), "
            f"committed {COMMITTED_OPS[name, backend]}")
