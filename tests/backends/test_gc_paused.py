"""Python's cyclic garbage collector paused while a signature is captured, traced, compiled or loaded."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import omenn_kernels.api
from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.gc_paused import gc_paused

from test_compiled_backend import _model


@pytest.fixture
def collector_on():
    """The collector on at the start (as Python starts it) and as it was at the end."""
    was_enabled = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was_enabled else gc.disable)()


def test_the_pause_ends_with_the_last_overlapping_step_and_keeps_a_collector_that_was_off(collector_on):
    first_inside, second_done = threading.Event(), threading.Event()
    seen = []

    def first():
        with gc_paused():
            first_inside.set()
            second_done.wait(timeout=30)
            seen.append(("first, after the second ended", gc.isenabled()))

    thread = threading.Thread(target=first)
    thread.start()
    first_inside.wait(timeout=30)
    with gc_paused():
        seen.append(("second", gc.isenabled()))
    second_done.set()
    thread.join(timeout=30)
    assert seen == [("second", False), ("first, after the second ended", False)]
    assert gc.isenabled()

    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()


def test_capture_trace_compile_and_load_run_without_collections(collector_on, monkeypatch, tmp_path):
    """The collector is off while the model is captured, while the explanation is traced and
    compiled, and while a new Explainer loads the saved graph; on again between and after."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "SAVE_WITH_ANY_COMPILER", True)
    seen = []
    capture = omenn_kernels.api.capture
    monkeypatch.setattr(omenn_kernels.api, "capture",
                        lambda *args, **kwargs: seen.append(("capture", gc.isenabled())) or capture(*args, **kwargs))
    monkeypatch.setattr(compiled, "COMPILER",
                        lambda graph, example: seen.append(("compile", gc.isenabled())) or graph)
    model, x = _model("mlp", torch.float64)
    for _ in range(2):  # traced and saved, then loaded by a new Explainer
        explainer = Explainer(model, backend="compiled")
        explainer(x, 1)
        seen.append(("after", gc.isenabled()))
        (kept,) = compiled.explanations(explainer.program(x)[0]).values()
        seen.append(("stages", tuple(kept.stages)[0]))
    assert seen == [("capture", False), ("compile", False), ("after", True), ("stages", "trace"),
                    ("capture", False), ("compile", False), ("after", True), ("stages", "load")]
