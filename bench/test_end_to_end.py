"""End-to-end cost of an explanation against a forward pass and input × gradient.

    python -m pytest bench/test_end_to_end.py --benchmark-json bench/results/end_to_end_cpu.json

CPU, float32, batch 8 at 224×224, randomly initialized timm models. Capture happens once,
outside the timed region; each timed call explains the predicted class.
"""

from __future__ import annotations

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.testing import FULL_SIZE, randomize_

BATCH = 8
MODELS = ["vit_base_patch16_224", "resnet50"]


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    torch.manual_seed(0)
    model = randomize_(FULL_SIZE[request.param].build()).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    x = torch.randn(BATCH, 3, 224, 224)
    return request.param, model, x


def _forward(model, x):
    with torch.no_grad():
        return model(x)


def _input_x_gradient(model, x):
    inputs = x.clone().requires_grad_(True)
    logits = model(inputs)
    selected = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    (gradient,) = torch.autograd.grad(selected, inputs)
    return gradient * inputs


@pytest.mark.parametrize("method", ["forward", "input_x_gradient", "omenn_reference"])
def test_end_to_end(benchmark, setup, method):
    name, model, x = setup
    benchmark.group = f"{name} cpu float32 batch {BATCH}"
    if method == "forward":
        run = lambda: _forward(model, x)  # noqa: E731
    elif method == "input_x_gradient":
        run = lambda: _input_x_gradient(model, x)  # noqa: E731
    else:
        explainer = Explainer(model, backend="reference")
        explainer.program(x)  # capture outside the timed region
        run = lambda: explainer(x)  # noqa: E731
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
