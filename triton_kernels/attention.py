"""Flash attention for OMENN rule R6: forward with log-sum-exp, backward dV only.

In the linearized network the attention matrix ``A = softmax(Q·Kᵀ·scale + bias)`` is a
constant (DESIGN.md §2, R5/R6), so ``Y = A·V`` is linear in ``V`` and its backward is
``dV = Aᵀ·dY`` alone: no dQ, no dK and no ``Δ = rowsum(dO∘O)`` pre-pass (two of the
seven matmuls of a full flash-attention backward).

* :func:`attention_forward` — one program per (query tile, batch·head); loops over key
  tiles with an online softmax (fp32 running max and sum, base-2 exponentials) and
  returns ``out`` and the natural-log ``lse`` per query row.
* :func:`attention_backward_dv` — one program per (key tile, batch·head); loops over
  query tiles, recomputes ``P = exp(scores − lse)`` tile by tile from ``Q``, ``K``,
  ``bias`` and the saved ``lse``, and accumulates ``dV = Pᵀ·dO`` in fp32. Each program
  owns its key rows, so there are no atomics.

Fully masked query rows (every score ``-inf``, or ``Tk == 0``): ``out`` is 0 and
``lse`` is ``-inf`` for that row, and the row contributes 0 to ``dV`` (the forward of
``softmax`` would be NaN there; 0 is the limit of a row whose weights all vanish and
keeps the linearized network finite).

Strides are passed to the kernels, so ``q``, ``k``, ``v``, ``grad_out`` and ``bias`` may
be arbitrary strided views (e.g. slices of a permuted ``qkv`` tensor); a broadcast bias
is expanded with stride 0, never copied.

Precision: fp16/bf16 inputs use native tensor-core ``tl.dot`` with fp32 accumulation on
a GPU (``P`` is cast to the value dtype before ``P·V`` / ``Pᵀ·dO``, as in flash
attention); fp32 inputs use ``input_precision="tf32x3"`` (three TF32 passes: about fp32 accuracy on
tensor cores, not plain TF32). Under
``TRITON_INTERPRET=1`` (CPU) every operand is upcast to fp32 before any math, because
the interpreter's bf16/fp16 arithmetic is unreliable (DESIGN.md §4).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

__all__ = ["attention_forward", "attention_backward_dv"]

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


# --------------------------------------------------------------------------- kernels


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Bias, Out, Lse,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, Tq, Tk, D, DV,
    qk_scale,  # scale * log2(e)
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Inductor passes a Python float as fp64, which would promote the scores and the accumulator
    qk_scale_f32 = tl.cast(qk_scale, tl.float32)
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_mask = offs_m < Tq
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    k_base = K + off_b * stride_kb + off_h * stride_kh
    v_base = V + off_b * stride_vb + off_h * stride_vh
    b_base = Bias + off_b * stride_bb + off_h * stride_bh

    q = tl.load(
        q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
        mask=m_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    for start_n in range(0, Tk, BLOCK_N):
        offs_n = start_n + offs_n0
        n_mask = offs_n < Tk
        # K loaded transposed: (BLOCK_D, BLOCK_N)
        kt = tl.load(
            k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
            mask=d_mask[:, None] & n_mask[None, :], other=0.0,
        )
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PREC) * qk_scale_f32  # log2 domain
        if HAS_BIAS:
            bias = tl.load(
                b_base + offs_m[:, None] * stride_bm + offs_n[None, :] * stride_bn,
                mask=m_mask[:, None] & n_mask[None, :], other=0.0,
            ).to(tl.float32)
            s = s + bias * 1.4426950408889634
        s = tl.where(n_mask[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row with no finite score so far: shift by 0 so that exp2(-inf - 0) = 0
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]

        v = tl.load(
            v_base + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )
        if UPCAST:
            v = v.to(tl.float32)
        else:
            p = p.to(v.dtype)
        acc = tl.dot(p, v, acc, input_precision=DOT_PREC)
        m_i = m_new

    has_mass = l_i > 0.0
    l_safe = tl.where(has_mass, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(has_mass, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))

    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_om + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])
    l_ptrs = Lse + off_b * stride_lb + off_h * stride_lh + offs_m * stride_lm
    tl.store(l_ptrs, lse, mask=m_mask)


@triton.jit
def _attn_bwd_dv_kernel(
    Q, K, DO, Bias, Lse, DV_out,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_lb, stride_lh, stride_lm,
    stride_vb, stride_vh, stride_vn, stride_vd,
    H, Tq, Tk, D, DV,
    qk_scale,  # scale * log2(e)
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PREC: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    # Inductor passes a Python float as fp64, which would promote the scores and the accumulator
    qk_scale_f32 = tl.cast(qk_scale, tl.float32)
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    off_b = (pid_bh // H).to(tl.int64)
    off_h = (pid_bh % H).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_mask = offs_n < Tk
    d_mask = offs_d < D
    dv_mask = offs_dv < DV

    q_base = Q + off_b * stride_qb + off_h * stride_qh
    g_base = DO + off_b * stride_gb + off_h * stride_gh
    b_base = Bias + off_b * stride_bb + off_h * stride_bh
    l_base = Lse + off_b * stride_lb + off_h * stride_lh

    k = tl.load(
        K + off_b * stride_kb + off_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
        mask=n_mask[:, None] & d_mask[None, :], other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)

    acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    for start_m in range(0, Tq, BLOCK_M):
        offs_m = start_m + offs_m0
        m_mask = offs_m < Tq
        # Q loaded transposed: (BLOCK_D, BLOCK_M); scores transposed: (BLOCK_N, BLOCK_M)
        qt = tl.load(
            q_base + offs_m[None, :] * stride_qm + offs_d[:, None] * stride_qd,
            mask=d_mask[:, None] & m_mask[None, :], other=0.0,
        )
        if UPCAST:
            qt = qt.to(tl.float32)
        st = tl.dot(k, qt, input_precision=DOT_PREC) * qk_scale_f32
        if HAS_BIAS:
            bias_t = tl.load(
                b_base + offs_m[None, :] * stride_bm + offs_n[:, None] * stride_bn,
                mask=n_mask[:, None] & m_mask[None, :], other=0.0,
            ).to(tl.float32)
            st = st + bias_t * 1.4426950408889634
        # lse = -inf (fully masked row) and padding rows -> +inf, so P = exp2(s - inf) = 0
        lse = tl.load(l_base + offs_m * stride_lm, mask=m_mask, other=float("inf"))
        lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
        pt = tl.exp2(st - lse2[None, :])
        # key rows >= Tk are computed from zero-padded k and never stored

        do = tl.load(
            g_base + offs_m[:, None] * stride_gm + offs_dv[None, :] * stride_gd,
            mask=m_mask[:, None] & dv_mask[None, :], other=0.0,
        )
        if UPCAST:
            do = do.to(tl.float32)
        else:
            pt = pt.to(do.dtype)
        acc = tl.dot(pt, do, acc, input_precision=DOT_PREC)

    dv_ptrs = DV_out + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    tl.store(dv_ptrs, acc.to(DV_out.dtype.element_ty), mask=n_mask[:, None] & dv_mask[None, :])


# --------------------------------------------------------------------------- host side


def _interpreting() -> bool:
    try:
        return bool(triton.knobs.runtime.interpret)
    except AttributeError:  # older triton
        import os

        return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(int(n), 1)))


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132  # H100 SXM; only used to pick a tile size


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be 4-D (B, H, T, D); got {tuple(q.shape)} and {tuple(k.shape)}")
    if q.shape[0] != k.shape[0] or q.shape[1] != k.shape[1] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree in B, H or D")
    if q.dtype not in _SUPPORTED or k.dtype != q.dtype:
        raise TypeError(f"q and k must share a dtype among {_SUPPORTED}; got {q.dtype} and {k.dtype}")
    if q.device != k.device:
        raise ValueError("q and k must be on the same device")
    if q.shape[3] > 128:
        raise ValueError(f"head dim {q.shape[3]} > 128 is not supported (tile sizes are chosen for D <= 128)")


def _prep_bias(bias, B, H, Tq, Tk, device):
    """Expand ``bias`` to (B, H, Tq, Tk) without copying; returns (tensor, strides, has_bias)."""
    if bias is None:
        return torch.empty(1, device=device, dtype=torch.float32), (0, 0, 0, 0), False
    if bias.dtype == torch.bool:  # SDPA convention: True = attend
        bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device).masked_fill(~bias, float("-inf"))
    if not bias.is_floating_point():
        raise TypeError(f"bias must be a float (additive) or bool mask; got {bias.dtype}")
    if bias.device != device:
        raise ValueError("bias must be on the same device as q")
    try:
        bias = bias.expand(B, H, Tq, Tk)
    except RuntimeError as e:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to {(B, H, Tq, Tk)}") from e
    return bias, tuple(bias.stride()), True


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32: three TF32 tensor-core passes (~fp32 accuracy, unlike plain TF32, and far
    # fewer registers than "ieee" FMA dots); for fp16/bf16 the option is ignored
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _fwd_config(Tq: int, Tk: int, D: int, DV: int, BH: int, dtype: torch.dtype, device: torch.device):
    BLOCK_D, BLOCK_DV = _pow2(D), _pow2(DV)
    if dtype == torch.float32:  # tf32x3 dots need many registers: narrower key tiles
        block_m, block_n, warps, stages = 64, (16 if max(BLOCK_D, BLOCK_DV) > 64 else 32), 4, 2
    else:
        block_n = 64
        wide = max(BLOCK_D, BLOCK_DV) > 64
        # 128 query rows per program when that still gives >= 2 programs per SM
        block_m = 128 if BH * triton.cdiv(Tq, 128) >= 2 * _sm_count(device) else 64
        warps = 8 if (wide or block_m == 128) else 4
        stages = 2 if wide else 3
    block_m = min(block_m, _pow2(Tq))  # short query sets (class attention, T = 1)
    block_n = min(block_n, _pow2(Tk))
    return block_m, block_n, BLOCK_D, BLOCK_DV, warps, stages


def _bwd_config(Tq: int, Tk: int, D: int, DV: int, dtype: torch.dtype):
    BLOCK_D, BLOCK_DV = _pow2(D), _pow2(DV)
    if dtype == torch.float32:  # tf32x3 dots need many registers: narrower query tiles
        block_n, block_m, warps, stages = 64, (16 if max(BLOCK_D, BLOCK_DV) > 64 else 32), 4, 2
    else:
        wide = max(BLOCK_D, BLOCK_DV) > 64
        block_n, block_m = 64, 64
        warps = 8 if wide else 4
        stages = 2 if wide else 3
    block_n = min(block_n, _pow2(Tk))
    block_m = min(block_m, _pow2(Tq))
    return block_m, block_n, BLOCK_D, BLOCK_DV, warps, stages


def _blocks(cfg_m: int, cfg_n: int, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    bm, bn = block_m or cfg_m, block_n or cfg_n
    for b in (bm, bn):
        if b < 16 or b & (b - 1):
            raise ValueError(f"block sizes must be powers of two >= 16; got {b}")
    return bm, bn


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention ``out = softmax(q·kᵀ·scale + bias)·v`` and its log-sum-exp.

    q (B, H, Tq, D), k (B, H, Tk, D), v (B, H, Tk, Dv), any strides, one dtype among
    fp32/fp16/bf16. ``bias``: additive float mask broadcastable to (B, H, Tq, Tk), may
    hold ``-inf`` (a bool mask is taken as SDPA does: True = attend). ``scale`` defaults
    to ``1/√D``. Returns ``out`` (B, H, Tq, Dv) in q's dtype (contiguous) and ``lse``
    (B, H, Tq) float32, the natural-log logsumexp of the scaled + biased scores per row.
    A fully masked row gets ``out = 0`` and ``lse = -inf``.
    ``block_m`` / ``block_n`` (powers of two ≥ 16) override the tile sizes (tests, tuning).
    """
    _check_qk(q, k)
    if v.dim() != 4 or v.shape[:3] != k.shape[:3] or v.dtype != q.dtype or v.device != q.device:
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} does not match k {tuple(k.shape)} {k.dtype}")
    if v.shape[3] > 128:
        raise ValueError(f"value head dim {v.shape[3]} > 128 is not supported")
    B, H, Tq, D = q.shape
    Tk, DV = k.shape[2], v.shape[3]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)

    out = torch.empty((B, H, Tq, DV), device=q.device, dtype=q.dtype)
    lse = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    if B * H * Tq == 0:
        return out, lse
    if Tk == 0:  # every row fully masked
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse

    bias_t, sb, has_bias = _prep_bias(bias, B, H, Tq, Tk, q.device)
    BM, BN, BLOCK_D, BLOCK_DV, warps, stages = _fwd_config(Tq, Tk, D, DV, B * H, q.dtype, q.device)
    BM, BN = _blocks(BM, BN, block_m, block_n)
    grid = (triton.cdiv(Tq, BM), B * H)
    wrap_triton(_attn_fwd_kernel)[grid](
        q, k, v, bias_t, out, lse,
        *q.stride(), *k.stride(), *v.stride(), *sb, *out.stride(), *lse.stride(),
        H, Tq, Tk, D, DV,
        scale * _LOG2E,
        HAS_BIAS=has_bias,
        UPCAST=_interpreting() or q.device.type != "cuda",
        DOT_PREC=_dot_prec(q.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def attention_backward_dv(
    q: torch.Tensor,
    k: torch.Tensor,
    grad_out: torch.Tensor,
    lse: torch.Tensor,
    scale: float | None = None,
    bias: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """``dV = Pᵀ·grad_out`` with ``P = exp(q·kᵀ·scale + bias − lse)`` recomputed tile by tile.

    q (B, H, Tq, D), k (B, H, Tk, D), grad_out (B, H, Tq, Dv), lse (B, H, Tq) float32 as
    returned by :func:`attention_forward` (same ``scale`` and ``bias``). Any strides.
    Accumulates in fp32; returns dV (B, H, Tk, Dv), contiguous, in grad_out's dtype.
    Rows with ``lse = -inf`` (fully masked) contribute 0.
    ``block_m`` (query tile) / ``block_n`` (key tile per program) override tile sizes.
    """
    _check_qk(q, k)
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    if grad_out.dim() != 4 or grad_out.shape[:3] != q.shape[:3]:
        raise ValueError(f"grad_out {tuple(grad_out.shape)} does not match q {tuple(q.shape)}")
    if grad_out.dtype not in _SUPPORTED or grad_out.device != q.device:
        raise TypeError(f"grad_out must be fp32/fp16/bf16 on q's device; got {grad_out.dtype}")
    if lse.shape != (B, H, Tq):
        raise ValueError(f"lse must have shape {(B, H, Tq)}; got {tuple(lse.shape)}")
    DV = grad_out.shape[3]
    if DV > 128:
        raise ValueError(f"value head dim {DV} > 128 is not supported")
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    lse = lse.to(torch.float32)

    dv = torch.empty((B, H, Tk, DV), device=q.device, dtype=grad_out.dtype)
    if B * H * Tk * DV == 0:
        return dv
    if Tq == 0:
        return dv.zero_()

    # a fp32 grad_out with fp16/bf16 q/k (or the reverse) would need mixed-dtype dots
    upcast = _interpreting() or q.device.type != "cuda" or grad_out.dtype != q.dtype
    bias_t, sb, has_bias = _prep_bias(bias, B, H, Tq, Tk, q.device)
    BM, BN, BLOCK_D, BLOCK_DV, warps, stages = _bwd_config(Tq, Tk, D, DV, q.dtype)
    BM, BN = _blocks(BM, BN, block_m, block_n)
    grid = (triton.cdiv(Tk, BN), B * H)
    wrap_triton(_attn_bwd_dv_kernel)[grid](
        q, k, grad_out, bias_t, lse, dv,
        *q.stride(), *k.stride(), *grad_out.stride(), *sb, *lse.stride(), *dv.stride(),
        H, Tq, Tk, D, DV,
        scale * _LOG2E,
        HAS_BIAS=has_bias,
        UPCAST=upcast,
        DOT_PREC=_dot_prec(torch.float32 if upcast else q.dtype),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV,
        num_warps=warps, num_stages=stages,
    )
    return dv
