"""What a run may do to the disk: --overwrite, the store/source relation, the writer lock, atomic creation,
and input errors that must name their value before anything is written."""

from __future__ import annotations

import json
import logging
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from omenn_kernels.bulk import AttributionStore, RunConfig, StoreLock, explain_folder
from omenn_kernels.bulk.lock import lock_path
from omenn_kernels.bulk.run import _BatchExplainer
from omenn_kernels.cli import EXIT_INTERRUPTED, EXIT_USAGE, main
from omenn_kernels.demo import draw_images
from omenn_kernels.errors import OptionError, StoreError, StoreLockedError, TargetError

ROOT = Path(__file__).resolve().parents[2]
SLOWED_CLI = Path(__file__).resolve().parent / "slowed_cli.py"
TARGETS = "label,top2"
ARRAYS = ("contribution", "explained", "logits", "targets", "status", "labels")


def _config(source: Path, out: Path, **overrides) -> RunConfig:
    options = dict(model="parts_vit", targets=TARGETS, batch_size=2, backend="reference", store_dtype="float32",
                   device="cpu", workers=0, progress=False)
    options.update(overrides)
    return RunConfig(source=source, out=out, **options)


def _command(source: Path, out: Path) -> list[str]:
    """The ``omenn explain`` arguments of the run :func:`_config` describes."""
    return ["explain", str(source), "--out", str(out), "--model", "parts_vit", "--targets", TARGETS,
            "--batch-size", "2", "--backend", "reference", "--store-dtype", "float32", "--device", "cpu",
            "--workers", "0", "-q"]


