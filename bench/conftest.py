"""Shared set-up of the benchmarks: the machine's description in every JSON result.

``--keep-freed-memory`` runs the whole session with glibc keeping freed memory
(:func:`omenn_kernels.cpu_memory.keep_freed_memory`, as ``omenn explain`` does on the
CPU); the machine info records whether it was set.

A run stopped by Ctrl-C or ``timeout -s INT`` still writes its ``--benchmark-json``: the
benchmark that was cut off (one without a finished round) is left out, the finished ones
are kept.
"""

from __future__ import annotations

import datetime
import platform

import pytest
import torch

from omenn_kernels.cpu_memory import keep_freed_memory

_KEPT = pytest.StashKey[bool]()


def pytest_addoption(parser):
    parser.addoption("--keep-freed-memory", action="store_true",
                     help="glibc keeps freed memory for the whole session (process-wide)")


def pytest_configure(config):
    config.stash[_KEPT] = keep_freed_memory() if config.getoption("--keep-freed-memory") else False


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    try:
        import triton

        machine_info["triton"] = triton.__version__
    except ImportError:
        machine_info["triton"] = None
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["cuda"] = torch.cuda.is_available()
    machine_info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        (platform.processor() or platform.machine())
    machine_info["date"] = datetime.date.today().isoformat()
    machine_info["keep_freed_memory"] = config.stash[_KEPT]


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # Runs before pytest-benchmark's own wrapper saves the JSON, which fails on a
    # benchmark without data (one interrupted before its first round finished).
    benchmark_session = getattr(session.config, "_benchmarksession", None)
    if benchmark_session is not None:
        benchmark_session.benchmarks[:] = [b for b in benchmark_session.benchmarks if b]
    yield
