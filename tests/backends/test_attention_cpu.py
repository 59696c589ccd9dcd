"""``omenn::attention`` on the CPU (``csrc/attention.cpp``: the forward and ``dV`` one query
row at a time) and R6 through it: attention whose weights do not fit in one chunk is never written out.

Oracle: softmax attention written out in float64 from the very values the op sees (inputs
rounded to their dtype first), fully masked rows defined as ``A = 0``, ``lse = -inf``;
``dV = Aᵀ·dY``. Inputs are views into NaN-filled buffers (a read outside the view turns the
result into NaN). Tolerances, max |error| / max |reference|: float64 1e-12, float32 1e-5,
float16 5e-3, bfloat16 2e-2 (``lse`` relative to max(1, |lse|)). Explanations through the op against the
reference backend: relative (Frobenius) 1e-10 in float64, 1e-5 in float32.
"""

from __future__ import annotations

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.linearize.rules import attention as attention_rules
from omenn_kernels.ops import attention
from omenn_kernels.testing import FAMILIES, python_entered, randomize_, relative_distance

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
NEG_INF = float("-inf")


def _nan_view(values: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) values in a (B, T, H, D)-major view with NaN padding on every dim."""
    b, h, t, d = values.shape
    buf = torch.full((b + 1, t + 2, h + 1, d + 3), float("nan"), dtype=values.dtype)
    view = buf[1:, 1:t + 1, 1:, 2:d + 2].permute(0, 2, 1, 3)
    view.copy_(values)
    return view


def _nan_bias(values: torch.Tensor) -> torch.Tensor:
    *lead, tq, tk = values.shape
    buf = torch.full((*lead, tq + 1, tk + 3), float("nan"), dtype=torch.float32)
    view = buf[..., 1:, 2:tk + 2]
    view.copy_(values)
    return view


def _bias(kind: str, b: int, h: int, tq: int, tk: int, generator: torch.Generator):
    if kind == "none":
        return None
    if kind == "relpos":  # per head, shared by the batch (Swin, BEiT)
        return _nan_bias(torch.randn(1, h, tq, tk, generator=generator))
    if kind == "causal":  # one (Tq, Tk) matrix, as the rule builds it from is_causal
        return _nan_bias(torch.zeros(tq, tk).masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(), NEG_INF))
    # "mask": per image, -inf entries and one fully masked row
    values = torch.randn(b, 1, tq, tk, generator=generator) * 0.5
    drop = torch.rand(b, 1, tq, tk, generator=generator) < 0.3
    drop[..., 0] = False
    values = values.masked_fill(drop, NEG_INF)
    values[0, 0, tq // 2] = NEG_INF
    return _nan_bias(values)


def _written_out(q, k, v, bias, scale, grad):
    s = q.double() @ k.double().transpose(-2, -1) * scale
    if bias is not None:
        s = s + bias.double()
    lse = torch.logsumexp(s, -1)
    dead = torch.isneginf(lse)[..., None]
    weights = torch.where(dead, 0.0, torch.exp(s - torch.where(dead, 0.0, lse[..., None])))
    return weights @ v.double(), lse, weights.transpose(-2, -1) @ grad.double()


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach()
    assert torch.isfinite(got).all()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


# (B, H, Tq, Tk, D, Dv, dtype, bias)
CASES = [
    (2, 3, 7, 7, 8, 8, torch.float64, "none"),
    (2, 3, 7, 7, 8, 8, torch.float64, "relpos"),
    (2, 3, 9, 9, 8, 8, torch.float64, "mask"),
    (2, 3, 9, 9, 8, 8, torch.float64, "causal"),
    (1, 2, 17, 17, 64, 64, torch.float64, "relpos"),
    (2, 2, 5, 11, 8, 8, torch.float64, "mask"),  # other query count
    (2, 2, 9, 9, 8, 4, torch.float64, "mask"),  # another value head size
    (1, 4, 17, 17, 16, 16, torch.float32, "relpos"),
    (2, 3, 17, 17, 16, 16, torch.float32, "mask"),
    (2, 3, 17, 17, 16, 8, torch.float32, "none"),
    (1, 2, 17, 17, 16, 16, torch.bfloat16, "mask"),
    (1, 2, 17, 17, 16, 16, torch.float16, "mask"),
    # Partial SIMD vectors along the keys and along the head sizes, one token, parts_vit's heads.
    (2, 2, 19, 19, 5, 7, torch.float64, "causal"),
    (1, 2, 33, 20, 24, 40, torch.float32, "mask"),
    (1, 1, 1, 1, 3, 3, torch.float64, "none"),
    (2, 4, 145, 145, 16, 16, torch.float32, "none"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}H{c[1]}-Tq{c[2]}Tk{c[3]}-D{c[4]}Dv{c[5]}-"
                                                    f"{str(c[6])[6:]}-{c[7]}")
def test_forward_and_dv_equal_the_weights_written_out(case):
    b, h, tq, tk, d, dv, dtype, kind = case
    generator = torch.Generator().manual_seed(tq * 100 + tk)
    q, k = (_nan_view(torch.randn(b, h, t, d, generator=generator).to(dtype)) for t in (tq, tk))
    v = _nan_view(torch.randn(b, h, tk, dv, generator=generator).to(dtype)).requires_grad_(True)
    grad = _nan_view(torch.randn(b, h, tq, dv, generator=generator).to(dtype))
    bias = _bias(kind, b, h, tq, tk, generator)
    out, lse = attention.attention(q, k, v, bias, 0.3)
    (got_dv,) = torch.autograd.grad(out, v, grad, retain_graph=True)
    want_out, want_lse, want_dv = _written_out(q, k, v.detach(), bias, 0.3, grad)

    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert _error(out, want_out) <= TOL[dtype] and _error(got_dv, want_dv) <= TOL[dtype]
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    finite = torch.isfinite(want_lse)
    lse_error = (lse.detach().double() - want_lse)[finite].abs() / want_lse[finite].abs().clamp_min(1)
    assert float(lse_error.max()) <= TOL[dtype]
    if kind == "mask":  # the fully masked row: zero output, and its gradient reaches no value
        assert (out[0, :, tq // 2] == 0).all()
        grad[0, :, tq // 2] = 1e6
        assert torch.equal(torch.autograd.grad(out, v, grad)[0], got_dv)


@pytest.mark.parametrize("kind", ["none", "mask"])
def test_dv_differentiates_again_with_respect_to_the_gradient(kind):
    """``dV = Pᵀ·dO`` is linear in ``dO``; its derivative is the forward on the new values.
    gradgradcheck in float64, with a fully masked row; Q and K asking for a gradient through
    ``dV`` raise, rather than get none."""
    generator = torch.Generator().manual_seed(5)
    q, k = (_nan_view(torch.randn(2, 3, 9, 8, generator=generator, dtype=torch.float64)) for _ in range(2))
    v = torch.randn(2, 3, 9, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    bias = _bias(kind, 2, 3, 9, 9, generator)
    assert torch.autograd.gradgradcheck(lambda values: attention.attention(q, k, values, bias, 0.3)[0], (v,))
    query = q.detach().clone().requires_grad_(True)
    out, lse = attention.attention(q, k, v, bias, 0.3)
    dv = attention.attention_backward_dv(query, k, torch.randn_like(out), lse, bias, 0.3)
    with pytest.raises(RuntimeError, match="differentiable with respect to grad only"):
        dv.sum().backward()


def test_no_keys_give_zero_output_and_minus_infinite_lse():
    q = torch.randn(1, 2, 3, 4)
    empty = torch.randn(1, 2, 0, 4, requires_grad=True)
    out, lse = attention.attention(q, empty, empty, None, 0.5)
    assert out.shape == (1, 2, 3, 4) and (out == 0).all() and torch.isneginf(lse).all()
    assert torch.autograd.grad(out, empty, torch.randn_like(out))[0].shape == (1, 2, 0, 4)


@pytest.mark.parametrize("kind", ["none", "mask"])
def test_opcheck_cpu_ops(kind):
    """The fakes give the shapes, dtypes and strides the CPU ops return (Inductor allocates by them)."""
    generator = torch.Generator().manual_seed(1)
    q, k, v, grad = (_nan_view(torch.randn(2, 3, 9, 8, generator=generator)) for _ in range(4))
    bias = _bias(kind, 2, 3, 9, 9, generator)
    out, lse = torch.ops.omenn.attention_cpu(q, k, v, bias, 0.3)
    checks = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.omenn.attention_cpu.default, (q, k, v, bias, 0.3), test_utils=checks)
    torch.library.opcheck(torch.ops.omenn.attention_backward_dv_cpu.default, (q, k, grad, lse, bias, 0.3),
                          test_utils=checks)


def test_cpu_ops_run_no_python():
    """The dispatcher sends the CPU ops to ``csrc/attention.cpp`` directly: no Python per call."""
    generator = torch.Generator().manual_seed(2)
    q, k, v, grad = (_nan_view(torch.randn(2, 3, 9, 8, generator=generator)) for _ in range(4))
    out, lse = torch.ops.omenn.attention_cpu(q, k, v, None, 0.3)
    assert python_entered(lambda: torch.ops.omenn.attention_cpu(q, k, v, None, 0.3)) == []
    assert python_entered(lambda: torch.ops.omenn.attention_backward_dv_cpu(q, k, grad, lse, None, 0.3)) == []


def test_cpu_ops_name_mismatched_shapes():
    """Heads of another batch, head count or head size, values of another token count, an lse
    of another query count and a bias of more than 4 dims are refused, naming the op and the
    shapes, never read out of bounds."""
    q, lse = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5)
    with pytest.raises(RuntimeError, match=r"q \[2, 3, 5, 8\], k \[1, 3, 5, 8\] and grad .* are not heads"):
        torch.ops.omenn.attention_backward_dv_cpu(q, q[:1], q, lse, None, 0.3)
    with pytest.raises(RuntimeError, match="are not heads"):
        torch.ops.omenn.attention_cpu(q, q[..., :4], q, None, 0.3)
    with pytest.raises(RuntimeError, match=r"v \[2, 3, 4, 8\] does not have the 5 tokens of k"):
        torch.ops.omenn.attention_cpu(q, q, q[:, :, :4], None, 0.3)
    with pytest.raises(RuntimeError, match=r"lse \[2, 3, 2\] do not match q"):
        torch.ops.omenn.attention_backward_dv_cpu(q, q, q, lse[:, :, :2], None, 0.3)
    with pytest.raises(RuntimeError, match="attention_backward_dv_cpu: bias must have at most 4 dims"):
        torch.ops.omenn.attention_backward_dv_cpu(q, q, q, lse, torch.zeros(1, 1, 1, 5, 5), 0.3)


def test_weights_larger_than_one_chunk_go_through_the_op():
    """The CPU writes out attention weights that fit in one chunk (saving ``A`` costs less than
    recomputing it) and runs larger ones through the op: ViT-B/16 at batch 8 does not fit."""
    small = torch.empty(32, 3, 37, 64)  # parts_vit, batch 32
    large = torch.empty(8, 12, 197, 64)  # ViT-B/16, batch 8
    assert attention_rules.weights_fit_one_chunk(small, small)
    assert not attention_rules.weights_fit_one_chunk(large, large)


ATTENTION_FAMILIES = ["vit", "deit", "beit", "torchvision_vit"]


@pytest.mark.parametrize("name, dtype", [(name, torch.float64) for name in ATTENTION_FAMILIES]
                         + [("vit", torch.float32), ("beit", torch.float32)],
                         ids=[f"{name}-float64" for name in ATTENTION_FAMILIES] + ["vit-float32", "beit-float32"])
def test_explanations_through_the_op_equal_the_reference(name, dtype, monkeypatch):
    """Every SDPA of the family through ``omenn::attention`` (BEiT's with relative-position
    biases), as if its weights did not fit in one chunk."""
    calls = []
    real = attention.attention

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(attention_rules, "_CHUNK_BYTES", 0)
    monkeypatch.setattr(attention, "attention", counted)
    family = FAMILIES[name]
    torch.manual_seed(3)
    model = randomize_(family.build(), seed=3).to(dtype).eval()
    x = torch.randn(2, 3, family.size, family.size, dtype=dtype)
    want = Explainer(model, backend="reference")(x, 1)
    assert not calls
    got = Explainer(model, backend="fused")(x, 1)
    assert calls
    tolerance = 1e-10 if dtype == torch.float64 else 1e-5
    for field in ("contribution", "weight", "bias", "logits"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= tolerance, field


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_under_autocast_the_op_follows_the_reference(dtype, monkeypatch):
    """CPU autocast (a float32 ViT, low-precision matrix products): every SDPA through the op,
    within the low precision's rounding of the reference under the same autocast (2e-2)."""
    calls = []
    real = attention.attention

    def counted(*args):
        calls.append(args[0].dtype)
        return real(*args)

    monkeypatch.setattr(attention_rules, "_CHUNK_BYTES", 0)
    monkeypatch.setattr(attention, "attention", counted)
    family = FAMILIES["vit"]
    torch.manual_seed(4)
    model = randomize_(family.build(), seed=4).eval()
    x = torch.randn(2, 3, family.size, family.size)
    with torch.autocast("cpu", dtype=dtype):
        want = Explainer(model, backend="reference")(x, 1)
        got = Explainer(model, backend="fused")(x, 1)
    assert calls and set(calls) == {dtype}
    assert relative_distance(got.contribution.float(), want.contribution.float()) <= 2e-2
    assert relative_distance(got.logit.float(), want.logit.float()) <= 2e-2
