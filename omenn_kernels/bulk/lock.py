"""One writer per attribution store: a lock file beside the store, held with ``flock``.

The lock file is ``<store>.lock``, a sibling of the store, because the store itself
appears only when its creation is complete (see :mod:`.store`). The writer holds an
exclusive ``fcntl.flock`` on it for the whole run and records its process id, host and
start time in it, so that a second writer can be told who holds the store. The kernel
drops the ``flock`` when the holder's process ends, however it ends, so the lock file of
a dead process is taken over by the next writer. Releasing removes the file.

``flock`` is per host: processes on different machines writing one store on a network
file system are not kept apart by it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import IO

from ..errors import StoreError, StoreLockedError
from .store import store_location

log = logging.getLogger("omenn_kernels.bulk")

LOCK_SUFFIX = ".lock"


def lock_path(store: str | Path) -> Path:
    """The lock file of the store at ``store``: ``<store>.lock`` beside it.

    Symbolic links are resolved, so that every spelling of one store's path gives one lock.
    """
    store = store_location(Path(store).resolve())
    return store.with_name(store.name + LOCK_SUFFIX)


def _holder(text: str) -> dict | None:
    """The holder record of a lock file's text, or None if the text is not one."""
    try:
        record = json.loads(text)
    except ValueError:
        return None
    if not isinstance(record, dict) or not {"pid", "host", "since"} <= record.keys():
        return None
    return record


def _is_file_at(descriptor: int, path: Path) -> bool:
    """Whether the open file ``descriptor`` is still the file found at ``path``."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(descriptor)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


class StoreLock:
    """An exclusive lock on writing one store, held from :meth:`acquire` to :meth:`release`.

    Use as a context manager, or call :meth:`release` in a ``finally``.
    """

    def __init__(self, store: Path, path: Path, file: IO[str]) -> None:
        self.store = store
        self.path = path
        self._file: IO[str] | None = file

    @classmethod
    def acquire(cls, store: str | Path) -> "StoreLock":
        """Lock ``store`` for this process, creating its parent folder if needed.

        Raises:
            StoreLockedError: another live process holds the lock; the message names it.
            StoreError: the lock file cannot be created (the folder is missing, read-only,
                or its path runs through a file).
        """
        store = Path(store)
        path = lock_path(store)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise StoreError(f"cannot create the folder {path.parent} of the store {store}: "
                             f"{error.strerror or error}") from error
        while True:
            try:
                descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise StoreError(f"cannot write the lock file {path} in the folder {path.parent}: "
                                 f"{error.strerror or error}") from error
            file = os.fdopen(descriptor, "r+", encoding="utf-8")
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = file.read()
                file.close()
                raise StoreLockedError(cls._locked_message(store, path, text)) from None
            except OSError as error:
                file.close()
                raise StoreError(f"cannot lock {path} (the file system may not support flock): "
                                 f"{error.strerror or error}") from error
            # A holder that released between our open and our flock has removed the file we
            # opened; a lock on that removed file keeps nobody out, so lock the current one.
            if _is_file_at(descriptor, path):
                break
            file.close()
        previous = _holder(file.read())
        if previous is not None:
            log.info("took over the lock file %s of process %s on %s (since %s), which no longer holds it",
                     path, previous["pid"], previous["host"], previous["since"])
        file.seek(0)
        file.truncate()
        json.dump({"pid": os.getpid(), "host": socket.gethostname(),
                   "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, file)
        file.flush()
        return cls(store, path, file)

    @staticmethod
    def _locked_message(store: Path, path: Path, text: str) -> str:
        holder = _holder(text)
        if holder is None:
            # The holder has the lock but has not written its record yet.
            return (f"{store} is being written by another process (lock file {path}); "
                    "wait for it or write to another --out")
        return (f"{store} is being written by process {holder['pid']} on {holder['host']} since "
                f"{holder['since']}; wait for it or write to another --out")

    @property
    def held(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        """Remove the lock file and drop the lock; does nothing if already released."""
        if self._file is None:
            return
        try:
            # Removed while still locked: a process that opens the file now finds it gone
            # once it gets the lock, and locks a new file instead.
            self.path.unlink(missing_ok=True)
        finally:
            self._file.close()
            self._file = None

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
