"""R5' held multipliers and R1' products (rules/multiplier.py, rules/activation.py, rules/linear.py,
rules/arithmetic.py), against written-out matrices.

float64, random inputs and parameters (biases and norm affines included). Tolerances: the
written-out forms, and backend against backend, ``rtol=1e-9`` with ``atol=1e-12·max|expected|``;
completeness ``|Σ C − ŷ| / |ŷ| ≤ 1e-10``.

Tables (B, F) are explained with their features as one position (``feature_dim=1``), so
``C_w`` (B, F) is the explanation's matrix row and ``C_b`` (B,) what the biases add:
``ŷ = C_w·x + C_b``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rule_checks import assert_written_out, on_both_backends, rand

from omenn_kernels import UnsupportedOpError, explain

DT = torch.float64
F_IN, HIDDEN, K = 6, 8, 3


def _parameter(*shape: int, seed: int) -> nn.Parameter:
    return nn.Parameter(rand(*shape, seed=seed))


class RMSNormHead(nn.Module):
    """``head(γ ⊙ x · rsqrt(mean(x²) + ε))`` written out, as Llama's RMSNorm is."""

    def __init__(self) -> None:
        super().__init__()
        self.gamma = _parameter(F_IN, seed=1)
        self.head = nn.Linear(F_IN, K).to(DT)

    def forward(self, x):
        normalizer = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.head(self.gamma * (x * normalizer))


def test_rms_normalization_holds_its_normalizer():
    model, x = RMSNormHead(), rand(4, F_IN, seed=2)
    e = on_both_backends(model, x, 1)
    held = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # one number per row, held
    row = model.head.weight[1] * model.gamma
    assert_written_out(e.weight, held * row)
    assert_written_out(e.bias, model.head.bias[1].detach().expand(4))


class GatedMLP(nn.Module):
    """``down((x W_up) ⊙ silu(x W_gate))``: Llama's and EVA-02's MLP; with ``up_activation``
    the up branch is a would-be multiplier too."""

    def __init__(self, up_activation=None) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(F_IN, HIDDEN).to(DT), nn.Linear(F_IN, HIDDEN).to(DT)
        self.down = nn.Linear(HIDDEN, K).to(DT)
        self.up_activation = up_activation

    def forward(self, x):
        up = self.up(x) if self.up_activation is None else self.up_activation(self.up(x))
        return self.down(up * F.silu(self.gate(x)))


def test_a_gated_mlp_is_linear_in_its_up_projection_with_the_silu_held():
    model, x = GatedMLP(), rand(5, F_IN, seed=3)
    e = on_both_backends(model, x, 2)
    with torch.no_grad():
        gate = F.silu(model.gate(x))  # (B, HIDDEN), held
        scaled = model.down.weight[2] * gate  # diag(g) folded into the read-out row, per sample
        assert_written_out(e.weight, scaled @ model.up.weight)
        assert_written_out(e.bias, scaled @ model.up.bias + model.down.bias[2])


class NormAfterGatedMLP(nn.Module):
    """Llama's block in float32: an RMSNorm of the residual ``x + MLP(x)``, no cast between, so
    the normalizer's partner is computed (through a matrix product) from the silu gate."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = GatedMLP()
        self.lift = nn.Linear(K, F_IN).to(DT)
        self.norm = RMSNormHead()

    def forward(self, x):
        return self.norm(x + self.lift(self.mlp(x)))


def test_a_normalizer_whose_partner_comes_from_a_held_gate_is_held():
    model, x = NormAfterGatedMLP(), rand(5, F_IN, seed=13)
    e = on_both_backends(model, x, 1)
    with torch.no_grad():
        gate = F.silu(model.mlp.gate(x))
        # The residual r = x + lift(down(gate ⊙ up(x))) with the gate held: r = x·M_b + m_b.
        mlp = torch.einsum("ko,bo,oi->bki", model.mlp.down.weight, gate, model.mlp.up.weight)
        matrix = torch.eye(F_IN, dtype=DT) + torch.einsum("fk,bki->bfi", model.lift.weight, mlp)
        offset = model.lift(model.mlp.down(gate * model.mlp.up.bias))
        residual = x + model.lift(model.mlp(x))
        held = torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6)
        row = held * model.norm.head.weight[1] * model.norm.gamma  # (B, F_IN)
        assert_written_out(e.weight, torch.einsum("bf,bfi->bi", row, matrix))
        assert_written_out(e.bias, (row * offset).sum(1) + model.norm.head.bias[1])


class GlobalResponseNorm(nn.Module):
    """ConvNeXt-V2's GRN on channels-last maps: ``x + addcmul(β, γ, x · ‖x‖/mean‖x‖)``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma, self.beta = _parameter(channels, seed=4), _parameter(channels, seed=5)
        self.head = nn.Linear(channels, K).to(DT)

    def forward(self, x):  # x: (B, C, H, W)
        x = x.permute(0, 2, 3, 1)
        norm = torch.linalg.vector_norm(x, ord=2, dim=(1, 2), keepdim=True)
        response = norm / (norm.mean(dim=-1, keepdim=True) + 1e-6)
        x = x + torch.addcmul(self.beta, self.gamma, x * response)
        return self.head(x.mean((1, 2)))