def _env(**delays: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.update({f"OMENN_TEST_{name.upper()}_DELAY": str(value) for name, value in delays.items()})
    return env


def _launch_slowed(source: Path, out: Path, **delays: float) -> subprocess.Popen:
    """Start ``omenn explain`` with the given delays (see slowed_cli.py)."""
    return subprocess.Popen([sys.executable, str(SLOWED_CLI), *_command(source, out)], env=_env(**delays),
                            stdout=subprocess.PIPE, text=True)


def _await_creation(process: subprocess.Popen) -> None:
    """Return once the slowed run ``process`` has begun creating its store."""
    ready, _, _ = select.select([process.stdout], [], [], 300)
    line = process.stdout.readline() if ready else ""
    if line.strip() != "creating":
        process.kill()
        process.wait()
        pytest.fail(f"the slowed run did not start creating its store (exit code {process.returncode})")


def _assert_same_store(expected: Path, actual: Path) -> None:
    """Equal paths and integer arrays; float arrays to float32 rounding (the runs may use different thread counts)."""
    left, right = AttributionStore.open(expected), AttributionStore.open(actual)
    assert left.paths() == right.paths() and right.attrs["complete"]
    for name in ARRAYS:
        x, y = left.read(name), right.read(name)
        if np.issubdtype(x.dtype, np.floating):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            assert np.array_equal(x, y), name


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("safety") / "images"
    draw_images(folder, 6)
    return folder


@pytest.fixture(scope="module")
def reference(images, tmp_path_factory) -> Path:
    """A store written by one uninterrupted run."""
    out = tmp_path_factory.mktemp("reference") / "store.zarr"
    explain_folder(_config(images, out))
    return out


# --overwrite and where the store may be -------------------------------------------------------------------------


def test_overwrite_refuses_what_is_not_a_store_of_this_library(images, tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    foreign = tmp_path / "foreign.zarr"
    zarr.open_group(foreign, mode="w-").attrs.update({"format_version": 1, "model": "theirs"})
    for out in (precious, a_file, foreign):
        before = _tree(tmp_path)
        with pytest.raises(StoreError, match=f"--overwrite does not replace {out}"):
            explain_folder(_config(images, out, overwrite=True))
        assert _tree(tmp_path) == before and not lock_path(out).exists()
    # Through the command: exit 2 and the sentence.
    assert main(_command(images, precious) + ["--overwrite"]) == EXIT_USAGE
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_overwrite_replaces_a_store_of_this_library_and_an_empty_folder(images, reference, tmp_path):
    out = tmp_path / "store.zarr"
    shutil.copytree(reference, out)
    explain_folder(_config(images, out, targets="top2", overwrite=True))
    assert AttributionStore.open(out).attrs["targets"] == "top2" and AttributionStore.open(out).attrs["complete"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["store.zarr"]
    empty = tmp_path / "empty"
    empty.mkdir()
    explain_folder(_config(images, empty))
    _assert_same_store(reference, empty)


def test_the_store_is_never_the_image_folder_nor_inside_it_nor_around_it(images, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(images, data / "images")
    before = _tree(data)
    (tmp_path / "link").symlink_to(data / "images")
    cases = [(data / "images", data / "images", False), (data / "images", data / "images", True),
             (data / "images", data / "images" / "00" / "s.zarr", False),
             (data / "images", tmp_path / "link", True), (tmp_path / "link", data / "images" / "s.zarr", False),
             (data / "images", data, True), (data / "images", data, False)]
    for source, out, overwrite in cases:
        with pytest.raises(StoreError, match="image folder") as refused:
            explain_folder(_config(source, out, overwrite=overwrite))
        assert str(out) in str(refused.value) and str(source) in str(refused.value)
        assert _tree(data) == before
    assert main(_command(data / "images", data / "images") + ["--overwrite"]) == EXIT_USAGE
    assert _tree(data) == before


# The writer lock ---------------------------------------------------------------------------------------------


def test_a_second_writer_is_refused_and_the_lock_is_released(images, tmp_path):
    out = tmp_path / "s.zarr"
    with StoreLock.acquire(out) as held:
        record = json.loads(lock_path(out).read_text())
        assert (record["pid"], record["host"]) == (os.getpid(), socket.gethostname())
        expected = f"{out} is being written by process {os.getpid()} on {socket.gethostname()} since "
        with pytest.raises(StoreLockedError) as refused:
            StoreLock.acquire(out)
        assert str(refused.value).startswith(expected)
        assert str(refused.value).endswith("; wait for it or write to another --out")
        with pytest.raises(StoreLockedError, match=f"{out} is being written by process {os.getpid()}"):
            explain_folder(_config(images, out))
        assert held.held and not out.exists()
    assert not lock_path(out).exists()
    StoreLock.acquire(out).release()


def test_a_dead_processs_lock_file_is_taken_over(images, reference, tmp_path, caplog):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    out = tmp_path / "s.zarr"
    lock_path(out).write_text(json.dumps({"pid": int(dead.stdout), "host": socket.gethostname(),
                                          "since": "2020-01-01T00:00:00+0000"}))
    with caplog.at_level(logging.INFO, logger="omenn_kernels.bulk"):
        explain_folder(_config(images, out))
    assert f"took over the lock file {lock_path(out)} of process {int(dead.stdout)}" in caplog.text
    assert not lock_path(out).exists()
    _assert_same_store(reference, out)


@pytest.mark.parametrize("error", [RuntimeError("disk gone"), KeyboardInterrupt()], ids=["error", "interrupt"])
def test_the_lock_is_held_while_explaining_and_released_however_the_run_ends(images, reference, tmp_path,
                                                                              monkeypatch, error):
    out = tmp_path / "s.zarr"
    lock_files = []

    def failing(self, batch, image_shape):
        lock_files.append(json.loads(lock_path(out).read_text()))
        raise error
    monkeypatch.setattr(_BatchExplainer, "__call__", failing)
    with pytest.raises(type(error)):
        explain_folder(_config(images, out))
    assert lock_files[0]["pid"] == os.getpid() and not lock_path(out).exists()
    assert AttributionStore.open(out).summary()["pending"] == 6
    monkeypatch.undo()
    explain_folder(_config(images, out))
    _assert_same_store(reference, out)
    with pytest.raises(ValueError, match="unknown model"):
        explain_folder(_config(images, out, model="no_such_model"))
    assert not lock_path(out).exists()


def test_a_failed_write_is_a_store_error_and_resumes(images, reference, tmp_path, monkeypatch):
    """A disk error while writing a chunk (full, removed) names the store; the chunks written before are
    kept, and the same run resumes to the uninterrupted result."""
    out = tmp_path / "s.zarr"
    original, written = AttributionStore.write_chunk, []

    def full_after_one(self, chunk, arrays, status):
        if written:
            raise OSError(28, "No space left on device")
        original(self, chunk, arrays, status)
        written.append(chunk)
    monkeypatch.setattr(AttributionStore, "write_chunk", full_after_one)
    with pytest.raises(StoreError, match=f"writing the store {out} failed .*No space left on device"):
        explain_folder(_config(images, out, batch_size=2))
    assert not lock_path(out).exists()
    assert AttributionStore.open(out).summary()["pending"] == 4
    monkeypatch.undo()
    explain_folder(_config(images, out, batch_size=2))
    _assert_same_store(reference, out)


def test_two_processes_on_one_store(images, reference, tmp_path, capsys):
    """While one ``omenn explain`` writes the store, a second is refused (exit 2, naming the first); the first
    then finishes a store equal to an uninterrupted run's."""
    out = tmp_path / "s.zarr"
    first = _launch_slowed(images, out, write=0.5)
    try:
        _await_creation(first)
        capsys.readouterr()
        assert main(_command(images, out)) == EXIT_USAGE
        assert (f"{out} is being written by process {first.pid} on {socket.gethostname()} since "
                in capsys.readouterr().err)
        assert first.wait(timeout=300) == 0
    finally:
        first.kill()
        first.wait()
    assert not lock_path(out).exists()
    _assert_same_store(reference, out)


def test_sigterm_ends_a_run_as_an_interrupt_and_it_resumes(images, reference, tmp_path):
    """SIGTERM (a scheduler stopping the job) after the first batch is written: exit 130, the lock
    released, the later batches pending, and the same command resumes to the uninterrupted result."""
    out = tmp_path / "s.zarr"
    process = _launch_slowed(images, out, write=0.5)
    try:
        _await_creation(process)
        while not out.exists() or AttributionStore.open(out).summary()["explained"] == 0:
            assert process.poll() is None, "the run ended before it could be stopped"
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == EXIT_INTERRUPTED
    finally:
        process.kill()
        process.wait()
    assert not lock_path(out).exists()
    assert 0 < AttributionStore.open(out).summary()["pending"] < 6
    assert main(_command(images, out)) == 0
    _assert_same_store(reference, out)


def test_torchrun_ranks_fail_together_on_a_locked_store(images, tmp_path):
    out = tmp_path / "s.zarr"
    with StoreLock.acquire(out):
        run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              "-m", "omenn_kernels.cli", *_command(images, out)], env=_env(),
                             capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    # Each rank prints the same sentence (the command's exit 2 per rank).
    assert run.stderr.count(f"{out} is being written by process {os.getpid()} on {socket.gethostname()}") == 2
    assert not out.exists()


# Atomic creation ----------------------------------------------------------------------------------------------


def test_a_run_killed_while_creating_the_store_leaves_none_or_a_whole_one(images, reference, tmp_path):
    """SIGKILL at random moments of a slowed creation (0.1 s after each of 7 arrays), or later: the store path is
    then absent or a whole store, and resuming gives the uninterrupted run's store."""
    seeds = range(4)
    outs = [tmp_path / f"killed{seed}.zarr" for seed in seeds]
    # Slowed chunk writes (3 chunks, 0.6 s each) keep a run alive for kills that land after the creation.
    # The runs start together: their start-up (imports, capture) overlaps.
    processes = [_launch_slowed(images, out, create=0.1, write=0.6) for out in outs]

    def kill_during_creation(seed: int) -> None:
        _await_creation(processes[seed])
        time.sleep(random.Random(seed).uniform(0.0, 1.6))
        processes[seed].send_signal(signal.SIGKILL)
    try:
        with ThreadPoolExecutor(len(seeds)) as pool:
            list(pool.map(kill_during_creation, seeds))
    finally:
        for process in processes:
            process.kill()
            process.wait()
    mid_creation = 0
    for process, out in zip(processes, outs):
        assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
        if out.exists():
            assert AttributionStore.open(out).paths() == AttributionStore.open(reference).paths()
        else:
            mid_creation += 1
            assert list(tmp_path.glob(f".{out.name}.creating-*")), "killed before the creation began"
        explain_folder(_config(images, out))
        assert not list(tmp_path.glob(f".{out.name}.*")), "the killed run's temporary folder was not removed"
        _assert_same_store(reference, out)
    assert mid_creation >= 1, "no kill landed while the store was being created"


def test_a_failed_creation_leaves_nothing(tmp_path, monkeypatch):
    create_array = zarr.Group.create_array

    def failing(self, name, **kwargs):
        if name == "paths":
            raise OSError(28, "No space left on device")
        return create_array(self, name, **kwargs)
    monkeypatch.setattr(zarr.Group, "create_array", failing)
    out = tmp_path / "s.zarr"
    with pytest.raises(StoreError, match=f"cannot create the store {out} in the folder {tmp_path}: No space left"):
        AttributionStore.create(out, paths=["a.png", "b.png"], labels=[0, 1], target_count=1, classes=3,
                                image_shape=(3, 4, 4), batch_size=2, store_dtype="float32",
                                components=("contribution",), attributes={})
    assert not any(tmp_path.iterdir())


# Input errors that must name their value ------------------------------------------------------------------------


def test_the_store_folder_cannot_be_written(images, tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("not a folder")
    with pytest.raises(StoreError, match=f"{a_file}"):
        explain_folder(_config(images, a_file / "s.zarr"))
    assert main(_command(images, a_file / "s.zarr")) == EXIT_USAGE
    assert str(a_file) in capsys.readouterr().err and a_file.read_text() == "not a folder"

    def denied(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(zarr, "open_group", denied)
    out = tmp_path / "readonly" / "s.zarr"
    with pytest.raises(StoreError, match=f"cannot create the store {out} in the folder {out.parent}: Permission"):
        explain_folder(_config(images, out))
    assert not lock_path(out).exists() and not any(out.parent.iterdir())


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_a_read_only_folder_is_named(images, tmp_path):
    folder = tmp_path / "readonly"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this user can write to a read-only folder (root)")
        with pytest.raises(StoreError, match=f"{folder}"):
            explain_folder(_config(images, folder / "s.zarr"))
    finally:
        folder.chmod(0o700)


def test_unknown_or_missing_devices_are_option_errors(images, tmp_path):
    with pytest.raises(OptionError, match="unknown device 'bogus'"):
        explain_folder(_config(images, tmp_path / "a.zarr", device="bogus"))
    if not torch.cuda.is_available():
        with pytest.raises(OptionError, match="'cuda' was asked for, but CUDA is not available"):
            explain_folder(_config(images, tmp_path / "b.zarr", device="cuda"))
    assert not any(tmp_path.iterdir())


def test_corrupt_metadata_is_named(reference, tmp_path, capsys):
    store = tmp_path / "s.zarr"
    for broken in (store / "zarr.json", store / "status" / "zarr.json", store / "paths" / "zarr.json"):
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(reference, store)
        broken.write_text("garbage {")
        with pytest.raises(StoreError, match=f"metadata {broken} cannot be read"):
            AttributionStore.open(store)
        assert main(["show", str(store), "--out", str(tmp_path / "png"), "-q"]) == EXIT_USAGE
        assert str(broken) in capsys.readouterr().err
    # A store whose creation was cut short by an earlier version: no paths.
    shutil.rmtree(store / "paths")
    store.joinpath("zarr.json").write_bytes((reference / "zarr.json").read_bytes())
    with pytest.raises(StoreError, match=f"{store} is incomplete: it has no array 'paths'"):
        AttributionStore.open(store)


def test_a_class_folder_beyond_the_models_classes_is_named_before_anything_is_written(images, tmp_path):
    source = tmp_path / "images"
    shutil.copytree(images, source)
    first = sorted(source.rglob("*.png"))[0]
    (source / "999").mkdir()
    shutil.copy(first, source / "999" / "x.png")
    out = tmp_path / "s.zarr"
    with pytest.raises(TargetError, match=f"class folder {source / '999'} is class 999, but the model parts_vit "
                                          "has 50 classes"):
        explain_folder(_config(source, out))
    assert not out.exists() and not lock_path(out).exists()
