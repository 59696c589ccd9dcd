"""R2's backward for conv2d biases over a per-position ones channel (triton_kernels/conv_bias.py).

Forward context: ones ``O`` (B, 1, H, W), ``S = conv2d(O, ones(1, 1, kh, kw))`` with the
conv's stride/padding/dilation, and ``Ō = S/stopgrad(S)`` (0 where S = 0) carrying
``bias[c]·Ō`` into the conv's value. Oracles, computed in float64 from the very values
the kernels see (grad, bias, grad_ones_out rounded to their dtype first):

* ``torch.autograd`` of ``Σ bias[c]·Ō·grad + Σ Ō·grad_ones_out`` with respect to ``O``,
  where ``Ō = where(S ≠ 0, S/stopgrad(S), 0)`` (the plain ``S/S.detach()`` would give
  0/0 = NaN and an infinite gradient where S = 0; the rule book defines Ō = 0 there),
  by ``ones_bar_backward`` of ``tests/kernel_references.py`` (shared with the C++ tests);
* an explicit Python loop over samples, output positions, channels and taps that
  scatters ``r`` (independent of the kernels' gather) on tiny cases;
* for the two stages alone: the formula for ``r`` written with torch ops, and the
  adjoint of ``S_fn`` (``autograd.grad(S_fn(O), O, r)``) and ``F.conv_transpose2d``
  for the spread.

Tolerance: the kernels accumulate in fp32 whatever the input dtype, so for every dtype
``|out − ref| ≤ 1e-5 · bound``, where ``bound`` is the same reference computed from
|grad|, |bias|, |grad_ones_out| (the sum of the magnitudes of every term: fp32
accumulation error is a small multiple of 6e-8 of it). Positions no term reaches
must be exactly 0.

Inputs are non-contiguous views into NaN-filled buffers (gaps on every dim), so a read
outside a view (which the Triton interpreter does not fault on) shows up as NaN. Other
layouts (contiguous, contiguous at an offset in a NaN buffer, channels-last) are tested
separately. Without CUDA the conftest sets ``TRITON_INTERPRET=1`` and tensors live on
the CPU; with CUDA the same tests run natively and the ``gpu`` group adds larger sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernel_references import bias_share_reference, conv_bias_grads, ones_bar_backward
from triton_layouts import DEVICE, gen, nan_offset_view, nan_view
from omenn_kernels.triton_kernels.conv_bias import bias_share, conv_bias_ones_backward, spread_bias_share

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RTOL_BOUND = 1e-5


# --------------------------------------------------------------------------- geometry


def pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def S_fn(O: torch.Tensor, k, s, p, d) -> torch.Tensor:
    kh, kw = pair(k)
    window = torch.ones(1, 1, kh, kw, dtype=O.dtype, device=O.device)
    return F.conv2d(O, window, stride=s, padding=p, dilation=d)


def ones_channel(B, H, W, pattern: str, seed: int, device=DEVICE) -> torch.Tensor:
    """O (B, 1, H, W) float64: 1 at real positions, 0 at padding."""
    if pattern == "ones":
        return torch.ones(B, 1, H, W, dtype=torch.float64, device=device)
    if pattern == "border":  # an explicitly zero-padded region (2 wide on top/left, 1 on bottom/right)
        inner = torch.ones(B, 1, H - 3, W - 3, dtype=torch.float64)
        return F.pad(inner, (2, 1, 2, 1)).to(device)
    if pattern == "holes":  # random zeros, some windows entirely zero
        g = torch.Generator().manual_seed(seed)
        return (torch.rand(B, 1, H, W, generator=g) < 0.6).double().to(device)
    raise AssertionError(pattern)


# --------------------------------------------------------------------------- oracles


def autograd_reference(grad, bias, gof, O, k, s, p, d) -> torch.Tensor:
    """dL/dO (B, 1, H, W) float64 via autograd; inputs are taken as float64 as they are."""
    return ones_bar_backward(O, lambda ones: S_fn(ones, k, s, p, d), grad, bias, gof)


def loop_reference(grad, bias, gof, O, k, s, p, d) -> torch.Tensor:
    """The definition, term by term: r per output position, scattered over its field."""
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = pair(k), pair(s), pair(p), pair(d)
    B, C, Ho, Wo = grad.shape
    H, W = O.shape[-2:]
    g, o = grad.double().cpu().tolist(), O.double().cpu().tolist()
    bl = bias.double().cpu().tolist() if bias is not None else None
    gl = gof.double().cpu().tolist() if gof is not None else None
    out = [[[0.0] * W for _ in range(H)] for _ in range(B)]
    for b in range(B):
        for oh in range(Ho):
            for ow in range(Wo):
                taps = [(oh * sh - ph + i * dh, ow * sw - pw + j * dw) for i in range(kh) for j in range(kw)]
                taps = [(ih, iw) for ih, iw in taps if 0 <= ih < H and 0 <= iw < W]
                S = sum(o[b][0][ih][iw] for ih, iw in taps)
                num = sum(g[b][c][oh][ow] * bl[c] for c in range(C)) if bl is not None else 0.0
                num += gl[b][0][oh][ow] if gl is not None else 0.0
                r = num / S if S != 0 else 0.0
                for ih, iw in taps:
                    out[b][ih][iw] += r
    return torch.tensor(out, dtype=torch.float64).view(B, 1, H, W)


def check(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, rtol: float = RTOL_BOUND) -> None:
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == torch.float32
    assert not torch.isnan(out).any(), "NaN in the output (out-of-bounds read?)"
    out, ref, bound = out.double().cpu(), ref.double().cpu(), bound.double().cpu()
    err = (out - ref).abs()
    bad = err > rtol * bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {out.numel()} off; worst err {float(err.max()):.3e}, "
        f"worst err/bound {float((err / bound.clamp_min(1e-300)).max()):.3e}"
    )


def _abs(t):
    return None if t is None else t.abs()


# --------------------------------------------------------------------------- inputs


def place(values: torch.Tensor, layout: str, device=DEVICE) -> torch.Tensor:
    if layout == "nan_strided":
        return nan_view(values, device)
    if layout == "contiguous":
        return values.to(device).contiguous()
    if layout == "nan_offset":  # contiguous, NaN on both sides
        return nan_offset_view(values, 4099, 4100, device)
    if layout == "channels_last":
        if values.dim() != 4:
            return values.to(device).contiguous()
        return values.to(device).contiguous(memory_format=torch.channels_last)
    raise AssertionError(layout)


def make_inputs(B, C, H, W, k, s, p, d, pattern, dtype, with_gof, seed, layout="nan_strided", device=DEVICE):
    """(grad, bias, gof, S, O): grad/bias/gof in ``dtype``, S fp32, all placed in ``layout``."""
    O = ones_channel(B, H, W, pattern, seed, device)
    S = S_fn(O, k, s, p, d).float()
    Ho, Wo = S.shape[-2:]
    grad, bias, gof = conv_bias_grads(B, C, Ho, Wo, dtype, with_gof, seed)
    grad = place(grad, layout, device)
    bias = place(bias, "nan_strided" if layout == "nan_strided" else "contiguous", device)
    gof = place(gof, layout, device) if with_gof else None
    S = place(S, layout, device)
    return grad, bias, gof, S, O


#      B,   C,  H,  W, kernel, stride, padding, dilation, ones pattern
CASES = [
    (1, 3, 7, 7, 1, 1, 0, 1, "holes"),
    (3, 37, 13, 15, 3, 1, 1, 1, "ones"),
    (3, 3, 15, 13, 3, 2, 1, 1, "border"),
    (1, 197, 7, 13, 5, 1, 2, 1, "ones"),
    (3, 5, 13, 15, 7, 3, (3, 1), 2, "holes"),
    (1, 37, 15, 7, (3, 1), 2, (2, 0), (1, 2), "border"),
    (3, 8, 9, 9, 3, 3, 0, 1, "holes"),
    (3, 37, 15, 15, 3, 2, 2, 2, "border"),
    (1, 197, 15, 13, 7, 2, 3, 1, "ones"),
    (3, 3, 13, 7, (3, 1), 1, (1, 0), 1, "holes"),
    (1, 5, 7, 13, 1, 2, 1, 1, "ones"),  # 1×1 with padding: border outputs see only padding (S = 0)
]


def _case_id(c):
    B, C, H, W, k, s, p, d, pat = c
    return f"B{B}-C{C}-{H}x{W}-k{pair(k)[0]}x{pair(k)[1]}-s{s}-p{p}-d{d}-{pat}".replace(" ", "")


# --------------------------------------------------------------------------- the fused backward


@pytest.mark.parametrize("with_gof", [False, True], ids=["no_gof", "gof"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_matches_autograd(case, dtype, with_gof):
    B, C, H, W, k, s, p, d, pattern = case
    seed = CASES.index(case) * 7 + DTYPES.index(dtype) * 2 + with_gof
    grad, bias, gof, S, O = make_inputs(B, C, H, W, k, s, p, d, pattern, dtype, with_gof, seed)
    out = conv_bias_ones_backward(grad, bias, gof, S, (H, W), k, s, p, d)
    assert out.shape == (B, 1, H, W) and out.device == grad.device
    ref = autograd_reference(grad, bias, gof, O, k, s, p, d)
    bound = autograd_reference(grad.abs(), bias.abs(), _abs(gof), O, k, s, p, d)
    check(out, ref, bound)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "nan_offset", "channels_last"])
@pytest.mark.parametrize("case", [CASES[1], CASES[4], CASES[8]], ids=_case_id)
def test_layouts(case, layout, dtype):
    B, C, H, W, k, s, p, d, pattern = case
    grad, bias, gof, S, O = make_inputs(B, C, H, W, k, s, p, d, pattern, dtype, True, seed=5, layout=layout)
    out = conv_bias_ones_backward(grad, bias, gof, S, (H, W), k, s, p, d)
    ref = autograd_reference(grad, bias, gof, O, k, s, p, d)
    check(out, ref, autograd_reference(grad.abs(), bias.abs(), gof.abs(), O, k, s, p, d))


@pytest.mark.parametrize(
    "B,C,H,W,k,s,p,d,pattern",
    [
        (2, 3, 5, 4, (3, 2), (2, 1), (1, 0), (1, 2), "holes"),
        (1, 4, 7, 6, 3, 3, 2, 2, "border"),
        (2, 2, 4, 5, 1, 1, 0, 1, "holes"),
    ],
)
@pytest.mark.parametrize("with_gof", [False, True], ids=["no_gof", "gof"])
def test_matches_python_loop(B, C, H, W, k, s, p, d, pattern, with_gof):
    grad, bias, gof, S, O = make_inputs(B, C, H, W, k, s, p, d, pattern, torch.float32, with_gof, seed=9)
    out = conv_bias_ones_backward(grad, bias, gof, S, (H, W), k, s, p, d)
    ref = loop_reference(grad, bias, gof, O, k, s, p, d)
    bound = loop_reference(grad.abs(), bias.abs(), _abs(gof), O, k, s, p, d)
    check(out, ref, bound)
    check(out, autograd_reference(grad, bias, gof, O, k, s, p, d), bound)


def test_zero_S_gives_zero_share():
    """Where S = 0 the share is 0 even for huge gradients there (Ō = 0 has no gradient)."""
    B, C, H, W = 2, 5, 9, 8
    O = ones_channel(B, H, W, "border", 0)
    S = S_fn(O, 1, 1, 0, 1).float()
    grad = torch.randn(B, C, H, W, generator=gen(1), device="cpu").to(DEVICE)
    grad = torch.where(S == 0, torch.full_like(grad, 1e30), grad)
    gof = torch.where(S == 0, torch.full_like(S, -1e30), torch.randn(S.shape, generator=gen(2)).to(DEVICE))
    bias = torch.randn(C, generator=gen(3)).to(DEVICE)
    r = bias_share(nan_view(grad), nan_view(bias), nan_view(gof), nan_view(S))
    assert (r[S[:, 0] == 0] == 0).all() and (S == 0).any()
    out = spread_bias_share(r, (H, W), 1)
    assert (out[O == 0] == 0).all()


# --------------------------------------------------------------------------- the two stages alone


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("B,C,Ho,Wo", [(1, 1, 1, 1), (3, 37, 7, 13), (1, 197, 15, 7), (3, 3, 13, 15)])
def test_bias_share_formula(B, C, Ho, Wo, with_bias, dtype):
    g = gen(B * 1000 + C)
    grad = torch.randn(B, C, Ho, Wo, generator=g).to(dtype)
    bias = torch.randn(C, generator=g).to(dtype) if with_bias else None
    gof = torch.randn(B, 1, Ho, Wo, generator=g).to(dtype)
    S = torch.randint(0, 4, (B, 1, Ho, Wo), generator=g).float()
    ref = bias_share_reference(grad, bias, gof, S)
    bound = bias_share_reference(grad.abs(), _abs(bias), gof.abs(), S)
    r = bias_share(nan_view(grad), None if bias is None else nan_view(bias), nan_view(gof), nan_view(S))
    assert r.shape == (B, Ho, Wo)
    check(r, ref, bound)
    # S given as (B, Ho, Wo), grad_ones_out as (B, Ho, Wo) too
    check(bias_share(grad.to(DEVICE), bias if bias is None else bias.to(DEVICE), gof[:, 0].to(DEVICE),
                     S[:, 0].to(DEVICE)), ref, bound)


@pytest.mark.parametrize(
    "B,H,W,k,s,p,d",
    [
        (3, 7, 13, 3, 1, 1, 1),
        (1, 15, 13, 5, 2, 2, 1),
        (3, 13, 15, 7, 3, (3, 1), 2),
        (1, 15, 7, (3, 1), 2, (2, 0), (1, 2)),
        (3, 9, 9, 1, 1, 0, 1),
        (1, 13, 13, 3, 2, 0, 2),
    ],
)
def test_spread_is_adjoint_of_S(B, H, W, k, s, p, d):
    """spread(r) = ∂⟨S_fn(O), r⟩/∂O = conv_transpose2d(r, ones) cropped to H×W."""
    O = torch.ones(B, 1, H, W, dtype=torch.float64, device=DEVICE, requires_grad=True)
    Sv = S_fn(O, k, s, p, d)
    r = torch.randn(Sv.shape, generator=gen(H * W), dtype=torch.float64).to(DEVICE)
    (ref,) = torch.autograd.grad(Sv, O, r, retain_graph=True)
    (bound,) = torch.autograd.grad(Sv, O, r.abs())
    out = spread_bias_share(nan_view(r.float()[:, 0]), (H, W), k, s, p, d)
    check(out, ref, bound)
    # (B, 1, Ho, Wo) share, input_size as a full shape
    check(spread_bias_share(nan_view(r.float()), (B, 1, H, W), k, s, p, d), ref, bound)
    # conv_transpose2d with the output padding that restores H×W
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = pair(k), pair(s), pair(p), pair(d)
    Ho, Wo = r.shape[-2:]
    op = (H - ((Ho - 1) * sh - 2 * ph + dh * (kh - 1) + 1), W - ((Wo - 1) * sw - 2 * pw + dw * (kw - 1) + 1))
    ct = F.conv_transpose2d(r, torch.ones(1, 1, kh, kw, dtype=torch.float64, device=DEVICE), stride=s, padding=p,
                            output_padding=op, dilation=d)
    check(out, ct, bound)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")
@pytest.mark.parametrize("k,d", [(5, 2), ((4, 3), 1), ((2, 2), (2, 1))])
def test_padding_same_and_valid(k, d):
    B, C, H, W = 2, 5, 9, 11
    O = ones_channel(B, H, W, "holes", 4)
    for padding in ("same", "valid"):
        S = S_fn(O, k, 1, padding, d).float()
        grad = torch.randn(B, C, *S.shape[-2:], generator=gen(6)).to(DEVICE)
        bias = torch.randn(C, generator=gen(7)).to(DEVICE)
        out = conv_bias_ones_backward(nan_view(grad), bias, None, nan_view(S), (H, W), k, 1, padding, d)
        ref = autograd_reference(grad, bias, None, O, k, 1, padding, d)
        check(out, ref, autograd_reference(grad.abs(), bias.abs(), None, O, k, 1, padding, d))


# --------------------------------------------------------------------------- edges and errors


def test_empty_batch():
    grad = torch.randn(0, 4, 5, 5, device=DEVICE)
    S = torch.ones(0, 1, 5, 5, device=DEVICE)
    r = bias_share(grad, torch.randn(4, device=DEVICE), None, S)
    assert r.shape == (0, 5, 5)
    out = conv_bias_ones_backward(grad, torch.randn(4, device=DEVICE), None, S, (7, 7), 3, 1, 0, 1)
    assert out.shape == (0, 1, 7, 7) and out.dtype == torch.float32


def test_no_channels_and_no_bias():
    """Cout = 0 or bias None: only grad_ones_out reaches the ones."""
    B, H, W = 2, 7, 6
    O = ones_channel(B, H, W, "holes", 8)
    S = S_fn(O, 3, 1, 1, 1).float()
    gof = torch.randn(S.shape, generator=gen(9)).to(DEVICE)
    ref = autograd_reference(torch.zeros(B, 1, H, W), None, gof, O, 3, 1, 1, 1)
    bound = autograd_reference(torch.zeros(B, 1, H, W), None, gof.abs(), O, 3, 1, 1, 1)
    empty = torch.empty(B, 0, H, W, device=DEVICE)
    check(conv_bias_ones_backward(empty, torch.empty(0, device=DEVICE), gof, S, (H, W), 3, 1, 1, 1), ref, bound)
    grad = torch.randn(B, 4, H, W, device=DEVICE)
    check(conv_bias_ones_backward(nan_view(grad), None, nan_view(gof), S, (H, W), 3, 1, 1, 1), ref, bound)


def test_errors():
    grad = torch.randn(2, 4, 5, 5, device=DEVICE)
    S = torch.ones(2, 1, 5, 5, device=DEVICE)
    bias = torch.randn(4, device=DEVICE)
    with pytest.raises(ValueError, match="S has shape"):
        bias_share(grad, bias, None, torch.ones(2, 1, 5, 4, device=DEVICE))
    with pytest.raises(ValueError, match="bias"):
        bias_share(grad, torch.randn(3, device=DEVICE), None, S)
    with pytest.raises(ValueError, match="grad_ones_out"):
        bias_share(grad, bias, torch.ones(2, 2, 5, 5, device=DEVICE), S)
    with pytest.raises(ValueError, match="spatial size"):  # a 3×3 valid conv of 7×7 gives 5×5, not 6×6
        spread_bias_share(torch.ones(2, 6, 6, device=DEVICE), (7, 7), 3, 1, 0, 1)
    with pytest.raises(ValueError, match="padding"):
        spread_bias_share(torch.ones(2, 5, 5, device=DEVICE), (7, 7), 3, 1, "full", 1)
    with pytest.raises(ValueError, match="geometry"):
        spread_bias_share(torch.ones(2, 5, 5, device=DEVICE), (7, 7), 3, 0, 0, 1)


# --------------------------------------------------------------------------- GPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (native Triton)")
class TestGPU:
    """The same checks at realistic sizes, natively on CUDA."""

    @pytest.mark.parametrize("layout", ["contiguous", "nan_strided", "channels_last"])
    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize(
        "B,C,H,W,k,s,p,d,pattern",
        [
            (8, 256, 56, 56, 3, 1, 1, 1, "ones"),            # ResNet stage 1
            (4, 64, 224, 224, 7, 2, 3, 1, "ones"),           # ResNet stem
            (8, 512, 28, 28, 3, 2, 1, 1, "border"),          # strided downsampling
            (2, 197, 57, 45, (3, 1), (2, 1), (2, 0), (1, 2), "holes"),
            (4, 1000, 14, 14, 1, 1, 0, 1, "holes"),          # 1×1 with S = 0 positions
            (3, 96, 56, 56, 4, 4, 0, 1, "ones"),             # ConvNeXt patchify stem
        ],
    )
    def test_large(self, B, C, H, W, k, s, p, d, pattern, dtype, layout):
        grad, bias, gof, S, O = make_inputs(B, C, H, W, k, s, p, d, pattern, dtype, True, seed=1,
                                            layout=layout, device="cuda")
        out = conv_bias_ones_backward(grad, bias, gof, S, (H, W), k, s, p, d)
        ref = autograd_reference(grad, bias, gof, O, k, s, p, d)
        check(out, ref, autograd_reference(grad.abs(), bias.abs(), gof.abs(), O, k, s, p, d))
