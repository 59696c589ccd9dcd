"""Per-kernel benchmarks: each fused op against the PyTorch eager composition of the
same rule and against ``torch.compile`` of that composition.

    python -m pytest bench/test_kernels.py --benchmark-json bench/results/kernels_cpu.json

Each timed call runs the forward and the backward of the rule (the ones channel's
gradient included where the rule has one). On a GPU, the timed function synchronizes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from omenn_kernels.ops import activation, attention, conv_bias

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _timed(benchmark, fn):
    def run():
        fn()
        _sync()
    benchmark.pedantic(run, rounds=10, warmup_rounds=2)


def _eager_gelu(x):
    return x * (0.5 * (1 + torch.erf(x.detach() / math.sqrt(2))))


# --- (a) activation with a detached multiplier: ViT-B MLP size, batch 8 ---

@pytest.mark.parametrize("variant", ["fused", "eager", "compiled"])
def test_activation_gelu(benchmark, variant):
    benchmark.group = f"activation gelu 8x197x3072 {DEVICE} {DTYPE}"
    x = torch.randn(8, 197, 3072, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn_like(x)
    rule = {"fused": lambda t: activation.activation(t, "gelu", 0.0), "eager": _eager_gelu,
            "compiled": torch.compile(_eager_gelu)}[variant]
    _timed(benchmark, lambda: torch.autograd.grad(rule(x), x, grad))


# --- (b) convolution bias spreading with a per-pixel ones channel: ResNet-50 stage 2 3x3 ---

def _conv_setup():
    x = torch.randn(8, 128, 28, 28, device=DEVICE, dtype=DTYPE, requires_grad=True)
    ones = torch.ones(8, 1, 28, 28, device=DEVICE, dtype=DTYPE, requires_grad=True)
    weight = torch.randn(128, 128, 3, 3, device=DEVICE, dtype=DTYPE) * 0.05
    bias = torch.randn(128, device=DEVICE, dtype=DTYPE)
    return x, ones, weight, bias


def _eager_conv(x, ones, weight, bias):
    window = F.conv2d(ones, ones.new_ones(1, 1, 3, 3), None, 1, 1)
    return F.conv2d(x, weight, None, 1, 1) + bias.view(1, -1, 1, 1) * (window / window.detach())


@pytest.mark.parametrize("variant", ["fused", "eager", "compiled"])
def test_conv_bias_spreading(benchmark, variant):
    benchmark.group = f"conv 3x3 128->128 8x28x28 with bias spreading {DEVICE} {DTYPE}"
    x, ones, weight, bias = _conv_setup()
    grad = torch.randn(8, 128, 28, 28, device=DEVICE, dtype=DTYPE)
    if variant == "fused":
        window_sum = F.conv2d(ones.detach(), ones.new_ones(1, 1, 3, 3), None, 1, 1).float()

        def rule():
            value, _ = conv_bias.conv2d_ones(x, ones, window_sum, weight, bias, [1, 1], [1, 1], [1, 1], 1)
            return value
    else:
        composed = _eager_conv if variant == "eager" else torch.compile(_eager_conv)

        def rule():
            return composed(x, ones, weight, bias)
    _timed(benchmark, lambda: torch.autograd.grad(rule(), [x, ones], grad))


# --- (c) attention with the ones channel: dV-only backward vs full SDPA backward ---

@pytest.mark.parametrize("tokens", [197, 1024])
@pytest.mark.parametrize("variant", ["fused_dv_only", "sdpa_full_backward"])
def test_attention_backward(benchmark, variant, tokens):
    benchmark.group = f"attention B8 H12 T{tokens} d64 {DEVICE} {DTYPE}"
    shape = (8, 12, tokens, 64)
    q, k = torch.randn(shape, device=DEVICE, dtype=DTYPE), torch.randn(shape, device=DEVICE, dtype=DTYPE)
    v = torch.randn(shape, device=DEVICE, dtype=DTYPE, requires_grad=True)
    grad = torch.randn(shape, device=DEVICE, dtype=DTYPE)
    if variant == "fused_dv_only":
        _timed(benchmark, lambda: torch.autograd.grad(attention.attention(q, k, v, None, 0.125)[0], v, grad))
    else:
        qg, kg = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
        _timed(benchmark, lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, v), [qg, kg, v], grad))
