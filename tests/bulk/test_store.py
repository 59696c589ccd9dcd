"""The attribution store: layout, signature checks, chunk commits."""

import numpy as np
import pytest
import zarr

from omenn_kernels.bulk.store import (EXPLAINED, FAILED, FORMAT_VERSION, PENDING, WRITTEN_BY, AttributionStore,
                                      StoreMismatchError, check_replaceable, is_attribution_store, remove_leftovers)
from omenn_kernels.errors import OptionError, StoreError


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
    with pytest.raises(StoreError, match="s.zarr already exists"):
        _create(tmp_path / "s.zarr")
    with pytest.raises(StoreError, match="no array 'weighted_input'"):
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
    with pytest.raises(OptionError, match="components"):
        _create(tmp_path / "a.zarr", components=("bias",))
    with pytest.raises(OptionError, match="store dtype"):
        _create(tmp_path / "b.zarr", store_dtype="int8")
    with pytest.raises(StoreError, match="no attribution store at .*missing.zarr"):
        AttributionStore.open(tmp_path / "missing.zarr")


def test_only_a_store_of_this_library_is_replaceable(tmp_path):
    ours = tmp_path / "ours.zarr"
    _create(ours)
    assert is_attribution_store(ours) and AttributionStore.open(ours).attrs["written_by"] == WRITTEN_BY
    foreign = tmp_path / "foreign.zarr"
    zarr.open_group(foreign, mode="w-").attrs.update({"format_version": FORMAT_VERSION})
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "zarr.json").write_text("[1, 2")
    a_file = tmp_path / "file.zarr"
    a_file.write_text("data")
    link = tmp_path / "link.zarr"
    link.symlink_to(ours)
    for path, reason in [(foreign, "is not an attribution store"), (garbage, "is not an attribution store"),
                         (a_file, "is a file"), (link, "is a symbolic link")]:
        # A link to a store reads as one, and is still not replaced: the link would go, not the store.
        assert is_attribution_store(path) == (path == link)
        with pytest.raises(StoreError, match=f"--overwrite does not replace {path}: it {reason}"):
            check_replaceable(path)
        with pytest.raises(StoreError, match=f"--overwrite does not replace {path}"):
            _create(path, replace=True)
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "absent", tmp_path / "empty", ours):
        check_replaceable(path)
    rng = np.random.default_rng(1)
    store = AttributionStore.open(ours, writable=True)
    store.write_chunk(0, {"contribution": rng.standard_normal((3, 2, 4, 6)).astype(np.float16)},
                      np.full(3, EXPLAINED, np.int8))
    replaced = _create(ours, replace=True, attributes={"model": "new"})
    assert replaced.attrs["model"] == "new" and (replaced.status() == PENDING).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file.zarr", "foreign.zarr", "garbage",
                                                          "link.zarr", "ours.zarr"]


def test_leftovers_of_killed_runs_are_removed_and_nothing_else(tmp_path):
    store = tmp_path / "s.zarr"
    leftovers = [tmp_path / ".s.zarr.creating-123", tmp_path / ".s.zarr.removing-7"]
    kept = [tmp_path / ".s.zarr.creating-abc", tmp_path / ".t.zarr.creating-1", tmp_path / "s.zarr.creating-5"]
    for folder in leftovers + kept:
        (folder / "sub").mkdir(parents=True)
    assert sorted(remove_leftovers(store)) == sorted(leftovers)
    assert sorted(tmp_path.iterdir()) == sorted(kept)
