"""The C++ CPU kernels (``csrc/``, loaded by ``omenn_kernels.native``) against PyTorch,
called through their dispatcher ops ``torch.ops.omenn.*_cpu``.

The library must build here: a build failure makes these tests fail (the ``loaded``
fixture raises), never skip.

References, computed in float64 from the same inputs, written in this file or (shared
with the Triton tests) in ``tests/kernel_references.py``:

- activations (R4): the closed forms of ξ, and torch's own F.gelu / silu / relu /
  leaky_relu / hardswish;
- conv bias ones backward (R2): torch.autograd through ``Ō = S/stopgrad(S)`` (0 where
  S = 0) with ``S = conv2d(O, ones)``, the per-position share ``r`` of
  ``kernel_references`` spread by torch.autograd, and an explicit loop over output
  positions and kernel taps.

Tolerances. Activations: the kernel computes in float (double for float64) and rounds
once, so against the float64 formula it is within rtol = the dtype's epsilon (float16
1e-3, bfloat16 8e-3, float32 1e-6, float64 1e-13) plus an atol for results near 0
(1e-5, 1e-4, 1e-6, 1e-14). Against torch's functions (which round their own way, and
lose digits in GELU's left tail) the same rtol with atol 1e-6 (float32) / the dtype's
eps (half types). Conv: the ones path is float32 (float64 for float64 grads) summing up
to a few hundred products, so |out − ref| ≤ rtol·|ref| + atol·max|ref| with
rtol = atol = 2e-5 (float32, float16 and bfloat16 inputs: read exactly, accumulated in
float), 1e-12 (float64).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import omenn_kernels.ops.activation  # defines omenn::activation_cpu and activation_backward_cpu
import omenn_kernels.ops.conv_bias  # defines omenn::conv2d_ones_backward_cpu and the packed convolutions
from kernel_references import (bias_share_reference, conv_bias_grads, ones_bar_backward, torch_activation,
                               xi_reference)

native = omenn_kernels.native
activation_cpu = torch.ops.omenn.activation_cpu.default
activation_backward_cpu = torch.ops.omenn.activation_backward_cpu.default
conv2d_ones_backward_cpu = torch.ops.omenn.conv2d_ones_backward_cpu.default
# The ops whose CPU kernel csrc/bindings.cpp registers, of the modules imported above.
CPU_OPS = ("activation_cpu", "activation_backward_cpu", "conv2d_ones_backward_cpu", "conv2d_packed_cpu",
           "conv2d_input_grad_packed_cpu")

KINDS = ("gelu", "gelu_tanh", "silu", "relu", "leaky_relu", "hardswish")
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
EPS = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-13}
ATOL = {torch.float16: 1e-5, torch.bfloat16: 1e-4, torch.float32: 1e-6, torch.float64: 1e-14}


@pytest.fixture(scope="module", autouse=True)
def loaded():
    native.load_cpu_kernels()  # raises RuntimeError (test error, not skip) if the build fails


def cpu_kernel(op, *args):
    """``op``'s CPU kernel called whatever the devices of ``args`` (the dispatcher would send a
    meta tensor to the op's fake function): to reach the kernel's own device checks."""
    return op.redispatch(torch._C.DispatchKeySet(torch._C.DispatchKey.CPU), *args)


def test_loader_loads_once_and_registers_the_kernels():
    native.load_cpu_kernels()
    native.load_cpu_kernels()  # neither built nor loaded again
    assert native.available() is True
    libraries = [path for path in torch.ops.loaded_libraries if native.NAME in Path(path).name]
    assert len(libraries) == 1, libraries
    assert native.NAME not in sys.modules  # a plain library, not a Python module
    for name in CPU_OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"omenn::{name}", "CPU"), name
    # Defined by the library itself (they take no tensor, or a weight of any device).
    assert torch.ops.omenn.packed_weight_reorders() >= 0
    assert torch.ops.omenn.forget_packed_weight(torch.randn(2)) == 0


def test_each_checkout_builds_in_a_folder_of_its_own(tmp_path, monkeypatch):
    """Two checkouts of the sources (a clone beside a working copy) sharing torch's extensions
    folder would rebuild the library in each other's first call: each gets its own folder, and
    the loaded library is the one built in this checkout's."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here, other = native.build_directory(), native.build_directory(tmp_path / "clone" / "csrc")
    assert here != other and Path(here).parent == Path(other).parent == tmp_path
    assert native.build_directory() == here and Path(here).name.startswith(native.NAME)
    monkeypatch.undo()
    native.load_cpu_kernels()
    (library,) = [path for path in torch.ops.loaded_libraries if native.NAME in Path(path).name]
    assert Path(library).parent == Path(native.build_directory())


