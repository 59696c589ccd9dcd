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
produced_by    (N,)             what explained the image's batch: backend and versions
                                (see :func:`producer_record`)
============== ================ =======================================================

Every array is chunked by ``batch_size`` images along N, and the run writes one whole
chunk per batch: first the data, then ``status``. zarr writes each chunk file
atomically (a temporary file renamed into place), so a process killed at any moment
leaves every batch either marked done with all its data, or not marked — and a resumed
run redoes exactly the unmarked batches. Processes of a distributed run own disjoint
chunks. The group's attributes hold the run's signature (model, weights hash,
targets, dtype, ...), checked when a run resumes.

``produced_by`` records, per batch, the backend that actually explained it (``compiled``
falls back to ``fused`` where it cannot compile) and the versions of omenn_kernels and
torch, so that a resumed run can refuse to mix numbers of another backend or version into
the store (:mod:`.run`). The group attribute ``backend`` is the backend the creating run
asked for; the attribute ``produced_by`` lists the records of the explained images once a
run ends. Stores written before these records were kept have no ``produced_by`` array.

A resumed run checks the chunks of the batches marked done (:meth:`AttributionStore.verify`):
a chunk file that does not decode, or one that is missing where an explained image's data
must be, marks its batch pending again, to be explained anew; damaged ``paths`` and
``labels`` chunks are rewritten from the image list.

Creation is atomic: :meth:`AttributionStore.create` builds the whole store (every array,
the paths, the labels and the attributes) in a hidden sibling folder
``.<name>.creating-<pid>`` and renames it into place, so a process killed while creating
leaves either no store or a complete empty one. A store is marked as written by this
library (attribute ``written_by``); replacing a store (``--overwrite``) removes only a
folder so marked, and never anything else. Leftover hidden folders of killed runs are
removed by the next run that holds the store's lock (:mod:`.lock`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np
import zarr

from ..errors import OptionError, StoreError, first_line

log = logging.getLogger("omenn_kernels.bulk")

FORMAT_VERSION = 1
# The attribute that marks a store as written by this library: only such a folder is ever removed.
WRITTEN_BY = "omenn_kernels"
PENDING, EXPLAINED, FAILED = 0, 1, 2
COMPONENTS = ("contribution", "weighted_input", "bias")
STORE_DTYPES = {"float16": np.float16, "float32": np.float32}

# Attributes that must match for a run to resume into an existing store.
# The backend is not among them: what produced each batch is checked instead (``produced_by``).
SIGNATURE_KEYS = ("format_version", "model", "weights_sha256", "targets", "target_count", "classes",
                  "image_shape", "batch_size", "dtype", "store_dtype", "components",
                  "num_images", "paths_sha256")


# Arrays every store has, besides the optional ones of COMPONENTS.
REQUIRED_ARRAYS = ("explained", "logits", "targets", "labels", "status", "paths")
# Per image, what explained its batch; absent from stores written before it was kept.
PRODUCED_BY = "produced_by"
PRODUCER_FIELDS = ("backend", "omenn_kernels", "torch")
# Hidden sibling folders of a store being created or replaced: ``.<name>.creating-<pid>``.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(creating|removing)-\d+")
# What zarr's codecs raise on a chunk file whose bytes do not decode (truncated, overwritten).
_DECODE_ERRORS = (RuntimeError, ValueError, TypeError, EOFError)


class StoreMismatchError(StoreError):
    """An existing store was written by a different run configuration."""


def check_components(components: Iterable[str]) -> None:
    """Raise OptionError unless ``components`` include ``contribution`` and are all known."""
    components = tuple(components)
    if "contribution" not in components or set(components) - set(COMPONENTS):
        raise OptionError(f"components must include 'contribution' and be among {list(COMPONENTS)}; "
                         f"got {list(components)}")


def check_store_dtype(store_dtype: str) -> None:
    """Raise OptionError unless ``store_dtype`` is one a store can hold."""
    if store_dtype not in STORE_DTYPES:
        raise OptionError(f"store dtype must be one of {list(STORE_DTYPES)}, got {store_dtype!r}")


