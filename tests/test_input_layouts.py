"""Inputs of any layout: tables (B, F), audio (B, C, T), video (B, C, T, H, W), token embeddings (B, T, D).

float64, random inputs, biases and norm statistics randomized. Tolerances:
* completeness per sample, ``|Σ C − ŷ| / |ŷ| ≤ 1e-10`` (rounding is ~1e-16);
* the paper-literal forms below and backend against backend: ``rtol=1e-9``,
  ``atol=1e-12·max|expected|``.

The paper-literal forms: for a network of linear maps, convolutions, BatchNorm, ReLU
and max pooling, ``C_w`` is the gradient of the logit (every multiplier is 0 or 1 and
held, so the linearized network's gradient is the model's), and ``C_b`` is what the
weights leave of the logit, ``ŷ − Σ C_w ⊙ X``, per position. Without a feature axis
(``feature_dim=None``) a table's first linear layer contracts all its features, so
its ones are their mean (R1: ones over contracted dims) and every feature carries the
same share ``(ŷ − Σ C_w ⊙ X) / F`` of the biases.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from timm.models.vision_transformer import Block

from omenn_kernels import Explainer, InputError, explain
from omenn_kernels.backends import compiled
from omenn_kernels.losses import attribution_consistency, attribution_map
from omenn_kernels.testing import randomize_

DT = torch.float64
RTOL_COMPLETE = 1e-10
K = 5
BACKENDS = ["reference", "fused", "compiled"]


class TokenClassifier(nn.Module):
    """Two pre-norm transformer blocks over token embeddings (B, T, D), mean-pooled."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(dim, 4, qkv_bias=True), Block(dim, 4, qkv_bias=True))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, K)

    def forward(self, tokens):
        return self.head(self.norm(self.blocks(tokens)).mean(1))


def _tabular(piecewise_linear: bool) -> nn.Module:
    if piecewise_linear:
        return nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, K))
    return nn.Sequential(nn.Linear(7, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, K))


def _audio() -> nn.Module:
    return nn.Sequential(nn.Conv1d(2, 8, 5, padding=2), nn.BatchNorm1d(8), nn.ReLU(), nn.MaxPool1d(2),
                         nn.Conv1d(8, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(),
                         nn.Linear(8, K))


def _video() -> nn.Module:
    return nn.Sequential(nn.Conv3d(3, 4, 3, padding=1), nn.BatchNorm3d(4), nn.ReLU(), nn.MaxPool3d(2),
                         nn.Conv3d(4, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
                         nn.Linear(4, K))


# name: (model, input shape, feature_dim, whether the paper-literal gradient form holds)
CASES = {
    "tabular-one-position": (lambda: _tabular(True), (4, 7), 1, True),
    "tabular-per-feature": (lambda: _tabular(True), (4, 7), None, True),
    "tabular-gelu-layernorm": (lambda: _tabular(False), (4, 7), None, False),
    "audio": (_audio, (3, 2, 32), 1, True),
    "video": (_video, (2, 3, 4, 8, 8), 1, True),
    "tokens": (TokenClassifier, (2, 6, 16), -1, False),
}


def _case(name: str):
    build, shape, feature_dim, literal = CASES[name]
    model = randomize_(build(), seed=1).to(DT).eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=DT)
    return model, x, feature_dim, literal


@pytest.fixture
def traced_compiler(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-12 * float(expected.abs().max()))


@pytest.mark.parametrize("name", CASES)
def test_every_layout_is_complete_and_every_backend_equals_the_reference(name, traced_compiler):
    model, x, feature_dim, _ = _case(name)
    with torch.no_grad():
        logit = model(x)[:, 3]
    explanations = {backend: explain(model, x, 3, backend=backend, feature_dim=feature_dim) for backend in BACKENDS}
    reference = explanations["reference"]
    axis = None if feature_dim is None else feature_dim % x.dim()
    kept = list(x.shape) if axis is None else [size for dim, size in enumerate(x.shape) if dim != axis]
    assert list(reference.contribution.shape) == kept and list(reference.bias.shape) == kept
    assert reference.weight.shape == x.shape
    for backend, e in explanations.items():
        total = e.contribution.reshape(x.shape[0], -1).sum(1)
        assert float(((total - logit).abs() / logit.abs()).max()) <= RTOL_COMPLETE, backend
        assert float(e.completeness_error().max()) <= RTOL_COMPLETE, backend
        _assert_close(e.contribution, reference.contribution)
        _assert_close(e.weight, reference.weight)


@pytest.mark.parametrize("name", ["audio", "video"])
def test_a_view_with_gaps_is_explained_as_its_dense_copy(name, traced_compiler):
    """A crop along the last axis of a larger batch: captured and explained as the same values
    laid out densely, by every backend, to rounding."""
    model, x, feature_dim, _ = _case(name)
    wider = torch.randn(*x.shape[:-1], x.shape[-1] + 3, generator=torch.Generator().manual_seed(3), dtype=DT)
    view = wider[..., :x.shape[-1]]
    assert not view.is_contiguous()
    for backend in BACKENDS:
        got = explain(model, view, 3, backend=backend, feature_dim=feature_dim)
        want = explain(model, view.contiguous(), 3, backend=backend, feature_dim=feature_dim)
        _assert_close(got.contribution, want.contribution)
        _assert_close(got.weight, want.weight)


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case[3]])
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_piecewise_linear_models_give_the_paper_literal_form(name, backend):
    model, x, feature_dim, _ = _case(name)
    inputs = x.clone().requires_grad_(True)
    logit = model(inputs)[:, 3]
    (gradient,) = torch.autograd.grad(logit.sum(), inputs)
    e = explain(model, x, 3, backend=backend, feature_dim=feature_dim)
    _assert_close(e.weight, gradient)
    weighted = (gradient * x).reshape(x.shape[0], -1).sum(1)
    left = logit.detach() - weighted  # what the biases contribute to each sample's logit
    if feature_dim is None:  # one position per feature: equal shares
        _assert_close(e.bias, left.unsqueeze(1).expand_as(x) / x.shape[1])
    else:
        _assert_close(e.bias.reshape(x.shape[0], -1).sum(1), left)


