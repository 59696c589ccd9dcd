"""R4: elementwise activations with a detached multiplier, ``y = x·ξ(x)``.

Forward ``y = x·ξ(x)``; backward ``dx = dy·ξ(x)`` with ``ξ`` recomputed from the saved
``x`` (nothing else is saved). Every supported activation has ``f(0) = 0``, so no
ones term appears here. Multipliers (DESIGN.md §2, R4):

=============  =====================================================
kind           ξ(x)
=============  =====================================================
``gelu``       Φ(x) = ½(1 + erf(x/√2))
``gelu_tanh``  ½(1 + tanh(√(2/π)(x + 0.044715x³))) = σ(2√(2/π)(x + 0.044715x³))
``silu``       σ(x)
``relu``       1[x > 0]
``leaky_relu`` 1 if x > 0 else ``slope``
``hardswish``  clamp(x + 3, 0, 6)/6
=============  =====================================================

Math is done in fp32 whatever the storage dtype (fp32/fp16/bf16); results are stored
in the dtype of ``x``. Tensors that are dense in memory (contiguous, channels-last or
any other permutation without gaps) are processed in place of their storage order,
without a copy; anything else is copied to a contiguous tensor first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

KINDS = {"gelu": 0, "gelu_tanh": 1, "silu": 2, "relu": 3, "leaky_relu": 4, "hardswish": 5}

_BLOCK = 1024
_NUM_WARPS = 4


@triton.jit
def _xi(x, slope, KIND: tl.constexpr):
    """The detached multiplier ξ(x) of activation ``KIND`` (x in fp32)."""
    if KIND == 0:
        xi = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
    elif KIND == 1:
        # ½(1 + tanh(z)) = σ(2z), 2z = 2·√(2/π)·(x + 0.044715x³)
        xi = tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))
    elif KIND == 2:
        xi = tl.sigmoid(x)
    elif KIND == 3:
        xi = tl.where(x > 0.0, 1.0, 0.0)
    elif KIND == 4:
        xi = tl.where(x > 0.0, 1.0, tl.cast(slope, tl.float32))  # Inductor passes a Python float as fp64
    else:
        xi = tl.minimum(tl.maximum(x + 3.0, 0.0), 6.0) * (1.0 / 6.0)
    return xi


@triton.jit
def _activation_fwd_kernel(x_ptr, y_ptr, n, slope, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * _xi(x, slope, KIND)
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _activation_bwd_kernel(g_ptr, x_ptr, dx_ptr, n, slope, KIND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dx = g * _xi(x, slope, KIND)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _kind_id(kind: str) -> int:
    try:
        return KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation kind {kind!r}; expected one of {', '.join(KINDS)}") from None


def _check_dtype(t: torch.Tensor, name: str) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _is_dense(t: torch.Tensor) -> bool:
    """True if ``t``'s elements fill ``[data_ptr, data_ptr + numel)`` exactly once."""
    expected = 1
    dims = sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1)
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, both dense, same strides on every dimension of size > 1."""
    return (_is_dense(a) and _is_dense(b)
            and all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride()) if n != 1))


def _dense(t: torch.Tensor) -> torch.Tensor:
    return t if _is_dense(t) else t.contiguous()


def activation_forward(x: torch.Tensor, kind: str, slope: float = 0.0) -> torch.Tensor:
    """``y = x·ξ(x)``: same shape, dtype (and dense memory layout) as ``x``."""
    kid = _kind_id(kind)
    _check_dtype(x, "x")
    x = _dense(x)
    y = torch.empty_like(x)  # preserve_format: same strides as a dense x
    n = x.numel()
    if n == 0:
        return y
    grid = (triton.cdiv(n, _BLOCK),)
    wrap_triton(_activation_fwd_kernel)[grid](x, y, n, float(slope), KIND=kid, BLOCK=_BLOCK,
                                              num_warps=_NUM_WARPS)
    return y


def activation_backward(grad: torch.Tensor, x: torch.Tensor, kind: str, slope: float = 0.0) -> torch.Tensor:
    """``dx = dy·ξ(x)`` with ξ recomputed from ``x``; dtype (and dense layout) of ``x``."""
    kid = _kind_id(kind)
    _check_dtype(x, "x")
    _check_dtype(grad, "grad")
    if grad.shape != x.shape:
        raise ValueError(f"grad shape {tuple(grad.shape)} does not match x shape {tuple(x.shape)}")
    if grad.device != x.device:
        raise ValueError(f"grad is on {grad.device} but x is on {x.device}")
    x = _dense(x)
    dx = torch.empty_like(x)
    if not _same_layout(grad, x):
        grad = torch.empty_like(x, dtype=grad.dtype).copy_(grad)  # grad in x's memory layout
    n = x.numel()
    if n == 0:
        return dx
    grid = (triton.cdiv(n, _BLOCK),)
    wrap_triton(_activation_bwd_kernel)[grid](grad, x, dx, n, float(slope), KIND=kid, BLOCK=_BLOCK,
                                              num_warps=_NUM_WARPS)
    return dx


__all__ = ["KINDS", "activation_forward", "activation_backward"]
