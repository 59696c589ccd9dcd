"""``create_graph=True`` on the compiled backend: the explanation and its parameter gradient
compiled as one graph per signature.

* The first call of a signature returns the compiled graph's check run (whose backward
  the check ran once already), the second runs the compiled graph only (the fused backend
  is not called); both with the reference's values and parameter gradients (float64, rtol 1e-9) for
  both kinds of parameter gradient, on every small family: smooth CNN, ViT, and the ReLU
  CNN, whose fused eager path takes its logits' gradient from parameter paths that a
  trace cannot record (the compiled one runs the model's forward as the held pass instead).
* Most tests compile with the traced graph itself (``COMPILER`` swapped); one compiles
  with Inductor.
* The loss functions on ``backend="compiled"`` give the parameters the gradient of
  ``backend="auto"``.
* A compiled graph whose parameter gradient differs from the fused backend's is not
  used: one warning, and the fused backend's explanation.
* Freezing a parameter (``requires_grad_(False)``) is a new signature: it gets no
  gradient, the others the reference's.

Finite differences and the independent ``torch.func`` implementation run on this path
too (``test_finite_differences.py``, ``test_torch_func.py``).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled, fused
from omenn_kernels.losses import attribution_consistency
from differentiable_models import MODELS

RTOL = 1e-9
TARGET = torch.tensor([1, 3])


@pytest.fixture
def traced(monkeypatch):
    """Compile with the traced graph itself."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=RTOL * float(expected.abs().max()))


def _loss(explanation) -> torch.Tensor:
    """A loss of C, C_w, C_b and, where they carry a gradient, the logits."""
    loss = (explanation.contribution ** 2).sum() + explanation.bias.sum() + explanation.weight.sin().sum()
    if explanation.logits.requires_grad:
        loss = loss + explanation.logits.square().sum()
    return loss


def _assert_matches_reference(model, x, explanation, parameter_gradient: str, target=TARGET) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    reference = Explainer(model)(x, target, create_graph=True, parameter_gradient=parameter_gradient)
    for field in ("contribution", "weight", "bias", "logit", "logits"):
        _assert_close(getattr(explanation, field).detach(), getattr(reference, field).detach())
    assert explanation.logits.requires_grad == reference.logits.requires_grad
    for actual, expected in zip(torch.autograd.grad(_loss(explanation), params),
                                torch.autograd.grad(_loss(reference), params)):
        _assert_close(actual, expected)


def _compiled_call(explainer: Explainer, x, parameter_gradient: str, monkeypatch, target=TARGET):
    """The second call of a signature, with the fused backend made unreachable."""
    def unreachable(*args, **kwargs):
        raise AssertionError("the fused backend ran on a compiled signature")
    with monkeypatch.context() as patch:
        patch.setattr(fused, "explain_batch", unreachable)
        return explainer(x, target, create_graph=True, parameter_gradient=parameter_gradient)


