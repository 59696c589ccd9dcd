"""Shared set-up of the benchmarks: the machine's description in every JSON result.

A run stopped by Ctrl-C or ``timeout -s INT`` still writes its ``--benchmark-json``: the
benchmark that was cut off (one without a finished round) is left out, the finished ones
are kept.
"""

from __future__ import annotations

import datetime
import platform

import pytest
import torch


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


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    # Runs before pytest-benchmark's own wrapper saves the JSON, which fails on a
    # benchmark without data (one interrupted before its first round finished).
    benchmark_session = getattr(session.config, "_benchmarksession", None)
    if benchmark_session is not None:
        benchmark_session.benchmarks[:] = [b for b in benchmark_session.benchmarks if b]
    yield
