"""R6 attention kernels (triton_kernels/attention.py): forward with lse, backward dV only.

Oracle: a float64 PyTorch softmax attention written here (``A = softmax(q·kᵀ·scale +
bias)``, fully masked rows defined as ``A = 0``, ``lse = -inf``) computed from the very
values the kernel sees (inputs rounded to their dtype first), and ``dV`` from
``torch.autograd`` on ``Y = A.detach() @ V`` (= ``Aᵀ·dY``).

Every input is a non-contiguous view into a NaN-filled buffer, so a read outside the
view (which the Triton interpreter does not fault on) turns the result into NaN.

Tolerances, as max |error| / max |reference| (per output):
fp32 1e-5, fp16 2e-3, bf16 2e-2; ``lse`` to 1e-5 (fp32) … 2e-2 (bf16) of max(1, |lse|).

Without CUDA the conftest sets ``TRITON_INTERPRET=1`` and tensors live on the CPU; with
CUDA the same tests run natively, and the ``gpu`` group adds B=8, H=12, T∈{197, 1024},
D=64 bf16 checks against float64 and against SDPA's own forward and backward.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from triton_layouts import DEVICE, gen
from omenn_kernels.triton_kernels.attention import attention_backward_dv, attention_forward

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
NEG_INF = float("-inf")


# --------------------------------------------------------------------------- helpers


def _nan_view(B, H, T, D, dtype, seed, scale=1.0, device=DEVICE):
    """A (B, H, T, D) view, (B, T, H, D)-major with padding on every dim, in a NaN buffer."""
    buf = torch.full((B + 1, T + 3, H + 1, D + 7), float("nan"), dtype=dtype, device=device)
    view = buf[1:, 2 : T + 2, 1:, 3 : D + 3].permute(0, 2, 1, 3)
    view.copy_((torch.randn(B, H, T, D, generator=gen(seed)) * scale).to(dtype))
    assert not view.is_contiguous() or T * H * D <= 1
    return view


def _nan_bias(shape, values: torch.Tensor, device=DEVICE):
    """A float32 view of ``shape`` holding ``values``, inside a NaN buffer, last dim padded."""
    *lead, tq, tk = shape
    buf = torch.full((*lead, tq + 2, tk + 5), float("nan"), dtype=torch.float32, device=device)
    view = buf[..., 1 : tq + 1, 2 : tk + 2]
    view.copy_(values.to(device))
    return view


def _relpos_bias(H, Tq, Tk, seed):
    return _nan_bias((1, H, Tq, Tk), torch.randn(1, H, Tq, Tk, generator=gen(seed)))


def _mask_bias(B, Tq, Tk, seed, fully_masked_row: bool = True):
    """(B, 1, Tq, Tk) additive mask with -inf entries (a Swin-like window mask) plus noise."""
    vals = torch.randn(B, 1, Tq, Tk, generator=gen(seed)) * 0.5
    drop = torch.rand(B, 1, Tq, Tk, generator=gen(seed + 1)) < 0.3
    drop[..., :, 0] = False  # keep at least one key per row ...
    vals = vals.masked_fill(drop, NEG_INF)
    if fully_masked_row and Tq > 1:
        vals[0, 0, Tq // 2, :] = NEG_INF  # ... except one fully masked row
    return _nan_bias((B, 1, Tq, Tk), vals)


def _reference(q, k, v, scale, bias, grad_out):
    """float64 softmax attention; fully masked rows give A = 0. Returns out, lse, dV."""
    q64, k64 = q.double(), k.double()
    v64 = v.double().detach().requires_grad_(True)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias.double()
    lse = torch.logsumexp(s, dim=-1)
    dead = torch.isneginf(lse)[..., None]
    A = torch.exp(s - torch.where(dead, torch.zeros_like(lse[..., None]), lse[..., None]))
    A = torch.where(dead, torch.zeros_like(A), A).detach()
    y = A @ v64
    y.backward(grad_out.double())
    return y.detach(), lse, v64.grad, A


def _rel_err(got, ref) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    assert torch.isfinite(got).all(), "non-finite values (out-of-bounds read or NaN from a masked row)"
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _check_lse(lse, ref_lse, tol):
    lse, ref_lse = lse.double().cpu(), ref_lse.cpu()
    assert not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    fin = torch.isfinite(ref_lse)
    err = ((lse[fin] - ref_lse[fin]).abs() / ref_lse[fin].abs().clamp_min(1.0)).max().item() if fin.any() else 0.0
    assert err <= tol, f"lse error {err:.3g} > {tol}"


def _run_and_check(B, H, Tq, Tk, D, Dv, dtype, bias_kind, seed=0, scale=None, blocks=None):
    q = _nan_view(B, H, Tq, D, dtype, seed)
    k = _nan_view(B, H, Tk, D, dtype, seed + 1)
    v = _nan_view(B, H, Tk, Dv, dtype, seed + 2)
    g = _nan_view(B, H, Tq, Dv, dtype, seed + 3)
    bias = {
        None: None,
        "relpos": lambda: _relpos_bias(H, Tq, Tk, seed + 4),
        "mask": lambda: _mask_bias(B, Tq, Tk, seed + 5),
    }[bias_kind]
    bias = bias() if bias is not None else None
    kw = dict(block_m=blocks[0], block_n=blocks[1]) if blocks else {}

    out, lse = attention_forward(q, k, v, scale=scale, bias=bias, **kw)
    dv = attention_backward_dv(q, k, g, lse, scale=scale, bias=bias, **kw)

    sc = 1.0 / math.sqrt(D) if scale is None else scale
    ref_out, ref_lse, ref_dv, _ = _reference(q, k, v, sc, bias, g)
    tol = TOL[dtype]
    assert out.shape == (B, H, Tq, Dv) and out.dtype == dtype
    assert lse.shape == (B, H, Tq) and lse.dtype == torch.float32
    assert dv.shape == (B, H, Tk, Dv) and dv.dtype == dtype
    e_out, e_dv = _rel_err(out, ref_out), _rel_err(dv, ref_dv)
    assert e_out <= tol, f"out error {e_out:.3g} > {tol}"
    assert e_dv <= tol, f"dV error {e_dv:.3g} > {tol}"
    _check_lse(lse, ref_lse, tol)
    return q, k, v, g, bias, out, lse, dv


# --------------------------------------------------------------------------- CPU (interpreter) / native


# (B, H, Tq, Tk, D, Dv, dtype, bias, (block_m, block_n) or None for the defaults)
CASES = [
    (1, 2, 1, 1, 16, 16, torch.float32, None, None),  # T = 1
    (1, 2, 5, 5, 16, 16, torch.float32, "relpos", None),  # ragged, one tile
    (2, 2, 17, 17, 64, 64, torch.float32, "mask", (16, 16)),  # 2 x 2 tiles, ragged, -inf, dead row
    (1, 2, 17, 17, 80, 80, torch.float32, "relpos", (16, 32)),  # D = 80 padded to 128
    (1, 2, 1, 17, 64, 64, torch.float32, "relpos", (16, 16)),  # class attention: 1 query, 17 keys
    (1, 2, 1, 17, 64, 64, torch.bfloat16, None, None),
    (1, 2, 17, 23, 32, 16, torch.float32, "mask", (16, 16)),  # Tq != Tk, Dv != D
    (1, 2, 17, 17, 64, 64, torch.float16, "mask", (16, 16)),
    (1, 2, 17, 17, 64, 64, torch.bfloat16, "relpos", (16, 16)),
    (1, 1, 17, 17, 80, 80, torch.float16, None, None),
    (1, 1, 17, 17, 16, 16, torch.bfloat16, "mask", (16, 16)),
    (1, 2, 5, 40, 64, 64, torch.float32, "relpos", (16, 16)),  # cross attention, 3 key tiles
    (1, 1, 17, 17, 128, 128, torch.float16, "relpos", (16, 16)),  # D = 128
    (1, 1, 40, 40, 128, 128, torch.float32, "mask", None),  # fp32 D=128 default tiles (16-wide)
    (1, 1, 150, 150, 64, 64, torch.bfloat16, "relpos", (128, 64)),  # the long-sequence GPU tiles
    (1, 1, 197, 197, 64, 64, torch.float32, "relpos", None),  # ViT/DeiT token count, default tiles
    (1, 1, 197, 197, 64, 64, torch.bfloat16, "mask", None),
]


def _case_id(c):
    B, H, Tq, Tk, D, Dv, dt, bias, blocks = c
    return f"B{B}H{H}-Tq{Tq}-Tk{Tk}-D{D}-Dv{Dv}-{str(dt)[6:]}-{bias or 'nobias'}-{'x'.join(map(str, blocks)) if blocks else 'auto'}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_forward_and_dv_match_float64_reference(case):
    B, H, Tq, Tk, D, Dv, dtype, bias, blocks = case
    _run_and_check(B, H, Tq, Tk, D, Dv, dtype, bias, blocks=blocks)


def test_custom_scale():
    _run_and_check(1, 2, 17, 17, 32, 32, torch.float32, "relpos", scale=0.37, blocks=(16, 16))


def test_fully_masked_rows_give_zero_output_minus_inf_lse_and_no_dv():
    B, H, T, D = 1, 2, 17, 16
    q, k, v, g, bias, out, lse, dv = _run_and_check(B, H, T, T, D, D, torch.float32, "mask", blocks=(16, 16))
    dead = T // 2  # _mask_bias kills this row of batch 0 (all heads: the mask broadcasts over H)
    assert torch.isneginf(lse[0, :, dead]).all()
    assert (out[0, :, dead] == 0).all()
    # the dead row's grad_out must not reach dV: change it and dV stays bit-identical
    g2 = g.clone()
    g2[0, :, dead] = 1e6
    dv2 = attention_backward_dv(q, k, g2, lse, bias=bias, block_m=16, block_n=16)
    assert torch.equal(dv, dv2)


def test_all_rows_masked_and_empty_keys():
    B, H, T, D = 1, 1, 5, 16
    q, k, v = (_nan_view(B, H, T, D, torch.float32, s) for s in range(3))
    bias = _nan_bias((1, 1, T, T), torch.full((1, 1, T, T), NEG_INF))
    out, lse = attention_forward(q, k, v, bias=bias)
    assert (out == 0).all() and torch.isneginf(lse).all()
    dv = attention_backward_dv(q, k, v[:, :, :T], lse, bias=bias)
    assert (dv == 0).all()
    out0, lse0 = attention_forward(q, k[:, :, :0], v[:, :, :0])
    assert out0.shape == (B, H, T, D) and (out0 == 0).all() and torch.isneginf(lse0).all()


def test_qkv_slices_of_permuted_projection():
    """q, k, v = qkv.reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4): strided, no copies."""
    B, T, H, D = 2, 17, 2, 16
    buf = torch.full((B, T + 2, 3 * H * D + 8), float("nan"), device=DEVICE)
    qkv = buf[:, 1 : T + 1, 4 : 4 + 3 * H * D]
    qkv.copy_(torch.randn(B, T, 3 * H * D, generator=gen(7)))
    q, k, v = qkv.reshape(B, T, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
    assert not q.is_contiguous()
    bias = _relpos_bias(H, T, T, 8)
    g = _nan_view(B, H, T, D, torch.float32, 9)
    out, lse = attention_forward(q, k, v, bias=bias, block_m=16, block_n=16)
    dv = attention_backward_dv(q, k, g, lse, bias=bias, block_m=16, block_n=16)
    ref_out, ref_lse, ref_dv, _ = _reference(q, k, v, 1 / math.sqrt(D), bias, g)
    assert _rel_err(out, ref_out) <= 1e-5 and _rel_err(dv, ref_dv) <= 1e-5
    _check_lse(lse, ref_lse, 1e-5)


@pytest.mark.parametrize("bias_kind", ["relpos", "window", "bool"])
def test_forward_matches_sdpa(bias_kind):
    B, H, T, D = 2, 2, 17, 32
    q, k, v = (_nan_view(B, H, T, D, torch.float32, s) for s in (11, 12, 13))
    if bias_kind == "relpos":
        bias = _relpos_bias(H, T, T, 14)
    elif bias_kind == "window":  # (B, 1, T, T) with -inf, no fully masked row (SDPA gives NaN there)
        bias = _mask_bias(B, T, T, 15, fully_masked_row=False)
    else:
        keep = torch.rand(B, 1, T, T, generator=gen(16)) > 0.3
        keep[..., 0] = True
        bias = keep.to(DEVICE)
    out, lse = attention_forward(q, k, v, bias=bias, block_m=16, block_n=16)
    # PyTorch's CUDA attention kernels refuse (or misread) the padded views: give them copies.
    ref = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                         attn_mask=bias.contiguous())
    assert _rel_err(out, ref) <= 1e-5


def test_dv_equals_A_transpose_grad_out():
    """The autograd reference and the closed form Aᵀ·dY agree (sanity of the oracle)."""
    B, H, T, D = 1, 2, 5, 16
    q, k, v, g = (_nan_view(B, H, T, D, torch.float64, s, device="cpu") for s in range(4))
    _, _, ref_dv, A = _reference(q, k, v, 0.25, None, g)
    torch.testing.assert_close(ref_dv, A.transpose(-1, -2) @ g.double(), rtol=1e-12, atol=1e-12)


def test_bad_inputs_raise():
    q = torch.zeros(1, 1, 4, 16, device=DEVICE)
    with pytest.raises(ValueError):
        attention_forward(q, torch.zeros(1, 1, 4, 8, device=DEVICE), torch.zeros(1, 1, 4, 16, device=DEVICE))
    with pytest.raises(TypeError):
        attention_forward(q, q.double(), q.double())
    with pytest.raises(ValueError):
        attention_forward(q, q, q, bias=torch.zeros(2, 1, 4, 4, device=DEVICE))
    with pytest.raises(ValueError):
        attention_backward_dv(q, q, q, torch.zeros(1, 1, 3, device=DEVICE))
    with pytest.raises(ValueError):
        attention_forward(q, q, q, block_m=24)


# --------------------------------------------------------------------------- GPU (native)

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.parametrize("T", [197, 1024])
@pytest.mark.parametrize("bias_kind", [None, "relpos"])
def test_gpu_bf16_vit_sizes(T, bias_kind):
    B, H, D, dtype = 8, 12, 64, torch.bfloat16
    q, k, v, g, bias, out, lse, dv = _run_and_check(B, H, T, T, D, D, dtype, bias_kind, seed=T)
    # against PyTorch's own SDPA forward and full backward (its dV)
    mask = None if bias is None else bias.to(dtype).contiguous()
    v_req = v.detach().contiguous().requires_grad_(True)  # contiguous copies, as above
    ref = F.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v_req, attn_mask=mask)
    ref.backward(g.contiguous())
    assert _rel_err(out, ref.detach()) <= TOL[dtype]
    assert _rel_err(dv, v_req.grad) <= TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_other_dtypes_and_masks(dtype):
    _run_and_check(2, 4, 197, 197, 64, 64, dtype, "mask", seed=3)
    _run_and_check(2, 4, 1, 197, 128, 128, dtype, "relpos", seed=4)
    _run_and_check(2, 4, 197, 197, 80, 80, dtype, None, seed=5)
