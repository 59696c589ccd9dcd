"""R4 activation kernels (triton_kernels/activation.py): ``y = x·ξ(x)``, ``dx = dy·ξ(x)``.

Oracles, both computed from the very values the kernel sees (inputs rounded to their
dtype first):

* the multiplier formulas of DESIGN.md §2 (R4), in float64 (``xi_reference`` of
  ``tests/kernel_references.py``, shared with the C++ kernel tests):
  gelu Φ(x) = ½(1 + erf(x/√2)), gelu_tanh ½(1 + tanh(√(2/π)(x + 0.044715x³))),
  silu σ(x), relu 1[x > 0], leaky_relu 1 or slope, hardswish clamp(x + 3, 0, 6)/6;
* torch's own activations (F.gelu, F.gelu(approximate="tanh"), F.silu, F.relu,
  F.leaky_relu, F.hardswish) for the forward, in the input dtype.

Tolerances (``|out − ref| ≤ atol + rtol·|ref|``): fp32 rtol 1e-6 / atol 1e-6 (the
atol covers the cancellation in 1 + erf(x/√2) in the far negative tail, where y is
tiny), fp16 1e-3 / 1e-3, bf16 1e-2 / 1e-2 (half an ulp of the output dtype, plus fp32
rounding). Against torch: the same, except fp16 2e-3 and bf16 2e-2 (either side may
round the other way: one ulp).

Layouts: contiguous; a contiguous view at an offset inside a NaN-filled buffer; a
non-contiguous strided view inside a NaN-filled buffer (the wrapper copies it);
transposed and channels-last dense tensors (processed in storage order, no copy).
Without CUDA the conftest sets ``TRITON_INTERPRET=1`` and tensors live on the CPU; with
CUDA the same tests run natively and the ``gpu`` group adds larger tensors.
"""

from __future__ import annotations

import zlib

import pytest
import torch
import torch.nn.functional as F

from kernel_references import torch_activation, xi_reference
from triton_layouts import DEVICE, gen, nan_offset_view, nan_view
from omenn_kernels.triton_kernels.activation import (
    KINDS,
    _BLOCK,
    _activation_fwd_kernel,
    activation_backward,
    activation_forward,
)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: (1e-6, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (1e-2, 1e-2)}
TOL_TORCH = {torch.float32: (1e-6, 1e-6), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
SLOPE = {"leaky_relu": 0.1}
ALL_KINDS = list(KINDS)

# σ(x) = 1/(1 + exp(−x)) overflows to 1/inf = 0 for x ≪ 0 in the interpreter (numpy warns).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")
LAYOUTS = ["contiguous", "nan_offset", "nan_strided", "transposed", "channels_last"]


# --------------------------------------------------------------------------- oracles


def assert_close(out: torch.Tensor, ref: torch.Tensor, rtol: float, atol: float) -> None:
    assert out.shape == ref.shape
    assert not torch.isnan(out).any(), "NaN in the output (out-of-bounds read?)"
    out, ref = out.double().cpu(), ref.double().cpu()
    err = (out - ref).abs()
    bound = atol + rtol * ref.abs()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {out.numel()} elements off; worst excess "
        f"{float((err - bound).max()):.3e} at ref {float(ref.flatten()[int((err - bound).argmax())]):.6g}"
    )


# --------------------------------------------------------------------------- inputs


def _seed(*key) -> int:
    return zlib.crc32(repr(key).encode()) % 10_000


def sample(shape, seed: int, scale: float = 3.0) -> torch.Tensor:
    """float64 values: normal·scale, with exact zeros, ±tiny, ±large and ±3 (hardswish kinks)."""
    x = torch.randn(shape, generator=gen(seed), dtype=torch.float64) * scale
    flat = x.view(-1)
    specials = torch.tensor([0.0, -0.0, 1e-3, -1e-3, 3.0, -3.0, 8.0, -8.0, 11.5, -11.5, -0.75], dtype=torch.float64)
    k = min(flat.numel(), specials.numel())
    flat[:k] = specials[:k]
    return x


