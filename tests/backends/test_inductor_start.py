"""What Inductor computes once per process, on a thread of its own (backends/inductor_start.py):
started once, before the capture of a compiled backend's program on the CPU and only there, and
finished before Inductor compiles. Inductor's probe is replaced by one that waits for the test,
and the hashes of its cache keys by ones that record their thread."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from torch._inductor import codecache, cpu_vec_isa

from omenn_kernels import Explainer
from omenn_kernels.backends import Backend, compiled, direct_inductor, inductor_start

THREAD = "omenn-kernels-inductor-start"
RAN = [THREAD, f"torch_key: {THREAD}", f"get_system: {THREAD}"]


@pytest.fixture
def probe(monkeypatch, tmp_path) -> SimpleNamespace:
    """``ran``: the threads the probe ran on, then the hashes' (named); the probe runs once ``release``
    is set. No probe started before."""
    state = SimpleNamespace(ran=[], release=threading.Event())

    def valid_vec_isa_list():
        state.release.wait(10)
        state.ran.append(threading.current_thread().name)
        return []

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # where a compiled graph is saved
    monkeypatch.setattr(inductor_start, "_thread", None)
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    monkeypatch.setattr(codecache, "torch_key",
                        lambda: state.ran.append(f"torch_key: {threading.current_thread().name}"))
    monkeypatch.setattr(codecache.CacheBase, "get_system",
                        lambda: state.ran.append(f"get_system: {threading.current_thread().name}"))
    yield state
    state.release.set()
    inductor_start.wait()


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.GELU(), torch.nn.Linear(3, 2)).eval()


def test_the_work_runs_once_on_its_own_thread(probe):
    inductor_start.start()
    inductor_start.start()
    assert probe.ran == []  # started, not waited for
    probe.release.set()
    inductor_start.wait()
    assert probe.ran == RAN


@pytest.mark.parametrize("backend, device, starts", [("compiled", "cpu", True), ("auto", "cpu", False),
                                                     ("fused", "cpu", False), ("compiled", "meta", False)])
def test_the_compiled_backend_starts_the_probe_before_a_capture_on_the_cpu(backend, device, starts, probe):
    Backend(backend).before_capture(torch.device(device))
    assert (inductor_start._thread is not None) == starts


def test_no_probe_for_another_compiler(probe, monkeypatch):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    Explainer(_mlp(), backend="compiled", feature_dim=1)(torch.randn(2, 4))
    assert inductor_start._thread is None


def test_inductor_compiles_once_the_probe_has_finished(probe, monkeypatch):
    events, wait = [], inductor_start.wait

    def waited():
        probe.release.set()
        wait()
        events.append(f"waited: {probe.ran}")

    def compile_graph(graph, example_inputs, cpp_wrapper):
        events.append("compiled")
        return graph

    monkeypatch.setattr(inductor_start, "wait", waited)
    monkeypatch.setattr(direct_inductor, "compile_graph", compile_graph)
    Explainer(_mlp(), backend="compiled", feature_dim=1)(torch.randn(2, 4))
    assert events == [f"waited: {RAN}", "compiled"]
