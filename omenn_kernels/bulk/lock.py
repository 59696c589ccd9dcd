"""One writer per attribution store: a lock file beside the store, held with ``flock``.

The lock file is ``<store>.lock``, a sibling of the store, because the store itself
appears only when its creation is complete (see :mod:`.store`). The writer holds an
exclusive ``fcntl.flock`` on it for the whole run and records its process id, host and
start time in it (a JSON *lock record*), so that a second writer can be told who holds
the store. The kernel drops the ``flock`` when the holder's process ends, however it
ends, so the lock file of a dead process is taken over by the next writer. Releasing
removes the file.

The lock never writes through a link nor over a file that is not its own. It creates its
file with ``O_CREAT | O_EXCL | O_NOFOLLOW``. A file already at that path is taken over
only if it is a regular file holding a lock record that no live process locks: the lock
file of a run that was killed. Anything else there (a symbolic link, a folder, a file of
other content) is refused with :class:`LockFileError` naming the path, and left as it
is. Releasing removes the file only while it is still the one this lock holds (same
device and inode).

``flock`` is per host: processes on different machines writing one store on a network
file system are not kept apart by it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import stat
import time
from pathlib import Path

from ..errors import StoreError, StoreLockedError
from .store import WRITTEN_BY, store_location

log = logging.getLogger("omenn_kernels.bulk")

LOCK_SUFFIX = ".lock"
# A lock record is a few hundred bytes; a bigger file at the lock's path is someone else's.
_MAX_RECORD_BYTES = 4096
# How long a lock file may be seen empty: its creator writes its record right after creating it.
_CREATION_SECONDS = 2.0
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


class LockFileError(StoreError):
    """The path of a store's lock file holds something that is not a lock file of this library."""


def lock_path(store: str | Path) -> Path:
    """The lock file of the store at ``store``: ``<store>.lock`` beside it.

    Symbolic links in the store's path are resolved, so that every spelling of one store's
    path gives one lock; the lock file itself is never a link.
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


def _contents(descriptor: int) -> str | None:
    """The text of the open file ``descriptor``, or None if it is too big or not UTF-8 for a lock record."""
    data = os.pread(descriptor, _MAX_RECORD_BYTES + 1, 0)
    if len(data) > _MAX_RECORD_BYTES:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _is_file_at(descriptor: int, path: Path) -> bool:
    """Whether the open file ``descriptor`` is still the file found at ``path`` (links not followed)."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(descriptor)
    return (found.st_dev, found.st_ino) == (mine.st_dev, mine.st_ino)


def _link_error(store: Path, path: Path) -> LockFileError:
    return LockFileError(f"the lock file path {path} of the store {store} is a symbolic link; the lock is a file "
                         "of its own and is never written through a link: remove the link or choose another --out")


