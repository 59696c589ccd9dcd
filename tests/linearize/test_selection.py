"""R1' selections, writes and sums, R4's added activations and R5' held masks, against written-out forms.

float64, random inputs and parameters (biases included). Every model here but the
activation models is piecewise linear in its input, so its OMENN matrix row is the
gradient: ``C_w`` must equal autograd's gradient of the logit, and ``Σ C = ŷ`` holds with
the biases (and CONST operands) carried by the ones. Tolerances: ``rtol=1e-9`` with
``atol=1e-12·max|expected|``; completeness ``|Σ C − ŷ| / |ŷ| ≤ 1e-10``; reference and fused
backends against each other the same.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rule_checks import assert_written_out, on_both_backends, rand

DT = torch.float64
B, F_IN, HIDDEN, K = 3, 6, 8, 4


def _assert_is_the_gradient(model: nn.Module, x: torch.Tensor, target: int, **kwargs):
    """A piecewise-linear model: ``C_w`` is the gradient of the logit, and the explanation is complete."""
    e = on_both_backends(model, x, target, **kwargs)
    inputs = x.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(inputs)[:, target].sum(), inputs)
    assert_written_out(e.weight, gradient)
    return e


class _Net(nn.Module):
    """``head(middle(first(x)))`` for tables, with random biases."""

    def __init__(self, middle, width: int = HIDDEN, seed: int = 1) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.first, self.second = nn.Linear(F_IN, HIDDEN).to(DT), nn.Linear(F_IN, HIDDEN).to(DT)
        self.head = nn.Linear(width, K).to(DT)
        self.middle = middle
        self.register_buffer("mask", torch.rand(HIDDEN, generator=torch.Generator().manual_seed(seed)) > 0.5)
        self.register_buffer("bound", rand(HIDDEN, seed=seed + 7))

    def forward(self, x):
        return self.head(self.middle(self, self.first(x), self.second(x)))


SELECTIONS = {
    "where_of_a_held_comparison": lambda m, a, b: torch.where(a > 0, a, 0.0),
    "where_with_a_const_mask_and_a_const_branch": lambda m, a, b: torch.where(m.mask, a, m.bound),
    "where_between_two_live_branches": lambda m, a, b: torch.where(m.mask, a, b),
    "masked_fill": lambda m, a, b: a.masked_fill(m.mask, 0.7),
    "a_held_mask_as_a_factor": lambda m, a, b: a * (a > 0.1).to(a.dtype),
    "maximum_and_minimum": lambda m, a, b: torch.maximum(a, b) + torch.minimum(a, m.bound),
    "clamp_with_tensor_bounds": lambda m, a, b: a.clamp(min=m.bound - 1, max=m.bound + 1)
    + torch.clamp_min(b, m.bound) + torch.clamp_max(b, m.bound),
    "cumsum": lambda m, a, b: a.cumsum(-1),
    "amax_as_a_value": lambda m, a, b: a.unflatten(-1, (2, 4)).amax(-1).repeat(1, 4),
    "max_over_a_dim": lambda m, a, b: torch.max(a.unflatten(-1, (4, 2)), dim=-1).values.repeat(1, 2),
    "sort": lambda m, a, b: torch.sort(a, dim=-1).values,
    "topk": lambda m, a, b: torch.topk(a, 5, dim=-1).values.repeat(1, 2)[:, :HIDDEN],
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_selections_are_linear_with_the_choice_held(name):
    _assert_is_the_gradient(_Net(SELECTIONS[name]), rand(B, F_IN, seed=2), 1)


def test_where_of_a_comparison_is_relu():
    x = rand(B, F_IN, seed=3)
    selected = on_both_backends(_Net(SELECTIONS["where_of_a_held_comparison"]), x, 2)
    relu = on_both_backends(_Net(lambda m, a, b: torch.relu(a)), x, 2)
    assert_written_out(selected.weight, relu.weight)
    assert_written_out(selected.bias, relu.bias)


WRITES = {
    "slice_scatter_into_zeros": lambda m, a, b: torch.zeros(a.shape[0], 2 * HIDDEN, dtype=DT)
    .slice_scatter(a, 1, 0, HIDDEN).slice_scatter(b, 1, HIDDEN, 2 * HIDDEN),
    "index_put": lambda m, a, b: _index_put(a, b),
    "scatter": lambda m, a, b: a.scatter(1, torch.arange(HIDDEN).flip(0).expand(a.shape[0], -1), b),
    "scatter_add": lambda m, a, b: a.scatter_add(1, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3]).expand(a.shape[0], -1), b),
    "scatter_of_a_scalar": lambda m, a, b: a.scatter(1, torch.tensor([[1, 3]]).expand(a.shape[0], -1), 0.5),
    "select_scatter": lambda m, a, b: a.select_scatter(b[:, 2], 1, 5),
    "copy": lambda m, a, b: a.clone().copy_(b.flip(1)),
    "index_put_accumulating": lambda m, a, b: a.T.index_put((torch.tensor([1, 2, 1]),), b[:, :3].T,
                                                            accumulate=True).T,
}


def _index_put(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(a.shape[0], 2 * HIDDEN, dtype=a.dtype)
    out[:, torch.arange(0, 2 * HIDDEN, 2)] = a
    out[:, torch.arange(1, 2 * HIDDEN, 2)] = b
    return out


@pytest.mark.parametrize("name", list(WRITES))
def test_writes_with_constant_indices_are_linear(name):
    width = 2 * HIDDEN if name in ("slice_scatter_into_zeros", "index_put") else HIDDEN
    _assert_is_the_gradient(_Net(WRITES[name], width), rand(B, F_IN, seed=4), 0)


class Signal(nn.Module):
    """A 1-D signal model (B, C, T): reflection and replication padding, a linear layer over time (whose
    ones are shared by the channels) and a diagonal read-out."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.conv = nn.Conv1d(2, 4, 3).to(DT)
        self.mix = nn.Linear(12, 12).to(DT)
        self.head = nn.Linear(4 + 12, K).to(DT)

    def forward(self, x):
        h = self.conv(F.pad(x, (1, 1), mode="reflect")) + self.conv(F.pad(x, (1, 1), mode="replicate"))
        square = self.mix(h[:, :, :12]).view(-1, 4, 3, 4)[:, :, 0, :]  # (B, 4, 4)
        return self.head(torch.cat([torch.diagonal(square, dim1=1, dim2=2), h[:, 0, :12]], dim=1))


