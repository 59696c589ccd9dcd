"""A resumed run reads back the batches marked done and explains damaged ones again; ``show`` names a damaged file.

A store of 4 images in 2 batches (reference backend) is shared; each test damages a copy.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from omenn_kernels.bulk import AttributionStore, RunConfig, explain_folder
from omenn_kernels.cli import EXIT_OK, EXIT_USAGE, main
from omenn_kernels.demo import draw_images

ARRAYS = ("contribution", "explained", "logits", "targets", "status", "labels", "produced_by")


def _config(source: Path, out: Path, **overrides) -> RunConfig:
    options = dict(model="parts_vit", targets="predicted", batch_size=2, backend="reference",
                   store_dtype="float32", device="cpu", workers=0, progress=False)
    options.update(overrides)
    return RunConfig(source=source, out=out, **options)


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("verify") / "images"
    draw_images(folder, 4)
    return folder


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "store.zarr"
    explain_folder(_config(images, out))
    return out


@pytest.fixture
def copy(reference, tmp_path) -> Path:
    out = tmp_path / "store.zarr"
    shutil.copytree(reference, out)
    return out


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _assert_same(expected: Path, actual: Path) -> None:
    left, right = AttributionStore.open(expected), AttributionStore.open(actual)
    assert left.paths() == right.paths()
    for name in ARRAYS:
        assert np.array_equal(left.read(name), right.read(name), equal_nan=name != "produced_by"), name


def test_damaged_batches_marked_done_are_explained_again(images, reference, copy, caplog):
    store = AttributionStore.open(copy)
    _truncate(store.chunk_file("status", 0))  # batch 0: its commit mark does not decode
    store.chunk_file("explained", 1).unlink()  # batch 1: a data file is gone
    store.chunk_file("paths", 1).write_bytes(b"\x28\xb5\x2f\xfd garbage")  # written at creation: rewritten
    with caplog.at_level(logging.WARNING, logger="omenn_kernels.bulk"):
        summary = explain_folder(_config(images, copy))
    assert summary.damaged == [0, 1] and (summary.explained, summary.skipped) == (4, 0)
    assert f"its status chunk file {store.chunk_file('status', 0)} cannot be decoded" in caplog.text
    assert (f"the chunk file {store.chunk_file('explained', 1)} of 'explained' holds no values for the explained "
            "image 2") in caplog.text
    assert f"the chunk file {store.chunk_file('paths', 1)} of 'paths' (images 2–3) is damaged" in caplog.text
    _assert_same(reference, copy)


def test_a_truncated_chunk_is_explained_again_unless_not_verified_and_show_names_it(images, reference, copy,
                                                                                    tmp_path, capsys):
    contribution = AttributionStore.open(copy).chunk_file("contribution", 1)
    _truncate(contribution)
    summary = explain_folder(_config(images, copy, verify=False))
    assert (summary.explained, summary.damaged) == (0, [])  # not read back: still damaged
    assert main(["show", str(copy), "--out", str(tmp_path / "png"), "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"the chunk file {contribution} of the array 'contribution' (images 2–3) "
                                     "cannot be decoded") in err
    assert main(["explain", str(images), "--out", str(copy), "--model", "parts_vit", "--targets", "predicted",
                 "--batch-size", "2", "--backend", "reference", "--store-dtype", "float32", "--device", "cpu",
                 "--workers", "0", "-q"]) == EXIT_OK
    _assert_same(reference, copy)
