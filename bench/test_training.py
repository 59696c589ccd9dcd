"""Per-step cost of training with an attribution loss against a plain training step.

Target: a step with the regularizer costs ≤ 2.5× a plain step (CPU; GPU when available).

    OMP_NUM_THREADS=1 PYTHONPATH=. python -m pytest bench/test_training.py -p no:cacheprovider \
        --benchmark-json bench/results/training_cpu.json
    python bench/report.py bench/results/training_cpu.json

A step is ``zero_grad``, the loss, ``backward`` and an Adam ``step``, on a batch of 32
parts training images (96×96) with their labels. Workloads:

* ``consistency-parts_vit``, ``consistency-parts_cnn`` (continual learning): the shipped
  model trained on cross-entropy; the regularized step adds
  ``attribution_consistency(model, frozen_copy, x, labels)`` (weight 1). The ViT has no
  dropout, so its task loss reads the logits of the explanation's forward (the shared
  forward); the CNN's BatchNorm uses batch statistics in training, so it keeps its own
  training forward for the task loss.
* ``distillation-parts_vit_to_small``: a small ViT student (width 32, 2 blocks) trained on
  cross-entropy plus logit distillation from the shipped ViT teacher; the regularized
  step adds ``attribution_distillation(student, teacher, x, labels)`` and takes the
  teacher's logits from its explanation's forward.

``test_training_steps_in_turn`` times the plain step and the eight steps of both backends
in turn, one after the other in each round, so that each ratio to the plain step
compares steps timed within seconds of each other; it also counts each step's FLOPs
(``FlopCounterMode``: matrix products and convolutions, the explanation's fused ops and
the compiled graphs' products included), whose ratio to the plain step's is the least
time ratio a step running at the plain step's FLOP rate can reach.

Variants: ``plain``; ``total`` (the default total parameter gradient); ``fixed`` (the
``fixed_multipliers`` surrogate, whose logits are detached, so the task loss needs the
model's own forward); ``total_stored`` and ``fixed_stored``: the same with the
reference's maps stored beforehand (a replay buffer of explanations), so a step
explains only the model being trained (the teacher's logits still come from its
forward in the step, as in ``plain``). These run on the default backend (``auto``);
``compiled_total``, ``compiled_fixed``, ``compiled_total_stored`` and
``compiled_fixed_stored`` are the same on ``backend="compiled"`` (both models'
explanations; the parameter gradient compiled with the explanation). Every variant's
models are fresh copies; timing starts after one warm-up step (capture, and the
compilation, included there).
"""

from __future__ import annotations

import copy
import datetime
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from pytest_benchmark.fixture import BenchmarkFixture
from torch.utils.flop_counter import FlopCounterMode

from omenn_kernels.evaluation.parts_dataset import PartsDataset
from omenn_kernels import explain
from omenn_kernels.losses import attribution_consistency, attribution_distillation, attribution_map
from omenn_kernels.models import build, load_pretrained
from omenn_kernels.models.train import cpu_model

BATCH = 32
TEMPERATURE = 2.0
VARIANTS = ["plain", "total", "fixed", "total_stored", "fixed_stored"]
COMPILED = "compiled_"
VARIANTS += [COMPILED + variant for variant in VARIANTS[1:]]


@dataclass
class Batch:
    x: torch.Tensor
    labels: torch.Tensor


@pytest.fixture(scope="module")
def batch() -> Batch:
    images = PartsDataset("train", BATCH)
    samples = [images[i] for i in range(BATCH)]
    return Batch(torch.stack([s["image"] for s in samples]), torch.tensor([int(s["label"]) for s in samples]))


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _backend(variant: str) -> str:
    return "compiled" if variant.startswith(COMPILED) else "auto"


def _parameter_gradient(variant: str) -> str:
    return "total" if variant.removeprefix(COMPILED).startswith("total") else "fixed_multipliers"


def _reference(model: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor,
               variant: str) -> torch.nn.Module | torch.Tensor:
    """The reference model, or its maps of ``x`` stored before the step for ``*_stored``."""
    if not variant.endswith("stored"):
        return model
    return attribution_map(explain(model, x, labels), x, "contribution")


