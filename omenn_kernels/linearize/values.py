"""The kinds of values a linearized program passes between its operations.

* ``Live``: computed from the input; carries its ones channel ``ones`` (the rule
  book's ``O``) next to its ``value``. Both take part in the backward pass.
  Multipliers (activation ``ξ``, ``1/σ``, attention weights) are computed from its
  held value: the same numbers, constant with respect to the input (``Rule.held_args``).
* ``Gate``: computed from the input but held constant (R5): softmax attention
  weights, squeeze-excitation sigmoids and everything that only feeds them.
* anything else (tensors, numbers, shapes): CONST — parameters, buffers, constants.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass
class Live:
    """An input-dependent tensor and its ones channel.

    ``ones`` is broadcastable to ``value``: a dimension of size 1 in ``ones`` means one
    ones value shared along that dimension (one per token or pixel, not per channel).
    Sharing does not change C, C_w or C_b: a shared entry's gradient is the sum of
    the gradients its broadcast copies would get.
    """

    value: torch.Tensor
    ones: torch.Tensor


@dataclass
class Gate:
    """An input-dependent tensor that the linearization holds constant (R5)."""

    value: torch.Tensor


def full_ones(live: Live) -> torch.Tensor:
    """The ones channel expanded (as a view) to the full shape of the value."""
    return live.ones.expand(live.value.shape)


def channels_last(t: torch.Tensor) -> bool:
    """Whether a batch of images ``t`` is in channels-last memory (and not also contiguous, as with one channel)."""
    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def channel_rows(t: torch.Tensor) -> torch.Tensor:
    """Images (N, C, H, W) as (N, H·W, C): one row of channels per position, a view of
    channels-last memory (a copy of other layouts)."""
    return t.permute(0, 2, 3, 1).flatten(1, 2)


def plain(obj: Any) -> Any:
    """The numeric value of ``obj`` with Live/Gate unwrapped (recursively in lists/tuples).

    Live values give their value detached: a plain value never carries a gradient.
    """
    if isinstance(obj, Live):
        return obj.value.detach()
    if isinstance(obj, Gate):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain(o) for o in obj)
    return obj


def contains(obj: Any, kind: type) -> bool:
    """Whether ``obj`` (or any element of a nested list/tuple) is of ``kind``."""
    if isinstance(obj, kind):
        return True
    if isinstance(obj, (list, tuple)):
        return any(contains(o, kind) for o in obj)
    return False


def renormalized(pooled_ones: torch.Tensor) -> torch.Tensor:
    """``S / stopgrad(S)``, and 0 where ``S = 0``.

    Numerically 1 wherever any real position contributes, so a bias or a pooled
    value keeps its size; its gradient spreads ``1/S`` over the contributing ones.
    """
    empty = pooled_ones.detach() == 0
    denominator = torch.where(empty, torch.ones_like(pooled_ones), pooled_ones.detach())
    return torch.where(empty, torch.zeros_like(pooled_ones), pooled_ones / denominator)


@dataclass
class OnesChecks:
    """The state of the ones checks during one forward of a linearized program.

    The input's ones are all 1, and most rules compute ones from ones and shapes alone,
    so where a bias meets a zero (:func:`reached`) is the same for every input of one
    shape. ``decided``: what a forward on ones of this shape found at each bias, in order
    (whether :func:`reached` filled padded positions), with ``shape_decided`` kept; a
    forward given it reads no ones. ``shape_decided``: no rule of this forward made its
    ones depend on values in a way a later input could change (:func:`ones_from_values`).
    ``fills``: what this forward found (or replayed) at each bias. ``traced``: the forward is
    traced into a graph that later inputs replay; undecided by shapes (its ones depend on
    values), each bias fills its ones without reading them (``torch.where`` on the zeros,
    the same numbers).
    """

    decided: tuple[bool, ...] | None
    shape_decided: bool = True
    fills: list[bool] = field(default_factory=list)
    traced: bool = False


_ONES_CHECKS: ContextVar[OnesChecks | None] = ContextVar("omenn_ones_checks", default=None)


_TRACED: ContextVar[bool] = ContextVar("omenn_traced_forward", default=False)


@contextlib.contextmanager
def traced_forwards() -> Iterator[None]:
    """Forwards run inside are traced into a graph that later inputs replay (see :class:`OnesChecks`)."""
    token = _TRACED.set(True)
    try:
        yield
    finally:
        _TRACED.reset(token)


@contextlib.contextmanager
def ones_checks(decided: tuple[bool, ...] | None) -> Iterator[OnesChecks]:
    """The checks of one forward (see :class:`OnesChecks`); outside one, every check runs."""
    checks = OnesChecks(decided, traced=_TRACED.get())
    token = _ONES_CHECKS.set(checks)
    try:
        yield checks
    finally:
        _ONES_CHECKS.reset(token)


def reached(ones: torch.Tensor) -> torch.Tensor:
    """The ones that carry a bias added over ``ones``: ``ones`` itself where none is 0.

    R11': positions that only padding reaches have no ones of their own (R11); a bias added
    there is carried by the per-sample mean of the ones over the sample's real (non-zero)
    positions, so that its share is spread evenly over the sample. Returns ``ones`` itself
    (the same object) where there is nothing to fill. Reads the ones (a device sync) only
    where no forward on ones of the same shape decided it before (:class:`OnesChecks`).
    """
    checks = _ONES_CHECKS.get()
    if checks is not None and checks.decided is not None:
        fill = checks.decided[len(checks.fills)]
    elif checks is not None and checks.traced:
        fill = True  # a traced graph that later inputs replay, whose zeros move: no read, no branch
    else:
        real = ones != 0
        fill = not bool(real.all())
        if fill and not bool(real.flatten(1).any(1).all()):
            from .registry import RuleError

            raise RuleError("a bias is added to a sample none of whose positions is real (all are padding), "
                            "so it cannot be attributed to any position",
                            "R11' (a bias over padding needs real positions)")
    if checks is not None:
        checks.fills.append(fill)
    if not fill:
        return ones
    real = ones != 0
    count = real.flatten(1).sum(1).to(ones.dtype)
    mean = (ones.flatten(1).sum(1) / count).view(-1, *([1] * (ones.dim() - 1)))
    return torch.where(real, ones, mean)


def removed_where_zero(ones: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """R8': ``ones`` with the positions that ``mask`` zeroes removed (their ones 0).

    A position is removed where the mask is 0 over all of the elements the ones share (the
    features of a token); the result keeps the ones' sharing. The zeros move with the
    mask's values, so every forward reads its ones where a bias meets them.
    """
    ndim = max(ones.dim(), mask.dim())
    ones_shape = (1,) * (ndim - ones.dim()) + tuple(ones.shape)
    keep = (mask != 0).reshape((1,) * (ndim - mask.dim()) + tuple(mask.shape))
    shared = [d for d in range(ndim) if ones_shape[d] == 1 and keep.shape[d] > 1]
    if shared:
        keep = keep.any(dim=shared, keepdim=True)
    ones_from_values(None)
    return ones * keep


def summed_ones(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """R7: the ones of a sum of two LIVE tensors, their average; where some ones may be 0
    (a removed or padded position, :func:`ones_from_values`), the renormalized sum, which is
    1 wherever either operand has a real position and has the average's gradient."""
    checks = _ONES_CHECKS.get()
    if checks is None or checks.shape_decided:
        return (first + second) / 2
    return renormalized(first + second)


def ones_from_values(operand_ones: torch.Tensor | None) -> None:
    """Declare that a rule's result ones depend on values, not on ones and shapes alone.

    ``operand_ones``: the ones the result's are read from (max pooling at the arg-max,
    softmax attention weighting them): where they have no zero the result's have none
    either, whatever the values, so the checks stay decided by shapes. None: the result's
    zeros can move with the values (weights that may be 0), so every forward checks.
    """
    checks = _ONES_CHECKS.get()
    if checks is None or checks.decided is not None or not checks.shape_decided:
        return
    if operand_ones is None or bool((operand_ones == 0).any()):
        checks.shape_decided = False
