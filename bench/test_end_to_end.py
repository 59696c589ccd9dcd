"""End-to-end cost of an explanation against a forward pass and input × gradient.

    python -m pytest bench/test_end_to_end.py --benchmark-json bench/results/end_to_end_cpu.json

CPU: float32, batch 8; GPU: bfloat16, batch 64; 224×224, randomly initialized timm
models with frozen parameters. Capture happens once, outside the timed region; each
timed call explains the predicted class. On a GPU the peak memory of one call is
recorded in ``extra_info``.
"""

from __future__ import annotations

import pytest
import torch

import timm

from omenn_kernels import Explainer
from omenn_kernels.testing import randomize_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, BATCH = (torch.bfloat16, 64) if DEVICE == "cuda" else (torch.float32, 8)
MODELS = ["vit_base_patch16_224", "resnet50", "convnext_base", "vgg16"]


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    torch.manual_seed(0)
    model = randomize_(timm.create_model(request.param, pretrained=False)).to(DEVICE, DTYPE).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    x = torch.randn(BATCH, 3, 224, 224, device=DEVICE, dtype=DTYPE)
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


@pytest.mark.parametrize("method", ["forward", "input_x_gradient", "omenn_reference", "omenn_fused"])
def test_end_to_end(benchmark, setup, method):
    name, model, x = setup
    benchmark.group = f"{name} {DEVICE} {str(DTYPE).replace('torch.', '')} batch {BATCH}"
    if method == "forward":
        call = lambda: _forward(model, x)  # noqa: E731
    elif method == "input_x_gradient":
        call = lambda: _input_x_gradient(model, x)  # noqa: E731
    else:
        explainer = Explainer(model, backend=method.removeprefix("omenn_"))
        explainer.program(x)  # capture outside the timed region
        call = lambda: explainer(x)  # noqa: E731

    def run():
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        run()
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
