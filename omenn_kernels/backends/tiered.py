"""``auto``: the device's eager backend until a signature is hot, then the compiled one, as a JIT tiers.

The eager tier is ``fused`` on the CPU and ``reference`` on CUDA (``backends.AUTO_EAGER``).

Cost model. Compiling a signature (:mod:`~omenn_kernels.backends.compiled`; one graph serves
every batch size) takes seconds on a warm Inductor cache and one to a few minutes on an empty
one, once; each call after it takes about 0.5–0.9× the fused backend's time on the CPU and about
0.2× the reference backend's on CUDA (the README's Performance section). Compiling at the first
call would charge a short session minutes it never earns back; never compiling charges a long one
10–80 % of every call. As in the ski-rental problem, a signature is compiled once its eager calls
have taken about as long as a compilation does, :data:`COMPILE_AFTER_SECONDS` in all
(:data:`COMPILE_SAVED_AFTER_SECONDS` where a process saved the signature's graph,
:mod:`~omenn_kernels.backends.saved_graphs`): whichever way the session goes on, it spends at
most about twice the time of the better choice made in hindsight.

Only first-order explanations tier. Differentiable ones (``create_graph``, training) stay on
the eager backend (on the CPU the training benchmarks show fused faster than compiled on CNNs);
so do read-outs that the compiled backend does not trace (plain functions). A signature whose
compilation fails or does not pass its checks stays on the eager backend, after one warning (the
compiled backend's). On CUDA each eager call is timed to the end of its kernels (the device is
synchronized before the clock is read), so the calls before the switch do not overlap.

A run that knows its length (``omenn explain``: the number of batches, all of one signature)
needs no switch: it decides once, before its first batch, with :func:`pays_to_compile`. A
compilation costs about :data:`COMPILE_AFTER_SECONDS` and saves a share of each call
(:data:`COMPILED_SAVING`, the lowest measured for the device), so the run is compiled when
that share of its eager time exceeds a compilation's.

Numbers: calls before the switch return the eager backend's explanation, calls from it on the
compiled graph's, which differ from it by rounding (checked at compile time, in the least precise
type the model computes in: 1e-4 relative in float32, 1e-8 in float64). The switch follows
measured time, so two runs of one script can switch at different calls; name a backend
(``fused`` or ``compiled``) for numbers that do not depend on timing. ``omenn explain``'s ``auto`` runs one backend for the whole run and records it
in the store, so that a resumed run goes on with the same one.
"""

from __future__ import annotations

import logging
import time
import weakref
from types import ModuleType
from typing import Callable

import torch

from ..linearize.program import LinearizedProgram
from ..readout import Readout
from . import compiled, fused
from .executor import BackendExplanation, ParameterGradient

log = logging.getLogger("omenn_kernels.tiered")

# Seconds of eager calls after which a signature is compiled: about a compilation's time on an
# empty Inductor cache on one CPU thread (half a minute for a ViT-S, the parts models or a small
# LM, about a minute for a ResNet-50 or a ViT-B/16; bench/README.md).
COMPILE_AFTER_SECONDS = 60.0
# The same for a signature whose checked graph a process saved earlier (see saved_graphs): about
# the time to load it and read Inductor's code back for a ViT-S on one CPU thread.
COMPILE_SAVED_AFTER_SECONDS = 10.0
# Per device type, the share of the eager backend's time a compiled explanation saves, at least:
# the lowest of the committed benchmarks (bench/README.md). CPU: compiled takes 0.65-0.97x
# fused's time (ResNet-50 at batch 8 saves least). CUDA (H200): compiled takes 0.18-0.22x the
# reference backend's time (ViT-B/16 and ResNet-50, bf16, batch 64).
COMPILED_SAVING = {"cpu": 0.03, "cuda": 0.75}
# What times the eager calls; tests may swap in a clock of their own.
CLOCK: Callable[[], float] = time.perf_counter


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None,
                  eager: ModuleType = fused) -> BackendExplanation:
    """The explanation of ``readout`` from the tier its signature has reached (see the module
    docstring); ``eager`` is the eager tier's backend module."""
    key = _hot_key(program, model, x, readout, parameter_gradient)
    if key is None:
        return eager.explain_batch(program, model, x, readout, parameter_gradient)
    spent = _EAGER_SECONDS.setdefault(program, {})
    if spent.get(key, 0.0) >= _compile_after(program, model, x, readout, key):
        if compiled.runs_fused(program, model, x, readout):  # its compilation or check failed
            return eager.explain_batch(program, model, x, readout)
        if key not in compiled.explanations(program):  # this call compiles
            log.info("the explanation of %s has run on the %s backend for %.0f s: compiling it (seconds on a "
                     "warm Inductor cache or from a saved graph, minutes on an empty cache)",
                     type(model).__name__, eager.__name__.rsplit(".", 1)[-1], spent[key])
        return compiled.explain_batch(program, model, x, readout)
    start = _finished(x.device)
    explanation = eager.explain_batch(program, model, x, readout)
    spent[key] = spent.get(key, 0.0) + _finished(x.device) - start
    return explanation


def _finished(device: torch.device) -> float:
    """:data:`CLOCK` once the work queued on ``device`` has run."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return CLOCK()


def pays_to_compile(seconds_per_call: float, calls: int, device: torch.device) -> bool:
    """Whether ``calls`` explanations of one signature, each taking ``seconds_per_call`` on the
    eager backend of ``device``, are done sooner compiled: when the share
    :data:`COMPILED_SAVING` of their time exceeds a compilation's, :data:`COMPILE_AFTER_SECONDS`."""
    saving = COMPILED_SAVING.get(device.type, 0.0)
    return calls * seconds_per_call * saving > COMPILE_AFTER_SECONDS


def runs_compiled(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> bool:
    """Whether :func:`explain_batch` of these arguments only runs a graph compiled earlier."""
    key = _hot_key(program, model, x, readout, parameter_gradient)
    return key is not None and \
        _EAGER_SECONDS.get(program, {}).get(key, 0.0) >= _compile_after(program, model, x, readout, key) and \
        compiled.replays(program, model, x, readout)


def _compile_after(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                   key: tuple) -> float:
    """The seconds of eager calls after which the signature ``key`` is compiled: fewer where a
    process saved its graph (looked up once per signature)."""
    thresholds = _THRESHOLDS.setdefault(program, {})
    if key not in thresholds:
        thresholds[key] = COMPILE_SAVED_AFTER_SECONDS if compiled.saved(program, model, x, readout) \
            else COMPILE_AFTER_SECONDS
    return thresholds[key]


def _hot_key(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
             parameter_gradient: ParameterGradient | None) -> tuple | None:
    """The compiled backend's signature of a first-order explanation it traces, or None: it stays eager."""
    if parameter_gradient is not None:
        return None
    return compiled.signature(program, model, x, readout)


# Per program and compiled signature, the seconds of eager calls after which it is compiled.
_THRESHOLDS: weakref.WeakKeyDictionary[LinearizedProgram, dict[tuple, float]] = weakref.WeakKeyDictionary()
# Per program and compiled signature, the seconds its eager calls have taken.
_EAGER_SECONDS: weakref.WeakKeyDictionary[LinearizedProgram, dict[tuple, float]] = weakref.WeakKeyDictionary()
