"""The attribution store: chunked zarr arrays of explanations, written batch by batch.

Layout (a zarr v3 group; N images, T targets, K classes, C channels, H×W pixels):

============== ================ =======================================================
array          shape            what
============== ================ =======================================================
contribution   (N, T, H, W)     ``C = Σ_c C_w ⊙ X + C_b`` (float16 or float32)
weighted_input (N, T, C, H, W)  ``C_w ⊙ X`` (optional)
bias           (N, T, H, W)     ``C_b`` (optional)
explained      (N, T)           the explained read-out ``logit_pos − logit_neg`` (float32)
logits         (N, K)           all logits (float32)
targets        (N, T, 2)        class pairs (positive, negative); negative -1 if none
labels         (N,)             folder label, -1 if none
paths          (N,)             image path relative to the source folder
status         (N,)             0 pending, 1 explained, 2 failed (unreadable image)
============== ================ =======================================================

Every array is chunked by ``batch_size`` images along N, and the run writes one whole
chunk per batch: first the data, then ``status``. zarr writes each chunk file
atomically (a temporary file renamed into place), so a process killed at any moment
leaves every batch either marked done with all its data, or not marked — and a resumed
run redoes exactly the unmarked batches. Processes of a distributed run own disjoint
chunks. The group's attributes hold the run's signature (model, weights hash,
targets, dtype, backend, ...), checked when a run resumes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
import zarr

FORMAT_VERSION = 1
PENDING, EXPLAINED, FAILED = 0, 1, 2
COMPONENTS = ("contribution", "weighted_input", "bias")
STORE_DTYPES = {"float16": np.float16, "float32": np.float32}

# Attributes that must match for a run to resume into an existing store.
SIGNATURE_KEYS = ("format_version", "model", "weights_sha256", "targets", "target_count", "classes",
                  "image_shape", "batch_size", "dtype", "backend", "store_dtype", "components",
                  "num_images", "paths_sha256")


class StoreMismatchError(ValueError):
    """An existing store was written by a different run configuration."""


def check_components(components: Iterable[str]) -> None:
    """Raise ValueError unless ``components`` include ``contribution`` and are all known."""
    components = tuple(components)
    if "contribution" not in components or set(components) - set(COMPONENTS):
        raise ValueError(f"components must include 'contribution' and be among {list(COMPONENTS)}; "
                         f"got {list(components)}")


def check_store_dtype(store_dtype: str) -> None:
    """Raise ValueError unless ``store_dtype`` is one a store can hold."""
    if store_dtype not in STORE_DTYPES:
        raise ValueError(f"store dtype must be one of {list(STORE_DTYPES)}, got {store_dtype!r}")


def paths_digest(paths: Iterable[str]) -> str:
    """sha256 of the image list, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode("utf-8") + b"\0")
    return digest.hexdigest()


