"""R2's backward for 2-D convolutions: the bias spread over the ones channel.

Forward context (DESIGN.md §2, R2): a conv2d whose input ones ``O`` is (B, 1, H, W) —
one ones value per input pixel — with kernel (kh, kw), stride, padding and dilation.
``S[b, p]`` is the sum of ``O`` over output position ``p``'s receptive field (zero
padding counts 0), and the conv's value gets ``bias[c]·Ō[p]`` with
``Ō = S/stopgrad(S)`` (0 where ``S = 0``). Given ``grad = dL/dy`` and
``grad_ones_out = dL/dŌ``, the gradient reaching ``O`` is

    r[b, p]        = (Σ_c grad[b, c, p]·bias[c] + grad_ones_out[b, 0, p]) / S[b, p]
                     (r = 0 where S = 0)
    dL/dO[b, 0, q] = Σ_{p : q ∈ field(p)} r[b, p]

The second step is a transposed convolution of ``r`` with an all-ones kh×kw kernel;
it is computed as a gather per input position ``q`` over the kernel taps (no
atomics, deterministic): tap (i, j) reads ``r`` at
``p_h = (q_h + pad_h − i·dil_h)/stride_h`` when that is an integer in [0, Ho), and
likewise for w.

Groups do not matter: with one ones value per position the share of a position is
the same for every channel group.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

IntPair = Union[int, Sequence[int]]

_NUM_WARPS = 4
_BLOCK_Q = 256


@triton.jit
def _bias_share_kernel(
    g_ptr, bias_ptr, gof_ptr, s_ptr, r_ptr,
    C, Wo, P, n_pblocks,
    g_sb, g_sc, g_sh, g_sw,
    gof_sb, gof_sh, gof_sw,
    s_sb, s_sh, s_sw,
    HAS_BIAS: tl.constexpr, HAS_GOF: tl.constexpr,
    G_FLAT: tl.constexpr, GOF_FLAT: tl.constexpr, S_FLAT: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """One program: BLOCK_P output positions of one sample, reduced over all channels.

    ``*_FLAT``: that tensor's (Ho, Wo) dims collapse to one of stride ``*_sw``, so the
    position offset is ``p·sw`` (contiguity the compiler can see: vector loads).
    """
    pid = tl.program_id(0)
    b = (pid // n_pblocks).to(tl.int64)
    p = (pid % n_pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = p < P
    oh = (p // Wo).to(tl.int64)
    ow = (p % Wo).to(tl.int64)
    p64 = p.to(tl.int64)

    num = tl.zeros([BLOCK_P], dtype=tl.float32)
    if HAS_BIAS:
        acc = tl.zeros([BLOCK_C, BLOCK_P], dtype=tl.float32)
        if G_FLAT:
            g_pos = g_ptr + b * g_sb + p64 * g_sw  # [BLOCK_P] pointers
        else:
            g_pos = g_ptr + b * g_sb + oh * g_sh + ow * g_sw
        cc = tl.arange(0, BLOCK_C)
        for c0 in range(0, C, BLOCK_C):
            c = c0 + cc
            cmask = c < C
            w = tl.load(bias_ptr + c, mask=cmask, other=0.0).to(tl.float32)
            g = tl.load(
                g_pos[None, :] + c.to(tl.int64)[:, None] * g_sc,
                mask=cmask[:, None] & pmask[None, :], other=0.0,
            ).to(tl.float32)
            acc += g * w[:, None]
        num += tl.sum(acc, axis=0)
    if HAS_GOF:
        if GOF_FLAT:
            gof_off = b * gof_sb + p64 * gof_sw
        else:
            gof_off = b * gof_sb + oh * gof_sh + ow * gof_sw
        num += tl.load(gof_ptr + gof_off, mask=pmask, other=0.0).to(tl.float32)
    if S_FLAT:
        s_off = b * s_sb + p64 * s_sw
    else:
        s_off = b * s_sb + oh * s_sh + ow * s_sw
    s = tl.load(s_ptr + s_off, mask=pmask, other=0.0).to(tl.float32)
    nonzero = s != 0.0
    r = tl.where(nonzero, num / tl.where(nonzero, s, 1.0), 0.0)
    tl.store(r_ptr + b * P + p64, r, mask=pmask)


@triton.jit
def _spread_kernel(
    r_ptr, out_ptr,
    H, W, Ho, Wo, n_qblocks,
    r_sb, r_sh, r_sw,
    stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
    KH: tl.constexpr, KW: tl.constexpr, BLOCK_Q: tl.constexpr,
):
    """One program: BLOCK_Q input positions of one sample, gathering over the kh×kw taps."""
    pid = tl.program_id(0)
    b = (pid // n_qblocks).to(tl.int64)
    q = (pid % n_qblocks) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qmask = q < H * W
    qh = q // W
    qw = q % W
    r_base = r_ptr + b * r_sb
    acc = tl.zeros([BLOCK_Q], dtype=tl.float32)
    for i in tl.static_range(KH):
        th = qh + pad_h - i * dil_h
        ph = th // stride_h  # only used where th >= 0, so truncation vs floor does not matter
        hmask = qmask & (th >= 0) & (ph * stride_h == th) & (ph < Ho)
        for j in tl.static_range(KW):
            tw = qw + pad_w - j * dil_w
            pw = tw // stride_w
            m = hmask & (tw >= 0) & (pw * stride_w == tw) & (pw < Wo)
            acc += tl.load(r_base + ph.to(tl.int64) * r_sh + pw.to(tl.int64) * r_sw, mask=m, other=0.0)
    tl.store(out_ptr + b * H * W + q, acc, mask=qmask)


# ----------------------------------------------------------------------------- host


def _pair(value: IntPair, name: str) -> tuple[int, int]:
    if isinstance(value, int):
        pair = (value, value)
    else:
        pair = tuple(int(v) for v in value)
        if len(pair) == 1:
            pair = (pair[0], pair[0])
    if len(pair) != 2:
        raise ValueError(f"{name} must be an int or a pair of ints, got {value!r}")
    return pair


def _padding(padding, kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int]:
    """Leading (top, left) padding; 'valid' and 'same' as in ``torch.nn.functional.conv2d``."""
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0)
        if padding == "same":  # torch puts the odd extra pad at the end: the leading pad is total // 2
            return tuple(d * (k - 1) // 2 for k, d in zip(kernel, dilation))
        raise ValueError(f"padding must be an int, a pair, 'valid' or 'same', got {padding!r}")
    return _pair(padding, "padding")


def _conv_out(size: int, k: int, s: int, p: int, d: int) -> int:
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _spatial(t: torch.Tensor, name: str) -> torch.Tensor:
    """(B, 1, Ho, Wo) or (B, Ho, Wo) → a (B, Ho, Wo) view."""
    if t.dim() == 4:
        if t.shape[1] != 1:
            raise ValueError(f"{name} must have one channel, got shape {tuple(t.shape)}")
        return t[:, 0]
    if t.dim() == 3:
        return t
    raise ValueError(f"{name} must be (B, 1, Ho, Wo) or (B, Ho, Wo), got shape {tuple(t.shape)}")


def _flat(t: torch.Tensor) -> bool:
    """The last two dims of ``t`` collapse into one: offset ``(h·Wo + w)·stride(-1)``."""
    return t.shape[-2] == 1 or t.stride(-2) == t.shape[-1] * t.stride(-1)


def bias_share(grad: torch.Tensor, bias, grad_ones_out, S: torch.Tensor) -> torch.Tensor:
    """``r = (Σ_c grad·bias + grad_ones_out) / S`` (0 where S = 0): (B, Ho, Wo) fp32.

    ``grad`` (B, Cout, Ho, Wo), ``bias`` (Cout,) or None, ``grad_ones_out``
    (B, 1, Ho, Wo) or None, ``S`` (B, 1, Ho, Wo) or (B, Ho, Wo); any float dtypes and
    strides (no copies are made).
    """
    if grad.dim() != 4:
        raise ValueError(f"grad must be (B, Cout, Ho, Wo), got shape {tuple(grad.shape)}")
    B, C, Ho, Wo = grad.shape
    S3 = _spatial(S, "S")
    if tuple(S3.shape) != (B, Ho, Wo):
        raise ValueError(f"S has shape {tuple(S.shape)}, expected ({B}, 1, {Ho}, {Wo})")
    tensors = [grad, S3]
    if bias is not None:
        if bias.dim() != 1 or bias.shape[0] != C:
            raise ValueError(f"bias must be ({C},), got shape {tuple(bias.shape)}")
        tensors.append(bias)
    gof = None
    if grad_ones_out is not None:
        gof = _spatial(grad_ones_out, "grad_ones_out")
        if tuple(gof.shape) != (B, Ho, Wo):
            raise ValueError(f"grad_ones_out has shape {tuple(grad_ones_out.shape)}, expected ({B}, 1, {Ho}, {Wo})")
        tensors.append(gof)
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"bias_share expects floating-point tensors, got {t.dtype}")
        if t.device != grad.device:
            raise ValueError(f"all tensors must be on {grad.device}, got one on {t.device}")

    P = Ho * Wo
    r = torch.empty((B, Ho, Wo), dtype=torch.float32, device=grad.device)
    if r.numel() == 0:
        return r
    if bias is not None and C == 0:
        bias = None
    has_bias = bias is not None
    if has_bias:
        bias = bias.contiguous()
    BLOCK_P = max(16, min(128, triton.next_power_of_2(P)))
    BLOCK_C = max(1, min(4096 // BLOCK_P, triton.next_power_of_2(C)))
    n_pblocks = triton.cdiv(P, BLOCK_P)
    gof_arg = gof if gof is not None else S3
    grid = (B * n_pblocks,)
    wrap_triton(_bias_share_kernel)[grid](
        grad, bias if has_bias else S3, gof_arg, S3, r,
        C, Wo, P, n_pblocks,
        *grad.stride(),
        *gof_arg.stride(),
        *S3.stride(),
        HAS_BIAS=has_bias, HAS_GOF=gof is not None,
        G_FLAT=_flat(grad), GOF_FLAT=_flat(gof_arg), S_FLAT=_flat(S3),
        BLOCK_C=BLOCK_C, BLOCK_P=BLOCK_P, num_warps=_NUM_WARPS,
    )
    return r


def spread_bias_share(share: torch.Tensor, input_size, kernel_size: IntPair, stride: IntPair = 1,
                      padding: Union[IntPair, str] = 0, dilation: IntPair = 1) -> torch.Tensor:
    """``dL/dO`` (B, 1, H, W) fp32: each input position gathers ``r`` of every output
    position whose receptive field contains it (a transposed convolution of ``share``
    with an all-ones kernel).

    ``share`` is ``r`` (B, Ho, Wo) (or (B, 1, Ho, Wo)), any float dtype and strides;
    ``input_size`` is (H, W) or any size whose last two entries are H, W (e.g. the
    input's shape); ``padding`` is the leading (top, left) padding, an int, a pair, or
    'valid'/'same' as in ``F.conv2d``.
    """
    r = _spatial(share, "share")
    if not r.is_floating_point():
        raise TypeError(f"share must be floating point, got {r.dtype}")
    size = tuple(int(v) for v in input_size)
    if len(size) < 2:
        raise ValueError(f"input_size must end with (H, W), got {input_size!r}")
    H, W = size[-2:]
    kh, kw = _pair(kernel_size, "kernel_size")
    sh, sw = _pair(stride, "stride")
    dh, dw = _pair(dilation, "dilation")
    ph, pw = _padding(padding, (kh, kw), (dh, dw))
    if min(kh, kw, sh, sw, dh, dw) < 1 or min(ph, pw) < 0 or min(H, W) < 0:
        raise ValueError(f"invalid convolution geometry: input {(H, W)}, kernel {(kh, kw)}, "
                         f"stride {(sh, sw)}, padding {(ph, pw)}, dilation {(dh, dw)}")
    B, Ho, Wo = r.shape
    if padding == "same":
        expected = (H, W)
    else:
        expected = (_conv_out(H, kh, sh, ph, dh), _conv_out(W, kw, sw, pw, dw))
    if (Ho, Wo) != expected:
        raise ValueError(f"share has spatial size {(Ho, Wo)} but a conv with input {(H, W)}, kernel {(kh, kw)}, "
                         f"stride {(sh, sw)}, padding {padding!r}, dilation {(dh, dw)} gives {expected}")
    if r.dtype != torch.float32:
        r = r.float()
    out = torch.empty((B, 1, H, W), dtype=torch.float32, device=r.device)
    if out.numel() == 0:
        return out
    n_qblocks = triton.cdiv(H * W, _BLOCK_Q)
    grid = (B * n_qblocks,)
    wrap_triton(_spread_kernel)[grid](
        r, out,
        H, W, Ho, Wo, n_qblocks,
        *r.stride(),
        sh, sw, ph, pw, dh, dw,
        KH=kh, KW=kw, BLOCK_Q=_BLOCK_Q, num_warps=_NUM_WARPS,
    )
    return out


def conv_bias_ones_backward(grad: torch.Tensor, bias, grad_ones_out, S: torch.Tensor, input_size,
                            kernel_size: IntPair, stride: IntPair = 1, padding: Union[IntPair, str] = 0,
                            dilation: IntPair = 1) -> torch.Tensor:
    """``dL/dO`` (B, 1, H, W), fp32 (the caller casts): ``bias_share`` then ``spread_bias_share``."""
    r = bias_share(grad, bias, grad_ones_out, S)
    return spread_bias_share(r, input_size, kernel_size, stride, padding, dilation)


__all__ = ["bias_share", "spread_bias_share", "conv_bias_ones_backward"]
