"""Explaining a whole image folder into an attribution store: batches, resume, sharding.

The unit of work is a chunk of the store (``batch_size`` consecutive images of the
sorted file list). A run explains the chunks that are not yet done, one batch per
chunk, all targets of a batch from one forward pass; a reader thread reads the next
batch and a writer thread stores each finished chunk while a batch is explained. Under ``torchrun`` every process
takes the chunks ``rank, rank + world, ...``, so the processes write disjoint chunks
of one store, and each batch holds the same images as in a single-process run.

Every batch is padded to ``batch_size`` images (repeating its first readable image;
the padding is dropped) so that the model is captured once, whatever images fail.

One run writes a store at a time: the run holds the store's lock (:mod:`.lock`) from
before the model is loaded until it ends, however it ends, and a second run on the same
store is refused with :class:`~omenn_kernels.errors.StoreLockedError` naming the holder.
Under ``torchrun``, process 0 takes the lock and creates the store, and every process
fails with its error if it cannot. The store never lies inside the image folder, nor the
image folder inside the store, and ``overwrite`` replaces only a store written by this
library (see :mod:`.store`).

Every batch is written with the record of what explained it (``produced_by``: the backend
that ran, ``compiled`` or its fallback ``fused`` included, and the versions of
omenn_kernels and torch). A run adds no batch whose record the store's explained images
do not already have, unless ``allow_mixed``: a resumed run with another backend or
version is refused before it explains anything, and a compiled run that falls back to
the fused backend at its first batch is refused then. ``auto`` picks one backend for the
whole run before its first batch: compiled where the run is long enough to pay for the
compilation, else the eager one; a resumed run goes on with the backend its store records.
Resuming first checks the chunks
of the batches marked done (``verify``, see :meth:`.AttributionStore.verify`) and
explains damaged ones again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .. import __version__, backends
from ..backends import tiered
from ..api import Explainer, Explanation
from ..readout import Readout, ReadoutFunction
from ..errors import OmennError, OptionError, StoreError, TargetError
from .images import ImageFiles, ImageList, collate_images, list_images
from .lock import StoreLock
from .model_source import LoadedModel, load_model
from .store import (EXPLAINED, FAILED, PRODUCED_BY, PRODUCER_FIELDS, STORE_DTYPES, AttributionStore,
                    StoreMismatchError, check_components, check_replaceable, check_store_dtype, parse_producer,
                    producer_record, remove_leftovers)
from .targets import NO_CLASS, TargetSpec, parse_targets, readout_weights

log = logging.getLogger("omenn_kernels.bulk")

AUTOCAST_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}

Result = TypeVar("Result")


@dataclass
class RunConfig:
    """What ``omenn explain`` does; the fields mirror its options.

    ``allow_mixed``: resume a store although its explained images come from another
    backend (a compiled run's fallback to fused included) or another version of
    omenn_kernels or torch than this run's; by default that is refused
    (:class:`~omenn_kernels.bulk.StoreMismatchError`), as it mixes their numbers.
    ``verify``: on resuming, read back the chunks of the batches marked done and explain
    damaged ones again (see :meth:`~omenn_kernels.bulk.AttributionStore.verify`); it reads
    the finished part of the store once.
    """

    source: str | Path
    out: str | Path
    model: str
    checkpoint: str | Path | None = None
    pretrained: bool = False
    num_classes: int | None = None
    targets: str = "predicted"
    batch_size: int = 32
    dtype: str = "fp32"
    device: str = "cpu"
    backend: str = "auto"
    store_dtype: str = "float16"
    components: tuple[str, ...] = ("contribution",)
    workers: int = 2
    overwrite: bool = False
    progress: bool = True
    allow_mixed: bool = False
    verify: bool = True

    def __post_init__(self) -> None:
        # Paths may be given as strings, as everywhere else in the API.
        self.source, self.out = Path(self.source), Path(self.out)
        if self.checkpoint is not None:
            self.checkpoint = Path(self.checkpoint)

    def validate(self) -> None:
        """Raise OptionError naming the first invalid option."""
        if self.batch_size < 1:
            raise OptionError(f"batch size must be ≥ 1, got {self.batch_size}")
        if self.dtype not in AUTOCAST_DTYPES:
            raise OptionError(f"dtype must be one of {list(AUTOCAST_DTYPES)}, got {self.dtype!r}")
        check_store_dtype(self.store_dtype)
        check_components(self.components)
        if self.workers < 0:
            raise OptionError(f"workers must be ≥ 0, got {self.workers}")


@dataclass
class RunSummary:
    """The outcome of a run, over all processes.

    ``explained`` and ``failed`` count the images this run processed; ``skipped`` those
    a previous run had already done; ``damaged`` the batches a previous run had marked done
    whose chunks were damaged, explained again by this run; ``store`` holds the totals.
    """

    store: Path
    explained: int = 0
    failed: int = 0
    skipped: int = 0
    damaged: list[int] = field(default_factory=list)
    seconds: float = 0.0
    totals: dict = field(default_factory=dict)

    @property
    def images_per_second(self) -> float:
        return (self.explained + self.failed) / self.seconds if self.seconds > 0 else 0.0


def _distributed(device: str) -> tuple[int, int, bool]:
    """(rank, world size, whether this call started the process group) under torchrun."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        return dist.get_rank(), dist.get_world_size(), True
    return 0, 1, False


def _device(name: str, world: int) -> torch.device:
    """The torch device ``name`` (under torchrun, "cuda" is this process's local GPU).

    Raises:
        OptionError: a name torch does not know, a device other than the CPU and CUDA (meta,
            mps, ...), or a CUDA device this machine does not have.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise OptionError(f"unknown device {name!r}: use cpu, cuda or cuda:N ({error})") from None
    if device.type not in ("cpu", "cuda"):
        raise OptionError(f"device {name!r} cannot run omenn explain: it explains on cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise OptionError(f"device {name!r} was asked for, but CUDA is not available")
        if device.index is None and world > 1:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise OptionError(f"device {name!r} was asked for, but this machine has "
                              f"{torch.cuda.device_count()} CUDA devices")
    return device


def _on_rank0(action: Callable[[], Result], rank: int, device: torch.device) -> Result | None:
    """Run ``action`` on process 0 only; under a process group, every process raises its error.

    Returns what ``action`` returns on process 0, None on the others. Every process
    must call this at the same point, as it is a collective when a group exists.
    """
    result, error = None, None
    if rank == 0:
        try:
            result = action()
        except Exception as raised:  # handed to every process below, then raised
            error = raised
    if dist.is_available() and dist.is_initialized():
        # The class and message travel, not the exception: not every exception pickles.
        shared = [None if error is None else (type(error), str(error))]
        dist.broadcast_object_list(shared, src=0, device=device if dist.get_backend() == "nccl" else None)
        if rank != 0 and shared[0] is not None:
            error = _rebuilt(*shared[0])
    if error is not None:
        raise error
    return result


def _rebuilt(kind: type, message: str) -> Exception:
    """Process 0's error, as this process raises it: the same class where that class takes just a message."""
    if issubclass(kind, OmennError):
        try:
            return kind(message)
        except TypeError:  # a class whose constructor needs more than the message
            pass
    return RuntimeError(f"process 0 failed with {kind.__name__}: {message}")


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _claim_out(config: RunConfig) -> StoreLock:
    """Check that ``config.out`` may be written (and replaced, with ``overwrite``), and lock it.

    Raises:
        StoreError: the store would be, or would hold, the image folder; ``overwrite``
            names something other than a store of this library; the folder cannot be written.
        StoreLockedError: another process writes the store.
    """
    # Resolved, so that a symbolic link cannot hide that two paths are one folder.
    source, out = config.source.resolve(), config.out.resolve()
    if _is_within(out, source):
        raise StoreError(f"the store {config.out} would be inside the image folder {config.source}; "
                         "choose an --out outside it")
    if _is_within(source, out):
        raise StoreError(f"the image folder {config.source} is inside the store path {config.out}; "
                         "choose another --out")
    lock = StoreLock.acquire(config.out)
    try:
        if config.overwrite:
            check_replaceable(config.out)
    except BaseException:
        lock.release()
        raise
    return lock


def _signature(config: RunConfig, loaded: LoadedModel, spec: TargetSpec, classes: int,
               images: ImageList) -> dict:
    return {
        "model": loaded.name, "weights": loaded.weights, "weights_sha256": loaded.weights_sha256,
        "targets": spec.text, "target_count": spec.count, "classes": classes,
        "dtype": config.dtype, "backend": config.backend, "store_dtype": config.store_dtype,
        "components": list(config.components), "batch_size": config.batch_size,
        "image_shape": list(loaded.data_config["input_size"]), "num_images": len(images.paths),
        "data_config": {k: list(v) if isinstance(v, tuple) else v for k, v in loaded.data_config.items()},
        "source": str(images.root.resolve()), "class_folders": list(images.classes),
        "omenn_kernels_version": __version__, "torch_version": torch.__version__,
    }


def _producer(backend: str) -> str:
    """The ``produced_by`` record of a batch that ``backend`` explains in this process."""
    return producer_record(backend, __version__, torch.__version__)


def _mixing_error(out: Path, held: Iterable[str], record: str, requested: str) -> StoreMismatchError:
    """The refusal to add batches of ``record`` to a store whose explained images have the records ``held``."""
    new = parse_producer(record)
    known = [parse_producer(r) for r in held if r]
    differing = []
    for name in PRODUCER_FIELDS:
        stored = sorted({fields.get(name, "?") for fields in known})
        if stored and new[name] not in stored:
            differing.append(f"{name}: store has {', '.join(map(repr, stored))}, this run {new[name]!r}")
    if "" in held:
        differing.append("the backend and versions of images explained before omenn_kernels recorded them are "
                         "not known")
    fallback = ""
    if requested in ("compiled", "auto") and new["backend"] == "fused":
        fallback = (" (the compiled backend could not compile this run's explanation, which runs on the fused "
                    "backend: see the warning above)")
    return StoreMismatchError(f"the store {out} holds explained images of another backend or version than this "
                              f"run's{fallback}: {'; '.join(differing)}; resuming would mix their numbers in one "
                              "store: pass --allow-mixed (allow_mixed=True) to do so anyway, or --overwrite to "
                              "start again")


def _open_store(config: RunConfig, signature: dict, images: ImageList, rank: int,
                device: torch.device) -> tuple[AttributionStore, list[int]]:
    """Process 0 creates (or replaces, or checks) the store while holding its lock; the others open it then.

    Returns the store and the batches marked done whose chunks were damaged (now pending again).
    """
    backend = backends.resolved_name(config.backend, device)
    # A compiled run may fall back to fused: that is checked again at its first batch. An auto run
    # goes on with the backend the store's images record (see _auto_backend).
    candidates = [_producer(backend)] + ([_producer("fused")] if backend == "compiled" else []) + \
        ([_producer("compiled"), _producer("fused")] if config.backend == "auto" else [])

    def resume(store: AttributionStore) -> list[int]:
        damaged = store.verify(images.paths, images.labels) if config.verify else []
        held = store.producers()
        if store.pending_chunks() and held and not config.allow_mixed and not any(c in held for c in candidates):
            raise _mixing_error(config.out, held, candidates[0], config.backend)
        store.add_producer_array()
        return damaged

    def create_or_check() -> tuple[AttributionStore, list[int]]:
        remove_leftovers(config.out)
        if (config.out / "zarr.json").is_file() and not config.overwrite:
            store = AttributionStore.open(config.out, writable=True)
            store.check_signature(signature)
            damaged = resume(store)
            log.info("resuming %s: %s", config.out, store.summary())
            return store, damaged
        return AttributionStore.create(
            config.out, paths=list(images.paths), labels=list(images.labels),
            target_count=signature["target_count"], classes=signature["classes"],
            image_shape=tuple(signature["image_shape"]), batch_size=config.batch_size,
            store_dtype=config.store_dtype, components=config.components,
            attributes={**signature, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            replace=config.overwrite), []

    opened = _on_rank0(create_or_check, rank, device)
    if rank != 0:
        store = AttributionStore.open(config.out, writable=True)
        store.check_signature(signature)
        return store, []
    return opened


def _check_labels(images: ImageList, classes: int, model: str) -> None:
    """Raise TargetError naming the first class folder whose label the model has no class for."""
    for path, label in zip(images.paths, images.labels):
        if label >= classes:
            folder = Path(path).parts[0]
            raise TargetError(f"class folder {images.root / folder} is class {label}, but the model {model} has "
                              f"{classes} classes (valid: 0..{classes - 1}); the target 'label' cannot be explained")


def _read_ahead(batches: Iterable, depth: int = 2) -> Iterator:
    """Yield ``batches``, taken from their iterator on a thread up to ``depth`` batches ahead.

    With no DataLoader workers this reads the next batch's images (PNG decoding and the
    transform release the GIL) while the model explains the current one, where worker
    processes would take whole cores from the model on a small machine; with workers it
    only waits for them. An exception while reading is raised here; closing the
    generator stops the thread.
    """
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: tuple) -> bool:
        while not stop.is_set():
            try:
                slots.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for batch in batches:
                if not put(("batch", batch)):
                    return
            put(("end", None))
        except BaseException as error:  # handed to the consuming thread, which raises it
            put(("error", error))

    reader = threading.Thread(target=read, name="omenn-image-reader", daemon=True)
    reader.start()
    try:
        while True:
            kind, item = slots.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        reader.join()


class _ChunkWriter:
    """Writes finished chunks on a thread, so that storing overlaps explaining."""

    def __init__(self, store: AttributionStore, out: Path, progress: tqdm) -> None:
        self.store = store
        self.out = out
        self.progress = progress
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=2)
        self._thread = threading.Thread(target=self._work, name="omenn-store-writer", daemon=True)
        self._thread.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.error is not None:
                continue
            chunk, arrays, status = item
            try:
                self.store.write_chunk(chunk, arrays, status)
                self.progress.update(len(status))
            except BaseException as error:  # handed to the main thread, which re-raises it
                self.error = error

    def put(self, chunk: int, arrays: dict, status: np.ndarray) -> None:
        self._raise_error()
        self._queue.put((chunk, arrays, status))

    def close(self) -> None:
        """Write what is queued and stop; re-raise a write error."""
        self._queue.put(None)
        self._thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        """A write error: the disk's (full, removed, read-only) as a StoreError, anything else as a defect."""
        if isinstance(self.error, OSError):
            raise StoreError(f"writing the store {self.out} failed ({self.error}); the batches written "
                             "before are kept: free the disk and run the same command again") from self.error
        if self.error is not None:
            raise RuntimeError(f"writing the store {self.out} failed") from self.error


