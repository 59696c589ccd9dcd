"""Completeness on every supported model family (timm, torchvision, plain nn.Sequential).

Biases, norm statistics, layer scales and tokens are randomized (``randomize_``) so
that a bias routed to the wrong place shows. Tolerances: relative error of Σ C
against the model's own logit ≤ 1e-10 in float64 and ≤ 1e-5 in float32.
"""

from __future__ import annotations

import pytest
import torch

from omenn_kernels import Explainer, explain
from omenn_kernels.testing import FAMILIES, FULL_SIZE, randomize_, relative_completeness_error

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _explain_family(family, dtype, batch, seed=0):
    torch.manual_seed(seed)
    model = randomize_(family.build(), seed=seed).to(dtype).eval()
    x = torch.randn(batch, 3, family.size, family.size, dtype=dtype)
    return model, x, Explainer(model)(x)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_small_family_is_complete(name, dtype):
    model, x, explanation = _explain_family(FAMILIES[name], dtype, batch=2)
    assert explanation.contribution.shape == (2, x.shape[2], x.shape[3])
    assert explanation.weight.shape == x.shape
    assert torch.isfinite(explanation.contribution).all()
    assert relative_completeness_error(model, x, explanation) <= TOLERANCE[dtype]
    # The explanation's own logit is the model's output, up to rounding.
    with torch.no_grad():
        expected = model(x).gather(1, explanation.target.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(explanation.logit, expected, rtol=TOLERANCE[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(FULL_SIZE))
def test_full_size_model_at_224_is_complete(name, dtype):
    model, x, explanation = _explain_family(FULL_SIZE[name], dtype, batch=1)
    assert relative_completeness_error(model, x, explanation) <= TOLERANCE[dtype]


def test_several_targets_of_one_family_are_each_complete():
    family = FAMILIES["vit"]
    torch.manual_seed(1)
    model = randomize_(family.build(), seed=1).double().eval()
    x = torch.randn(3, 3, family.size, family.size, dtype=torch.float64)
    for target in (0, 7, torch.tensor([1, 2, 3])):
        e = explain(model, x, target)
        assert relative_completeness_error(model, x, e) <= 1e-10


def test_swin_input_that_needs_window_padding_spreads_the_padded_biases():
    """Swin pads token grids to a multiple of the window; the biases its linear layers add
    to padded tokens are spread over the sample's real tokens (R11'), so the map still sums
    to the logit, on every backend alike."""
    import timm

    model = randomize_(timm.create_model("swin_tiny_patch4_window7_224", img_size=64,
                                         num_classes=10)).double().eval()
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    reference = explain(model, x, 0, backend="reference")
    assert relative_completeness_error(model, x, reference) <= 1e-10
    fused = explain(model, x, 0, backend="fused")
    torch.testing.assert_close(fused.contribution, reference.contribution, rtol=1e-9,
                               atol=1e-12 * float(reference.contribution.abs().max()))


def test_swiglu_mlp_holds_its_silu_as_a_multiplier():
    """EVA-02's SwiGLU, ``silu(x W₁) ⊙ (x W₂)``, and rotary embeddings: the silu is held (R5')."""
    import timm

    model = randomize_(timm.create_model("eva02_tiny_patch14_224", img_size=56, num_classes=10)).double().eval()
    x = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    with torch.no_grad():
        logit = model(x)[:, 0]
    reference, fused = explain(model, x, 0, backend="reference"), explain(model, x, 0, backend="fused")
    assert float(((reference.contribution.sum((1, 2)) - logit).abs() / logit.abs()).max()) <= 1e-10
    torch.testing.assert_close(fused.contribution, reference.contribution, rtol=1e-9,
                               atol=1e-12 * float(reference.contribution.abs().max()))