def test_token_contributions_are_sums_over_their_embedding_features():
    model, x, _, _ = _case("tokens")
    e = explain(model, x, 3, feature_dim=-1)
    _assert_close(e.contribution, (e.weight * x).sum(-1) + e.bias)
    assert e.contribution.shape == x.shape[:2]


def test_attributions_spread_the_bias_over_the_feature_axis():
    model, x, _, _ = _case("tokens")
    explainer = Explainer(model, feature_dim=-1)
    attributions = explainer.attribute(x, 3)
    e = explainer(x, 3)
    assert attributions.shape == x.shape
    _assert_close(attributions.sum(-1), e.contribution)


def test_several_read_outs_keep_the_layout():
    model, x, _, _ = _case("audio")
    readouts = torch.randn(3, 2, K, generator=torch.Generator().manual_seed(3), dtype=DT)
    many = Explainer(model).explain_targets(x, readouts)
    assert many.contribution.shape == (3, 2, 32) and many.weight.shape == (3, 2, 2, 32)
    for t in range(2):
        single = explain(model, x, readouts[:, t])
        _assert_close(many.contribution[:, t], single.contribution)
    assert float(many.completeness_error().max()) <= RTOL_COMPLETE


@pytest.mark.parametrize("shape, feature_dim, message", [
    ((5,), 1, r"a batch \(B, \.\.\.\) with at least one dimension after the batch; got shape \(5,\)"),
    ((2, 3, 8, 8), 0, r"feature_dim=0 is not an axis after the batch of an input of shape \(2, 3, 8, 8\)"),
    ((2, 3, 8, 8), 4, r"feature_dim=4 is not an axis after the batch"),
    ((2, 3, 8, 8), -5, r"feature_dim=-5 is not an axis after the batch"),
])
def test_an_input_without_the_axis_is_an_input_error_naming_it(shape, feature_dim, message):
    model = nn.Sequential(nn.Flatten(), nn.LazyLinear(K)).to(DT)
    with pytest.raises(InputError, match=message):
        explain(model, torch.randn(*shape, dtype=DT), 0, feature_dim=feature_dim)


@pytest.mark.parametrize("feature_dim", [1.0, "channels", True])
def test_a_feature_dim_of_another_type_is_a_type_error(feature_dim):
    with pytest.raises(TypeError, match=f"feature_dim must be an int or None, got {type(feature_dim).__name__}"):
        Explainer(nn.Linear(3, K), feature_dim=feature_dim)


@pytest.mark.parametrize("name", ["audio", "tokens", "tabular-per-feature"])
def test_attribution_losses_take_the_layout(name):
    model, x, feature_dim, _ = _case(name)
    frozen = _case(name)[0]
    with torch.no_grad():
        for parameter in frozen.parameters():
            parameter.add_(0.01 * torch.randn_like(parameter))
    loss = attribution_consistency(model, frozen, x, 3, feature_dim=feature_dim)
    loss.loss.backward()
    assert loss.explanation.contribution.shape == loss.reference.contribution.shape
    assert all(parameter.grad is not None for parameter in model.parameters() if parameter.requires_grad)
    maps = attribution_map(loss.reference, x, "weighted_input", feature_dim)
    assert maps.shape == loss.reference.contribution.shape
    stored = attribution_consistency(model, maps.detach(), x, 3, component="weighted_input", feature_dim=feature_dim)
    torch.testing.assert_close(stored.loss, attribution_consistency(model, frozen, x, 3, component="weighted_input",
                                                                    feature_dim=feature_dim).loss)
    with pytest.raises(InputError, match=r"stored reference maps have shape"):
        attribution_consistency(model, maps.detach()[..., :1], x, 3, feature_dim=feature_dim)