def test_padding_by_copies_and_a_diagonal_are_structure():
    _assert_is_the_gradient(Signal(), rand(B, 2, 12, seed=6), 3)


class Activated(nn.Module):
    def __init__(self, activation) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.first, self.head = nn.Linear(F_IN, HIDDEN).to(DT), nn.Linear(HIDDEN, K).to(DT)
        self.activation = activation

    def forward(self, x):
        return self.head(self.activation(self.first(x)))


@pytest.mark.parametrize("activation, at_zero", [(torch.sin, 0.0), (torch.acos, math.pi / 2),
                                                 (torch.atan, 0.0), (torch.log1p, 0.0)],
                         ids=["sin", "acos", "atan", "log1p"])
def test_added_elementwise_activations_are_r4(activation, at_zero):
    """``f(z) = f(0) + z·ξ(z)``: ``C_w = w_k·diag(ξ(z))·W``, and ``f(0)`` is carried by the ones."""
    model = Activated(activation)
    x = rand(B, F_IN, seed=8) * 0.3  # inside acos's domain
    e = on_both_backends(model, x, 1)
    z = model.first(x).detach()
    xi = (activation(z) - at_zero) / z
    assert_written_out(e.weight, (model.head.weight[1] * xi) @ model.first.weight)
    expected_bias = (model.head.weight[1] * xi) @ model.first.bias + model.head.weight[1] @ torch.full(
        (HIDDEN,), at_zero, dtype=DT) + model.head.bias[1]
    assert_written_out(e.bias, expected_bias)


def test_amax_used_as_a_factor_is_a_held_multiplier():
    """``a / max|a|``: the maximum held, ``C_w = w_k·W / m`` per sample."""
    model = _Net(lambda m, a, b: a / a.abs().amax(-1, keepdim=True))
    x = rand(B, F_IN, seed=9)
    e = on_both_backends(model, x, 2)
    held = model.first(x).detach().abs().amax(-1, keepdim=True)
    assert_written_out(e.weight, (model.head.weight[2] @ model.first.weight).expand(B, -1) / held)
