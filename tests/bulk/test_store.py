"""The attribution store: layout, signature checks, chunk commits."""

import numpy as np
import pytest

from omenn_kernels.bulk.store import EXPLAINED, FAILED, PENDING, AttributionStore, StoreMismatchError


def _create(path, **overrides):
    options = dict(paths=[f"img{i}.png" for i in range(7)], labels=list(range(7)), target_count=2, classes=5,
                   image_shape=(3, 4, 6), batch_size=3, store_dtype="float16",
                   components=("contribution", "bias"), attributes={"model": "m", "weights_sha256": "abc"})
    options.update(overrides)
    return AttributionStore.create(path, **options)


def test_layout_and_fill(tmp_path):
    store = _create(tmp_path / "s.zarr")
    assert store.num_chunks == 3 and list(store.chunk_range(2)) == [6]
    assert store.read("contribution").shape == (7, 2, 4, 6) and store.read("contribution").dtype == np.float16
    assert store.read("bias").shape == (7, 2, 4, 6) and "weighted_input" not in store.group
    assert store.read("logits").shape == (7, 5) and store.read("targets").shape == (7, 2, 2)
    assert np.isnan(store.read("contribution")).all() and (store.status() == PENDING).all()
    assert store.paths() == [f"img{i}.png" for i in range(7)]
    assert store.read("labels").tolist() == list(range(7))
    assert store.attrs["model"] == "m" and store.attrs["complete"] is False
    with pytest.raises(FileExistsError):
        _create(tmp_path / "s.zarr")
    with pytest.raises(KeyError, match="no array 'weighted_input'"):
        store.read("weighted_input")


def test_write_chunk_commits_status_and_pending(tmp_path):
    store = _create(tmp_path / "s.zarr")
    rng = np.random.default_rng(0)
    contribution = rng.standard_normal((3, 2, 4, 6)).astype(np.float16)
    store.write_chunk(1, {"contribution": contribution}, np.array([EXPLAINED, FAILED, EXPLAINED], np.int8))
    reopened = AttributionStore.open(tmp_path / "s.zarr")
    assert np.array_equal(reopened.read("contribution", slice(3, 6)), contribution)
    assert np.array_equal(reopened.read("contribution", [4, 3])[1], contribution[0])
    assert reopened.pending_chunks() == [0, 2]
    assert reopened.summary() == {"explained": 2, "failed": 1, "pending": 4}


def test_signature_mismatch_names_the_keys(tmp_path):
    store = _create(tmp_path / "s.zarr")
    store.check_signature({"model": "m", "batch_size": 3})
    with pytest.raises(StoreMismatchError, match="model: store has 'm', this run 'other'.*batch_size"):
        store.check_signature({"model": "other", "batch_size": 4})


def test_bad_create_and_open(tmp_path):
    with pytest.raises(ValueError, match="components"):
        _create(tmp_path / "a.zarr", components=("bias",))
    with pytest.raises(ValueError, match="store dtype"):
        _create(tmp_path / "b.zarr", store_dtype="int8")
    with pytest.raises(FileNotFoundError, match="no attribution store"):
        AttributionStore.open(tmp_path / "missing.zarr")