def _consistency_step(name: str, variant: str, batch: Batch) -> Callable[[], None]:
    device = _device()
    model = load_pretrained(name).to(device).train()
    x, labels = batch.x.to(device), batch.labels.to(device)
    reference = _reference(copy.deepcopy(model).eval().requires_grad_(False), x, labels, variant)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    shares_forward = name == "parts_vit" and _parameter_gradient(variant) == "total"

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if variant == "plain":
            loss = F.cross_entropy(model(x), labels)
        else:
            regularizer = attribution_consistency(model, reference, x, labels, backend=_backend(variant),
                                                  reference_backend=_backend(variant),
                                                  parameter_gradient=_parameter_gradient(variant))
            logits = regularizer.logits if shares_forward else model(x)
            loss = F.cross_entropy(logits, labels) + regularizer.loss
        loss.backward()
        optimizer.step()
    return step


def _distillation_step(variant: str, batch: Batch) -> Callable[[], None]:
    device = _device()
    teacher = load_pretrained("parts_vit").to(device).requires_grad_(False)
    torch.manual_seed(0)
    student = build("vit", 50, embed_dim=32, depth=2, num_heads=2).to(device).train()
    optimizer = torch.optim.Adam(student.parameters(), lr=1e-3)
    x, labels = batch.x.to(device), batch.labels.to(device)
    reference = _reference(teacher, x, labels, variant)

    def distilled(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        soft = F.kl_div(F.log_softmax(student_logits / TEMPERATURE, -1),
                        F.log_softmax(teacher_logits / TEMPERATURE, -1), log_target=True,
                        reduction="batchmean") * TEMPERATURE ** 2
        return F.cross_entropy(student_logits, labels) + soft

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        if variant == "plain":
            with torch.no_grad():
                teacher_logits = teacher(x)
            loss = distilled(student(x), teacher_logits)
        else:
            regularizer = attribution_distillation(student, reference, x, labels, backend=_backend(variant),
                                                   teacher_backend=_backend(variant),
                                                   parameter_gradient=_parameter_gradient(variant))
            if regularizer.reference is not None:
                teacher_logits = regularizer.reference.logits
            else:
                with torch.no_grad():
                    teacher_logits = teacher(x)
            logits = regularizer.logits if _parameter_gradient(variant) == "total" else student(x)
            loss = distilled(logits, teacher_logits) + regularizer.loss
        loss.backward()
        optimizer.step()
    return step


WORKLOADS = {
    "consistency-parts_vit": lambda variant, batch: _consistency_step("parts_vit", variant, batch),
    "consistency-parts_cnn": lambda variant, batch: _consistency_step("parts_cnn", variant, batch),
    "distillation-parts_vit_to_small": _distillation_step,
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_training_step(benchmark: BenchmarkFixture, batch: Batch, workload: str, variant: str) -> None:
    step = WORKLOADS[workload](variant, batch)

    def timed() -> None:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    step()  # warm-up: capture, first allocations
    benchmark.group = f"training-{workload}"
    benchmark.extra_info.update(workload=workload, variant=variant, batch=BATCH,
                                device=torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_model(),
                                torch=torch.__version__, date=datetime.date.today().isoformat())
    benchmark.pedantic(timed, rounds=10, warmup_rounds=1)


@pytest.mark.parametrize("workload", sorted(WORKLOADS))
def test_training_steps_in_turn(benchmark: BenchmarkFixture, batch: Batch, workload: str) -> None:
    steps = {variant: WORKLOADS[workload](variant, batch) for variant in VARIANTS}
    flops = {}
    for variant, step in steps.items():
        step()  # warm-up: capture, first allocations, compilation
        with FlopCounterMode(display=False) as counter:
            step()
        flops[variant] = counter.get_total_flops()
    seconds: dict[str, list[float]] = {variant: [] for variant in steps}

    def round_of_steps() -> None:
        for variant, step in steps.items():
            start = time.perf_counter()
            step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            seconds[variant].append(time.perf_counter() - start)

    benchmark.group = f"training-in-turn-{workload}"
    benchmark.pedantic(round_of_steps, rounds=10, iterations=1, warmup_rounds=1)
    medians = {variant: statistics.median(times[1:]) for variant, times in seconds.items()}  # not the warm-up
    benchmark.extra_info.update(
        workload=workload, batch=BATCH, torch=torch.__version__, date=datetime.date.today().isoformat(),
        device=torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_model(),
        median_s=medians, flops=flops,
        over_plain={variant: medians[variant] / medians["plain"] for variant in steps},
        flops_over_plain={variant: flops[variant] / flops["plain"] for variant in steps})