def place(values: torch.Tensor, layout: str, dtype, device=DEVICE) -> torch.Tensor:
    """``values`` (≥ 2-D unless contiguous) rounded to ``dtype`` and laid out as asked."""
    values = values.to(dtype)
    shape = tuple(values.shape)
    if layout == "contiguous":
        return values.to(device).contiguous()
    if layout == "nan_offset":  # contiguous, NaN on both sides
        return nan_offset_view(values, _BLOCK + 3, _BLOCK + 2, device)
    if layout == "nan_strided":  # gaps on every dim
        view = nan_view(values, device)
        assert not view.is_contiguous()
        return view
    if layout == "transposed":  # dense, not contiguous
        return values.transpose(0, -1).contiguous().to(device).transpose(0, -1)
    if layout == "channels_last":
        assert len(shape) == 4
        return values.to(device).contiguous(memory_format=torch.channels_last)
    raise AssertionError(layout)


SHAPES = {
    "contiguous": [(1,), (1025,), (3, 37, 15)],
    "nan_offset": [(7, 13), (3, 37, 15)],
    "nan_strided": [(7, 13), (3, 5, 15)],
    "transposed": [(13, 7), (3, 37, 15)],
    "channels_last": [(3, 5, 7, 13)],
}


def _cases():
    for layout in LAYOUTS:
        for shape in SHAPES[layout]:
            yield pytest.param(layout, shape, id=f"{layout}-{'x'.join(map(str, shape))}")


# --------------------------------------------------------------------------- forward


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layout,shape", list(_cases()))
def test_forward_matches_formula(layout, shape, kind, dtype):
    slope = SLOPE.get(kind, 0.0)
    x = place(sample(shape, seed=_seed(layout, shape, kind)), layout, dtype)
    y = activation_forward(x, kind, slope)
    assert y.shape == x.shape and y.dtype == dtype and y.device == x.device
    if layout in ("transposed", "channels_last"):
        assert y.stride() == x.stride(), "dense layouts are kept"
    xd = x.double()
    assert_close(y, xd * xi_reference(xd, kind, slope), *TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_forward_matches_torch(kind, dtype):
    slope = SLOPE.get(kind, 0.0)
    x = place(sample((5, 7, 61), seed=11), "nan_strided", dtype)
    y = activation_forward(x, kind, slope)
    assert_close(y, torch_activation(x, kind, slope), *TOL_TORCH[dtype])


@pytest.mark.parametrize("slope", [0.0, 0.01, 0.2, -0.5, 1.0])
def test_leaky_relu_slopes(slope):
    x = place(sample((3, 37, 15), seed=5), "contiguous", torch.float32)
    assert_close(activation_forward(x, "leaky_relu", slope), F.leaky_relu(x, slope), 1e-6, 0.0)
    g = place(sample((3, 37, 15), seed=6), "contiguous", torch.float32)
    ref = g.double() * xi_reference(x, "leaky_relu", slope)
    assert_close(activation_backward(g, x, "leaky_relu", slope), ref, 1e-6, 0.0)


def test_paper_gelu_example():
    """DESIGN.md §2: GELU at x = −0.75 has ξ = Φ(−0.75) ≈ 0.2266, contribution ≈ −0.17."""
    x = torch.full((3,), -0.75, device=DEVICE)
    y = activation_forward(x, "gelu")
    assert torch.allclose(y.cpu(), torch.full((3,), -0.75 * 0.2266273523768682), rtol=1e-6)
    dx = activation_backward(torch.ones_like(x), x, "gelu")
    assert torch.allclose(dx.cpu(), torch.full((3,), 0.2266273523768682), rtol=1e-6)


# --------------------------------------------------------------------------- backward


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ALL_KINDS)
@pytest.mark.parametrize("layout,shape", list(_cases()))
def test_backward_matches_formula(layout, shape, kind, dtype):
    slope = SLOPE.get(kind, 0.0)
    seed = _seed(layout, shape, kind)
    x = place(sample(shape, seed=seed), layout, dtype)
    g = place(sample(shape, seed=seed + 1, scale=1.0), layout, dtype)
    dx = activation_backward(g, x, kind, slope)
    assert dx.shape == x.shape and dx.dtype == dtype
    assert_close(dx, g.double() * xi_reference(x, kind, slope), *TOL[dtype])


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_backward_is_gradient_of_detached_multiplier(kind):
    """``dx`` is autograd's gradient of ``x·stopgrad(ξ(x))`` (float64 reference)."""
    slope = SLOPE.get(kind, 0.0)
    x = place(sample((3, 37, 15), seed=21), "contiguous", torch.float32)
    g = place(sample((3, 37, 15), seed=22, scale=1.0), "contiguous", torch.float32)
    xd = x.double().requires_grad_()
    (xd * xi_reference(xd.detach(), kind, slope)).backward(g.double())
    assert_close(activation_backward(g, x, kind, slope), xd.grad, *TOL[torch.float32])


