"""The store lock never writes through a link nor over a file it did not create, and removes only its own file.

Each case is refused before a model is loaded, so the command's cases run in-process in well under a second.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from omenn_kernels.bulk import LockFileError, StoreLock
from omenn_kernels.bulk.lock import lock_path
from omenn_kernels.bulk.run import RunSummary
from omenn_kernels.cli import EXIT_USAGE, main
from omenn_kernels.errors import StoreError, StoreLockedError


def _command(out: Path) -> list[str]:
    """``omenn explain`` into ``out`` (the image folder beside it is never read: each case ends before)."""
    return ["explain", str(out.parent / "images"), "--out", str(out), "--model", "parts_vit", "--device", "cpu",
            "--workers", "0", "-q"]


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_a_symbolic_link_at_the_lock_path_is_refused_and_not_followed(tmp_path, capsys):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    out = tmp_path / "out.zarr"
    lock_path(out).symlink_to(notes)
    dangling = tmp_path / "other.zarr"
    lock_path(dangling).symlink_to(tmp_path / "nowhere.txt")
    for store in (out, dangling):
        with pytest.raises(LockFileError, match=f"the lock file path {lock_path(store)} of the store {store} is a "
                                                "symbolic link"):
            StoreLock.acquire(store)
        assert lock_path(store).is_symlink()
    assert main(_command(out)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{lock_path(out)} of the store {out} is a symbolic link" in err
    assert notes.read_text() == "my notes" and lock_path(out).is_symlink()
    assert not (tmp_path / "nowhere.txt").exists() and not out.exists()


def test_a_file_that_is_not_a_lock_record_is_refused_and_left_as_it_is(tmp_path, capsys):
    out = tmp_path / "out.zarr"
    mine = lock_path(out)
    for content in (b"my own file called out.zarr.lock\n", json.dumps({"pid": 1}).encode(), bytes(range(256)) * 40):
        mine.write_bytes(content)
        with pytest.raises(LockFileError, match=f"{mine} exists and is not a lock file of omenn_kernels"):
            StoreLock.acquire(out)
        assert mine.read_bytes() == content
    assert main(_command(out)) == EXIT_USAGE
    assert f"{mine} exists and is not a lock file of omenn_kernels" in capsys.readouterr().err
    assert mine.read_bytes() == bytes(range(256)) * 40
    folder = tmp_path / "f.zarr"
    lock_path(folder).mkdir()
    with pytest.raises(LockFileError, match=f"{lock_path(folder)} of the store {folder} is taken by something"):
        StoreLock.acquire(folder)


def test_a_killed_runs_lock_record_is_taken_over_and_a_held_one_is_not(tmp_path, caplog):
    out = tmp_path / "out.zarr"
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "2020-01-01T00:00:00+0000"}
    lock_path(out).write_text(json.dumps(stale))
    with caplog.at_level(logging.INFO, logger="omenn_kernels.bulk"):
        lock = StoreLock.acquire(out)
    assert f"took over the lock file {lock_path(out)} of process {stale['pid']}" in caplog.text
    record = json.loads(lock_path(out).read_text())
    assert (record["pid"], record["lock_of"]) == (os.getpid(), "omenn_kernels")
    with pytest.raises(StoreLockedError, match=f"{out} is being written by process {os.getpid()}"):
        StoreLock.acquire(out)
    lock.release()
    assert not lock_path(out).exists()


def test_release_removes_only_the_file_it_holds(tmp_path):
    out = tmp_path / "out.zarr"
    lock = StoreLock.acquire(out)
    replacement = tmp_path / "replacement"
    replacement.write_text("someone else's file")
    os.replace(replacement, lock_path(out))
    lock.release()
    assert lock_path(out).read_text() == "someone else's file" and not lock.held


def test_a_lock_file_that_cannot_be_removed_is_exit_2_or_a_warning_under_another_error(tmp_path, monkeypatch,
                                                                                        capsys, caplog):
    """The folder turns immutable while the run holds the lock: removing the lock fails with EPERM."""
    out = tmp_path / "out.zarr"

    def denied(path, *args, **kwargs):
        if Path(path) == lock_path(out):
            raise PermissionError(1, "Operation not permitted")
        return unlink(path, *args, **kwargs)
    unlink = os.unlink
    monkeypatch.setattr(os, "unlink", denied)
    # The run itself is not what is tested: it ends at once.
    monkeypatch.setattr("omenn_kernels.bulk.run._explain_folder", lambda config, *args: RunSummary(config.out))
    assert main(_command(out)) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"omenn explain: error: the lock file {lock_path(out)} could "
                                                   "not be removed (Operation not permitted)")

    def failing(config, *args):
        raise StoreError("the run's own error")
    monkeypatch.setattr("omenn_kernels.bulk.run._explain_folder", failing)
    with caplog.at_level(logging.WARNING, logger="omenn_kernels.bulk"):
        assert main(_command(out)) == EXIT_USAGE  # the stale file is taken over first
    assert capsys.readouterr().err == "omenn explain: error: the run's own error\n"
    assert f"the lock file {lock_path(out)} could not be removed" in caplog.text
    monkeypatch.undo()
    StoreLock.acquire(out).release()
    assert not lock_path(out).exists()
