"""explain_folder: what the store holds after a run, failed images, resuming, configuration checks."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from omenn_kernels import Explainer, __version__
from omenn_kernels.bulk import AttributionStore, RunConfig, StoreMismatchError, explain_folder, list_images
from omenn_kernels.bulk.model_source import load_model
from omenn_kernels.bulk.run import _read_ahead
from omenn_kernels.bulk.store import EXPLAINED, FAILED, PENDING, producer_record
from omenn_kernels.bulk.targets import NO_CLASS

TARGETS = "predicted,label,top3,label-predicted,3-7"


def _config(source, out, **overrides) -> RunConfig:
    options = dict(model="parts_vit", targets=TARGETS, batch_size=8, backend="reference", store_dtype="float32",
                   components=("contribution", "weighted_input", "bias"), workers=0, progress=False)
    options.update(overrides)
    return RunConfig(source=source, out=out, **options)


def _inputs(folder, paths) -> torch.Tensor:
    transform = load_model("parts_vit").transform()
    images = []
    for path in paths:
        with Image.open(folder / path) as image:
            images.append(transform(image.convert("RGB")))
    return torch.stack(images)


@pytest.fixture(scope="module")
def multi_target_store(parts_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "store.zarr"
    summary = explain_folder(_config(parts_folder, out))
    return summary, AttributionStore.open(out)


def test_every_image_and_target_is_complete(multi_target_store):
    summary, store = multi_target_store
    assert (summary.explained, summary.failed, summary.skipped) == (20, 0, 0)
    assert summary.totals == {"explained": 20, "failed": 0, "pending": 0} and store.attrs["complete"]
    contribution, explained = store.read("contribution").astype(np.float64), store.read("explained")
    assert contribution.shape == (20, 7, 96, 96)
    # float32 store: the sum of 96·96 contributions matches ŷ to float32 rounding.
    np.testing.assert_allclose(contribution.sum((-2, -1)), explained, rtol=1e-5, atol=1e-4)
    composed = store.read("weighted_input").astype(np.float64).sum(2) + store.read("bias")
    np.testing.assert_allclose(composed, contribution, rtol=1e-5, atol=1e-6)


def test_targets_and_readouts_match_the_logits(multi_target_store, parts_folder):
    _, store = multi_target_store
    logits, pairs, explained = store.read("logits"), store.read("targets"), store.read("explained")
    labels = np.array(list_images(parts_folder).labels)
    predicted, top3 = logits.argmax(1), np.argsort(-logits, 1)[:, :3]
    expected_positive = np.stack([predicted, labels, *top3.T, labels, np.full(20, 3)], 1)
    expected_negative = np.stack([*[np.full(20, NO_CLASS)] * 5, predicted, np.full(20, 7)], 1)
    assert np.array_equal(pairs[..., 0], expected_positive) and np.array_equal(pairs[..., 1], expected_negative)
    rows = np.arange(20)[:, None]
    readout = logits[rows, pairs[..., 0]] - np.where(pairs[..., 1] >= 0, logits[rows, pairs[..., 1]], 0.0)
    np.testing.assert_allclose(explained, readout, rtol=1e-5, atol=1e-5)


def test_values_equal_direct_explanations(multi_target_store, parts_folder):
    """The pipeline (padding, batching, multi-target) changes nothing: per image and target,
    the stored maps equal a direct Explainer call on the same image alone."""
    _, store = multi_target_store
    paths, pairs = store.paths(), store.read("targets")
    x = _inputs(parts_folder, paths)
    explainer = Explainer(load_model("parts_vit").model)
    for i in (0, 9, 19):
        for t in (2, 6):
            weights = torch.zeros(1, 50)
            weights[0, pairs[i, t, 0]] += 1
            if pairs[i, t, 1] >= 0:
                weights[0, pairs[i, t, 1]] -= 1
            direct = explainer(x[i:i + 1], target=weights)
            np.testing.assert_allclose(store.read("contribution", [i])[0, t], direct.contribution[0].numpy(),
                                       rtol=1e-4, atol=1e-6)
            np.testing.assert_allclose(store.read("explained", [i])[0, t], direct.logit[0].item(), rtol=1e-5)
    with torch.no_grad():
        np.testing.assert_allclose(store.read("logits"), load_model("parts_vit").model(x).numpy(),
                                   rtol=1e-5, atol=1e-5)


def test_unreadable_image_is_logged_and_failed(folder_with_corrupt_file, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="omenn_kernels.bulk"):
        summary = explain_folder(_config(folder_with_corrupt_file, tmp_path / "s.zarr", targets="predicted",
                                         batch_size=4))
    store = AttributionStore.open(tmp_path / "s.zarr")
    bad = store.paths().index("00/0000b.png")
    status = store.status()
    assert status[bad] == FAILED and (np.delete(status, bad) == EXPLAINED).all()
    assert (summary.explained, summary.failed) == (6, 1) and store.attrs["complete"]
    assert np.isnan(store.read("contribution", [bad])).all() and (store.read("targets", [bad]) == NO_CLASS).all()
    assert "00/0000b.png" in caplog.text and "recorded as failed" in caplog.text
    good = np.delete(np.arange(7), bad)
    np.testing.assert_allclose(store.read("contribution", good).astype(np.float64).sum((-2, -1)),
                               store.read("explained", good), rtol=1e-5, atol=1e-4)


def test_resume_redoes_only_pending_chunks(parts_folder, tmp_path):
    out = tmp_path / "s.zarr"
    explain_folder(_config(parts_folder, out, targets="top2"))
    store = AttributionStore.open(out, writable=True)
    before = store.read("contribution")
    # An interrupted run leaves a chunk without its commit mark (status written last).
    store.group["status"][8:16] = PENDING
    store.group["contribution"][8:16] = 0.0
    # Paths as strings name the same folder and store.
    summary = explain_folder(_config(str(parts_folder), str(out), targets="top2"))
    assert (summary.explained, summary.skipped) == (8, 12)
    assert np.array_equal(AttributionStore.open(out).read("contribution"), before)


def test_auto_compiles_a_long_run_and_a_resumed_run_keeps_its_stores_backend(parts_folder, tmp_path, monkeypatch):
    """``--backend auto`` compiles a run whose eager time pays for a compilation (here every run: a
    compilation's cost set to 0) and runs fused otherwise. A resumed run goes on with the backend its
    store records, whatever a new run would pick, and compiles on the batch it resumes at: that batch
    has the compiled graph's numbers, as in the uninterrupted run (here the graph rounds unlike the
    fused backend: its floating outputs scaled by 1 + 1e-7)."""
    from omenn_kernels.backends import compiled, tiered
    traced = []

    def rounding_otherwise(graph, example):
        traced.append(graph)
        return lambda *inputs: tuple(t * (1 + 1e-7) if t.is_floating_point() else t for t in graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", rounding_otherwise)
    monkeypatch.setattr(tiered, "COMPILE_AFTER_SECONDS", 0.0)
    out = tmp_path / "long.zarr"
    config = _config(parts_folder, out, targets="top2", backend="auto", components=("contribution",))
    explain_folder(config)
    assert len(traced) == 1
    store = AttributionStore.open(out, writable=True)
    assert set(store.read("produced_by")) == {producer_record("compiled", __version__, torch.__version__)}
    before = {name: store.read(name) for name in ("contribution", "explained", "logits")}
    store.group["status"][8:16] = PENDING
    store.group["contribution"][8:16] = 0.0
    monkeypatch.setattr(tiered, "COMPILE_AFTER_SECONDS", float("inf"))  # a new run stays on fused
    summary = explain_folder(config)  # a new process: nothing compiled yet
    assert (summary.explained, summary.skipped) == (8, 12) and len(traced) == 2
    after = AttributionStore.open(out)
    for name, values in before.items():
        assert np.array_equal(after.read(name), values), name

    short = tmp_path / "short.zarr"
    explain_folder(_config(parts_folder, short, targets="top2", backend="auto", components=("contribution",)))
    assert set(AttributionStore.open(short).read("produced_by")) == \
        {producer_record("fused", __version__, torch.__version__)} and len(traced) == 2


def test_other_configuration_is_refused_unless_overwritten(parts_folder, tmp_path):
    out = tmp_path / "s.zarr"
    explain_folder(_config(parts_folder, out, targets="predicted", components=("contribution",)))
    with pytest.raises(StoreMismatchError, match="targets: store has 'predicted', this run 'top2'"):
        explain_folder(_config(parts_folder, out, targets="top2", components=("contribution",)))
    summary = explain_folder(_config(parts_folder, out, targets="top2", components=("contribution",), overwrite=True))
    assert summary.explained == 20 and AttributionStore.open(out).attrs["targets"] == "top2"


def test_bf16_autocast_run(parts_folder, tmp_path):
    explain_folder(_config(parts_folder, tmp_path / "bf16.zarr", targets="label", dtype="bf16",
                           components=("contribution",)))
    explain_folder(_config(parts_folder, tmp_path / "fp32.zarr", targets="label", components=("contribution",)))
    low, full = (AttributionStore.open(tmp_path / name) for name in ("bf16.zarr", "fp32.zarr"))
    assert low.attrs["dtype"] == "bf16"
    c_low, c_full = low.read("contribution").astype(np.float64), full.read("contribution").astype(np.float64)
    # bf16 keeps 8 mantissa bits: the maps agree in shape, the sums to within a few percent.
    assert np.corrcoef(c_low.ravel(), c_full.ravel())[0, 1] > 0.99
    np.testing.assert_allclose(c_low.sum((-2, -1)), low.read("explained"), rtol=0.1)


def test_bad_options(parts_folder, tmp_path):
    with pytest.raises(ValueError, match="batch size"):
        explain_folder(_config(parts_folder, tmp_path / "a", batch_size=0))
    with pytest.raises(ValueError, match="dtype"):
        explain_folder(_config(parts_folder, tmp_path / "b", dtype="fp8"))
    with pytest.raises(ValueError, match="unknown model"):
        explain_folder(_config(parts_folder, tmp_path / "c", model="no_such_model"))
    with pytest.raises(ValueError, match="needs weights"):
        explain_folder(_config(parts_folder, tmp_path / "d", model="resnet18"))
    assert not any(tmp_path.iterdir())


def test_read_ahead_keeps_order_raises_reading_errors_and_stops_on_close():
    assert list(_read_ahead(iter(range(7)), depth=2)) == list(range(7))

    def failing():
        yield 0
        raise OSError("disk gone")
    reading = _read_ahead(failing())
    assert next(reading) == 0
    with pytest.raises(OSError, match="disk gone"):
        next(reading)

    endless = _read_ahead(iter(int, 1), depth=2)  # never ends by itself
    assert next(endless) == 0
    endless.close()
    assert not any(t.name == "omenn-image-reader" and t.is_alive() for t in threading.enumerate())


def test_the_compiled_backend_writes_the_reference_store(multi_target_store, parts_folder, tmp_path, monkeypatch):
    """``--backend compiled``: every batch after the first runs the traced explanation, target
    resolution (predicted, label, top-k, contrasts) included, with each batch's labels as inputs."""
    from omenn_kernels.backends import compiled, fused
    traced = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: traced.append(graph) or graph)
    eager = []
    explain_batch = fused.explain_batch
    monkeypatch.setattr(fused, "explain_batch",
                        lambda *args, **kwargs: eager.append(1) or explain_batch(*args, **kwargs))
    out = tmp_path / "compiled.zarr"
    summary = explain_folder(_config(parts_folder, out, backend="compiled"))
    assert summary.explained == 20 and len(traced) == 1
    assert len(eager) == 2  # the first batch's eager run and its trace; the other two batches ran the graph
    _, reference = multi_target_store
    store = AttributionStore.open(out)
    record = producer_record("compiled", __version__, torch.__version__)
    assert store.read("produced_by").tolist() == [record] * 20 and store.attrs["produced_by"] == [record]
    assert np.array_equal(store.read("targets"), reference.read("targets"))
    for name in ("contribution", "weighted_input", "bias", "explained", "logits"):
        np.testing.assert_allclose(store.read(name), reference.read(name), rtol=1e-4, atol=1e-5, err_msg=name)
