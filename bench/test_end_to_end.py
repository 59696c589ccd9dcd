"""End-to-end cost of an explanation against a forward pass and input × gradient.

    python -m pytest bench/test_end_to_end.py --benchmark-json bench/results/end_to_end_cpu.json

CPU: float32, batch 8; GPU: bfloat16, batch 64; 224×224, randomly initialized timm
models with frozen parameters. Capture (and, for ``omenn_compiled``,
``omenn_reference_compiled`` and ``input_x_gradient_compiled``, the compilation)
happens outside the timed region; each timed call explains the predicted class. The
peak memory of one call is recorded in ``extra_info``: on a GPU the allocator's peak,
on the CPU the rise of the process's resident-set high-water mark over its resident
set at the start of the call (freed heap memory is first returned to the system, so
the start is not inflated by earlier calls).
"""

from __future__ import annotations

import ctypes
import gc

import pytest
import torch

import timm

from omenn_kernels import Explainer
from omenn_kernels.backends import executor
from omenn_kernels.testing import randomize_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE, BATCH = (torch.bfloat16, 64) if DEVICE == "cuda" else (torch.float32, 8)
MODELS = ["vit_base_patch16_224", "resnet50", "convnext_base", "vgg16"]
METHODS = ["forward", "input_x_gradient", "input_x_gradient_compiled", "omenn_reference", "omenn_fused",
           "omenn_compiled", "omenn_reference_compiled"]


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


def _compiled_reference(model, x):
    """The reference backend's linearized forward under ``torch.compile``, then one backward."""
    program, _ = Explainer(model, backend="reference").program(x)
    linear_forward = torch.compile(
        lambda inputs, ones: executor.forward(program, model, inputs, ones, lambda rule: rule.reference).value)

    def call():
        inputs = x.clone().requires_grad_(True)
        ones = torch.ones_like(x).requires_grad_(True)
        logits = linear_forward(inputs, ones)
        selected = logits.gather(1, logits.detach().argmax(1, keepdim=True)).sum()
        weight, bias = torch.autograd.grad(selected, [inputs, ones])
        return weight, bias.sum(1)

    return call


def _cpu_peak_bytes(run) -> int:
    """Rise of the resident-set high-water mark during ``run()`` (Linux)."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set

    def status(field: str) -> int:
        with open("/proc/self/status") as lines:
            return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field))

    start = status("VmRSS:")
    run()
    return status("VmHWM:") - start


@pytest.mark.parametrize("method", METHODS)
def test_end_to_end(benchmark, setup, method):
    name, model, x = setup
    benchmark.group = f"{name} {DEVICE} {str(DTYPE).replace('torch.', '')} batch {BATCH}"
    warmup_rounds = 1
    if method == "forward":
        call = lambda: _forward(model, x)  # noqa: E731
    elif method == "input_x_gradient":
        call = lambda: _input_x_gradient(model, x)  # noqa: E731
    elif method == "input_x_gradient_compiled":
        compiled = torch.compile(_input_x_gradient)
        call = lambda: compiled(model, x)  # noqa: E731
        warmup_rounds = 2  # compilation
    elif method == "omenn_reference_compiled":
        call = _compiled_reference(model, x)
        warmup_rounds = 3  # compilation and the recompilations of its graph-break frames
    else:
        explainer = Explainer(model, backend=method.removeprefix("omenn_"))
        explainer.program(x)  # capture outside the timed region
        call = lambda: explainer(x)  # noqa: E731
        if method == "omenn_compiled":
            warmup_rounds = 2  # the first call runs eagerly and compiles; the second runs the graph once

    def run():
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    for _ in range(warmup_rounds):
        run()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        run()
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    else:
        benchmark.extra_info["peak_memory_bytes"] = _cpu_peak_bytes(run)
    benchmark.pedantic(run, rounds=3, warmup_rounds=0)
