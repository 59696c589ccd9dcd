"""Telling whether tensors that a cache was computed from changed since, by any route.

A compiled explanation keeps values computed from the model's parameters and buffers
between calls: the folded kernels of :mod:`~omenn_kernels.backends.parameter_only` and the
reordered kernels of :mod:`~omenn_kernels.backends.packed_weights`. A tensor's version
counter and storage miss one kind of change: an in-place write through ``.data``
(``p.data.mul_(0.5)``, an EMA teacher's ``t.data.lerp_(s, 0.01)``), since ``.data`` is a
new tensor with a version counter of its own over the same memory. So these caches compare
values: :class:`Watch` keeps a bitwise copy of each tensor it watches and compares the
tensor with it before every run (a ``memcmp`` on the CPU, no aten op; on other devices a
few multi-tensor kernels and one read-back for all). The copy is shared by every watch of that
tensor (the graphs of several batch sizes read the same parameters), each watch noting
which version of the copy it last saw.

The price: one copy of each watched tensor in memory, and one read of it and its copy per
run. On the CPU the comparison is bitwise (NaN equals NaN); on other devices a NaN or an
infinity reads as a change at every run (the cache is computed again: slower, never stale).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

_LIBC_NAME = ctypes.util.find_library("c")
_MEMCMP = ctypes.CDLL(_LIBC_NAME).memcmp if _LIBC_NAME else None  # else torch.equal
if _MEMCMP is not None:
    _MEMCMP.restype = ctypes.c_int
    _MEMCMP.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)

# Integer dtypes of each element size, to compare floating-point values bit by bit.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Copy:
    """A watched tensor's values when they were last seen to change, and how many times they were."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.bits = _snapshot(tensor)
        self.generation = 0


# The copy of each watched tensor, while a watch holds it.
_COPIES: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor → weakref.ref(_Copy)


class Watch:
    """Tells which of ``tensors`` changed in value since the previous :meth:`changed` of this watch."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = list({id(tensor): tensor for tensor in tensors}.values())
        self._copies = [_shared_copy(tensor) for tensor in self.tensors]
        self._seen = [copy.generation for copy in self._copies]

    def changed(self) -> list[torch.Tensor]:
        """The watched tensors whose values differ from those this watch saw at its previous call
        (or at its creation)."""
        with torch.no_grad():
            for tensor, copy, same in zip(self.tensors, self._copies, _unchanged(self.tensors, self._copies)):
                if not same:
                    if copy.bits.shape == tensor.shape and copy.bits.dtype == tensor.dtype:
                        copy.bits.copy_(tensor)  # no new memory for a parameter changed in place
                    else:
                        copy.bits = _snapshot(tensor)
                    copy.generation += 1
        changed = [tensor for tensor, copy, seen in zip(self.tensors, self._copies, self._seen)
                   if copy.generation != seen]
        self._seen = [copy.generation for copy in self._copies]
        return changed


def _shared_copy(tensor: torch.Tensor) -> _Copy:
    reference = _COPIES.get(tensor)
    copy = reference() if reference is not None else None
    if copy is None:
        copy = _Copy(tensor)
        _COPIES[tensor] = weakref.ref(copy)
    return copy


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tensor.detach().clone(memory_format=torch.contiguous_format)


def _unchanged(tensors: list[torch.Tensor], copies: list[_Copy]) -> list[bool]:
    """Whether each tensor still holds its copy's bits."""
    same = []
    elsewhere: list[int] = []  # off the CPU: compared together, read back once
    for index, (tensor, copy) in enumerate(zip(tensors, copies)):
        if tensor.shape != copy.bits.shape or tensor.dtype != copy.bits.dtype:
            same.append(False)
        elif tensor.device.type != "cpu":
            elsewhere.append(index)
            same.append(True)
        elif tensor.is_contiguous() and _MEMCMP is not None:
            size = tensor.numel() * tensor.element_size()
            same.append(size == 0 or _MEMCMP(tensor.data_ptr(), copy.bits.data_ptr(), size) == 0)
        else:
            same.append(torch.equal(_bits(tensor), _bits(copy.bits)))
    if elsewhere:
        differ = _differ_on_device([tensors[i] for i in elsewhere], [copies[i].bits for i in elsewhere])
        for index, changed in zip(elsewhere, differ):
            same[index] = not changed
    return same


def _differ_on_device(tensors: list[torch.Tensor], copies: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor differs from its copy, in a few multi-tensor kernels and one read-back:
    the largest absolute difference of floating-point tensors (NaN or an infinity there reads
    as a change: computed again, never stale), the bits of the others."""
    floating = [i for i, t in enumerate(tensors) if t.is_floating_point() and t.numel()]
    others = [i for i, t in enumerate(tensors) if not t.is_floating_point() and t.numel()]
    if not floating and not others:
        return [False] * len(tensors)
    largest = torch._foreach_norm(torch._foreach_sub([tensors[i] for i in floating], [copies[i] for i in floating]),
                                  float("inf")) if floating else []
    flags = [(n != 0).logical_or(n.isnan()) for n in largest] + \
        [(_bits(tensors[i]) != _bits(copies[i])).any() for i in others]
    differ = [False] * len(tensors)
    for i, flag in zip(floating + others, torch.stack(flags).tolist()):
        differ[i] = flag
    return differ


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as integers of its element size, so that equal means equal bits."""
    if tensor.dtype == torch.bool or not (tensor.is_floating_point() or tensor.is_complex()):
        return tensor
    return tensor.view(_BITS[tensor.element_size()]) if not tensor.is_complex() else \
        torch.view_as_real(tensor).view(_BITS[tensor.element_size() // 2])
