"""Attribution losses (``omenn_kernels.losses``).

float64 small models (tests/differentiable/differentiable_models.py); tolerances:
gradients and losses recomputed by hand rtol 1e-9 (separate passes, rounding ~1e-15).

* The loss equals its definition on explanations computed directly, and its
  parameter gradient equals the gradient of that definition.
* The reference model gets no gradient; the model's logits can feed a task loss
  with the model's own gradient (the shared forward).
* Stored reference maps (a replay buffer) give the loss and gradient of the live
  reference model.
* Matching a copy of itself gives zero loss; after perturbing the copy, a few
  gradient steps on the loss bring the model's explanations back towards it.
* Bad arguments are refused with errors that name them.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omenn_kernels import Explainer, explain
from omenn_kernels.capture import eval_semantics
from omenn_kernels.losses import (attribution_consistency, attribution_distillation, attribution_map,
                                  map_distance)

sys.path.insert(0, str(Path(__file__).parent / "differentiable"))
from differentiable_models import DT, MODELS  # noqa: E402

RTOL = 1e-9
TARGET = torch.tensor([1, 3])


def _close(actual: torch.Tensor, expected: torch.Tensor, scale: float | None = None) -> None:
    """Equal to rtol 1e-9, with the absolute tolerance at that fraction of ``scale``
    (default: the largest expected value; for a gradient, pass its largest over all
    parameters, so that one that is 0 up to rounding compares at the right scale)."""
    scale = float(expected.detach().abs().max()) if scale is None else scale
    torch.testing.assert_close(actual.detach(), expected.detach(), rtol=RTOL, atol=RTOL * scale)


def _close_gradients(actual: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    scale = max(float(e.abs().max()) for e in expected)
    for a, e in zip(actual, expected):
        _close(a, e, scale)


def _perturbed_copy(model: torch.nn.Module, seed: int = 5, scale: float = 0.3) -> torch.nn.Module:
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * torch.randn(p.shape, generator=generator, dtype=p.dtype) * p.abs().mean())
    return other


@pytest.mark.parametrize("distance", ["cosine", "mse"])
@pytest.mark.parametrize("component", ["contribution", "weighted_input", "bias"])
def test_loss_is_its_definition_with_its_gradient(distance, component):
    student, x = MODELS["vit"]()
    teacher = _perturbed_copy(student)
    params = list(student.parameters())
    result = attribution_distillation(student, teacher, x, TARGET, distance=distance, component=component)

    mine = explain(student, x, TARGET, create_graph=True)
    theirs = explain(teacher, x, TARGET)
    maps = {"contribution": (mine.contribution, theirs.contribution),
            "weighted_input": ((mine.weight * x).sum(1), (theirs.weight * x).sum(1)),
            "bias": (mine.bias, theirs.bias)}[component]
    if distance == "cosine":
        expected = (1 - F.cosine_similarity(maps[0].flatten(1), maps[1].flatten(1))).mean()
    else:
        expected = ((maps[0] - maps[1]) ** 2).mean()
    _close(result.loss, expected)
    # Some parameters (the head's bias) do not reach C_w: their gradient is zero.
    _close_gradients(torch.autograd.grad(result.loss, params, allow_unused=True, materialize_grads=True),
                     torch.autograd.grad(expected, params, allow_unused=True, materialize_grads=True))


def test_reference_gets_no_gradient_and_logits_are_shared():
    model, x = MODELS["cnn"]()
    reference = _perturbed_copy(model)
    result = attribution_consistency(model, reference, x, TARGET)
    task = F.cross_entropy(result.logits, TARGET)
    (task + result.loss).backward()
    assert all(p.grad is None for p in reference.parameters())
    assert not result.reference.contribution.requires_grad
    torch.testing.assert_close(result.logits.detach(), result.explanation.logits.detach())

    shared = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with eval_semantics(model):
        own_task = F.cross_entropy(model(x), TARGET)
    fresh = attribution_consistency(model, reference, x, TARGET)
    (own_task + fresh.loss).backward()
    _close_gradients(tuple(shared), tuple(p.grad for p in model.parameters()))


@pytest.mark.parametrize("component", ["contribution", "bias"])
def test_stored_reference_maps_give_the_same_loss_and_gradient(component):
    model, x = MODELS["cnn"]()
    reference = _perturbed_copy(model)
    params = list(model.parameters())
    live = attribution_consistency(model, reference, x, TARGET, component=component)
    stored = attribution_map(explain(reference, x, TARGET), x, component)
    replayed = attribution_consistency(model, stored, x, TARGET, component=component)
    assert replayed.reference is None
    _close(replayed.loss, live.loss)
    _close_gradients(torch.autograd.grad(replayed.loss, params), torch.autograd.grad(live.loss, params))


def test_default_target_is_the_references_prediction():
    model, x = MODELS["vit"]()
    reference = _perturbed_copy(model)
    result = attribution_distillation(model, reference, x)
    with eval_semantics(reference), torch.no_grad():
        predicted = reference(x).argmax(1)
    assert torch.equal(result.reference.target, predicted)
    assert torch.equal(result.explanation.target, predicted)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_training_on_the_loss_moves_explanations_towards_the_reference(family):
    model, x = MODELS[family]()
    reference = copy.deepcopy(model)
    # The copy's explanation is the model's up to rounding (its graph is not kept).
    assert attribution_consistency(model, reference, x, TARGET).loss.detach().item() < 1e-24

    student = _perturbed_copy(model)
    optimizer = torch.optim.SGD(student.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        optimizer.zero_grad()
        result = attribution_consistency(student, reference, x, TARGET, distance="cosine")
        result.loss.backward()
        optimizer.step()
        losses.append(result.loss.detach().item())
    after = attribution_consistency(student, reference, x, TARGET, distance="cosine").loss.detach().item()
    assert after < losses[0], f"{family}: loss {losses[0]:.6g} -> {after:.6g}"


def test_bad_arguments_are_refused():
    model, x = MODELS["cnn"]()
    other = _perturbed_copy(model)
    with pytest.raises(ValueError, match="distance 'l3'"):
        attribution_distillation(model, other, x, TARGET, distance="l3")
    with pytest.raises(ValueError, match="component 'logit'"):
        attribution_distillation(model, other, x, TARGET, component="logit")
    with pytest.raises(ValueError, match="same object"):
        attribution_consistency(model, model, x, TARGET)
    with pytest.raises(TypeError, match="reference must be a torch.nn.Module or a tensor"):
        attribution_consistency(model, "teacher.pt", x, TARGET)
    with pytest.raises(ValueError, match="stored reference maps need the target"):
        attribution_consistency(model, torch.zeros(2, 8, 8, dtype=DT), x)
    with pytest.raises(ValueError, match="differ in shape"):
        map_distance(torch.zeros(2, 3, 3), torch.zeros(2, 4, 4), "mse")
    explanation = Explainer(model)(x, TARGET)
    with pytest.raises(ValueError, match="component"):
        attribution_map(explanation, x, "weights")
