"""K targets per image from one shared forward against K separate explain calls.

Target: K = 10 targets per image sharing one forward (``Explainer.explain_targets``)
is ≥ 3× faster than 10 separate ``Explainer.__call__`` calls, one per target.

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m pytest bench/test_targets.py bench/test_pipeline.py \
        -p no:cacheprovider --benchmark-json bench/results/bulk_cpu.json
    python bench/report.py bench/results/bulk_cpu.json

On a CPU shared with other processes, pin torch to one thread (``OMP_NUM_THREADS=1``): two
threads on two busy cores stall each other at every operation (``bulk_cpu.json`` was
measured so, on 2 cores).

For comparison, the same two variants of the model's own input gradient (``gradient``
group: ``torch.autograd.grad`` of each target's logit with respect to the images; one
forward and ten backward passes, or ten forwards and backwards). They show how much any
method with one backward per target can gain from sharing the forward.

Models: the shipped parts_vit and parts_cnn (batch 32 of 96×96 parts test images) and a
randomly initialized timm resnet50 (batch 8 of 224×224 noise, biases and BatchNorm
statistics randomized). Targets are classes 0..9, as one-hot read-outs. Both variants of
a (model, backend) use the same Explainer, captured before timing. resnet50 takes
about 4½ of the run's 6 minutes on 2 CPU cores; ``-k "not resnet50"`` leaves it out.

With CUDA the same workloads (float32, same batches and inputs) run on the GPU: models,
images and read-outs on the device, the timed function synchronizes, 10 rounds instead
of 3; ``extra_info`` names the device (the GPU, or the CPU's model).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Callable

import pytest
import timm
import torch
from pytest_benchmark.fixture import BenchmarkFixture

from omenn_kernels import Explainer
from omenn_kernels.evaluation.parts_dataset import PartsDataset
from omenn_kernels.models import load_pretrained
from omenn_kernels.models.train import cpu_model
from omenn_kernels.testing import randomize_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROUNDS = 10 if DEVICE == "cuda" else 3
TARGETS = 10
MODELS = ["parts_vit", "parts_cnn", "resnet50"]
BACKENDS = ["fused", "reference"]


@dataclass
class Workload:
    """A model and the batch it is explained on."""

    name: str
    model: torch.nn.Module
    x: torch.Tensor


@pytest.fixture(scope="module", params=MODELS)
def workload(request: pytest.FixtureRequest) -> Workload:
    if request.param == "resnet50":
        torch.manual_seed(0)
        model = randomize_(timm.create_model("resnet50", pretrained=False)).eval().requires_grad_(False)
        # Drawn on the CPU, so that both devices explain the same noise.
        return Workload("resnet50", model.to(DEVICE), torch.randn(8, 3, 224, 224).to(DEVICE))
    images = PartsDataset("test", 32)
    x = torch.stack([images[i]["image"] for i in range(len(images))])
    model = load_pretrained(request.param).eval().requires_grad_(False)
    return Workload(request.param, model.to(DEVICE), x.to(DEVICE))


@pytest.fixture(scope="module", params=BACKENDS)
def explainer(request: pytest.FixtureRequest, workload: Workload) -> Explainer:
    """One Explainer per (model, backend), shared by both variants; captured here, untimed."""
    explainer = Explainer(workload.model, backend=request.param)
    explainer.program(workload.x)
    return explainer


@pytest.mark.parametrize("variant", ["shared", "separate"])
def test_targets(benchmark: BenchmarkFixture, workload: Workload, explainer: Explainer, variant: str) -> None:
    x = workload.x
    _, classes = explainer.program(x)
    if variant == "shared":
        # (B, T, K) one-hot rows
        readouts = torch.eye(classes, device=x.device)[:TARGETS].repeat(x.shape[0], 1, 1)

        def call() -> None:
            explainer.explain_targets(x, readouts)
    else:
        def call() -> None:
            for target in range(TARGETS):
                explainer(x, target=target)

    _measure(benchmark, call, workload, explainer.backend)


@pytest.mark.parametrize("variant", ["shared", "separate"])
def test_gradient_targets(benchmark: BenchmarkFixture, workload: Workload, variant: str) -> None:
    """The model's own input gradient of each of the K targets' logits."""
    model = workload.model

    def target_gradients(images: torch.Tensor, forwards: int) -> None:
        per_forward = TARGETS // forwards
        for first in range(0, TARGETS, per_forward):
            x = images.detach().requires_grad_(True)
            logits = model(x)
            for target in range(first, first + per_forward):
                torch.autograd.grad(logits[:, target].sum(), x, retain_graph=target + 1 < first + per_forward)

    _measure(benchmark, lambda: target_gradients(workload.x, 1 if variant == "shared" else TARGETS),
             workload, "gradient")


def _measure(benchmark: BenchmarkFixture, call: Callable[[], None], workload: Workload, method: str) -> None:
    def run() -> None:
        call()
        if DEVICE == "cuda":
            torch.cuda.synchronize()

    benchmark.group = f"targets-{workload.name}-{method}"
    benchmark.extra_info.update(model=workload.name, backend=method, batch=workload.x.shape[0], K=TARGETS,
                                cpu=cpu_model(),
                                device=torch.cuda.get_device_name() if DEVICE == "cuda" else cpu_model(),
                                torch=torch.__version__, date=datetime.date.today().isoformat())
    benchmark.pedantic(run, rounds=ROUNDS, warmup_rounds=1)