def producer_record(backend: str, omenn_kernels: str, torch: str) -> str:
    """What explained a batch, as ``produced_by`` holds it: ``backend=B omenn_kernels=V torch=V``."""
    return f"backend={backend} omenn_kernels={omenn_kernels} torch={torch}"


def parse_producer(record: str) -> dict[str, str]:
    """The fields of a :func:`producer_record` (empty for the empty record)."""
    return dict(part.partition("=")[::2] for part in record.split())


def paths_digest(paths: Iterable[str]) -> str:
    """sha256 of the image list, in order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.encode("utf-8") + b"\0")
    return digest.hexdigest()


def store_location(path: str | Path) -> Path:
    """``path`` made absolute and normalized, so that the store has a name and a parent folder.

    Raises:
        StoreError: ``path`` is a file system root, which cannot be a store.
    """
    location = Path(os.path.abspath(path))
    if not location.name:
        raise StoreError(f"{path} is the root of the file system and cannot be an attribution store; "
                         "choose another --out")
    return location


def is_attribution_store(path: str | Path) -> bool:
    """Whether ``path`` is a folder whose ``zarr.json`` marks it as a store written by this library."""
    metadata = Path(path) / "zarr.json"
    try:
        document = json.loads(metadata.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(document, dict) or document.get("node_type") != "group":
        return False
    attributes = document.get("attributes")
    return (isinstance(attributes, dict) and attributes.get("written_by") == WRITTEN_BY
            and attributes.get("format_version") == FORMAT_VERSION)


def _is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def check_replaceable(path: str | Path) -> None:
    """Raise :class:`StoreError` unless ``path`` is absent, an empty folder, or a store written by this library.

    This is what ``--overwrite`` may remove: never a file, a link, or a folder of anything else.
    """
    path = Path(path)
    if not os.path.lexists(path) or _is_empty_folder(path):
        return
    if path.is_symlink():
        raise StoreError(f"--overwrite does not replace {path}: it is a symbolic link; give the store's own path")
    if not path.is_dir():
        raise StoreError(f"--overwrite does not replace {path}: it is a file, not an attribution store")
    if not is_attribution_store(path):
        raise StoreError(f"--overwrite does not replace {path}: it is not an attribution store written by "
                         f"{WRITTEN_BY} (format {FORMAT_VERSION}); remove it yourself or choose another --out")


def remove_leftovers(path: str | Path) -> list[Path]:
    """Remove the hidden folders that killed runs left while creating or replacing the store ``path``.

    Call only while holding the store's lock: a live run's folders look the same.
    """
    path = store_location(path)
    if not path.parent.is_dir():
        return []
    removed = []
    for candidate in path.parent.iterdir():
        match = _TEMPORARY.fullmatch(candidate.name)
        if match and match["name"] == path.name and candidate.is_dir() and not candidate.is_symlink():
            log.info("removing %s, left by a run that was killed while creating or replacing %s", candidate, path)
            shutil.rmtree(candidate)
            removed.append(candidate)
    return removed


class AttributionStore:
    """An attribution store on disk (see the module docstring for the layout)."""

    def __init__(self, group: zarr.Group, path: str | Path) -> None:
        self.group = group
        self.path = Path(path)

    @classmethod
    def create(cls, path: str | Path, *, paths: list[str], labels: list[int], target_count: int,
               classes: int, image_shape: tuple[int, int, int], batch_size: int, store_dtype: str,
               components: tuple[str, ...], attributes: Mapping[str, object],
               replace: bool = False) -> "AttributionStore":
        """Create an empty store at ``path``, atomically.

        ``path`` must not exist, or be an empty folder; with ``replace``, it may also be a
        store written by this library, which the new store replaces (see
        :func:`check_replaceable`). The store is built under a hidden sibling name and
        renamed into place, so ``path`` never holds a partly created store.
        ``attributes`` are recorded as the group's attributes, next to the signature
        keys derived here (shapes, dtype, components, digest of ``paths``).

        Raises:
            StoreError: ``path`` exists and may not be replaced, or its folder cannot be written.
            OptionError: unknown components or store dtype.
        """
        path = store_location(path)
        check_components(components)
        check_store_dtype(store_dtype)
        if len(paths) != len(labels) or not paths:
            raise StoreError(f"the store {path} needs one label per path and at least one image; got "
                             f"{len(paths)} paths and {len(labels)} labels")
        if replace:
            check_replaceable(path)
        elif os.path.lexists(path) and not _is_empty_folder(path):
            raise StoreError(f"{path} already exists and is not an empty folder; choose another --out "
                             "(or, if it is a store, resume it or pass --overwrite to replace it)")
        building = path.with_name(f".{path.name}.creating-{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            if building.exists():  # left by a killed process that had this process id
                shutil.rmtree(building)
            cls._build(building, paths=paths, labels=labels, target_count=target_count, classes=classes,
                       image_shape=image_shape, batch_size=batch_size, store_dtype=store_dtype,
                       components=components, attributes=attributes)
            if replace and is_attribution_store(path):
                # The old store leaves the path only when the new one is complete.
                removing = path.with_name(f".{path.name}.removing-{os.getpid()}")
                log.info("replacing the existing store %s (--overwrite)", path)
                os.rename(path, removing)
                os.rename(building, path)
            else:
                os.rename(building, path)  # atomic; it also replaces an empty folder
        except OSError as error:
            shutil.rmtree(building, ignore_errors=True)
            raise StoreError(f"cannot create the store {path} in the folder {path.parent}: "
                             f"{error.strerror or error}") from error
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise
        if replace:
            # What is left of the old store, should this fail, is removed by the next run (remove_leftovers).
            shutil.rmtree(path.with_name(f".{path.name}.removing-{os.getpid()}"), ignore_errors=True)
        return cls.open(path, writable=True)

    @staticmethod
    def _build(path: Path, *, paths: list[str], labels: list[int], target_count: int, classes: int,
               image_shape: tuple[int, int, int], batch_size: int, store_dtype: str,
               components: tuple[str, ...], attributes: Mapping[str, object]) -> None:
        """Write a complete empty store (all arrays, paths, labels, attributes) at ``path``."""
        n, (channels, height, width) = len(paths), image_shape
        group = zarr.open_group(path, mode="w-")
        group.attrs.update({
            **attributes, "format_version": FORMAT_VERSION, "written_by": WRITTEN_BY,
            "target_count": target_count, "classes": classes, "image_shape": list(image_shape),
            "batch_size": batch_size, "store_dtype": store_dtype, "components": list(components),
            "num_images": n, "paths_sha256": paths_digest(paths), "complete": False,
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
        group.create_array(PRODUCED_BY, shape=(n,), chunks=(batch_size,), dtype=str)
        group["labels"][:] = np.asarray(labels, dtype=np.int32)
        group["paths"][:] = np.asarray(paths, dtype=object)

    @classmethod
    def open(cls, path: str | Path, *, writable: bool = False) -> "AttributionStore":
        """Open an existing store (read-only unless ``writable``), checking that its metadata is whole.

        Raises:
            StoreError: no store at ``path``, another format version, or metadata that
                cannot be read or is missing (the message names the file).
        """
        path = Path(path)
        metadata = path / "zarr.json"
        if not metadata.is_file():
            raise StoreError(f"no attribution store at {path} (no file {metadata})")
        try:
            group = zarr.open_group(path, mode="r+" if writable else "r")
            version = group.attrs.get("format_version")
            components = group.attrs.get("components")
            num_images = group.attrs.get("num_images")
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise StoreError(f"the store metadata {metadata} cannot be read: {error}") from error
        except OSError as error:
            raise StoreError(f"cannot open the store {path}: {error.strerror or error}") from error
        if version != FORMAT_VERSION:
            raise StoreError(f"{path} has store format {version!r}; this version reads {FORMAT_VERSION}")
        if not isinstance(components, list) or "contribution" not in components \
                or set(components) - set(COMPONENTS) or not isinstance(num_images, int):
            raise StoreError(f"the store metadata {metadata} lacks valid 'components' and 'num_images' "
                             f"attributes (components {components!r}, num_images {num_images!r})")
        optional = (PRODUCED_BY,) if (path / PRODUCED_BY / "zarr.json").is_file() else ()
        for name in (*components, *REQUIRED_ARRAYS, *optional):
            array_metadata = path / name / "zarr.json"
            if not array_metadata.is_file():
                raise StoreError(f"the store {path} is incomplete: it has no array {name!r} (no file "
                                 f"{array_metadata}); pass --overwrite to replace it")
            try:
                length = group[name].shape[0]
            except (ValueError, TypeError, KeyError, AttributeError, IndexError) as error:
                raise StoreError(f"the array metadata {array_metadata} cannot be read: {error}") from error
            if length != num_images:
                raise StoreError(f"the array metadata {array_metadata} gives {length} images, the store "
                                 f"{num_images}")
        return cls(group, path)

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
        return self._read("status")

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
        """Array ``name`` (all images, or the images ``indices``).

        Raises:
            StoreError: no such array, or a chunk file of it that cannot be read or decoded
                (the message names the file).
        """
        if name not in self.group:
            raise StoreError(f"the store has no array {name!r}; it has {sorted(self.group.array_keys())}")
        return self._read(name, indices)

    def _read(self, name: str, indices: slice | list[int] | np.ndarray | None = None) -> np.ndarray:
        array = self.group[name]
        try:
            if indices is None:
                return array[:]
            if isinstance(indices, slice):
                return array[indices]
            return array.get_orthogonal_selection(np.asarray(indices, dtype=np.int64))
        except _DECODE_ERRORS as error:
            rows = range(self.num_images)
            chosen = rows if indices is None else rows[indices] if isinstance(indices, slice) else indices
            message = self._damage_message(name, chosen)
            if message is None:  # every chunk decodes: not a damaged file
                raise
            raise StoreError(message) from error
        except OSError as error:
            raise StoreError(f"cannot read the array {name!r} of the store {self.path}: "
                             f"{error.strerror or error}") from error

    def _damage_message(self, name: str, images: Iterable[int]) -> str | None:
        """A sentence naming the first chunk file of ``name`` among those of ``images`` that does not decode."""
        for chunk in sorted({int(i) // self.batch_size for i in images}):
            error = self._undecodable(name, chunk)
            if error is not None:
                rows = self.chunk_range(chunk)
                return (f"the store {self.path} is damaged: the chunk file {self.chunk_file(name, chunk)} of the "
                        f"array {name!r} (images {rows.start}–{rows.stop - 1}) cannot be decoded "
                        f"({first_line(error)}); run the omenn explain command that wrote the store again: it "
                        "explains those images anew")
        return None

    def _undecodable(self, name: str, chunk: int) -> BaseException | None:
        """The error decoding chunk ``chunk`` of array ``name`` raises, or None if it decodes."""
        rows = self.chunk_range(chunk)
        try:
            self.group[name][rows.start:rows.stop]
        except _DECODE_ERRORS as error:
            return error
        return None

    def chunk_file(self, name: str, chunk: int) -> Path:
        """The file of chunk ``chunk`` of array ``name`` (absent while the chunk holds only the fill value)."""
        array = self.group[name]
        return self.path / name / array.metadata.encode_chunk_key((chunk,) + (0,) * (array.ndim - 1))

    def paths(self) -> list[str]:
        return [str(p) for p in self._read("paths")]

    def summary(self) -> dict[str, int]:
        """Counts of explained, failed and pending images."""
        status = self.status()
        return {"explained": int((status == EXPLAINED).sum()), "failed": int((status == FAILED).sum()),
                "pending": int((status == PENDING).sum())}

    def producers(self) -> dict[str, int]:
        """How many explained images each :func:`producer_record` explained; the empty record counts
        the explained images of a store that has no ``produced_by`` array."""
        explained = self.status() == EXPLAINED
        if PRODUCED_BY not in self.group:
            return {"": int(explained.sum())} if explained.any() else {}
        return dict(Counter(str(record) for record in self._read(PRODUCED_BY)[explained]))

    def add_producer_array(self) -> None:
        """Give a store written without ``produced_by`` the array (empty records: not known)."""
        if PRODUCED_BY not in self.group:
            self.group.create_array(PRODUCED_BY, shape=(self.num_images,), chunks=(self.batch_size,), dtype=str)

    def verify(self, paths: Sequence[str], labels: Sequence[int]) -> list[int]:
        """Check the chunks of the batches marked done; mark damaged ones pending again; return them.

        A done chunk is damaged where a chunk file of its data or its status does not decode,
        or where an explained image has no values (a missing chunk file reads as the fill
        value: NaN maps, class -1). Every data chunk of the done batches is read once. The
        ``paths`` and ``labels`` of every chunk, written when the store was created, are
        compared with ``paths`` and ``labels`` (the run's image list, whose digest the store's
        signature matched) and rewritten where they differ or do not decode. Each repair is
        logged as a warning.
        """
        expected = {"paths": np.asarray(list(paths), dtype=object), "labels": np.asarray(list(labels), np.int32)}
        data = [name for name in (*COMPONENTS, "explained", "logits", "targets", PRODUCED_BY) if name in self.group]
        damaged = []
        for chunk in range(self.num_chunks):
            rows = self.chunk_range(chunk)
            region = slice(rows.start, rows.stop)
            for name, values in expected.items():
                if not self._holds(name, region, values[region]):
                    log.warning("the store %s: the chunk file %s of %r (images %d–%d) is damaged; rewriting it "
                                "from the image list", self.path, self.chunk_file(name, chunk), name,
                                rows.start, rows.stop - 1)
                    self.group[name][region] = values[region]
            reason = self._chunk_damage(chunk, data)
            if reason is not None:
                log.warning("the store %s: batch %d (images %d–%d) is marked done but %s; it is explained again",
                            self.path, chunk, rows.start, rows.stop - 1, reason)
                self.group["status"][region] = np.full(len(rows), PENDING, np.int8)
                damaged.append(chunk)
        return damaged

    def _holds(self, name: str, region: slice, values: np.ndarray) -> bool:
        """Whether the chunk of ``name`` at ``region`` decodes to ``values``."""
        try:
            stored = self.group[name][region]
        except _DECODE_ERRORS:
            return False
        if values.dtype == object:
            return [str(v) for v in stored] == [str(v) for v in values]
        return np.array_equal(stored, values)

    def _chunk_damage(self, chunk: int, data: Sequence[str]) -> str | None:
        """Why the done chunk ``chunk`` is damaged, or None if it is whole or not done."""
        rows = self.chunk_range(chunk)
        region = slice(rows.start, rows.stop)
        try:
            status = self.group["status"][region]
        except _DECODE_ERRORS as error:
            return (f"its status chunk file {self.chunk_file('status', chunk)} cannot be decoded "
                    f"({first_line(error)})")
        if not (status != PENDING).any():
            return None
        unknown = sorted(set(np.unique(status).tolist()) - {PENDING, EXPLAINED, FAILED})
        if unknown:
            return f"its status chunk file {self.chunk_file('status', chunk)} holds unknown values {unknown}"
        explained = status == EXPLAINED
        for name in data:
            try:
                values = self.group[name][region]
            except _DECODE_ERRORS as error:
                return (f"the chunk file {self.chunk_file(name, chunk)} of {name!r} cannot be decoded "
                        f"({first_line(error)})")
            values = values[explained]
            if name == PRODUCED_BY:  # empty records are those of images explained before they were kept
                continue
            if name == "targets":
                empty = (values[..., 0] < 0).reshape(len(values), -1).any(1)
            else:
                empty = np.isnan(values).reshape(len(values), -1).all(1)
            if empty.any():
                image = rows.start + int(np.flatnonzero(explained)[np.argmax(empty)])
                return (f"the chunk file {self.chunk_file(name, chunk)} of {name!r} holds no values for the "
                        f"explained image {image} (the file is missing or was replaced)")
        return None

    def mark_complete(self) -> None:
        """Record in the attributes whether every image is explained or failed, and what explained them."""
        self.group.attrs.update({"complete": self.summary()["pending"] == 0,
                                 "produced_by": sorted(self.producers())})
