"""Vector strides of affine indices taken without simplifying the index: equal to Inductor's."""

from __future__ import annotations

import threading
import warnings

import pytest
import sympy
import torch
from torch._inductor import sizevars
from torch._inductor.codegen import cpp
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from omenn_kernels import Explainer
from omenn_kernels.backends import vector_strides
from omenn_kernels.backends.vector_strides import affine_strides

x0, x1, x2, x3, s0 = sympy.symbols("vs_x0 vs_x1 vs_x2 vs_x3 vs_s0", integer=True, nonnegative=True)


@pytest.fixture
def inductors():
    """Inductor's own ``stride_at_vec_range`` (the one :func:`affine_strides` replaced)."""
    with affine_strides():  # installs it
        pass
    return vector_strides._inductor["stride_at_vec_range"]


@pytest.fixture
def rewritten(monkeypatch):
    """The indices whose floor divisions and modulos Inductor's path rewrote, in order."""
    seen = []
    original = sizevars.simplify_index_in_vec_range

    def simplify_index_in_vec_range(index, var, vec_length):
        seen.append(index)
        return original(index, var, vec_length)
    monkeypatch.setattr(sizevars, "simplify_index_in_vec_range", simplify_index_in_vec_range)
    return seen


AFFINE = [
    75648 * x0 + 64 * x1 + 302592 * x2 + 12608 * x3,
    226944 * x0 + 64 * x1 + 1152 * x2 + x3 + 384,
    x3,
    sympy.Integer(7),
    16 * x1 + 4 * x3 + s0 * x2 + 3 * s0 * x3,  # a symbolic size
    x3 * (x1 + 2) + 5,  # not expanded
]


@pytest.mark.parametrize("index", AFFINE, ids=str)
@pytest.mark.parametrize("vec_length", [8, 16])
def test_affine_indices_skip_the_rewrite_with_inductors_stride(index, vec_length, inductors, rewritten):
    with affine_strides():
        got = cpp.stride_at_vec_range(index, x3, vec_length)
    assert rewritten == []
    assert got == inductors(index, x3, vec_length)


@pytest.mark.parametrize("index", [FloorDiv(x3, 16) * 64 + x1, ModularIndexing(x3, 1, 32) + 128 * x0,
                                   ModularIndexing(x3, 3, 5) + x3], ids=str)
def test_floor_divisions_and_modulos_take_inductors_path(index, inductors, rewritten):
    with affine_strides():
        got = cpp.stride_at_vec_range(index, x3, 16)
    assert rewritten and rewritten[0] == index
    assert got == inductors(index, x3, 16)


def test_only_the_active_thread_skips_the_rewrite(inductors, rewritten):
    index = 3 * x0 + 11 * x3 + 2 * x2
    seen = {}

    def other_thread():
        seen["other"] = cpp.stride_at_vec_range(index, x3, 8)
    with affine_strides():
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
        assert rewritten == [index]  # the other thread's call, by Inductor's path
        assert cpp.stride_at_vec_range(index, x3, 8) == 11 and rewritten == [index]
    rewritten.clear()
    assert cpp.stride_at_vec_range(index, x3, 16) == 11 and rewritten == [index]  # outside the block
    assert seen["other"] == 11


class _Attention(torch.nn.Module):
    """Heads split and merged by reshapes and permutes: kernels with multi-axis affine indices."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.proj, self.head = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16), torch.nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, 4, c // 4).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1)).softmax(-1)
        x = x + self.proj((attention @ v).transpose(1, 2).reshape(b, n, c))
        return self.head(torch.nn.functional.gelu(x).mean(1))


def test_a_compiled_explanations_strides_equal_inductors(monkeypatch, tmp_path, inductors):
    """Real Inductor: every stride its code generator asked for while compiling an explanation was
    asked with the affine path active, and is the one Inductor's path gives; some are affine."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    calls, active = [], []

    def recorded(index, var, vec_length=None):
        active.append(getattr(vector_strides._active, "on", False))
        calls.append((index, var, vec_length, vector_strides.stride_at_vec_range(index, var, vec_length)))
        return calls[-1][-1]
    monkeypatch.setattr(cpp, "stride_at_vec_range", recorded)
    torch.manual_seed(0)
    model = _Attention().eval()
    x = torch.randn(2, 8, 16)
    explainer = Explainer(model, backend="compiled", feature_dim=-1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")  # a fallback to the fused backend would warn
        explainer(x)
    assert calls and all(active)
    assert any(not index.has(FloorDiv, ModularIndexing) for index, *_ in calls)
    for index, var, vec_length, got in calls:
        assert got == inductors(index, var, vec_length), index
