"""Devices, generators and NaN-buffer views shared by the Triton kernel tests.

Not a test module: the test files of this directory import it as ``triton_layouts``
(pytest's default ``prepend`` import mode puts this directory on ``sys.path``). It does
not import Triton: ``conftest.py`` sets ``TRITON_INTERPRET`` before any test module does.
A view inside a NaN-filled buffer makes a read outside the view (which the Triton
interpreter does not fault on) show up as NaN.
"""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def nan_view(values: torch.Tensor, device=DEVICE) -> torch.Tensor:
    """A view holding ``values`` with NaN gaps on every dim (last dim stride 2)."""
    shape = tuple(values.shape)
    buf = torch.full(tuple(n + 2 for n in shape[:-1]) + (2 * shape[-1] + 3,), float("nan"),
                     dtype=values.dtype, device=device)
    view = buf[tuple(slice(1, 1 + n) for n in shape[:-1]) + (slice(1, 1 + 2 * shape[-1], 2),)]
    view.copy_(values)
    assert not view.is_contiguous() or values.numel() <= 1
    return view


def nan_offset_view(values: torch.Tensor, before: int, after: int, device=DEVICE) -> torch.Tensor:
    """A contiguous view holding ``values``, with ``before`` NaNs ahead of it and ``after`` behind."""
    n = values.numel()
    buf = torch.full((before + n + after,), float("nan"), dtype=values.dtype, device=device)
    view = buf[before : before + n].view(values.shape)
    view.copy_(values)
    return view
