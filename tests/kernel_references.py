"""Float64 references and input helpers shared by the kernel tests (tests/csrc, tests/triton_kernels).

Not a test module: ``tests/conftest.py`` puts this directory on ``sys.path`` so that the
test files import it as ``kernel_references``. Nothing here imports Triton.

* activations (R4): ``xi_reference`` (ξ(x) by the textbook formulas) and
  ``torch_activation`` (torch's own functions);
* conv bias over the ones (R2): ``conv_bias_grads`` (seeded grad / bias / grad_ones_out),
  ``ones_bar_backward`` (torch.autograd through ``Ō = S/stopgrad(S)``, 0 where S = 0) and
  ``bias_share_reference`` (the per-position share ``r``);
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F


# --------------------------------------------------------------------------- activations


def xi_reference(x: torch.Tensor, kind: str, slope: float = 0.0) -> torch.Tensor:
    """ξ(x) by the textbook formulas, in float64."""
    x = x.double()
    if kind == "gelu":
        return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if kind == "gelu_tanh":
        return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    if kind == "silu":
        return torch.sigmoid(x)
    if kind == "relu":
        return (x > 0).double()
    if kind == "leaky_relu":
        return torch.where(x > 0, torch.ones_like(x), torch.full_like(x, slope))
    if kind == "hardswish":
        return (x + 3.0).clamp(0.0, 6.0) / 6.0
    raise AssertionError(kind)


def torch_activation(x: torch.Tensor, kind: str, slope: float = 0.0) -> torch.Tensor:
    return {
        "gelu": lambda: F.gelu(x),
        "gelu_tanh": lambda: F.gelu(x, approximate="tanh"),
        "silu": lambda: F.silu(x),
        "relu": lambda: F.relu(x),
        "leaky_relu": lambda: F.leaky_relu(x, slope),
        "hardswish": lambda: F.hardswish(x),
    }[kind]()


# --------------------------------------------------------------------------- conv bias over the ones


def conv_bias_grads(B: int, C: int, Ho: int, Wo: int, dtype, with_gout: bool, seed: int):
    """(grad (B, C, Ho, Wo), bias (C,), grad_ones_out (B, 1, Ho, Wo) or None), drawn in that order."""
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(B, C, Ho, Wo, generator=g).to(dtype)
    bias = torch.randn(C, generator=g).to(dtype)
    gout = torch.randn(B, 1, Ho, Wo, generator=g).to(dtype) if with_gout else None
    return grad, bias, gout


def ones_bar_backward(O: torch.Tensor, S_of: Callable[[torch.Tensor], torch.Tensor], grad, bias,
                      gout) -> torch.Tensor:
    """∂/∂O of Σ bias·Ō·grad + Σ Ō·gout by torch.autograd, in float64.

    ``Ō = S/stopgrad(S)`` with ``S = S_of(O)``, and ``Ō = 0`` where S = 0 (the plain
    ``S/S.detach()`` would give 0/0 = NaN there). ``bias`` or ``gout`` may be None.
    """
    O = O.double().detach().requires_grad_(True)
    S = S_of(O)
    Sd = S.detach()
    nz = Sd != 0
    ones_bar = torch.where(nz, S / torch.where(nz, Sd, torch.ones_like(Sd)), torch.zeros_like(S))
    loss = torch.zeros((), dtype=torch.float64, device=O.device)
    if bias is not None:
        loss = loss + (bias.double().view(1, -1, 1, 1) * ones_bar * grad.double()).sum()
    if gout is not None:
        loss = loss + (ones_bar * gout.double()).sum()
    (dO,) = torch.autograd.grad(loss, O)
    return dO


def bias_share_reference(grad, bias, gout, S) -> torch.Tensor:
    """r = (Σ_c grad·bias + gout) / S per output position (B, Ho, Wo), float64; 0 where S = 0.

    ``bias`` may be None (then r = gout / S).
    """
    num = gout.double()[:, 0]
    if bias is not None:
        num = num + (grad.double() * bias.double().view(1, -1, 1, 1)).sum(1)
    S64 = S.double()[:, 0]
    return torch.where(S64 == 0, 0.0, num / torch.where(S64 == 0, 1.0, S64))