class AttributionStore:
    """An attribution store on disk (see the module docstring for the layout)."""

    def __init__(self, group: zarr.Group) -> None:
        self.group = group

    @classmethod
    def create(cls, path: str | Path, *, paths: list[str], labels: list[int], target_count: int,
               classes: int, image_shape: tuple[int, int, int], batch_size: int, store_dtype: str,
               components: tuple[str, ...], attributes: Mapping[str, object]) -> "AttributionStore":
        """Create an empty store at ``path`` (which must not exist).

        ``attributes`` are recorded as the group's attributes, next to the signature
        keys derived here (shapes, dtype, components, digest of ``paths``).
        """
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path} exists; resume it or remove it first")
        check_components(components)
        check_store_dtype(store_dtype)
        if len(paths) != len(labels) or not paths:
            raise ValueError("the store needs one label per path and at least one image")
        n, (channels, height, width) = len(paths), image_shape
        group = zarr.open_group(path, mode="w-")
        group.attrs.update({
            **attributes, "format_version": FORMAT_VERSION, "target_count": target_count,
            "classes": classes, "image_shape": list(image_shape), "batch_size": batch_size,
            "store_dtype": store_dtype, "components": list(components), "num_images": n,
            "paths_sha256": paths_digest(paths), "complete": False,
        })
        value = STORE_DTYPES[store_dtype]
        shapes = {
            "contribution": ((n, target_count, height, width), value),
            "weighted_input": ((n, target_count, channels, height, width), value),
            "bias": ((n, target_count, height, width), value),
            "explained": ((n, target_count), np.float32),
            "logits": ((n, classes), np.float32),
            "targets": ((n, target_count, 2), np.int32),
        }
        for name, (shape, dtype) in shapes.items():
            if name in COMPONENTS and name not in components:
                continue
            group.create_array(name, shape=shape, chunks=(batch_size, *shape[1:]), dtype=dtype,
                               fill_value=np.nan if np.issubdtype(dtype, np.floating) else -1)
        group.create_array("labels", shape=(n,), chunks=(batch_size,), dtype=np.int32, fill_value=-1)
        group.create_array("status", shape=(n,), chunks=(batch_size,), dtype=np.int8, fill_value=PENDING)
        group.create_array("paths", shape=(n,), chunks=(batch_size,), dtype=str)
        group["labels"][:] = np.asarray(labels, dtype=np.int32)
        group["paths"][:] = np.asarray(paths, dtype=object)
        return cls(group)

    @classmethod
    def open(cls, path: str | Path, *, writable: bool = False) -> "AttributionStore":
        """Open an existing store (read-only unless ``writable``)."""
        path = Path(path)
        if not (path / "zarr.json").is_file():
            raise FileNotFoundError(f"no attribution store at {path}")
        group = zarr.open_group(path, mode="r+" if writable else "r")
        version = group.attrs.get("format_version")
        if version != FORMAT_VERSION:
            raise ValueError(f"{path} has store format {version!r}; this version reads {FORMAT_VERSION}")
        return cls(group)

    @property
    def attrs(self) -> dict:
        return dict(self.group.attrs)

    @property
    def num_images(self) -> int:
        return int(self.group.attrs["num_images"])

    @property
    def batch_size(self) -> int:
        return int(self.group.attrs["batch_size"])

    @property
    def num_chunks(self) -> int:
        return -(-self.num_images // self.batch_size)

    def chunk_range(self, chunk: int) -> range:
        """The image indices of chunk ``chunk``."""
        return range(chunk * self.batch_size, min((chunk + 1) * self.batch_size, self.num_images))

    def check_signature(self, signature: Mapping[str, object]) -> None:
        """Raise :class:`StoreMismatchError` naming every key where ``signature`` differs."""
        stored = self.attrs
        differing = [f"{key}: store has {stored.get(key)!r}, this run {signature[key]!r}"
                     for key in SIGNATURE_KEYS if key in signature and stored.get(key) != signature[key]]
        if differing:
            raise StoreMismatchError("the store was written by a different run; " + "; ".join(differing) +
                                     " (write to a new store, or pass --overwrite to replace it)")

    def status(self) -> np.ndarray:
        """(N,) int8: PENDING, EXPLAINED or FAILED per image."""
        return self.group["status"][:]

    def pending_chunks(self) -> list[int]:
        """Chunks with at least one image not yet explained or failed."""
        pending = self.status() == PENDING
        return [c for c in range(self.num_chunks) if bool(pending[self.chunk_range(c)].any())]

    def write_chunk(self, chunk: int, arrays: Mapping[str, np.ndarray], status: np.ndarray) -> None:
        """Write one chunk's data arrays, then its status (the commit mark)."""
        rows = self.chunk_range(chunk)
        region = slice(rows.start, rows.stop)
        for name, values in arrays.items():
            self.group[name][region] = values
        self.group["status"][region] = status

    def read(self, name: str, indices: slice | list[int] | np.ndarray | None = None) -> np.ndarray:
        """Array ``name`` (all images, or the images ``indices``)."""
        if name not in self.group:
            raise KeyError(f"the store has no array {name!r}; it has {sorted(self.group.array_keys())}")
        array = self.group[name]
        if indices is None:
            return array[:]
        if isinstance(indices, slice):
            return array[indices]
        return array.get_orthogonal_selection(np.asarray(indices, dtype=np.int64))

    def paths(self) -> list[str]:
        return [str(p) for p in self.group["paths"][:]]

    def summary(self) -> dict[str, int]:
        """Counts of explained, failed and pending images."""
        status = self.status()
        return {"explained": int((status == EXPLAINED).sum()), "failed": int((status == FAILED).sum()),
                "pending": int((status == PENDING).sum())}

    def mark_complete(self) -> None:
        """Record in the attributes whether every image is explained or failed."""
        self.group.attrs["complete"] = self.summary()["pending"] == 0
