"""The shipped parts models: each backend against a forward pass and input × gradient, CPU.

    OMP_NUM_THREADS=1 python -m pytest bench/test_parts_backends.py --benchmark-json parts_backends_cpu.json

(The committed result, ``bench/results/compiled_cpu_parts.json``, comes from a run of this
file; see bench/README.md.)

float32, 96×96, batch 1 and 32, one thread; each timed call explains class 3. Capture and
compilation happen outside the timed region (``omenn_compiled``: the first call runs
eagerly and compiles, the second runs the compiled graph once;
``input_x_gradient_compiled``: ``torch.compile`` of the forward and the backward).

The timed calls of one method follow each other, so on a shared host whose speed changes
from one minute to the next, a ratio of two methods' medians moves with it. The
``interleaved`` groups time the fused and the compiled explanation at batch 1 called in
turn, one pair per round, and record each one's median and their ratio in ``extra_info``
(the benchmark's own time is the pair's).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from omenn_kernels import Explainer, models

METHODS = ["forward", "input_x_gradient", "input_x_gradient_compiled", "omenn_reference", "omenn_fused",
           "omenn_compiled"]


@pytest.fixture(scope="module", params=[("parts_vit", 1), ("parts_vit", 32), ("parts_cnn", 1), ("parts_cnn", 32)],
                ids=lambda p: f"{p[0]}-batch{p[1]}")
def setup(request):
    name, batch = request.param
    model = models.load_pretrained(name).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)
    return name, model, torch.rand(batch, 3, 96, 96)


def _input_x_gradient(model, x):
    inputs = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(inputs)[:, 3].sum(), inputs)
    return gradient * inputs


@pytest.mark.parametrize("method", METHODS)
def test_parts_backends(benchmark, setup, method):
    name, model, x = setup
    benchmark.group = f"{name} cpu float32 batch {x.shape[0]}"
    if method == "forward":
        def call():
            with torch.no_grad():
                return model(x)
    elif method == "input_x_gradient":
        call = lambda: _input_x_gradient(model, x)  # noqa: E731
    elif method == "input_x_gradient_compiled":
        compiled = torch.compile(_input_x_gradient)
        call = lambda: compiled(model, x)  # noqa: E731
    else:
        explainer = Explainer(model, backend=method.removeprefix("omenn_"))
        call = lambda: explainer(x, 3)  # noqa: E731
    for _ in range(2):
        call()
    benchmark.pedantic(call, rounds=10, iterations=3, warmup_rounds=0)


@pytest.mark.parametrize("name", ["parts_vit", "parts_cnn"])
def test_fused_and_compiled_interleaved(benchmark, name):
    model = models.load_pretrained(name).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    torch.manual_seed(0)
    x = torch.rand(1, 3, 96, 96)
    benchmark.group = f"interleaved-{name} cpu float32 batch 1"
    explainers = {backend: Explainer(model, backend=backend) for backend in ("fused", "compiled")}
    for explainer in explainers.values():
        for _ in range(3):
            explainer(x, 3)
    seconds: dict[str, list[float]] = {backend: [] for backend in explainers}

    def pair():
        for backend, explainer in explainers.items():
            start = time.perf_counter()
            explainer(x, 3)
            seconds[backend].append(time.perf_counter() - start)

    benchmark.pedantic(pair, rounds=100, iterations=1, warmup_rounds=0)
    medians = {backend: statistics.median(times) for backend, times in seconds.items()}
    benchmark.extra_info.update(fused_median_s=medians["fused"], compiled_median_s=medians["compiled"],
                                fused_over_compiled=medians["fused"] / medians["compiled"])
