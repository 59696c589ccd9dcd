"""Shared set-up of the benchmarks: the machine's description in every JSON result."""

from __future__ import annotations

import datetime
import platform

import torch


def pytest_benchmark_update_machine_info(config, machine_info):
    machine_info["torch"] = torch.__version__
    try:
        import triton

        machine_info["triton"] = triton.__version__
    except ImportError:
        machine_info["triton"] = None
    machine_info["torch_threads"] = torch.get_num_threads()
    machine_info["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else \
        (platform.processor() or platform.machine())
    machine_info["date"] = datetime.date.today().isoformat()
