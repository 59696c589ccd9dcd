"""Runs the ``omenn`` command with the store's creation and chunk writes slowed down (store-safety tests).

The delays stretch short moments into windows that a test can hit from outside, by
killing the process or by starting a second one. They are patched in here, never in
the library.

Environment:
    OMENN_TEST_CREATE_DELAY: seconds to sleep after each array of a new store is created.
    OMENN_TEST_WRITE_DELAY: seconds to sleep before each chunk is written.

Prints ``creating`` (flushed) on stdout when the store's creation begins.

Usage: ``python slowed_cli.py explain SOURCE --out STORE ...`` (the arguments of ``omenn``).
"""

from __future__ import annotations

import os
import sys
import time

import zarr

from omenn_kernels.bulk.store import AttributionStore
from omenn_kernels.cli import main

CREATE_DELAY = float(os.environ.get("OMENN_TEST_CREATE_DELAY", "0"))
WRITE_DELAY = float(os.environ.get("OMENN_TEST_WRITE_DELAY", "0"))

create_array = zarr.Group.create_array
create_store = AttributionStore.create
write_chunk = AttributionStore.write_chunk


def slow_create_array(self, *args, **kwargs):
    array = create_array(self, *args, **kwargs)
    time.sleep(CREATE_DELAY)
    return array


def announced_create(cls, *args, **kwargs):
    print("creating", flush=True)
    return create_store(*args, **kwargs)


def slow_write_chunk(self, *args, **kwargs):
    time.sleep(WRITE_DELAY)
    return write_chunk(self, *args, **kwargs)


zarr.Group.create_array = slow_create_array
AttributionStore.create = classmethod(announced_create)
AttributionStore.write_chunk = slow_write_chunk

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
