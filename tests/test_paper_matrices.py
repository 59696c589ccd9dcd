"""OMENN's matrices built explicitly, as in the paper, for tiny networks.

For each network below the test builds every layer's augmented matrix ``W̃_i`` of
the paper (CVPR 2025, "One Matrix to Explain Neural Networks", sections "OMENN",
"Explaining Layers" and the supplementary "Combining parameters"), with the
ambiguities fixed by ``DESIGN.md`` §2 (rules R1-R14):

* state of a layer = ``x̃ = vec(X̃) = [vec(X); 1_t]`` for the token matrix
  ``X`` (t × d, one row per token / pixel) with *column-major* ``vec`` and ONE ones
  entry per token (the paper's ``X̃ = [X 1]``).  An image (C, H, W) is the token
  matrix (HW × C), so ``vec(X) = x.reshape(-1)`` and the last HW entries are the ones;
* fully-connected layers: ``W̃_l^T ⊗ I`` with ``W̃_l = [[W_l, 0], [b_l, 1]]``;
* convolution: the doubly block-Toeplitz ``T(K̃_w) + T(K̃_b_i)``, built by loops
  over output positions and kernel taps; ``K̃_b_i`` spreads the bias (and the
  output's ones) evenly, ``1/s_i``, over the valid taps, ``s_i = Σ c_Pi``;
* activations: ``diag(vec([ξ(X), 1]))``;
* attention: rows ``W̃_v_h^T ⊗ A_h`` per head and ``W̃_aug^T ⊗ I`` for the ones;
* LayerNorm: token-wise fully-connected ``Σ_t W̃_t^T ⊗ e_t e_t^T`` with
  ``W̃_t = [[(I - 11^T/d) diag(γ/σ_t), 0], [β, 1]]`` (centring linear, 1/σ detached);
* residual ``x + f(x)``: ``I + W̃_f`` with the ones rows halved (values add, ones
  average, R7);
* average pooling / mean over tokens: ``I_{d+1} ⊗ (1^T/t)`` (R13);
* class token (R12): value ``c·Ō`` and ones ``Ō``, ``Ō`` = mean of the patch
  tokens' ones; positional embedding (R7'): ``+ pos·O_t``.

``Ω̃ = e_target^T Π W̃_i`` is accumulated from the read-out backwards as a row
vector and reshaped into ``C̃_wb`` (weight part (C, H, W), ones part (H, W)).

Part (a), ``test_construction[case]``: every ``W̃_i`` maps the previous state onto
``[vec(Y_i); 1]`` where ``Y_i`` is the layer's output computed by torch, and
``Ω̃ x̃ = model(x)[target]``.  This checks the construction and needs no engine.

Part (b), ``test_engine[case]``: ``omenn_kernels.explain(..., backend="reference")``
must give ``e.weight`` = weight part and ``e.bias`` = ones part of ``C̃_wb``.

Cases are ordered from single layer families (Linear, Flatten+Linear,
activations, Conv2d, LayerNorm, attention, residual, class token) to the three
whole networks (MLP, CNN, ViT), so the first failing case names the family.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

DT = torch.float64

# Tolerances.
#  (a) construction: |Ω̃ x̃ - f(x)| <= 1e-10 * Σ|Ω̃ ⊙ x̃| (relative to the size of the
#      summed terms, the natural rounding scale); every intermediate state likewise
#      relative to its largest entry.
#  (b) engine: assert_close(rtol=1e-9, atol=1e-12 * max|expected|) for C_w and C_b.
RTOL_CONSTRUCTION = 1e-10
RTOL_ENGINE = 1e-9
ATOL_ENGINE_REL = 1e-12


# ----------------------------------------------------------------------------
# vec / augmented state
# ----------------------------------------------------------------------------


def vec(m: torch.Tensor) -> torch.Tensor:
    """Column-major vectorization of a (t, d) matrix (the paper's vec)."""
    return m.T.reshape(-1)


def aug(m: torch.Tensor) -> torch.Tensor:
    """vec(X̃) for X̃ = [X 1]: the values then one ones entry per token."""
    return torch.cat([vec(m), torch.ones(m.shape[0], dtype=DT)])


def image_tokens(x: torch.Tensor) -> torch.Tensor:
    """(C, H, W) image -> (HW, C) token matrix; vec of it is x.reshape(-1)."""
    c = x.shape[0]
    return x.reshape(c, -1).T


def eye(n: int) -> torch.Tensor:
    return torch.eye(n, dtype=DT)


def kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Kronecker product A ⊗ B (torch.kron rejects some transposed views)."""
    return torch.kron(a.contiguous(), b.contiguous())


# ----------------------------------------------------------------------------
# The paper's augmented matrices
# ----------------------------------------------------------------------------


def fc_tilde(w_l: torch.Tensor, b_l: torch.Tensor) -> torch.Tensor:
    """W̃_l = [[W_l, 0], [b_l, 1]] for Y = X W_l + B_l (W_l: d_in × d_out)."""
    d_in, d_out = w_l.shape
    wt = torch.zeros(d_in + 1, d_out + 1, dtype=DT)
    wt[:d_in, :d_out] = w_l
    wt[d_in, :d_out] = b_l
    wt[d_in, d_out] = 1.0
    return wt


def fc_matrix(w_l: torch.Tensor, b_l: torch.Tensor, t: int) -> torch.Tensor:
    """Fully-connected layer on t tokens: W̃ = W̃_l^T ⊗ I_t (paper, Eq. fused_fc_vec).

    R1's Ō (mean of O over the contracted features) is the token's ones entry.
    """
    return kron(fc_tilde(w_l, b_l).T, eye(t))


def layernorm_matrix(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    """LayerNorm as a token-wise fully-connected map: Σ_t W̃_t^T ⊗ e_t e_t^T.

    W̃_t = [[(I - 11^T/d) diag(γ · r_t), 0], [β, 1]] with r_t = 1/σ_t detached
    (σ_t = sqrt(biased var + eps)); the centring is linear in x (R3').
    """
    t, d = x.shape
    r = 1.0 / torch.sqrt(x.var(dim=1, unbiased=False) + ln.eps)
    centre = eye(d) - torch.full((d, d), 1.0 / d, dtype=DT)
    m = torch.zeros((d + 1) * t, (d + 1) * t, dtype=DT)
    for k in range(t):
        w_t = centre @ torch.diag(ln.weight.detach() * r[k])
        e_tt = torch.zeros(t, t, dtype=DT)
        e_tt[k, k] = 1.0
        m += kron(fc_tilde(w_t, ln.bias.detach()).T, e_tt)
    return m


def activation_matrix(xi: torch.Tensor) -> torch.Tensor:
    """diag(vec([ξ(X), 1])): the multiplier held constant, the ones passed on."""
    return torch.diag(aug(xi))


def attention_matrix(attn_mats: list[torch.Tensor], w_v: torch.Tensor, b_v: torch.Tensor) -> torch.Tensor:
    """Multi-head Y = [A_1 V_1 ... A_h V_h], V_h = X̃ W̃_v_h, ones by W̃_aug.

    Rows: W̃_v_h^T ⊗ A_h for each head, then W̃_aug^T ⊗ I (token identity, R6).
    w_v: d_in × d_model (all heads), b_v: d_model.
    """
    heads = len(attn_mats)
    t = attn_mats[0].shape[0]
    d_in, d_model = w_v.shape
    hd = d_model // heads
    blocks = []
    for h, a_h in enumerate(attn_mats):
        wv_h = torch.cat([w_v[:, h * hd:(h + 1) * hd], b_v[None, h * hd:(h + 1) * hd]], dim=0)
        blocks.append(kron(wv_h.T, a_h))
    w_aug = torch.zeros(d_in + 1, 1, dtype=DT)
    w_aug[d_in, 0] = 1.0
    blocks.append(kron(w_aug.T, eye(t)))
    return torch.cat(blocks, dim=0)


def conv_matrix(weight: torch.Tensor, bias: torch.Tensor, in_hw: tuple[int, int], stride: int,
                padding: int, ones_in: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
    """T(K̃_w) + T(K̃_b_i): the doubly block-Toeplitz matrix of the augmented conv.

    Built by loops over output positions i and kernel taps.  Padding taps are zero in
    both the values and the ones (c_Pi = 0 there), so they get no column.  For every
    output position i, K̃_b_i adds b/s_i (value rows) and 1/s_i (the output's ones row)
    at the ones entry of every valid tap, s_i = Σ c_Pi.
    """
    c_out, c_in, kh, kw = weight.shape
    h, w = in_hw
    ho = (h + 2 * padding - kh) // stride + 1
    wo = (w + 2 * padding - kw) // stride + 1
    t_in, t_out = h * w, ho * wo
    m = torch.zeros((c_out + 1) * t_out, (c_in + 1) * t_in, dtype=DT)
    rows_v = torch.arange(c_out) * t_out
    cols_v = torch.arange(c_in) * t_in
    for oy in range(ho):
        for ox in range(wo):
            i = oy * wo + ox
            taps = []
            for ky in range(kh):
                for kx in range(kw):
                    iy, ix = oy * stride - padding + ky, ox * stride - padding + kx
                    if 0 <= iy < h and 0 <= ix < w:
                        q = iy * w + ix
                        taps.append(q)
                        # K̃_w = [[K, 0], [0, 0]]
                        m[(rows_v + i)[:, None], (cols_v + q)[None, :]] += weight[:, :, ky, kx]
            s_i = sum(float(ones_in[q]) for q in taps)  # s_i = Σ c_Pi
            for q in taps:
                # K̃_b_i = (1/s_i) [[0, B̃], [0, 1]]
                m[rows_v + i, c_in * t_in + q] += bias / s_i
                m[c_out * t_out + i, c_in * t_in + q] += 1.0 / s_i
    return m, (ho, wo)


def mean_tokens_matrix(t: int, d: int) -> torch.Tensor:
    """Mean over tokens (adaptive avg-pool to 1, mean(dim=tokens)): I_{d+1} ⊗ 1^T/t.

    The ones are pooled the same way and stay 1 (R13, S/stopgrad(S) = mean here).
    """
    return kron(eye(d + 1), torch.full((1, t), 1.0 / t, dtype=DT))


def flatten_matrix(t: int, d: int) -> torch.Tensor:
    """Flatten a (t × d) state (image (C, H, W) with per-pixel ones) into ONE token.

    Values: torch's flatten of (C, H, W) has feature index c·HW + p = the vec order,
    so the value block is the identity.  Ones: R10 flattens O with the values (each
    pixel's O appears in all d channels) and the next Linear takes Ō = the mean of O
    over its t·d contracted features = (1/t) Σ_p O_p.  We fold that mean in here: the
    single token's ones entry is the mean of the t per-pixel ones, [[I, 0], [0, 1^T/t]].
    (Every consumer here is a Linear, whose Ō is that mean, so this is the same map.)
    """
    m = torch.zeros(t * d + 1, t * d + t, dtype=DT)
    m[: t * d, : t * d] = eye(t * d)
    m[t * d, t * d:] = 1.0 / t
    return m


def cat_cls_matrix(cls: torch.Tensor, t: int, d: int) -> torch.Tensor:
    """cat([cls, X]) along tokens, cls first (R12).

    The CONST class token becomes c·Ō with ones Ō, Ō = the mean of the ones over every
    position of the LIVE tensor in the join (the t patch tokens), per sample.
    """
    t2 = t + 1
    m = torch.zeros((d + 1) * t2, (d + 1) * t, dtype=DT)
    for j in range(d):
        for k in range(t):
            m[j * t2 + k + 1, j * t + k] = 1.0
            m[j * t2 + 0, d * t + k] = cls[j] / t
    for k in range(t):
        m[d * t2 + k + 1, d * t + k] = 1.0
        m[d * t2 + 0, d * t + k] = 1.0 / t
    return m


def pos_embed_matrix(pos: torch.Tensor) -> torch.Tensor:
    """X + pos (R7'): value (k, j) gets pos[k, j] · O_k; the ones pass on."""
    t, d = pos.shape
    m = eye((d + 1) * t)
    for j in range(d):
        for k in range(t):
            m[j * t + k, d * t + k] += pos[k, j]
    return m


def select_token_matrix(k: int, t: int, d: int) -> torch.Tensor:
    """X[k] (R10): the token's values and its ones entry."""
    m = torch.zeros(d + 1, (d + 1) * t, dtype=DT)
    for j in range(d + 1):
        m[j, j * t + k] = 1.0
    return m


def residual_matrix(branch: torch.Tensor, t: int, d: int) -> torch.Tensor:
    """x + f(x): I + W̃_f with the ones rows averaged, (O_x + O_f)/2 (R7)."""
    m = eye((d + 1) * t) + branch
    m[d * t:, :] *= 0.5
    return m


def readout_row(t: int, d: int, token: int, feature: int) -> torch.Tensor:
    """e^T picking value (token, feature) of a (t × d) state."""
    r = torch.zeros((d + 1) * t, dtype=DT)
    r[feature * t + token] = 1.0
    return r


# ----------------------------------------------------------------------------
# A chain of layers: the matrices, checked layer by layer against torch
# ----------------------------------------------------------------------------


def assert_state(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    scale = max(float(want.abs().max()), 1.0)
    err = float((got - want).abs().max())
    assert err <= RTOL_CONSTRUCTION * scale, (
        f"construction of {name!r}: W̃ x̃ differs from [vec(Y); 1] by {err:.3e} (scale {scale:.3e})")


def gelu_xi(x: torch.Tensor) -> torch.Tensor:
    """ξ for the exact (erf) GELU: (gelu(x) - gelu(0))/x = Φ(x)."""
    return 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def relu_xi(x: torch.Tensor) -> torch.Tensor:
    return (x > 0).to(DT)


class Chain:
    """Layer matrices W̃_i for one sample, with the true intermediate values.

    ``x`` is the current token matrix (t × d) as computed by torch; ``hw`` its
    spatial size while the state is an image.  ``push`` checks W̃ x̃_prev = [vec(Y); 1].
    """

    def __init__(self, x: torch.Tensor, hw: tuple[int, int] | None = None, prefix: str = ""):
        self.x = x
        self.hw = hw
        self.prefix = prefix
        self.state = aug(x)
        self.x0 = self.state.clone()
        self.stages: list[tuple[str, torch.Tensor]] = []

    @property
    def t(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.x.shape[1]

    def push(self, name: str, m: torch.Tensor, y: torch.Tensor, hw: tuple[int, int] | None = None) -> None:
        name = self.prefix + name
        new = m @ self.state
        assert_state(name, new, aug(y))
        self.stages.append((name, m))
        self.state, self.x, self.hw = new, y, hw

    def matrix(self) -> torch.Tensor:
        m = eye(self.x0.numel())
        for _, w in self.stages:
            m = w @ m
        return m

    def omega(self, row: torch.Tensor) -> torch.Tensor:
        """Ω̃ = row^T Π W̃_i, accumulated from the read-out backwards."""
        for _, w in reversed(self.stages):
            row = row @ w
        return row

    # --- layers ---------------------------------------------------------------

    def linear(self, name: str, lin: nn.Linear) -> None:
        y = lin(self.x)
        self.push(name, fc_matrix(lin.weight.detach().T, lin.bias.detach(), self.t), y)

    def act(self, name: str, kind: str) -> None:
        if kind == "gelu":
            xi, y = gelu_xi(self.x), F.gelu(self.x)
        elif kind == "relu":
            xi, y = relu_xi(self.x), F.relu(self.x)
        else:
            raise ValueError(kind)
        self.push(name, activation_matrix(xi), y, self.hw)

    def conv(self, name: str, conv: nn.Conv2d) -> None:
        assert self.hw is not None and conv.groups == 1 and conv.dilation == (1, 1)
        stride, padding = conv.stride[0], conv.padding[0]
        img = self.x.T.reshape(self.d, *self.hw)
        y_img = F.conv2d(img[None], conv.weight, conv.bias, stride=conv.stride, padding=conv.padding)[0]
        ones_in = self.state[self.d * self.t:]
        m, hw_out = conv_matrix(conv.weight.detach(), conv.bias.detach(), self.hw, stride, padding, ones_in)
        self.push(name, m, image_tokens(y_img), hw_out)

    def layernorm(self, name: str, ln: nn.LayerNorm) -> None:
        y = F.layer_norm(self.x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
        self.push(name, layernorm_matrix(self.x, ln), y)

    def mean_tokens(self, name: str) -> None:
        self.push(name, mean_tokens_matrix(self.t, self.d), self.x.mean(0, keepdim=True))

    def flatten(self, name: str) -> None:
        self.push(name, flatten_matrix(self.t, self.d), self.x.T.reshape(1, -1))

    def attention(self, name: str, attn: "Attention") -> None:
        """Values and A·V as one W̃ (the paper's MHA), then the output projection."""
        t, d = self.x.shape
        h, hd = attn.heads, attn.head_dim
        qkv = attn.qkv(self.x).reshape(t, 3, h, hd)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # (t, h, hd)
        a = [torch.softmax((q[:, i] @ k[:, i].T) * attn.scale, dim=-1) for i in range(h)]
        y_av = torch.cat([a[i] @ v[:, i] for i in range(h)], dim=1)
        w_v = attn.qkv.weight.detach()[2 * d:3 * d].T
        b_v = attn.qkv.bias.detach()[2 * d:3 * d]
        y = attn(self.x[None])[0]  # the module's own forward (SDPA or written out)
        self.push(name + ".AV", attention_matrix([ai.detach() for ai in a], w_v, b_v), y_av)
        self.push(name + ".proj", fc_matrix(attn.proj.weight.detach().T, attn.proj.bias.detach(), t), y)

    def residual(self, name: str, branch: Callable[["Chain"], None]) -> None:
        sub = Chain(self.x, self.hw, prefix=self.prefix + name + ".")
        branch(sub)
        self.push(name, residual_matrix(sub.matrix(), self.t, self.d), self.x + sub.x, self.hw)

    def cat_cls(self, name: str, cls: torch.Tensor) -> None:
        c = cls.detach().reshape(-1)
        self.push(name, cat_cls_matrix(c, self.t, self.d), torch.cat([c[None], self.x], dim=0))

    def pos_embed(self, name: str, pos: torch.Tensor) -> None:
        p = pos.detach().reshape(self.t, self.d)
        self.push(name, pos_embed_matrix(p), self.x + p)

    def select_token(self, name: str, k: int) -> None:
        self.push(name, select_token_matrix(k, self.t, self.d), self.x[k:k + 1])


# ----------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, use_sdpa: bool):
        super().__init__()
        self.heads, self.head_dim, self.use_sdpa = heads, dim // heads, use_sdpa
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        if self.use_sdpa:
            o = F.scaled_dot_product_attention(q, k, v)
        else:
            a = (q @ k.transpose(-2, -1)) * self.scale
            a = a.softmax(dim=-1)
            o = a @ v
        return self.proj(o.transpose(1, 2).reshape(b, n, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, use_sdpa: bool):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, use_sdpa)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


def block_chain(ch: Chain, blk: Block, name: str) -> None:
    def attn_branch(s: Chain) -> None:
        s.layernorm("norm1", blk.norm1)
        s.attention("attn", blk.attn)

    def mlp_branch(s: Chain) -> None:
        s.layernorm("norm2", blk.norm2)
        s.linear("fc1", blk.fc1)
        s.act("gelu", "gelu")
        s.linear("fc2", blk.fc2)

    ch.residual(name + ".res_attn", attn_branch)
    ch.residual(name + ".res_mlp", mlp_branch)


class TinyViT(nn.Module):
    """Patch 4 on 3×8×8 (4 patches), class token, pos embedding, 2 blocks, width 16."""

    def __init__(self, dim: int = 16, heads: int = 2, hidden: int = 32, classes: int = 3):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, dim))
        self.blocks = nn.ModuleList([Block(dim, heads, hidden, use_sdpa=True),
                                     Block(dim, heads, hidden, use_sdpa=False)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        return self.head(x[:, 0])


class Tokens(nn.Module):
    """(B, C, H, W) -> (B, HW, C), tokens in row-major pixel order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(2).transpose(1, 2)


class MeanTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


class TokenwiseLinear(nn.Module):
    """One Linear on the channels of every pixel; output flattened (B, HW·k)."""

    def __init__(self, c: int, k: int):
        super().__init__()
        self.fc = nn.Linear(c, k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.permute(0, 2, 3, 1)).flatten(1)


class ClsPos(nn.Module):
    """Patch embedding, class token, positional embedding, mean over tokens, head."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, dim))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos_embed
        return self.head(x.mean(dim=1))


class ResidualTokens(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.inner(x)


def randomize(model: nn.Module, seed: int, qkv_gain: float = 2.0) -> nn.Module:
    """Deterministic random parameters; biases, LN γ/β, cls token and pos embedding
    are random and non-zero.  qkv weights are scaled up so that A is far from uniform."""
    g = torch.Generator().manual_seed(seed)
    model = model.to(DT)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "cls_token" not in name and "pos_embed" not in name:
                fan_in = p[0].numel()
                gain = qkv_gain if "qkv" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=g, dtype=DT) * gain / math.sqrt(fan_in))
            else:
                v = 0.5 * torch.randn(p.shape, generator=g, dtype=DT)
                is_ln_weight = name.endswith("weight") and p.dim() == 1
                p.copy_(1.0 + v if is_ln_weight else v)
                assert bool((p != 0).all())
    return model.eval()


def make_input(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=DT)


# ----------------------------------------------------------------------------
# Cases: model, input, target, and the builder of the paper's matrices
# ----------------------------------------------------------------------------


@dataclass
class Case:
    model: nn.Module
    x: torch.Tensor  # (B, C, H, W)
    target: int
    build: Callable[[nn.Module, torch.Tensor, int], tuple[Chain, torch.Tensor]]  # -> chain, read-out row


def case_linear_tokenwise(target: int) -> Case:
    model = randomize(TokenwiseLinear(3, 5), seed=1)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.linear("fc", m.fc)
        p, j = divmod(tgt, 5)  # output (H, W, k) flattened: index p·k + j
        return ch, readout_row(ch.t, ch.d, p, j)

    return Case(model, make_input((2, 3, 4, 4), 101), target, build)


def mlp_build(m: nn.Sequential, x: torch.Tensor, tgt: int) -> tuple[Chain, torch.Tensor]:
    ch = Chain(image_tokens(x), x.shape[1:])
    for i, layer in enumerate(m):
        if isinstance(layer, nn.Flatten):
            ch.flatten(f"{i}.flatten")
        elif isinstance(layer, nn.Linear):
            ch.linear(f"{i}.linear", layer)
        elif isinstance(layer, nn.GELU):
            ch.act(f"{i}.gelu", "gelu")
        elif isinstance(layer, nn.ReLU):
            ch.act(f"{i}.relu", "relu")
        else:
            raise TypeError(layer)
    return ch, readout_row(1, ch.d, 0, tgt)


def case_flatten_linear() -> Case:
    model = randomize(nn.Sequential(nn.Flatten(), nn.Linear(48, 5)), seed=2)
    return Case(model, make_input((2, 3, 4, 4), 102), 3, mlp_build)


def case_token_mlp(kind: str) -> Case:
    act = nn.GELU() if kind == "gelu" else nn.ReLU()
    model = randomize(nn.Sequential(Tokens(), nn.Linear(3, 8), act, nn.Linear(8, 3), MeanTokens()), seed=3)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.linear("fc1", m[1])
        ch.act(kind, kind)
        ch.linear("fc2", m[3])
        ch.mean_tokens("mean")
        return ch, readout_row(1, ch.d, 0, tgt)

    return Case(model, make_input((2, 3, 4, 4), 103), 1, build)


def case_conv(stride: int, target: int) -> Case:
    model = randomize(nn.Sequential(nn.Conv2d(3, 4, 3, stride=stride, padding=1), nn.Flatten()), seed=4)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.conv("conv", m[0])
        co, p = divmod(tgt, ch.t)  # flatten of (C_out, Ho, Wo): index co·HoWo + p
        return ch, readout_row(ch.t, ch.d, p, co)

    return Case(model, make_input((2, 3, 8, 8), 104), target, build)


def case_layernorm_linear() -> Case:
    model = randomize(nn.Sequential(Tokens(), nn.LayerNorm(6), nn.Linear(6, 4), MeanTokens()), seed=5)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.layernorm("ln", m[1])
        ch.linear("fc", m[2])
        ch.mean_tokens("mean")
        return ch, readout_row(1, ch.d, 0, tgt)

    return Case(model, make_input((2, 6, 3, 3), 105), 2, build)


def mean_head_build(body: Callable[[Chain, nn.Module], None]):
    """The builder of ``Sequential(Tokens(), body, MeanTokens(), Linear head)``: ``body(ch, m[1])``."""

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        body(ch, m[1])
        ch.mean_tokens("mean")
        ch.linear("head", m[3])
        return ch, readout_row(1, ch.d, 0, tgt)

    return build


def residual_mean_head_build(name: str, branch: Callable[[Chain, nn.Sequential], None]):
    """``mean_head_build`` with ``ResidualTokens(inner)`` as the body: ``branch(sub_chain, inner)``."""
    return mean_head_build(lambda ch, res: ch.residual(name, lambda s: branch(s, res.inner)))


def case_attention(use_sdpa: bool) -> Case:
    model = randomize(nn.Sequential(Tokens(), Attention(8, 2, use_sdpa), MeanTokens(), nn.Linear(8, 3)), seed=6)
    build = mean_head_build(lambda ch, attn: ch.attention("attn", attn))
    return Case(model, make_input((2, 8, 2, 3), 106), 0, build)


def case_attention_block(use_sdpa: bool) -> Case:
    inner = nn.Sequential(nn.LayerNorm(8), Attention(8, 2, use_sdpa))
    model = randomize(nn.Sequential(Tokens(), ResidualTokens(inner), MeanTokens(), nn.Linear(8, 3)), seed=7)

    def branch(s: Chain, inner: nn.Sequential) -> None:
        s.layernorm("ln", inner[0])
        s.attention("attn", inner[1])

    return Case(model, make_input((2, 8, 2, 3), 107), 2, residual_mean_head_build("res_attn", branch))


def case_residual_mlp() -> Case:
    inner = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 6))
    model = randomize(nn.Sequential(Tokens(), ResidualTokens(inner), MeanTokens(), nn.Linear(6, 3)), seed=8)

    def branch(s: Chain, inner: nn.Sequential) -> None:
        s.linear("fc1", inner[0])
        s.act("gelu", "gelu")
        s.linear("fc2", inner[2])

    return Case(model, make_input((2, 6, 3, 3), 108), 1, residual_mean_head_build("res_mlp", branch))


def case_cls_pos() -> Case:
    model = randomize(ClsPos(8), seed=9)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.conv("patch", m.patch)
        ch.cat_cls("cat_cls", m.cls_token)
        ch.pos_embed("pos_embed", m.pos_embed)
        ch.mean_tokens("mean")
        ch.linear("head", m.head)
        return ch, readout_row(1, ch.d, 0, tgt)

    return Case(model, make_input((2, 3, 8, 8), 109), 1, build)


def case_mlp() -> Case:
    model = randomize(nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.GELU(), nn.Linear(16, 16), nn.ReLU(),
                                    nn.Linear(16, 5)), seed=10)
    return Case(model, make_input((2, 3, 4, 4), 110), 2, mlp_build)


def case_cnn() -> Case:
    model = randomize(nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(),
        nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.GELU(),
        nn.Conv2d(6, 5, 3, padding=1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)), seed=11)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.conv("0.conv", m[0])
        ch.act("1.relu", "relu")
        ch.conv("2.conv_s2", m[2])
        ch.act("3.gelu", "gelu")
        ch.conv("4.conv", m[4])
        ch.mean_tokens("5.avgpool")
        ch.flatten("6.flatten")  # one token already: the identity
        ch.linear("7.linear", m[7])
        return ch, readout_row(1, ch.d, 0, tgt)

    return Case(model, make_input((2, 3, 8, 8), 111), 1, build)


def case_vit() -> Case:
    model = randomize(TinyViT(), seed=12)

    def build(m, x, tgt):
        ch = Chain(image_tokens(x), x.shape[1:])
        ch.conv("patch", m.patch)
        ch.cat_cls("cat_cls", m.cls_token)
        ch.pos_embed("pos_embed", m.pos_embed)
        for i, blk in enumerate(m.blocks):
            block_chain(ch, blk, f"blocks.{i}")
        ch.layernorm("norm", m.norm)
        ch.select_token("cls", 0)
        ch.linear("head", m.head)
        return ch, readout_row(1, ch.d, 0, tgt)

    return Case(model, make_input((2, 3, 8, 8), 112), 2, build)


CASES: dict[str, Callable[[], Case]] = {
    "01_linear_tokenwise": lambda: case_linear_tokenwise(target=37),
    "02_flatten_linear": case_flatten_linear,
    "03_activation_gelu": lambda: case_token_mlp("gelu"),
    "04_activation_relu": lambda: case_token_mlp("relu"),
    "05_conv_s1_pad_corner": lambda: case_conv(1, target=1 * 64 + 0),
    "06_conv_s1_pad_interior": lambda: case_conv(1, target=2 * 64 + 3 * 8 + 5),
    "07_conv_s2_pad_corner": lambda: case_conv(2, target=1 * 16 + 0),
    "08_conv_s2_pad_edge": lambda: case_conv(2, target=2 * 16 + 2),
    "09_conv_s2_pad_interior": lambda: case_conv(2, target=3 * 16 + 2 * 4 + 3),
    "10_layernorm_linear": case_layernorm_linear,
    "11_attention_sdpa": lambda: case_attention(True),
    "12_attention_written_out": lambda: case_attention(False),
    "13_attention_block_sdpa": lambda: case_attention_block(True),
    "14_attention_block_written_out": lambda: case_attention_block(False),
    "15_residual_mlp": case_residual_mlp,
    "16_cls_token_pos_embed": case_cls_pos,
    "17_mlp": case_mlp,
    "18_cnn": case_cnn,
    "19_vit": case_vit,
}


def paper_explanation(case: Case) -> list[tuple[torch.Tensor, torch.Tensor, Chain, torch.Tensor]]:
    """Per sample: (C_w, C_b) from C̃_wb = vec^{-1}(Ω̃), the chain, and Ω̃."""
    out = []
    with torch.no_grad():
        for xb in case.x:
            ch, row = case.build(case.model, xb, case.target)
            omega = ch.omega(row)
            c, h, w = xb.shape
            c_w = omega[: c * h * w].reshape(c, h, w)
            c_b = omega[c * h * w:].reshape(h, w)
            out.append((c_w, c_b, ch, omega))
    return out


# ----------------------------------------------------------------------------
# Tests
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_construction(name: str) -> None:
    """(a) the paper's matrices reproduce the network: Ω̃ x̃ = model(x)[target]."""
    case = CASES[name]()
    with torch.no_grad():
        logits = case.model(case.x)
    for b, (c_w, c_b, ch, omega) in enumerate(paper_explanation(case)):
        terms = omega * ch.x0
        got = float(terms.sum())
        want = float(logits[b].reshape(-1)[case.target])
        scale = float(terms.abs().sum())
        assert abs(got - want) <= RTOL_CONSTRUCTION * scale, (
            f"{name}, sample {b}: Ω̃ x̃ = {got!r} but model(x)[target] = {want!r}")
        # C̃_wb ⊙ X̃ summed = the logit (completeness), in the shapes of the engine
        contribution = (c_w * case.x[b]).sum(0) + c_b
        assert abs(float(contribution.sum()) - want) <= RTOL_CONSTRUCTION * scale
        assert bool((c_b != 0).any()), "the bias part should not vanish: every bias is non-zero"


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    # rtol 1e-9, atol 1e-12 relative to the size of the expected tensor
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=RTOL_ENGINE, atol=ATOL_ENGINE_REL * scale,
                               msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("name", list(CASES))
def test_engine(name: str) -> None:
    """(b) the engine's C_w and C_b equal the weight and ones parts of C̃_wb."""
    from omenn_kernels import explain  # the engine; the construction tests do not need it

    case = CASES[name]()
    expected = paper_explanation(case)
    e = explain(case.model, case.x.clone(), case.target, backend="reference")
    with torch.no_grad():
        logits = case.model(case.x)
    assert tuple(e.weight.shape) == tuple(case.x.shape)
    assert tuple(e.bias.shape) == (case.x.shape[0], *case.x.shape[2:])
    for b, (c_w, c_b, _, _) in enumerate(expected):
        _close(e.weight[b].detach().to(DT), c_w, f"{name}, sample {b}, C_w (weight part of C̃_wb)")
        _close(e.bias[b].detach().to(DT), c_b, f"{name}, sample {b}, C_b (ones part of C̃_wb)")
        c = (c_w * case.x[b]).sum(0) + c_b
        _close(e.contribution[b].detach().to(DT), c, f"{name}, sample {b}, C")
        _close(e.logit[b].detach().to(DT).reshape(()), logits[b].reshape(-1)[case.target],
               f"{name}, sample {b}, logit")