@pytest.mark.parametrize("parameter_gradient", ["total", "fixed_multipliers"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_compiled_training_matches_reference(traced, monkeypatch, family, parameter_gradient):
    model, x = MODELS[family]()
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        first = explainer(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
        second = _compiled_call(explainer, x, parameter_gradient, monkeypatch)
    _assert_matches_reference(model, x, first, parameter_gradient)  # the check run's: its backward runs again
    _assert_matches_reference(model, x, second, parameter_gradient)


@pytest.mark.parametrize("family, parameter_gradient", [("cnn", "total"), ("vit", "fixed_multipliers")])
def test_inductor_compiled_training_matches_reference(monkeypatch, family, parameter_gradient):
    model, x = MODELS[family]()
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        explainer(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
        explanation = _compiled_call(explainer, x, parameter_gradient, monkeypatch)
    _assert_matches_reference(model, x, explanation, parameter_gradient)


def test_a_batch_of_another_size_runs_the_graph_in_chunks(traced, monkeypatch):
    """Traced at 2 samples, a batch of 3 runs in two chunks, the second filled up with a copy of
    its sample: values and parameter gradients of the reference at 3."""
    model, x = MODELS["cnn"]()
    explainer = Explainer(model, backend="compiled")
    explainer(x, TARGET, create_graph=True)
    x, target = torch.cat([x, x[:1].flip(-1)]), torch.tensor([1, 3, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        first = explainer(x, target, create_graph=True)
        second = _compiled_call(explainer, x, "total", monkeypatch, target)
    (explanation,) = compiled.explanations(explainer.program(x)[0]).values()
    assert explanation.batch == 2 and explanation.batches == {3: True}
    _assert_matches_reference(model, x, first, "total", target)
    _assert_matches_reference(model, x, second, "total", target)


def test_the_differentiable_graph_keeps_the_convolutions_input_gradient_an_op(traced, monkeypatch):
    """Differentiated again, ``omenn::conv2d_input_grad`` takes its registered backward (a weight
    gradient for the weight), not aten's double backward of a convolution (a convolution over
    the batch); a first-order graph traces it as aten. Max pooling's arg-max is an op in both
    (in a first-order graph its C++ op; the default ``total`` gradient also runs the model's own
    pooling, in the held pass)."""
    model, x = MODELS["relu_cnn"]()
    explainer = Explainer(model, backend="compiled")
    for create_graph in (True, False):
        for _ in range(2):
            explainer(x, TARGET, create_graph=create_graph)
    program, _ = explainer.program(x)
    for key, explanation in compiled.explanations(program).items():
        called = {str(node.target) for node in explanation.graph.graph.nodes if node.op == "call_function"}
        differentiable = key[-1] is not None
        assert ("omenn.conv2d_input_grad.default" in called) == differentiable, key
        assert ("omenn.max_pool_indices.default" if differentiable else "omenn.max_pool_indices_cpu.default") in called
        # The model's own pooling runs only in the held pass (the total parameter gradient).
        assert ("aten.max_pool2d_with_indices.default" in called) == differentiable


def test_an_optimizer_step_is_followed(traced, monkeypatch):
    """Parameters updated in place between calls: the compiled graph reads the new values."""
    model, x = MODELS["cnn"]()
    explainer = Explainer(model, backend="compiled")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    for _ in range(3):
        optimizer.zero_grad()
        _loss(explainer(x, TARGET, create_graph=True)).backward()
        optimizer.step()
    _assert_matches_reference(model, x, _compiled_call(explainer, x, "total", monkeypatch), "total")


def test_consistency_loss_on_the_compiled_backend(traced):
    model, x = MODELS["vit"]()
    reference_model = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    gradients = {}
    for backend in ("auto", "compiled", "compiled"):  # the second compiled call runs the compiled graph
        model.zero_grad()
        attribution_consistency(model, reference_model, x, TARGET, backend=backend,
                                reference_backend=backend).loss.backward()
        gradients[backend] = [p.grad.clone() for p in model.parameters()]
    for actual, expected in zip(gradients["compiled"], gradients["auto"]):
        _assert_close(actual, expected)


def test_a_graph_with_another_parameter_gradient_is_not_used(monkeypatch):
    """Values right, parameter gradient wrong (the weight detached): not used."""
    model, x = MODELS["cnn"]()

    def detached_weight(graph, example):
        return lambda *inputs: (lambda out: (out[0].detach(), *out[1:]))(graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", detached_weight)
    explainer = Explainer(model, backend="compiled")
    with pytest.warns(RuntimeWarning, match="gives the parameters a gradient that differs from the fused"):
        explainer(x, TARGET, create_graph=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        _assert_matches_reference(model, x, explainer(x, TARGET, create_graph=True), "total")


def test_frozen_parameters_are_a_new_signature(traced, monkeypatch):
    model, x = MODELS["cnn"]()
    explainer = Explainer(model, backend="compiled")
    explainer(x, TARGET, create_graph=True)
    model.head.requires_grad_(False)
    explainer(x, TARGET, create_graph=True)
    explanation = _compiled_call(explainer, x, "total", monkeypatch)
    program, _ = explainer.program(x)
    assert len(compiled.explanations(program)) == 2
    _assert_matches_reference(model, x, explanation, "total")