class _BatchExplainer:
    """Explains one batch of a chunk into the store's arrays for that chunk."""

    def __init__(self, config: RunConfig, explainer: Explainer, spec: TargetSpec, classes: int,
                 images: ImageList, device: torch.device) -> None:
        self.config = config
        self.explainer = explainer
        self.spec = spec
        self.classes = classes
        self.labels = torch.tensor(images.labels) if spec.needs_labels else None
        if self.labels is not None:
            spec.check_labels(self.labels, classes)
        self.readout_weights = self._readout_weights  # one function object: the compiled backend's key
        self.paths = images.paths
        self.device = device
        self.autocast = AUTOCAST_DTYPES[config.dtype]
        self.store_dtype = STORE_DTYPES[config.store_dtype]
        self.backend = backends.Backend(backends.resolved_name(config.backend, device))

    def use(self, backend: str) -> None:
        """Explain the following batches on ``backend``."""
        self.backend = backends.Backend(backend)
        self.explainer.backend = backend

    def _readout_weights(self, logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """The (B, T, K) read-out weights of the target specification for a batch's logits."""
        return readout_weights(self.spec.pairs(logits, labels), self.classes, torch.float32)

    def _empty(self, rows: int, image_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
        t, (c, h, w) = self.spec.count, image_shape
        maps = {"contribution": (t, h, w), "weighted_input": (t, c, h, w), "bias": (t, h, w)}
        arrays = {name: np.full((rows, *maps[name]), np.nan, self.store_dtype) for name in self.config.components}
        arrays.update(explained=np.full((rows, t), np.nan, np.float32),
                      logits=np.full((rows, self.classes), np.nan, np.float32),
                      targets=np.full((rows, t, 2), NO_CLASS, np.int32))
        arrays[PRODUCED_BY] = np.full(rows, _producer(backends.resolved_name(self.backend.name, self.device)), object)
        return arrays

    def _explain(self, x: torch.Tensor, labels: torch.Tensor | None) -> tuple[Explanation, str]:
        """The explanation of the batch ``x`` (padded to the batch size) and the backend that ran it."""
        readout = Readout(ReadoutFunction(self.readout_weights, () if labels is None else (labels,)))
        with torch.autocast(self.device.type, dtype=self.autocast) if self.autocast else contextlib.nullcontext():
            e = self.explainer.explain_targets(x, readout)
            # under the same autocast: a compiled graph is specialized on it
            program, _ = self.explainer.program(x)
            return e, self.backend.runs_on(program, self.explainer.model, x, readout)

    def seconds_per_batch(self, image_shape: tuple[int, ...]) -> float:
        """The seconds one batch (of zeros, every target resolved as for images) takes to explain."""
        x = torch.zeros(self.config.batch_size, *image_shape, device=self.device)
        labels = None if self.labels is None else torch.zeros(len(x), dtype=self.labels.dtype, device=self.device)
        start = time.perf_counter()
        self._explain(x, labels)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def __call__(self, batch: dict, image_shape: tuple[int, ...]) -> tuple[dict, np.ndarray]:
        indices = batch["indices"]
        arrays = self._empty(len(indices), image_shape)
        status = np.full(len(indices), FAILED, np.int8)
        for index, error in batch["errors"].items():
            log.warning("image %d (%s) could not be read and is recorded as failed: %s",
                        index, self.paths[index], error)
        if batch["images"] is None:
            return arrays, status
        rows = [indices.index(i) for i in batch["readable"]]
        readable = len(rows)
        x = batch["images"].to(self.device, non_blocking=True)
        padding = self.config.batch_size - readable
        if padding:
            x = torch.cat([x, x[:1].expand(padding, *x.shape[1:])])
        labels = None
        if self.labels is not None:
            labels = self.labels[batch["readable"]].to(self.device)
            labels = torch.cat([labels, labels[:1].expand(padding)])
        e, backend = self._explain(x, labels)
        arrays[PRODUCED_BY][:] = _producer(backend)
        # the pairs the read-outs were made of: the same function of the same logits
        outputs = {"contribution": e.contribution, "bias": e.bias, "explained": e.logit, "logits": e.logits,
                   "targets": self.spec.pairs(e.logits, labels)}
        if "weighted_input" in arrays:
            outputs["weighted_input"] = e.weight * x.unsqueeze(1)
        for name, values in outputs.items():
            if name in arrays:
                arrays[name][rows] = values[:readable].detach().float().cpu().numpy() \
                    if values.is_floating_point() else values[:readable].cpu().numpy()
        status[rows] = EXPLAINED
        return arrays, status


def explain_folder(config: RunConfig) -> RunSummary:
    """Explain every image of ``config.source`` into the store ``config.out``.

    Resumes a store written by an identical configuration (skipping finished chunks, after
    checking them unless ``config.verify`` is off); shards the chunks over the processes of
    a ``torchrun`` launch. Holds the store's lock for the whole run and releases it
    (removing the lock file) when the run ends, also on an exception or an interrupt. With
    ``config.overwrite``, an existing store written by this library is replaced, and
    nothing else is ever removed.

    Raises:
        StoreLockedError: another process is writing ``config.out``.
        LockFileError: the lock file's path holds a link or a file that is not a lock
            record of this library; or the lock file cannot be removed when the run ends.
        StoreMismatchError: ``config.out`` holds a store of a different configuration, or
            (unless ``config.allow_mixed``) explained images of another backend or version.
        StoreError: ``config.out`` is inside the image folder (or holds it), is something
            other than a store, cannot be written, or holds unreadable metadata.
        OptionError: an invalid option, such as an unknown device or one that cannot explain.
        FileNotFoundError, ValueError: a missing folder, no images, an unknown model.
        TargetError: a target specification that does not fit the model or the images,
            such as a class folder beyond the model's classes with the target 'label'.
    """
    config.validate()
    rank, world, started_group = _distributed(config.device)
    try:
        device = _device(config.device, world)
        lock = _on_rank0(lambda: _claim_out(config), rank, device)
        try:
            summary = _explain_folder(config, rank, world, device)
        except BaseException:
            if lock is not None:
                lock.release(raise_errors=False)  # the run's own error is the one to report
            raise
        if lock is not None:
            lock.release()
        return summary
    finally:
        if started_group:
            dist.destroy_process_group()


def _auto_backend(held: Iterable[str], batch_explainer: _BatchExplainer, image_shape: tuple[int, ...],
                  batches: int, device: torch.device) -> str:
    """The backend of a run with ``--backend auto``, one for the whole run.

    A resumed run goes on with the backend its store's explained images record, so that it
    ends with an uninterrupted run's values. A new run is compiled where that pays off over its
    ``batches`` (:func:`~omenn_kernels.backends.tiered.pays_to_compile`), timed on a batch of
    zeros; else it runs on the eager backend. Under torchrun every process decides alike: on the
    longest share of batches and the slowest time.
    """
    eager = backends.resolved_name("auto", device)
    for backend in (eager, "compiled"):
        if _producer(backend) in held:
            return backend
    seconds = batch_explainer.seconds_per_batch(image_shape) if batches else 0.0
    if tiered.pays_to_compile(seconds, batches, device):
        # timed again: the first call also paid one-time costs (kernels loaded, memory first touched)
        seconds = batch_explainer.seconds_per_batch(image_shape)
    if dist.is_initialized():
        longest = torch.tensor([seconds, batches], dtype=torch.float64,
                               device=device if dist.get_backend() == "nccl" else None)
        dist.all_reduce(longest, op=dist.ReduceOp.MAX)
        seconds, batches = longest[0].item(), int(longest[1].item())
    backend = "compiled" if tiered.pays_to_compile(seconds, batches, device) else eager
    log.info("backend auto: %s (%d batches of about %.2f s each on %s; a run is compiled from %.0f s on)",
             backend, batches, seconds, eager,
             tiered.COMPILE_AFTER_SECONDS / tiered.COMPILED_SAVING.get(device.type, float("nan")))
    return backend


def _explain_folder(config: RunConfig, rank: int, world: int, device: torch.device) -> RunSummary:
    images = list_images(config.source)
    spec = parse_targets(config.targets)
    loaded = load_model(config.model, checkpoint=config.checkpoint, pretrained=config.pretrained,
                        num_classes=config.num_classes)
    loaded.model.to(device)
    image_shape = tuple(loaded.data_config["input_size"])
    # auto's eager backend, not its tiers: a run does not switch backends midway (see _auto_backend).
    explainer = Explainer(loaded.model, backend=backends.resolved_name(config.backend, device))
    # Captured once, on the batch shape every batch is padded to.
    _, classes = explainer.program(torch.zeros(config.batch_size, *image_shape, device=device))
    spec.check(classes, has_labels=images.has_labels)
    if spec.needs_labels:
        _check_labels(images, classes, loaded.name)
    batch_explainer = _BatchExplainer(config, explainer, spec, classes, images, device)
    store, damaged = _open_store(config, _signature(config, loaded, spec, classes, images), images, rank, device)

    chunks = [c for c in store.pending_chunks() if c % world == rank]
    pending_images = sum(len(store.chunk_range(c)) for c in chunks)
    mine = sum(len(store.chunk_range(c)) for c in range(rank, store.num_chunks, world))
    summary = RunSummary(config.out, skipped=mine - pending_images, damaged=damaged)
    held = set(store.producers())
    if config.backend == "auto":
        batch_explainer.use(_auto_backend(held, batch_explainer, image_shape, len(chunks), device))
    log.info("rank %d/%d: %d images to explain in %d batches (%d done before), model %s, targets %r "
             "(%d per image), device %s, dtype %s, backend %s", rank, world,
             pending_images, len(chunks), summary.skipped, loaded.name,
             spec.text, spec.count, device, config.dtype, config.backend)
    loader = DataLoader(ImageFiles(images, loaded.transform()),
                        batch_sampler=[list(store.chunk_range(c)) for c in chunks],
                        num_workers=config.workers, collate_fn=collate_images,
                        pin_memory=device.type == "cuda")
    progress = tqdm(total=pending_images, unit="img", dynamic_ncols=True,
                    desc=f"explaining (rank {rank})" if world > 1 else "explaining",
                    disable=not config.progress or rank != 0)
    writer = _ChunkWriter(store, config.out, progress)
    batches = _read_ahead(loader)
    start = time.perf_counter()
    try:
        for chunk, batch in zip(chunks, batches):
            arrays, status = batch_explainer(batch, image_shape)
            if (status == EXPLAINED).any():
                record = str(arrays[PRODUCED_BY][0])
                if held and record not in held and not config.allow_mixed:
                    raise _mixing_error(config.out, held, record, config.backend)
                held.add(record)
            writer.put(chunk, arrays, status)
            summary.explained += int((status == EXPLAINED).sum())
            summary.failed += int((status == FAILED).sum())
    finally:
        batches.close()
        writer.close()
        progress.close()
    summary.seconds = time.perf_counter() - start

    if dist.is_initialized():
        counts = torch.tensor([summary.explained, summary.failed, summary.skipped], dtype=torch.float64)
        seconds = torch.tensor([summary.seconds], dtype=torch.float64)
        if dist.get_backend() == "nccl":
            counts, seconds = counts.to(device), seconds.to(device)
        dist.all_reduce(counts)
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        summary.explained, summary.failed, summary.skipped = (int(v) for v in counts.tolist())
        summary.seconds = float(seconds.item())
        dist.barrier()
    if rank == 0:
        store.mark_complete()
    summary.totals = store.summary()
    log.info("rank %d: explained %d, failed %d, skipped %d images in %.1f s (%.1f img/s); store %s: %s",
             rank, summary.explained, summary.failed, summary.skipped, summary.seconds,
             summary.images_per_second, config.out, summary.totals)
    return summary