def _open_existing(store: Path, path: Path) -> int | None:
    """Open the regular file at ``path`` for inspection, without following a link; None if it is gone.

    Raises:
        LockFileError: ``path`` is a symbolic link or not a regular file.
        StoreError: the file cannot be opened (its permissions).
    """
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(found.st_mode):
        raise _link_error(store, path)
    if not stat.S_ISREG(found.st_mode):
        raise LockFileError(f"the lock file path {path} of the store {store} is taken by something that is not a "
                            "file (a folder?); remove it or choose another --out")
    try:
        descriptor = os.open(path, _OPEN | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:  # replaced by a link since lstat
            raise _link_error(store, path) from None
        raise StoreError(f"cannot open the lock file {path} of the store {store}: "
                         f"{error.strerror or error}") from error
    if not stat.S_ISREG(os.fstat(descriptor).st_mode):
        os.close(descriptor)
        raise LockFileError(f"the lock file path {path} of the store {store} is taken by something that is not a "
                            "file; remove it or choose another --out")
    return descriptor


def _try_flock(descriptor: int, path: Path) -> bool:
    """Take the exclusive ``flock`` of ``descriptor`` if free; False if another open file holds it."""
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as error:
        raise StoreError(f"cannot lock {path} (the file system may not support flock): "
                         f"{error.strerror or error}") from error


class StoreLock:
    """An exclusive lock on writing one store, held from :meth:`acquire` to :meth:`release`.

    Use as a context manager, or call :meth:`release` in a ``finally``.
    """

    def __init__(self, store: Path, path: Path, descriptor: int) -> None:
        self.store = store
        self.path = path
        self._descriptor: int | None = descriptor

    @classmethod
    def acquire(cls, store: str | Path) -> "StoreLock":
        """Lock ``store`` for this process, creating its parent folder if needed.

        Raises:
            StoreLockedError: another live process holds the lock; the message names it.
            LockFileError: the lock file's path holds a symbolic link, a folder, or a file
                that is not a lock record of this library (left untouched).
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
        deadline = time.monotonic() + _CREATION_SECONDS
        while True:
            try:
                descriptor = os.open(path, _OPEN | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:  # a link, a lock file, or anything else: inspected, never followed
                descriptor = _open_existing(store, path)
                if descriptor is None:  # released meanwhile
                    continue
                created = False
            except OSError as error:
                raise StoreError(f"cannot write the lock file {path} in the folder {path.parent}: "
                                 f"{error.strerror or error}") from error
            try:
                lock = cls._lock(store, path, descriptor, created, deadline)
            except BaseException:
                os.close(descriptor)
                raise
            if lock is not None:
                return lock
            os.close(descriptor)
            time.sleep(0.01)

    @classmethod
    def _lock(cls, store: Path, path: Path, descriptor: int, created: bool, deadline: float) -> "StoreLock | None":
        """Lock the opened ``descriptor`` and write this process's record in it; None to try again."""
        # Whoever inspects a new file (an empty one) holds its flock only for a moment.
        while not _try_flock(descriptor, path):
            if not created or time.monotonic() > deadline:
                raise StoreLockedError(cls._locked_message(store, path, _contents(descriptor) or ""))
            time.sleep(0.01)
        # A holder that released between our open and our flock has removed the file we
        # opened; a lock on that removed file keeps nobody out, so lock the current one.
        if not _is_file_at(descriptor, path):
            return None
        if not created:
            text = _contents(descriptor)
            previous = None if text is None else _holder(text)
            if previous is None:
                if text == "" and time.monotonic() < deadline:
                    return None  # a lock file whose creator has not locked it yet
                raise LockFileError(f"{path} exists and is not a lock file of {WRITTEN_BY} (it holds no lock "
                                    f"record); it is left as it is: move it away, or choose another --out than "
                                    f"{store}")
            log.info("took over the lock file %s of process %s on %s (since %s), which no longer holds it",
                     path, previous["pid"], previous["host"], previous["since"])
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                             "since": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "store": str(store),
                             "lock_of": WRITTEN_BY}).encode("utf-8")
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, record, 0)
        return cls(store, path, descriptor)

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
        return self._descriptor is not None

    def release(self, *, raise_errors: bool = True) -> None:
        """Remove the lock file and drop the lock; does nothing if already released.

        Only the file this lock holds is removed: if something else is at the path now, it stays.

        Raises:
            LockFileError: the lock file cannot be removed (its folder became read-only or
                immutable); with ``raise_errors=False`` this is logged as a warning instead, for
                a release on the way out of another error. The lock itself is dropped either way,
                and the file left is taken over by the next run.
        """
        if self._descriptor is None:
            return
        try:
            # Removed while still locked: a process that opens the file now finds it gone
            # once it gets the lock, and locks a new file instead.
            if _is_file_at(self._descriptor, self.path):
                os.unlink(self.path)
        except OSError as error:
            message = (f"the lock file {self.path} could not be removed ({error.strerror or error}); the run "
                       f"itself has ended: remove the file once its folder {self.path.parent} is writable (a "
                       "later run takes it over by itself)")
            if raise_errors:
                raise LockFileError(message) from error
            log.warning("%s", message)
        finally:
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> "StoreLock":
        return self

    def __exit__(self, exc_type: type | None, *exc_info: object) -> None:
        # An error raised inside the block is the one to report, not a failed removal.
        self.release(raise_errors=exc_type is None)
