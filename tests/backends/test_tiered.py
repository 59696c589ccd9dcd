"""``auto`` tiers: the device's eager backend until a signature's eager calls have taken
``COMPILE_AFTER_SECONDS``, then compiled (here with the traced graph itself as the compiler,
and a clock that advances one second per eager call).

* The switch comes at the documented call, compiles once for every batch size, and every
  call equals the fused backend's explanation (float64, relative Frobenius 1e-10).
* ``runs_on`` says which tier ran.
* Differentiable explanations and plain-function read-outs stay on fused.
* A failed compilation leaves the fused tier running, after one warning.
* With ``reference`` as the eager tier (CUDA's, here on the CPU) the same holds, and a failed
  compilation goes back to ``reference``.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from omenn_kernels import Explainer, backends
from omenn_kernels.backends import compiled, fused, reference, tiered
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


def _tiers(model, side: int, sizes: tuple[int, ...], oracle: Explainer) -> list[str]:
    """The tier each call of an ``auto`` explainer of ``model`` ran, one call per batch size, each
    checked against ``oracle``'s explanation."""
    explainer = Explainer(model)
    tiers = []
    for size in sizes:
        x = _images(size, side)
        _check(explainer(x, 1), oracle(x, 1))
        program, classes = explainer.program(x)
        tiers.append(explainer._backend.runs_on(program, model, x, checked_readout(1, size, classes, x.device)))
    return tiers


def test_auto_compiles_a_signature_once_it_is_hot(compilations):
    model, side = _model()
    tiers = _tiers(model, side, (4, 2, 4, 3, 4, 5, 2), Explainer(model, backend="fused"))
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


def _counted(monkeypatch, module) -> list[int]:
    """The batch sizes ``module.explain_batch`` is called with, from now on."""
    calls, explain_batch = [], module.explain_batch
    monkeypatch.setattr(module, "explain_batch", lambda program, model, x, *args: calls.append(x.shape[0]) or
                        explain_batch(program, model, x, *args))
    return calls


def test_auto_tiers_from_the_eager_backend_of_the_device(compilations, monkeypatch):
    """CUDA's eager tier, ``reference``, tiered on the CPU: three reference calls, then compiled."""
    monkeypatch.setitem(backends.AUTO_EAGER, "cpu", "reference")
    model, side = _model()
    references = _counted(monkeypatch, reference)
    tiers = _tiers(model, side, (4, 4, 4, 4, 2), Explainer(model, backend="reference"))
    assert compilations == [4]
    assert tiers == ["reference"] * 3 + ["compiled"] * 2
    assert references == [4] * 3 + [4, 4, 4, 4, 2]  # the explainer's three, then the oracle's


def test_a_failed_compilation_goes_back_to_the_eager_backend(compilations, monkeypatch):
    def failing(graph, example):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(compiled, "COMPILER", failing)
    monkeypatch.setitem(backends.AUTO_EAGER, "cpu", "reference")
    model, side = _model()
    explainer = Explainer(model)
    x = _images(2, side)
    references, fuseds = _counted(monkeypatch, reference), _counted(monkeypatch, fused)
    for _ in range(3):
        explainer(x, 1)
    with pytest.warns(RuntimeWarning, match="could not compile .* no C\\+\\+ compiler"):
        explainer(x, 1)  # the compiled backend's first call: fused's explanation, traced
    fuseds_at_failure = len(fuseds)
    for _ in range(2):
        explainer(x, 1)
    assert references == [2] * 5 and len(fuseds) == fuseds_at_failure
