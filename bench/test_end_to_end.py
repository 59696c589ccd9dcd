"""End-to-end cost of an explanation against a forward pass and input × gradient.

    python -m pytest bench/test_end_to_end.py --benchmark-json bench/results/end_to_end_cpu.json

CPU: float32, batch 8; GPU: bfloat16, batch 64; 224×224, randomly initialized timm
models with frozen parameters. Capture (and, for ``omenn_compiled``,
``omenn_reference_compiled`` and ``input_x_gradient_compiled``, the compilation)
happens outside the timed region; each timed call explains the predicted class. The
peak memory of one call is recorded in ``extra_info``: on a GPU the allocator's peak;
on the CPU the rise of the resident set's high-water mark during one call in a fresh
process (this file run as a script, after the same warm-up) in which glibc maps every
allocation of 64 KiB or more on its own and unmaps it when it is freed: its resident
set follows the live tensors, where under glibc's defaults (as in the timed process) it
also holds freed blocks kept for reuse, by amounts that vary from run to run.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from typing import Callable

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


def _model_and_input(name: str) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = randomize_(timm.create_model(name, pretrained=False)).to(DEVICE, DTYPE).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model, torch.randn(BATCH, 3, 224, 224, device=DEVICE, dtype=DTYPE)


@pytest.fixture(scope="module", params=MODELS)
def setup(request):
    return request.param, *_model_and_input(request.param)


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
        lambda inputs, ones: executor.forward(program, model, inputs, ones, lambda rule: rule.reference)[0].value)

    def call():
        inputs = x.clone().requires_grad_(True)
        ones = torch.ones_like(x).requires_grad_(True)
        logits = linear_forward(inputs, ones)
        selected = logits.gather(1, logits.detach().argmax(1, keepdim=True)).sum()
        weight, bias = torch.autograd.grad(selected, [inputs, ones])
        return weight, bias.sum(1)

    return call


def _prepared(method: str, model, x) -> tuple[Callable[[], None], int]:
    """One call of ``method`` and the number of warm-up calls it needs (capture, compilation)."""
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

    return run, warmup_rounds


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as lines:
        return next(int(line.split()[1]) * 1024 for line in lines if line.startswith(field))


def _cpu_peak_bytes(name: str, method: str) -> int:
    """The peak memory of one call of ``method`` on ``name``, measured by :func:`_measure_cpu_peak`
    in a fresh process whose glibc maps allocations of 64 KiB and more one by one (Linux)."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run([sys.executable, __file__, name, method], env=env, capture_output=True, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"measuring the peak memory of {method} on {name} failed "
                           f"(exit {done.returncode}): {done.stderr[-2000:]}")
    return int(done.stdout.split()[-1])


def _measure_cpu_peak(name: str, method: str) -> None:
    """Print the rise of this process's resident-set high-water mark during one call, after the warm-up."""
    run, warmup_rounds = _prepared(method, *_model_and_input(name))
    for _ in range(warmup_rounds):
        run()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    start = _status_bytes("VmRSS:")
    run()
    print(_status_bytes("VmHWM:") - start)


@pytest.mark.parametrize("method", METHODS)
def test_end_to_end(benchmark, setup, method):
    name, model, x = setup
    benchmark.group = f"{name} {DEVICE} {str(DTYPE).replace('torch.', '')} batch {BATCH}"
    run, warmup_rounds = _prepared(method, model, x)
    for _ in range(warmup_rounds):
        run()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
        run()
        benchmark.extra_info["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    else:
        benchmark.extra_info["peak_memory_bytes"] = _cpu_peak_bytes(name, method)
    benchmark.pedantic(run, rounds=3, warmup_rounds=0)


if __name__ == "__main__":  # the peak-memory measurement of one method (_cpu_peak_bytes)
    _measure_cpu_peak(*sys.argv[1:3])
