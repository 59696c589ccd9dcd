"""Read-outs as a pure tensor function of the logits: what the compiled backend can trace."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .errors import TargetError


@dataclass(frozen=True, eq=False)
class ReadoutFunction:
    """Read-outs that depend on the prediction, as a pure tensor function that can be compiled.

    ``function(logits, *arguments)`` maps the detached (B, K) logits and the tensors in
    ``arguments`` (e.g. each image's label) to (B, T, K) read-out weights with tensor
    operations only: no Python branch on values, no ``.item()``, no state. The compiled
    backend traces it into the explanation's graph (once per ``function`` object and
    shapes of ``arguments``; keep the same function object across calls), with the
    tensor arguments as graph inputs, so that new argument values are read at every call;
    other arguments (a number ``k``, a string) are baked into the graph, and a new value
    is traced and compiled anew (an unhashable one, such as a list, runs on the fused
    backend). A plain
    callable given to :meth:`Explainer.explain_targets` runs on the fused backend instead,
    since what it reads besides the logits would be baked into a graph.

    The weights' shape and dtype are checked; their values are not (a function that
    returns NaN gives NaN maps).
    """

    function: Callable[..., torch.Tensor]
    arguments: tuple[torch.Tensor, ...] = ()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        weights = self.function(logits, *self.arguments)
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() or weights.dim() != 3 or \
                weights.shape[0] != logits.shape[0] or weights.shape[2] != logits.shape[1] or weights.shape[1] == 0:
            shown = f"shape {tuple(weights.shape)} and dtype {weights.dtype}" \
                if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TargetError(f"the read-out function returned {shown}; it must return floating-point "
                              f"weights of shape ({logits.shape[0]}, T, {logits.shape[1]}) with T ≥ 1")
        return weights