def test_global_response_normalization_holds_its_response():
    model, x = GlobalResponseNorm(4), rand(2, 4, 3, 3, seed=6)
    e = on_both_backends(model, x, 0)
    with torch.no_grad():
        channels_last = x.permute(0, 2, 3, 1)
        norm = torch.linalg.vector_norm(channels_last, ord=2, dim=(1, 2), keepdim=True)
        response = (norm / (norm.mean(-1, keepdim=True) + 1e-6)).flatten(1)  # (B, C), held
        per_channel = model.head.weight[0] * (1 + model.gamma * response) / 9  # mean over 3×3
        assert_written_out(e.weight, per_channel[:, :, None, None].expand_as(x))
        bias = (model.head.weight[0] @ model.beta + model.head.bias[0]) / 9  # per pixel, spread by the mean
        assert_written_out(e.bias, bias.expand(2, 3, 3))


def _gelu_new(x):
    """Hugging Face's ``gelu_new`` (GPT-2, T5 v1.1's gated-GELU MLP), written out in several ops."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _quick_gelu(x):
    return x * torch.sigmoid(1.702 * x)


def _softcapped(x):
    return 3.0 * torch.tanh(x / 3.0)


class WrittenOutGatedMLP(nn.Module):
    """``down(activation(x W_gate) ⊙ (x W_up))`` with the activation written out in several ops."""

    def __init__(self, activation, up_activation=None) -> None:
        super().__init__()
        self.up, self.gate = nn.Linear(F_IN, HIDDEN).to(DT), nn.Linear(F_IN, HIDDEN).to(DT)
        self.down = nn.Linear(HIDDEN, K).to(DT)
        self.activation, self.up_activation = activation, up_activation

    def forward(self, x):
        up = self.up(x) if self.up_activation is None else self.up_activation(self.up(x))
        return self.down(self.activation(self.gate(x)) * up)


@pytest.mark.parametrize("activation", [_gelu_new, _quick_gelu, _softcapped], ids=["gelu_new", "quick_gelu",
                                                                                  "softcapping"])
def test_a_multiplier_written_out_in_several_ops_is_held_whole(activation):
    """R5' over a subgraph: the whole written-out activation is the held multiplier, as the one
    op is in a gated MLP (against the written-out matrix form)."""
    model, x = WrittenOutGatedMLP(activation), rand(5, F_IN, seed=7)
    e = on_both_backends(model, x, 1)
    with torch.no_grad():
        scaled = model.down.weight[1] * activation(model.gate(x))  # diag(held) folded into the read-out row
        assert_written_out(e.weight, scaled @ model.up.weight)
        assert_written_out(e.bias, scaled @ model.up.bias + model.down.bias[1])


def test_gelu_new_written_out_equals_the_one_op_tanh_gelu():
    written = WrittenOutGatedMLP(_gelu_new)
    one_op = WrittenOutGatedMLP(lambda g: F.gelu(g, approximate="tanh"))
    one_op.load_state_dict(written.state_dict())
    x = rand(4, F_IN, seed=8)
    a, b = explain(written, x, 2, backend="fused"), explain(one_op, x, 2, backend="fused")
    assert_written_out(a.contribution, b.contribution)


def test_two_written_out_non_linear_factors_stay_refused():
    with pytest.raises(UnsupportedOpError, match=r"aten\.mul\.Tensor") as info:
        explain(WrittenOutGatedMLP(_gelu_new, up_activation=F.silu), rand(2, F_IN, seed=0), 0)
    assert "R9" in info.value.rule_kind


class AddedNormalizer(nn.Module):
    def forward(self, x):
        return x + torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_product_of_two_multipliers_stays_refused():
    with pytest.raises(UnsupportedOpError, match=r"aten\.mul\.Tensor") as info:
        explain(GatedMLP(up_activation=F.gelu), rand(2, F_IN, seed=0), 0)
    assert "R9" in info.value.rule_kind


def test_a_multiplier_used_other_than_as_a_factor_is_refused_naming_r5_prime():
    with pytest.raises(UnsupportedOpError, match=r"aten\.(rsqrt|pow)") as info:
        explain(AddedNormalizer(), rand(2, F_IN, seed=0), 0)
    assert "R5'" in info.value.rule_kind


class EinsumModel(nn.Module):
    """An einsum projection, a constant addcmul, attention written with einsum, an addcdiv."""

    def __init__(self) -> None:
        super().__init__()
        self.project = _parameter(3, 6, seed=7)
        self.shift, self.scale = _parameter(6, seed=8), _parameter(6, seed=9)
        self.head = nn.Linear(6 * 16, K).to(DT)

    def forward(self, x, einsum=True):  # x: (B, 3, 4, 4)
        if einsum:
            tokens = torch.einsum("bchw,cd->bhwd", x, self.project).flatten(1, 2)
            tokens = torch.addcmul(self.shift, self.scale, tokens)
            weights = torch.einsum("bid,bjd->bij", tokens, tokens).softmax(-1)
            mixed = torch.einsum("bij,bjd->bid", weights, tokens)
            mixed = torch.addcdiv(mixed, mixed, self.scale.abs() + 1, value=0.5)
        else:
            tokens = (x.permute(0, 2, 3, 1) @ self.project).flatten(1, 2)
            tokens = self.shift + self.scale * tokens
            mixed = (tokens @ tokens.transpose(1, 2)).softmax(-1) @ tokens
            mixed = mixed + 0.5 * mixed / (self.scale.abs() + 1)
        return self.head(mixed.flatten(1))


class WrittenWithMatmul(nn.Module):
    def __init__(self, model: EinsumModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x, einsum=False)


def test_einsum_and_addcmul_equal_the_same_model_written_with_matmul():
    model, x = EinsumModel(), rand(2, 3, 4, 4, seed=10)
    e = on_both_backends(model, x, 1)
    written = explain(WrittenWithMatmul(model), x, 1, backend="reference")
    assert_written_out(e.contribution, written.contribution)
    assert_written_out(e.weight, written.weight)


class EinsumTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight, self.bias = _parameter(F_IN, K, seed=11), _parameter(K, seed=12)

    def forward(self, x):
        return torch.einsum("bf,fk->bk", x, self.weight) + self.bias


def test_an_einsum_with_a_constant_is_its_matrix():
    model, x = EinsumTable(), rand(3, F_IN, seed=13)
    e = on_both_backends(model, x, 2)
    assert_written_out(e.weight, model.weight[:, 2].detach().expand(3, F_IN))
    assert_written_out(e.bias, model.bias[2].detach().expand(3))


class EllipsisEinsum(nn.Module):
    def forward(self, x):
        return torch.einsum("...f,f->...", x, torch.ones(F_IN, dtype=x.dtype))[:, None].expand(-1, K)


def test_an_einsum_with_an_ellipsis_is_refused_naming_the_equation():
    with pytest.raises(UnsupportedOpError, match=r"aten\.einsum.*without ellipsis"):
        explain(EllipsisEinsum(), rand(2, F_IN, seed=0), 0)


@pytest.mark.parametrize("model_class", [GatedMLP, RMSNormHead])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_held_multipliers_follow_the_parameters_in_a_training_gradient(model_class, backend):
    """``create_graph``'s total parameter gradient of a loss on the explanation equals central
    finite differences along a random direction (step 1e-6; agreement to 1e-6 relative)."""
    torch.manual_seed(0)
    model, x = model_class(), rand(3, F_IN, seed=14)
    parameter = next(model.parameters())
    direction = rand(*parameter.shape, seed=15)

    def loss(e):
        return (e.weight ** 2).sum() + (e.bias ** 2).sum()

    (gradient,) = torch.autograd.grad(loss(explain(model, x, 1, backend=backend, create_graph=True)), parameter)
    values = []
    for step in (1e-6, -1e-6):
        with torch.no_grad():
            parameter += step * direction
        values.append(float(loss(explain(model, x, 1, backend="reference"))))
        with torch.no_grad():
            parameter -= step * direction
    finite = (values[0] - values[1]) / 2e-6
    assert abs(float((gradient * direction).sum()) - finite) <= 1e-6 * abs(finite)
