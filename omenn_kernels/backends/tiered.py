"""``auto`` on the CPU: the fused backend until a signature is hot, then the compiled one, as a JIT tiers.

Cost model. Compiling a signature (:mod:`~omenn_kernels.backends.compiled`; one graph serves
every batch size) takes seconds on a warm Inductor cache and one to a few minutes on an empty
one, once; each call after it takes about 0.5–0.9× the fused backend's time (the README's
Performance section). Compiling at the first call would charge a short session minutes it never
earns back; never compiling charges a long one 10–50 % of every call. As in the ski-rental
problem, a signature is compiled once its fused calls have taken about as long as a compilation
does, :data:`COMPILE_AFTER_SECONDS` in all: whichever way the session goes on, it spends at most
about twice the time of the better choice made in hindsight.

Only first-order explanations tier. Differentiable ones (``create_graph``, training) stay on
fused, which the training benchmarks show faster than compiled on CNNs; so do read-outs that
the compiled backend does not trace (plain functions). A signature whose compilation fails or
does not pass its checks stays on fused, after one warning (the compiled backend's).

Numbers: calls before the switch return the fused backend's explanation, calls from it on the
compiled graph's, which differ from it by rounding (checked at compile time: 1e-5 relative
in float32, 1e-8 in float64). The switch follows measured time, so two runs of one script can
switch at different calls; name a backend (``fused`` or ``compiled``) for numbers that do not
depend on timing (``omenn explain`` does: its ``auto`` is ``fused``).
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import Callable

import torch

from ..linearize.program import LinearizedProgram
from ..readout import Readout
from . import compiled, fused
from .executor import BackendExplanation, ParameterGradient

log = logging.getLogger("omenn_kernels.tiered")

# Seconds of fused calls after which a signature is compiled: about a compilation's time on an
# empty Inductor cache for a ViT-S or a ResNet-50 on one CPU thread.
COMPILE_AFTER_SECONDS = 120.0
# What times the fused calls; tests may swap in a clock of their own.
CLOCK: Callable[[], float] = time.perf_counter


def explain_batch(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> BackendExplanation:
    """The explanation of ``readout`` from the tier its signature has reached (see the module docstring)."""
    key = _hot_key(program, model, x, readout, parameter_gradient)
    if key is None:
        return fused.explain_batch(program, model, x, readout, parameter_gradient)
    spent = _FUSED_SECONDS.setdefault(program, {})
    if spent.get(key, 0.0) >= COMPILE_AFTER_SECONDS:
        if key not in compiled.explanations(program):  # this call compiles
            log.info("the explanation of %s has run on the fused backend for %.0f s: compiling it (seconds on a "
                     "warm Inductor cache, minutes on an empty one)", type(model).__name__, spent[key])
        return compiled.explain_batch(program, model, x, readout)
    start = CLOCK()
    explanation = fused.explain_batch(program, model, x, readout)
    spent[key] = spent.get(key, 0.0) + CLOCK() - start
    return explanation


def runs_compiled(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
                  parameter_gradient: ParameterGradient | None = None) -> bool:
    """Whether :func:`explain_batch` of these arguments only runs a graph compiled earlier."""
    key = _hot_key(program, model, x, readout, parameter_gradient)
    return key is not None and _FUSED_SECONDS.get(program, {}).get(key, 0.0) >= COMPILE_AFTER_SECONDS and \
        compiled.replays(program, model, x, readout)


def _hot_key(program: LinearizedProgram, model: torch.nn.Module, x: torch.Tensor, readout: Readout,
             parameter_gradient: ParameterGradient | None) -> tuple | None:
    """The compiled backend's signature of a first-order explanation it traces, or None: it stays on fused."""
    if parameter_gradient is not None:
        return None
    return compiled.signature(program, model, x, readout)


# Per program and compiled signature, the seconds its fused calls have taken.
_FUSED_SECONDS: weakref.WeakKeyDictionary[LinearizedProgram, dict[tuple, float]] = weakref.WeakKeyDictionary()
