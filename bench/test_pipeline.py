"""Does the bulk data pipeline keep the model busy?

Target: end-to-end images/s of ``explain_folder`` (PNG decoding, transform, DataLoader,
explanation, zarr store) is ≥ 80 % of OMENN's on the same images preloaded as tensors.

It runs with ``bench/test_targets.py``, into ``bench/results/bulk_cpu.json``; the command
and why it pins torch to one thread are in that module's docstring.

256 parts test images, written once as 96×96 PNGs in an ImageFolder tree; parts_vit,
batch 32, the fused backend, the predicted class. ``explain_folder`` runs with 0, 1 and
2 DataLoader workers into a fresh store each round; a timed call includes loading the
model and capturing it, so ``extra_info`` also holds the images/s of its batch loop
alone (the run's own ``RunSummary.images_per_second``, median over rounds). The
preloaded variant explains the same tensors (the pipeline's transform, its batches, its
predicted-class read-out) with an Explainer captured before timing, and converts the
results to numpy as the store holds them, without writing them.

With CUDA, ``explain_folder`` runs with ``device="cuda"`` (PNG decoding and the store stay
on the CPU; the DataLoader pins its batches) and 4 DataLoader workers are added; the
preloaded variant's batches are on the GPU before timing and its results are copied
back to the host inside the timed call. The timed functions synchronize; ``extra_info``
names the device (the GPU, or the CPU's model).
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pytest_benchmark.fixture import BenchmarkFixture

from omenn_kernels import Explainer
from omenn_kernels.bulk.images import list_images
from omenn_kernels.bulk.model_source import load_model
from omenn_kernels.bulk.run import RunConfig, RunSummary, explain_folder
from omenn_kernels.bulk.targets import parse_targets, readout_weights
from omenn_kernels.demo import draw_images
from omenn_kernels.models.train import cpu_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
WORKERS = [0, 1, 2, 4] if DEVICE == "cuda" else [0, 1, 2]
IMAGES = 256
BATCH = 32
MODEL = "parts_vit"
GROUP = f"pipeline-{MODEL}"


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``IMAGES`` parts test images as ``<label:02d>/<index:04d>.png``."""
    root = tmp_path_factory.mktemp("parts_images")
    draw_images(root, IMAGES)
    return root


def _record(benchmark: BenchmarkFixture, workers: int | None) -> None:
    benchmark.group = GROUP
    benchmark.extra_info.update(images=IMAGES, workers=workers,
                                device=torch.cuda.get_device_name() if DEVICE == "cuda" else cpu_model())


def _synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _record_throughput(benchmark: BenchmarkFixture,
                       loop_images_per_second: list[float] | None = None) -> None:
    """images/s from the median round (and of the batch loop alone, where given)."""
    if benchmark.disabled:  # --benchmark-disable: one untimed call, no statistics
        return
    benchmark.extra_info["images_per_second"] = IMAGES / benchmark.stats.stats.median
    if loop_images_per_second is not None:
        benchmark.extra_info["loop_images_per_second"] = statistics.median(loop_images_per_second)


@pytest.mark.parametrize("workers", WORKERS, ids=lambda w: f"folder_workers{w}")
def test_pipeline_folder(benchmark: BenchmarkFixture, image_folder: Path, tmp_path: Path,
                         workers: int) -> None:
    stores = (tmp_path / f"store{round_}" for round_ in itertools.count())
    summaries: list[RunSummary] = []

    def fresh_config() -> tuple[tuple[RunConfig], dict]:
        # Untimed: a new store path per round, so that no round resumes a finished store.
        return (RunConfig(image_folder, next(stores), model=MODEL, targets="predicted", batch_size=BATCH,
                          backend="fused", device=DEVICE, workers=workers, progress=False),), {}

    def run(config: RunConfig) -> None:
        summaries.append(explain_folder(config))
        _synchronize()

    _record(benchmark, workers)
    benchmark.pedantic(run, setup=fresh_config, rounds=3, warmup_rounds=1)
    assert all(s.explained == IMAGES for s in summaries)
    # The warm-up round is left out, as in the benchmark's own statistics.
    _record_throughput(benchmark, [s.images_per_second for s in summaries[1:]])


def test_pipeline_preloaded(benchmark: BenchmarkFixture, image_folder: Path) -> None:
    loaded = load_model(MODEL)
    transform = loaded.transform()
    images = list_images(image_folder)
    tensors = []
    for path in images.paths:
        with Image.open(image_folder / path) as image:
            tensors.append(transform(image.convert("RGB")))
    # The pipeline's chunks: consecutive images in list order.
    batches = torch.stack(tensors).to(DEVICE).split(BATCH)
    explainer = Explainer(loaded.model.to(DEVICE), backend="fused")
    _, classes = explainer.program(batches[0])
    spec = parse_targets("predicted")

    def readouts(logits: torch.Tensor) -> torch.Tensor:
        return readout_weights(spec.resolve(logits, None), classes, torch.float32)

    def run() -> None:
        for x in batches:
            e = explainer.explain_targets(x, readouts)
            # What the store holds: float16 contributions, float32 read-outs and logits.
            e.contribution.float().cpu().numpy().astype(np.float16)
            e.logit.float().cpu().numpy()
            e.logits.float().cpu().numpy()
        _synchronize()

    _record(benchmark, None)
    benchmark.pedantic(run, rounds=3, warmup_rounds=1)
    _record_throughput(benchmark)