@pytest.mark.parametrize(
    "x_layout,g_layout,g_dtype",
    [
        ("channels_last", "contiguous", torch.float32),
        ("contiguous", "channels_last", torch.bfloat16),
        ("transposed", "nan_strided", torch.float16),
        ("nan_strided", "transposed", torch.float32),
    ],
)
def test_backward_mixed_layouts_and_dtypes(x_layout, g_layout, g_dtype):
    shape = (3, 5, 7, 13)
    x = place(sample(shape, seed=31), x_layout, torch.bfloat16)
    g = place(sample(shape, seed=32, scale=1.0), g_layout, g_dtype)
    dx = activation_backward(g, x, "gelu")
    assert dx.dtype == torch.bfloat16 and dx.shape == shape
    assert_close(dx, g.double() * xi_reference(x, "gelu"), *TOL[torch.bfloat16])


# --------------------------------------------------------------------------- edges


def test_stores_stay_in_bounds():
    """The kernel writes exactly ``n`` elements: sentinels on both sides are untouched."""
    n = 2 * _BLOCK + 37
    x = torch.randn(n, generator=gen(3)).to(DEVICE)
    buf = torch.full((n + 2 * _BLOCK,), float("nan"), device=DEVICE)
    y = buf[_BLOCK : _BLOCK + n]
    _activation_fwd_kernel[(3,)](x, y, n, 0.0, KIND=KINDS["silu"], BLOCK=_BLOCK)
    assert torch.isnan(buf[:_BLOCK]).all() and torch.isnan(buf[_BLOCK + n :]).all()
    assert_close(y, F.silu(x.double()), 1e-6, 1e-6)


@pytest.mark.parametrize("shape", [(0,), (3, 0, 5), (0, 4, 7, 7)])
def test_empty(shape):
    x = torch.empty(shape, device=DEVICE)
    assert activation_forward(x, "gelu").shape == shape
    assert activation_backward(x, x, "relu").shape == shape


def test_zero_dim():
    x = torch.tensor(-0.75, device=DEVICE)
    assert_close(activation_forward(x, "gelu"), F.gelu(x.double()), 1e-6, 1e-7)
    assert_close(activation_backward(torch.tensor(2.0, device=DEVICE), x, "silu"), 2.0 * torch.sigmoid(x.double()), 1e-6, 0)


def test_unknown_kind():
    x = torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="gelu.*gelu_tanh.*silu.*relu.*leaky_relu.*hardswish"):
        activation_forward(x, "mish")
    with pytest.raises(ValueError, match="unknown activation kind"):
        activation_backward(x, x, "tanh")


def test_shape_mismatch_and_dtype():
    x = torch.ones(4, 3, device=DEVICE)
    with pytest.raises(ValueError, match="shape"):
        activation_backward(torch.ones(3, 4, device=DEVICE), x, "gelu")
    with pytest.raises(TypeError, match="float"):
        activation_forward(x.double(), "gelu")


# --------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (native Triton)")
class TestGPU:
    """The same checks at realistic sizes, natively on CUDA."""

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("kind", ALL_KINDS)
    @pytest.mark.parametrize("layout", ["contiguous", "nan_strided", "channels_last"])
    def test_forward_backward_large(self, layout, kind, dtype):
        slope = SLOPE.get(kind, 0.0)
        shape = (8, 64, 56, 57)
        x = place(sample(shape, seed=41), layout, dtype, device="cuda")
        g = place(sample(shape, seed=42, scale=1.0), layout, dtype, device="cuda")
        xd = x.double()
        xi = xi_reference(xd, kind, slope)
        assert_close(activation_forward(x, kind, slope), xd * xi, *TOL[dtype])
        assert_close(activation_forward(x, kind, slope), torch_activation(x, kind, slope), *TOL_TORCH[dtype])
        assert_close(activation_backward(g, x, kind, slope), g.double() * xi, *TOL[dtype])

    def test_ragged_1d_large(self):
        n = (1 << 22) + 12345
        x = torch.randn(n, device="cuda", dtype=torch.bfloat16) * 3
        assert_close(activation_forward(x, "gelu_tanh"), F.gelu(x, approximate="tanh"), *TOL_TORCH[torch.bfloat16])