def test_simd_flags_follow_atens_cpu_capability():
    assert "-DCPU_CAPABILITY_AVX512" in native._simd_flags("AVX512")
    assert "-mavx512f" in native._simd_flags("AVX512")
    assert "-DCPU_CAPABILITY_AVX2" in native._simd_flags("AVX2") and "-mavx2" in native._simd_flags("AVX2")
    for capability in ("DEFAULT", "NO AVX", "ZVECTOR", "VSX", "SVE256"):
        assert native._simd_flags(capability) == []
    assert set(native._simd_flags(torch.backends.cpu.get_cpu_capability())) <= set(native.CFLAGS)


# --------------------------------------------------------------------------- activations

def activation_input(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Ragged (3, 37, 13) values over ±8 with zeros, tiny values and hardswish's kinks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 37, 13, generator=g, dtype=torch.float64) * 3.0
    flat = x.view(-1)
    special = torch.tensor([0.0, -0.0, 1e-3, -1e-3, -3.0, 3.0, -8.0, 8.0, -0.75, 0.75],
                           dtype=torch.float64)
    flat[: special.numel()] = special
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_forward_matches_formula_and_torch(kind, dtype):
    slope = 0.2 if kind == "leaky_relu" else 0.01
    x = activation_input(dtype)
    y = activation_cpu(x, kind, slope)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    ref = x.double() * xi_reference(x, kind, slope)
    torch.testing.assert_close(y.double(), ref, rtol=EPS[dtype], atol=ATOL[dtype])
    theirs = torch_activation(x, kind, slope).double()
    atol = max(ATOL[dtype], 1e-6) if dtype != torch.float64 else 1e-14
    torch.testing.assert_close(y.double(), theirs, rtol=2 * EPS[dtype], atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_activation_backward_matches_formula(kind, dtype):
    slope = 0.1
    x = activation_input(dtype, seed=1)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = activation_backward_cpu(grad, x, kind, slope)
    assert out.dtype == dtype and out.shape == x.shape
    ref = grad.double() * xi_reference(x, kind, slope)
    torch.testing.assert_close(out.double(), ref, rtol=EPS[dtype], atol=ATOL[dtype])


def test_activation_multiplier_at_zero_and_paper_example():
    zero = torch.zeros(1, dtype=torch.float64)
    ones = torch.ones(1, dtype=torch.float64)
    expect = {"gelu": 0.5, "gelu_tanh": 0.5, "silu": 0.5, "relu": 0.0, "leaky_relu": 0.3,
              "hardswish": 0.5}
    for kind, xi0 in expect.items():
        assert activation_backward_cpu(ones, zero, kind, 0.3).item() == xi0
    # DESIGN.md: GELU at x = −0.75 has ξ = Φ(−0.75) ≈ 0.2266 and a contribution ≈ −0.17.
    x = torch.tensor([-0.75], dtype=torch.float64)
    assert activation_backward_cpu(torch.ones_like(x), x, "gelu", 0.01).item() == pytest.approx(
        0.2266273523768682, rel=1e-14)
    assert activation_cpu(x, "gelu", 0.01).item() == pytest.approx(-0.16997051428265115,
                                                                     rel=1e-14)


def test_activation_gelu_left_tail_is_accurate():
    x = torch.tensor([-6.0, -9.0, -12.0], dtype=torch.float32)
    got = activation_backward_cpu(torch.ones_like(x), x, "gelu", 0.01).double()
    ref = 0.5 * torch.special.erfc(-x.double() / math.sqrt(2.0))
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_non_contiguous_and_special_shapes(dtype):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(7, 2 * 15, 13, generator=g).to(dtype)
    x = base.transpose(0, 2)[:, ::2]  # (13, 15, 7), non-contiguous
    grad = torch.randn(13, 7, 15, generator=g).to(dtype).transpose(1, 2)
    assert not x.is_contiguous() and not grad.is_contiguous()
    for kind in KINDS:
        y = activation_cpu(x, kind, 0.05)
        torch.testing.assert_close(y, activation_cpu(x.contiguous(), kind, 0.05),
                                   rtol=0, atol=0)
        ref = grad.double() * xi_reference(x, kind, 0.05)
        torch.testing.assert_close(activation_backward_cpu(grad, x, kind, 0.05).double(), ref,
                                   rtol=EPS[dtype], atol=ATOL[dtype])
    scalar = torch.tensor(1.5, dtype=dtype)
    assert activation_cpu(scalar, "silu", 0.0).shape == ()
    empty = torch.empty(0, 4, dtype=dtype)
    assert activation_cpu(empty, "gelu", 0.0).shape == (0, 4)
    nan = torch.tensor([float("nan")], dtype=dtype)
    for kind in KINDS:
        assert torch.isnan(activation_cpu(nan, kind, 0.01)).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_activation_keeps_channels_last(dtype):
    """A channels-last input gives a channels-last result, as ATen's elementwise ops do, with
    the values of the contiguous computation; the backward follows x's layout whatever grad's."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 24, 5, 7, generator=g).to(dtype).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(2, 24, 5, 7, generator=g).to(dtype)
    for kind in KINDS:
        y = activation_cpu(x, kind, 0.05)
        dx = activation_backward_cpu(grad, x, kind, 0.05)
        assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
        assert dx.is_contiguous(memory_format=torch.channels_last) and not dx.is_contiguous()
        torch.testing.assert_close(y, activation_cpu(x.contiguous(), kind, 0.05), rtol=0, atol=0)
        torch.testing.assert_close(dx, activation_backward_cpu(grad, x.contiguous(), kind, 0.05), rtol=0, atol=0)


def test_activation_large_input_is_thread_independent():
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = activation_cpu(x, "gelu", 0.0)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(activation_cpu(x, "gelu", 0.0), serial, rtol=0, atol=0)


def test_activation_errors():
    x = torch.randn(4)
    with pytest.raises(ValueError, match="gelu, gelu_tanh, silu, relu, leaky_relu, hardswish"):
        activation_cpu(x, "mish", 0.0)
    with pytest.raises(ValueError, match="unknown activation kind 'GELU'"):
        activation_backward_cpu(x, x, "GELU", 0.0)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        activation_cpu(torch.arange(4), "relu", 0.0)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        cpu_kernel(activation_cpu, torch.empty(4, device="meta"), "relu", 0.0)
    with pytest.raises(RuntimeError, match="same shape"):
        activation_backward_cpu(torch.randn(5), x, "relu", 0.0)
    with pytest.raises(TypeError, match="same dtype"):
        activation_backward_cpu(x.double(), x, "relu", 0.0)


# ------------------------------------------------------------------ conv bias ones backward

# (B, Cout, H, W, kernel, stride, padding before, dilation, padding after or None = same
# as before). Ragged channel counts and sizes, all strides/paddings/dilations/kernels.
CONV_CASES = [
    (2, 3, 7, 7, (3, 3), (1, 1), (1, 1), (1, 1), None),
    (1, 37, 13, 15, (5, 5), (2, 2), (2, 2), (1, 1), None),
    (2, 197, 15, 13, (7, 7), (3, 3), (0, 0), (1, 1), None),
    (2, 37, 15, 15, (7, 7), (1, 1), (3, 3), (1, 1), None),
    (3, 3, 15, 7, (3, 1), (2, 1), (0, 1), (1, 1), None),       # asymmetric: ph ≠ pw
    (1, 3, 13, 7, (1, 1), (1, 1), (2, 2), (1, 1), None),       # border sees only padding: S = 0
    (2, 3, 13, 13, (3, 3), (1, 1), (2, 2), (2, 2), None),      # dilation 2
    (1, 37, 7, 13, (3, 3), (3, 2), (1, 2), (2, 1), None),
    (1, 3, 13, 13, (1, 1), (2, 2), (0, 0), (1, 1), None),      # stride > kernel: gaps
    (2, 3, 7, 15, (3, 3), (1, 3), (2, 0), (2, 1), None),
    (1, 5, 13, 15, (4, 2), (1, 1), (1, 0), (1, 1), (2, 1)),    # padding='same' (extra after)
    (2, 3, 7, 13, (3, 3), (2, 2), (0, 2), (1, 2), (1, 0)),     # explicit asymmetric padding
    (1, 8, 41, 43, (3, 3), (1, 1), (1, 1), (1, 1), None),      # Ho·Wo > one kernel chunk
]


def case_id(case) -> str:
    B, C, H, W, k, s, p, d, after = case
    tail = f"-after{after[0]}x{after[1]}" if after else ""
    return f"B{B}C{C}-{H}x{W}-k{k[0]}x{k[1]}-s{s[0]}x{s[1]}-p{p[0]}x{p[1]}-d{d[0]}x{d[1]}{tail}"


def conv_geometry(case):
    B, C, H, W, k, s, p, d, after = case
    after = after or p
    Ho = (H + p[0] + after[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    Wo = (W + p[1] + after[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    return Ho, Wo, after


def S_fn(O: torch.Tensor, case) -> torch.Tensor:
    """S = sum of the ones over each output position's receptive field (padding counts 0)."""
    _, _, _, _, k, s, p, d, _ = case
    _, _, after = conv_geometry(case)
    padded = F.pad(O, (p[1], after[1], p[0], after[0]))
    return F.conv2d(padded, O.new_ones(1, 1, *k), stride=s, dilation=d)


def ones_channel(case, holes: bool) -> torch.Tensor:
    """O: all ones, or ones with a zero block and scattered zeros (S = 0 where a field is empty)."""
    B, _, H, W, *_ = case
    O = torch.ones(B, 1, H, W, dtype=torch.float64)
    if holes:
        O[:, :, : H // 2, : W // 2] = 0.0
        mask = torch.rand(B, 1, H, W, generator=torch.Generator().manual_seed(5)) < 0.2
        O[mask] = 0.0
    return O


def conv_inputs(case, dtype, with_gout: bool, holes: bool, seed: int = 0):
    B, C, H, W, *_ = case
    Ho, Wo, _ = conv_geometry(case)
    grad, bias, gout = conv_bias_grads(B, C, Ho, Wo, dtype, with_gout, seed)
    O = ones_channel(case, holes)
    S = S_fn(O, case).float()
    return grad, bias, gout, O, S


def autograd_reference(grad, bias, gout, O, case) -> torch.Tensor:
    """∂/∂O of Σ bias·Ō·grad + Σ Ō·grad_ones_out, Ō = S/stopgrad(S) (0 where S = 0)."""
    return ones_bar_backward(O, lambda ones: S_fn(ones, case), grad, bias, gout)


def loop_reference(grad, bias, gout, S, case) -> torch.Tensor:
    """The same by hand: each output position's share r = (Σ_c g·b + g_O)/S to every tap."""
    B, C, H, W, k, s, p, d, _ = case
    _, _, Ho, Wo = grad.shape
    g = grad.double().tolist()
    b = bias.double().tolist()
    go = gout.double().tolist() if gout is not None else None
    Sl = S.double().tolist()
    out = [[[0.0] * W for _ in range(H)] for _ in range(B)]
    for n in range(B):
        for oh in range(Ho):
            for ow in range(Wo):
                total = Sl[n][0][oh][ow]
                if total == 0:
                    continue
                r = sum(g[n][c][oh][ow] * b[c] for c in range(C))
                if go is not None:
                    r += go[n][0][oh][ow]
                r /= total
                for i in range(k[0]):
                    qh = oh * s[0] - p[0] + i * d[0]
                    for j in range(k[1]):
                        qw = ow * s[1] - p[1] + j * d[1]
                        if 0 <= qh < H and 0 <= qw < W:
                            out[n][qh][qw] += r
    return torch.tensor(out, dtype=torch.float64).unsqueeze(1)


def conv_tolerance(dtype):
    return 1e-12 if dtype == torch.float64 else 2e-5


def assert_close_scaled(got: torch.Tensor, ref: torch.Tensor, tol: float):
    scale = ref.abs().max().item() + 1e-30
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=tol * scale)


def call_backward(grad, bias, gout, S, case):
    """The op; no ``gout`` (the ones' gradient, which the op always takes) is zeros."""
    B, C, H, W, k, s, p, d, _ = case
    if gout is None:
        gout = grad.new_zeros(grad.shape[0], 1, *grad.shape[2:])
    return conv2d_ones_backward_cpu(grad, gout, bias, S, [H, W], list(k), list(s), list(p), list(d))


def spread_reference(share, O, case) -> torch.Tensor:
    """``share`` (B, Ho, Wo) spread over each output position's receptive field: ∂/∂O of Σ S(O)·share
    by torch.autograd, float64."""
    O64 = O.double().clone().requires_grad_(True)
    (spread,) = torch.autograd.grad((S_fn(O64, case)[:, 0] * share.double()).sum(), O64)
    return spread


@pytest.mark.parametrize("holes", [False, True], ids=["ones", "holes"])
@pytest.mark.parametrize("with_gout", [False, True], ids=["no_gout", "gout"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CONV_CASES, ids=case_id)
def test_conv_bias_ones_backward_matches_autograd(case, dtype, with_gout, holes):
    grad, bias, gout, O, S = conv_inputs(case, dtype, with_gout, holes)
    if case[5] == (1, 1) and case[6] == (2, 2) and case[4] == (1, 1):
        assert (S == 0).any()  # the 1×1 case with padding 2 has empty receptive fields
    got = call_backward(grad, bias, gout, S, case)
    B, _, H, W, *_ = case
    assert got.shape == (B, 1, H, W)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close_scaled(got, autograd_reference(grad, bias, gout, O, case), conv_tolerance(dtype))


@pytest.mark.parametrize("case", [c for c in CONV_CASES if c[0] * c[1] * c[2] * c[3] <= 4000],
                         ids=case_id)
def test_conv_bias_ones_backward_matches_loop(case):
    for with_gout, holes in ((True, False), (False, True)):
        grad, bias, gout, O, S = conv_inputs(case, torch.float64, with_gout, holes, seed=7)
        got = call_backward(grad, bias, gout, S, case)
        assert_close_scaled(got, loop_reference(grad, bias, gout, S, case), 1e-12)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [CONV_CASES[1], CONV_CASES[4], CONV_CASES[10]], ids=case_id)
def test_conv_bias_share_formula_and_non_contiguous_inputs(case, dtype):
    grad, bias, gout, O, S = conv_inputs(case, dtype, True, True, seed=11)
    B, C, H, W, *_ = case
    # The op is the share r = (Σ_c grad·bias + grad_ones)/S of the formula, spread over the windows.
    fused = call_backward(grad, bias, gout, S, case)
    assert fused.shape == (B, 1, H, W)
    share = bias_share_reference(grad, bias, gout, S)
    assert share.shape == (B, S.shape[2], S.shape[3])
    assert_close_scaled(fused, spread_reference(share, O, case), conv_tolerance(dtype))
    # Non-contiguous views of the same values give the same bits.
    grad_nc = torch.cat([grad, torch.full_like(grad, float("nan"))], 3)[..., : grad.shape[3]]
    bias_nc = torch.stack([bias, torch.full_like(bias, float("nan"))], 1)[:, 0]
    S_nc = S.transpose(2, 3).contiguous().transpose(2, 3)
    gout_nc = torch.cat([gout, torch.full_like(gout, float("nan"))], 3)[..., : gout.shape[3]]
    assert not (grad_nc.is_contiguous() or bias_nc.is_contiguous() or S_nc.is_contiguous()
                or gout_nc.is_contiguous())
    torch.testing.assert_close(call_backward(grad_nc, bias_nc, gout_nc, S_nc, case), fused,
                               rtol=0, atol=0)
    # The per-position maps may come without their channel dim: (B, Ho, Wo).
    torch.testing.assert_close(call_backward(grad, bias, gout[:, 0], S[:, 0], case), fused, rtol=0, atol=0)
    # Channels-last memory: the sum over channels as one matrix-vector product over rows of
    # channels, read in place (another order of the same sums).
    grad_cl = grad.contiguous(memory_format=torch.channels_last)
    assert_close_scaled(call_backward(grad_cl, bias, gout, S, case), fused.double(), conv_tolerance(dtype))
    assert_close_scaled(call_backward(grad_cl, bias, gout, S, case), spread_reference(share, O, case),
                        conv_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [CONV_CASES[1], CONV_CASES[4], CONV_CASES[10]], ids=case_id)
def test_conv_bias_free_backward_reads_only_the_ones_gradient(case, dtype):
    """Without a bias the share is ``grad_ones_out / S``: a NaN-filled ``grad`` (a strided
    view, which a read or a copy would expose) gives the same bits as the formula."""
    grad, _bias, gout, O, S = conv_inputs(case, dtype, True, True, seed=5)
    nan_grad = torch.full((*grad.shape[:3], 2 * grad.shape[3]), float("nan"), dtype=dtype)[..., ::2]
    assert not nan_grad.is_contiguous()
    got = call_backward(nan_grad, None, gout, S, case)
    assert torch.isfinite(got).all()
    share = bias_share_reference(grad, None, gout, S)
    assert_close_scaled(got, spread_reference(share, O, case), conv_tolerance(dtype))
    zero_bias = torch.zeros(grad.shape[1], dtype=dtype)
    assert_close_scaled(got, autograd_reference(grad, zero_bias, gout, O, case), conv_tolerance(dtype))


def test_conv_bias_mixed_dtypes_and_thread_independence():
    case = CONV_CASES[-1]
    grad, bias, gout, O, S = conv_inputs(case, torch.float16, True, True)
    ref = autograd_reference(grad, bias.float(), gout, O, case)
    got = call_backward(grad, bias.float(), gout.double(), S.double(), case)
    assert got.dtype == torch.float32
    assert_close_scaled(got, ref, 2e-5)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = call_backward(grad, bias, gout, S, case)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(call_backward(grad, bias, gout, S, case), serial, rtol=0,
                               atol=0)


def test_conv_bias_errors():
    grad = torch.randn(2, 3, 5, 5)
    bias = torch.randn(3)
    S = torch.ones(2, 1, 5, 5)
    gout = torch.zeros(2, 1, 5, 5)
    geometry = ([5, 5], [3, 3], [1, 1], [1, 1], [1, 1])
    op = conv2d_ones_backward_cpu
    with pytest.raises(RuntimeError, match=r"bias must have shape \(Cout,\) = \(3,\)"):
        op(grad, gout, torch.randn(4), S, *geometry)
    with pytest.raises(RuntimeError, match=r"S must have shape \(B, 1, Ho, Wo\)"):
        op(grad, gout, bias, torch.ones(2, 1, 5, 4), *geometry)
    with pytest.raises(RuntimeError, match="grad_ones_out must have shape"):
        op(grad, torch.ones(2, 2, 5, 5), bias, S, *geometry)
    with pytest.raises(RuntimeError, match=r"grad must have shape \(B, Cout, Ho, Wo\)"):
        op(grad[0], gout, bias, S, *geometry)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        op(grad.long(), gout, bias, S, *geometry)
    with pytest.raises(TypeError, match="float32, float64, float16 or bfloat16"):
        op(grad, gout, bias.long(), S, *geometry)
    with pytest.raises(RuntimeError, match="CPU tensor"):
        cpu_kernel(op, grad.to("meta"), gout, bias, S, *geometry)
    with pytest.raises(RuntimeError, match="too small for input"):
        op(grad, gout, bias, S, [9, 5], *geometry[1:])
    with pytest.raises(RuntimeError, match="stride must be positive"):
        op(grad, gout, bias, S, [5, 5], [3, 3], [0, 1], [1, 1], [1, 1])
    with pytest.raises(RuntimeError, match="kernel_size must have two entries"):
        op(grad, gout, bias, S, [5, 5], [3], [1, 1], [1, 1], [1, 1])
