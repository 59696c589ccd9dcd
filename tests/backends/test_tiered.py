"""``auto`` on the CPU tiers: fused until a signature's fused calls have taken
``COMPILE_AFTER_SECONDS``, then compiled (here with the traced graph itself as the compiler,
and a clock that advances one second per fused call).

* The switch comes at the documented call, compiles once for every batch size, and every
  call equals the fused backend's explanation (float64, relative Frobenius 1e-10).
* ``runs_on`` says which tier ran.
* Differentiable explanations and plain-function read-outs stay on fused.
* A failed compilation leaves the fused tier running, after one warning.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled, tiered
from omenn_kernels.readout import checked_readout
from omenn_kernels.testing import FAMILIES, randomize_
from test_batch_sizes import _check  # every field within 1e-10 relative (Frobenius)


@pytest.fixture
def compilations(monkeypatch) -> list[int]:
    """The batch sizes graphs are compiled at; a clock of one second per fused call; hot after 3 s."""
    compiled_at = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: compiled_at.append(example[0].shape[0]) or graph)
    ticks = itertools.count()
    monkeypatch.setattr(tiered, "CLOCK", lambda: float(next(ticks)))
    monkeypatch.setattr(tiered, "COMPILE_AFTER_SECONDS", 3.0)
    return compiled_at


def _model():
    family = FAMILIES["cnn"]
    torch.manual_seed(11)
    return randomize_(family.build(), seed=11).double().eval(), family.size


def _images(size: int, side: int) -> torch.Tensor:
    return torch.randn(size, 3, side, side, dtype=torch.float64)


def test_auto_compiles_a_signature_once_it_is_hot(compilations):
    model, side = _model()
    explainer, fused = Explainer(model), Explainer(model, backend="fused")
    tiers = []
    for size in (4, 2, 4, 3, 4, 5, 2):
        x = _images(size, side)
        _check(explainer(x, 1), fused(x, 1))
        program, classes = explainer.program(x)
        tiers.append(explainer._backend.runs_on(program, model, x, checked_readout(1, size, classes, x.device)))
    # Fused calls 1–3 take 3 s: call 4 compiles, at its batch of 3, which serves the other sizes.
    assert compilations == [3]
    assert tiers == ["fused"] * 3 + ["compiled"] * 4


def test_differentiable_explanations_and_plain_function_readouts_stay_on_fused(compilations):
    model, side = _model()
    explainer = Explainer(model)
    x = _images(2, side)
    for _ in range(5):
        explainer(x, 1, create_graph=True)
        explainer.explain_targets(x, lambda logits: torch.eye(10, dtype=logits.dtype)[None, :2].expand(2, 2, 10))
    assert compilations == []


def test_a_failed_compilation_leaves_the_fused_tier_running(compilations, monkeypatch):
    def failing(graph, example):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(compiled, "COMPILER", failing)
    model, side = _model()
    explainer, fused = Explainer(model), Explainer(model, backend="fused")
    x = _images(2, side)
    for _ in range(3):
        _check(explainer(x, 1), fused(x, 1))
    with pytest.warns(RuntimeWarning, match="could not compile .* no C\\+\\+ compiler"):
        _check(explainer(x, 1), fused(x, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for _ in range(2):
            _check(explainer(x, 1), fused(x, 1))


def test_auto_loads_a_saved_graph_after_fewer_fused_seconds(compilations, monkeypatch, tmp_path):
    """Where a process saved the signature's graph, ``auto`` compiles (loads it) once its fused
    calls have taken ``COMPILE_SAVED_AFTER_SECONDS`` (here 1 s: after one call)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compiled, "SAVE_WITH_ANY_COMPILER", True)
    monkeypatch.setattr(tiered, "COMPILE_SAVED_AFTER_SECONDS", 1.0)
    model, side = _model()
    x = _images(4, side)
    Explainer(model, backend="compiled")(x, 1)  # traced and saved
    explainer, fused = Explainer(model), Explainer(model, backend="fused")
    tiers = []
    for _ in range(3):
        _check(explainer(x, 1), fused(x, 1))
        program, classes = explainer.program(x)
        tiers.append(explainer._backend.runs_on(program, model, x, checked_readout(1, 4, classes, x.device)))
    assert tiers == ["fused", "compiled", "compiled"]
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    assert tuple(kept.stages) == ("load",)
