"""Read-outs: what an explanation reads out of the model's logits. :func:`checked_readout` turns
every form of target into a :class:`Readout` once per call; the backends read ``ŷ`` with it."""

from __future__ import annotations

import numbers
import reprlib
from dataclasses import dataclass
from typing import Callable, Sequence, Union

import numpy as np
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
        return _checked_weights(self.function(logits, *self.arguments), *logits.shape, returned=True, finite=False)


Target = Union[int, Sequence[int], np.ndarray, torch.Tensor, None]
Readouts = Union[torch.Tensor, ReadoutFunction, Callable[[torch.Tensor], torch.Tensor]]


@dataclass(frozen=True, eq=False)
class Readout:
    """A batch's read-out of the logits, checked: ``target`` is (B,) class indices, (B, K) or (B, T, K)
    read-out weights, a function of the detached logits returning (B, T, K) weights, or None (the
    predicted class)."""

    target: torch.Tensor | ReadoutFunction | Callable[[torch.Tensor], torch.Tensor] | None

    @property
    def kind(self) -> str:
        """``predicted``, ``indices``, ``weights``, ``function`` (a ReadoutFunction) or ``callable``."""
        if isinstance(self.target, torch.Tensor):
            return "weights" if self.target.is_floating_point() else "indices"
        if self.target is None:
            return "predicted"
        return "function" if isinstance(self.target, ReadoutFunction) else "callable"

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors it reads besides the logits (the inputs a traced explanation takes for them)."""
        if isinstance(self.target, ReadoutFunction):
            return tuple(a for a in self.target.arguments if isinstance(a, torch.Tensor))
        return (self.target,) if isinstance(self.target, torch.Tensor) else ()

    def with_tensors(self, tensors: Sequence[torch.Tensor]) -> Readout:
        """The same read-out of ``tensors`` in place of :attr:`tensors` (a trace's inputs, or copies)."""
        if isinstance(self.target, ReadoutFunction):
            given = iter(tensors)
            return Readout(ReadoutFunction(self.target.function, tuple(
                next(given) if isinstance(a, torch.Tensor) else a for a in self.target.arguments)))
        return Readout(tensors[0]) if isinstance(self.target, torch.Tensor) else self

    def chosen(self, logits: torch.Tensor) -> torch.Tensor:
        """The target explained on ``logits`` (B, K): class indices or read-out weights."""
        if self.target is None:
            return logits.detach().argmax(-1)
        return self.target(logits.detach()) if callable(self.target) else self.target

    @staticmethod
    def value(logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``ŷ`` of ``logits`` for the ``chosen`` target: (B,), or (B, T) for T read-outs."""
        if not chosen.is_floating_point():
            return logits.gather(1, chosen.unsqueeze(1)).squeeze(1)
        weights = chosen.to(logits.dtype)
        return ((logits.unsqueeze(1) if weights.dim() == 3 else logits) * weights).sum(-1)


def checked_readout(target: Target | Readouts | Readout, batch: int, classes: int, device: torch.device,
                    several: bool = False) -> Readout:
    """``target`` as the read-out of ``batch`` inputs of a model with ``classes`` logits; a TargetError
    naming what does not fit. One per input: an int class, (B,) classes, (K,) or (B, K) weights, or
    None (the predicted class); ``several``: (B, T, K) weights or a function of the logits returning
    them. A :class:`Readout` is taken as it is."""
    if isinstance(target, Readout):
        return target
    if several and isinstance(target, ReadoutFunction):
        return Readout(target)
    if several and callable(target):  # what it returns is checked as given weights are
        return Readout(lambda logits: _checked_weights(target(logits), batch, classes, True, True).to(device))
    if several:
        return Readout(_checked_weights(target, batch, classes, returned=False, finite=True).to(device))
    return Readout(_one_per_input(target, batch, classes, device))


def _checked_weights(weights: object, batch: int, classes: int, returned: bool, finite: bool) -> torch.Tensor:
    """``weights`` if they are (B, T, K) floating-point read-out weights (and finite where asked)."""
    if not isinstance(weights, torch.Tensor) or not weights.is_floating_point() or weights.dim() != 3 or \
            weights.shape[0] != batch or weights.shape[2] != classes or weights.shape[1] == 0:
        shown = f"shape {tuple(weights.shape)} and dtype {weights.dtype}" \
            if isinstance(weights, torch.Tensor) else f"type {type(weights).__name__}"
        given = "the read-out function returned" if returned else "the read-outs have"
        raise TargetError(f"{given} {shown}; read-outs must be a floating-point tensor of shape "
                          f"({batch}, T, {classes}) with T ≥ 1")
    if finite and not bool(torch.isfinite(weights).all()):
        raise TargetError("read-out weights contain NaN or Inf")
    return weights


def shown(values: torch.Tensor) -> str:
    """The values of a small target, or its shape and dtype if it is large."""
    if values.numel() <= 8:
        return str(values.tolist())
    return f"a tensor of shape {tuple(values.shape)} and dtype {values.dtype}"


def as_tensor(target: Sequence | np.ndarray) -> torch.Tensor:
    """A list, tuple or numpy array of targets as a tensor, refusing what is not numbers."""
    array = np.asarray(target)
    if array.dtype.kind not in "biufc":  # object (ints beyond 64 bits, ragged lists), strings, dates
        raise TargetError(f"the target {reprlib.repr(array.tolist())} is not class indices or read-out weights "
                          f"(as a numpy array its dtype is {array.dtype})")
    return torch.as_tensor(array)


def _one_per_input(target: Target, batch: int, classes: int, device: torch.device) -> torch.Tensor | None:
    """``target`` as (B,) class indices or (B, K) read-out weights (None: the predicted class)."""
    if target is None:
        return None
    if isinstance(target, (bool, np.bool_)):
        raise TargetError("the target must be a class index, indices or read-out weights, not a bool")
    if isinstance(target, (list, tuple, np.ndarray)):
        target = as_tensor(target)
    if isinstance(target, numbers.Integral):
        if not 0 <= int(target) < classes:  # checked before torch.tensor, which overflows beyond 64 bits
            raise TargetError(f"target class out of range: got {int(target)}, the model has {classes} "
                              f"classes (valid: 0..{classes - 1})")
        return torch.full((batch,), int(target), dtype=torch.long, device=device)
    if not isinstance(target, torch.Tensor):
        given = reprlib.repr(target.item() if isinstance(target, np.generic) else target)
        raise TargetError(f"unsupported target type {type(target).__name__} ({given}); use an int, "
                          "a (B,) integer tensor, or (K,) / (B, K) read-out weights")
    if target.dtype == torch.bool:
        raise TargetError("the target must be class indices or read-out weights, not a bool tensor")
    if target.is_complex():
        raise TargetError(f"the target {shown(target)} is complex ({target.dtype}); class indices must be "
                          "integers and read-out weights real floating-point numbers")
    if not target.is_floating_point():  # checked where the indices are: no device sync for host targets
        if target.dim() > 1:
            raise TargetError(f"integer targets must be a class index or (B,) indices; got shape "
                              f"{tuple(target.shape)}")
        if target.dtype == torch.uint64 and bool((target.double() >= classes).any()):
            # .long() would wrap these around to negative numbers
            raise TargetError(f"target class out of range: got {shown(target)}, the model has "
                              f"{classes} classes (valid: 0..{classes - 1})")
        indices = target.long().reshape(-1)
        if target.dim() == 0:
            indices = indices.expand(batch)
        if indices.numel() != batch:
            raise TargetError(f"got {indices.numel()} target indices for a batch of {batch} images")
        if bool(((indices < 0) | (indices >= classes)).any()):
            raise TargetError(f"target class out of range: got {indices.tolist()}, the model has "
                              f"{classes} classes (valid: 0..{classes - 1})")
        return indices.to(device)
    target = target.to(device)
    if target.dim() == 1 and target.numel() == classes:
        target = target.expand(batch, classes)
    if target.dim() != 2 or tuple(target.shape) != (batch, classes):
        hint = ""
        if target.dim() == 1 and target.numel() == batch:
            hint = (f" ({shown(target)} looks like one class per image: class indices must be an "
                    "integer tensor)")
        raise TargetError(f"read-out weights must have shape ({classes},) or ({batch}, {classes}); "
                          f"got {tuple(target.shape)}{hint}")
    if not bool(torch.isfinite(target).all()):
        raise TargetError("read-out weights contain NaN or Inf")
    return target
