"""``create_graph=True``: what changes (a graph to the parameters) and what must not.

* First-order results (C, C_w, C_b, ŷ, logits) are those of ``create_graph=False``,
  for both kinds of parameter gradient: float64, rtol 1e-12 (the two runs order no
  operation differently; the margin is for the logits' held/linear recombination).
* The model is unchanged by an explanation and its backward: parameters, buffers
  (BatchNorm statistics included), ``training`` and ``requires_grad`` flags are
  bitwise the same; only ``.grad`` is filled, for the optimizer.
* With ``"total"`` the returned logits are the model's own output with its own gradient.
* The fused backend differentiates its ops twice, with the reference's gradients (rtol
  1e-9); attention through its op with fixed multipliers, the reference rule where its
  weights follow the parameters. Its backward runs once per explanation; with a total
  gradient its convolutions take the numbers of the model's own forward.
* Many read-outs per forward: the gradient of their sum is the sum of single-target
  gradients (rtol 1e-9).
* The held pass is the model's forward for a total gradient, once per explanation, and
  for no other; with piecewise-constant multipliers only (ReLU, max pooling, eval
  BatchNorm) the total gradient equals the fixed-multiplier one (rtol 1e-12).
* Fixed multipliers hold gates computed with parameters fixed too: query and key
  projections of their own and a sigmoid gate's projection get no gradient.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omenn_kernels import Explainer, explain
from omenn_kernels.backends import executor
from omenn_kernels.capture import eval_semantics
from omenn_kernels.ops import conv_bias
from omenn_kernels.testing import randomize_
from differentiable_models import DT, MODELS

RTOL_SAME = 1e-12
RTOL_GRADIENT = 1e-9
TARGET = torch.tensor([1, 3])


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float) -> None:
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * float(expected.abs().max()))


def _gradients(explanation, params: list[torch.Tensor], logits: bool = True) -> tuple[torch.Tensor, ...]:
    """The parameters' gradient of a loss on C, C_b, C_w and (where they carry one and
    ``logits``) the logits."""
    loss = (explanation.contribution ** 2).sum() + explanation.bias.sum() + (explanation.weight.sin()).sum()
    if logits and explanation.logits.requires_grad:
        loss = loss + explanation.logits.square().sum()
    return torch.autograd.grad(loss, params)


@pytest.mark.parametrize("parameter_gradient", ["total", "fixed_multipliers"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_first_order_results_unchanged(family, parameter_gradient):
    model, x = MODELS[family]()
    explainer = Explainer(model)
    plain = explainer(x, TARGET)
    kept = explainer(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
    assert kept.contribution.requires_grad and kept.weight.requires_grad and kept.bias.requires_grad
    assert not (plain.contribution.requires_grad or plain.weight.requires_grad or plain.logit.requires_grad)
    for field in ("contribution", "weight", "bias", "logit", "logits"):
        _assert_close(getattr(kept, field).detach(), getattr(plain, field), RTOL_SAME)
    assert torch.equal(kept.target, plain.target)
    torch.testing.assert_close(kept.contribution.sum((1, 2)).detach(), kept.logit.detach(), rtol=1e-10, atol=0)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_model_unchanged_but_for_grad(family):
    model, x = MODELS[family]()
    model.train()
    frozen = next(iter(model.parameters()))
    frozen.requires_grad_(False)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [(m, m.training) for m in model.modules()]
    requires = [(p, p.requires_grad) for p in model.parameters()]

    explanation = explain(model, x, TARGET, create_graph=True)
    (explanation.contribution.square().sum() + explanation.logits.sum()).backward()

    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), f"{name} changed"
    assert all(m.training == flag for m, flag in flags)
    assert all(p.requires_grad == flag for p, flag in requires)
    assert frozen.grad is None
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", sorted(MODELS))
def test_total_logits_carry_the_models_own_gradient(family):
    model, x = MODELS[family]()
    params = list(model.parameters())
    logits = explain(model, x, TARGET, create_graph=True).logits
    with eval_semantics(model):
        own = model(x)
    weights = torch.randn(own.shape, dtype=DT, generator=torch.Generator().manual_seed(3))
    for actual, expected in zip(torch.autograd.grad((logits * weights).sum(), params),
                                torch.autograd.grad((own * weights).sum(), params)):
        _assert_close(actual, expected, RTOL_GRADIENT)
    fixed = explain(model, x, TARGET, create_graph=True, parameter_gradient="fixed_multipliers")
    assert not fixed.logits.requires_grad and not fixed.logit.requires_grad


@pytest.mark.parametrize("parameter_gradient", ["total", "fixed_multipliers"])
@pytest.mark.parametrize("family", sorted(MODELS))
def test_fused_backend_matches_reference(family, parameter_gradient):
    """The fused ops differentiate twice, and nothing warns. The ViT's attention weights fit
    in one chunk, so they run the reference rule, as first-order on the CPU."""
    _assert_fused_matches_reference(family, parameter_gradient)


def _assert_fused_matches_reference(family: str, parameter_gradient: str) -> None:
    """The fused backend's differentiable explanation (nothing warns) against the reference
    backend's: values and the parameters' gradients of a loss of them, rtol 1e-9."""
    model, x = MODELS[family]()
    params = list(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        fused = Explainer(model, backend="auto")(x, TARGET, create_graph=True,
                                                 parameter_gradient=parameter_gradient)
    reference = Explainer(model)(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
    for field in ("contribution", "weight", "bias", "logits"):
        _assert_close(getattr(fused, field).detach(), getattr(reference, field).detach(), RTOL_GRADIENT)
    for actual, expected in zip(_gradients(fused, params), _gradients(reference, params)):
        _assert_close(actual, expected, RTOL_GRADIENT)


@pytest.mark.parametrize("parameter_gradient", ["total", "fixed_multipliers"])
def test_attention_op_differentiates_again_with_its_weights_held(parameter_gradient, monkeypatch):
    """Attention weights larger than one chunk (forced here) run ``omenn::attention`` with fixed
    multipliers, whose ``dV`` differentiates again; with a total gradient the weights follow
    the parameters and the reference rule runs. Both give the reference backend's gradients."""
    from omenn_kernels.linearize.rules import attention as attention_rules
    from omenn_kernels.ops import attention as attention_op

    calls = []
    real = attention_op.attention
    monkeypatch.setattr(attention_rules, "_CHUNK_BYTES", 0)
    monkeypatch.setattr(attention_op, "attention", lambda *args: calls.append(1) or real(*args))
    _assert_fused_matches_reference("vit", parameter_gradient)
    assert bool(calls) == (parameter_gradient == "fixed_multipliers")


def test_fused_backward_runs_once_per_explanation_and_convolutions_take_the_model_numbers(monkeypatch):
    """ReLU CNN, total gradient:

    * the explanation's backward runs each convolution's fused input gradient once, and the
      attribution loss's backward does not run it again (nothing sends gradients into the
      linearized forward: max pooling gathers its value instead of keeping its input);
    * the linearized convolutions take the numbers of the model's forward (the held pass):
      no convolution runs twice.
    """
    model, x = MODELS["relu_cnn"]()
    input_grads, convolutions_run = [], []
    real_input_grad, real_conv = conv_bias.conv2d_input_grad, conv_bias.conv2d_ones
    monkeypatch.setattr(conv_bias, "conv2d_input_grad", lambda *a: input_grads.append(1) or real_input_grad(*a))
    monkeypatch.setattr(conv_bias, "conv2d_ones", lambda *a: convolutions_run.append(1) or real_conv(*a))
    explanation = Explainer(model, backend="auto")(x, TARGET, create_graph=True)
    convolutions = sum(isinstance(m, nn.Conv2d) for m in model.modules())
    assert len(input_grads) == convolutions and convolutions_run == []
    explanation.contribution.square().sum().backward(retain_graph=True)
    assert len(input_grads) == convolutions
    Explainer(model, backend="auto")(x, TARGET)
    assert len(convolutions_run) == convolutions  # a first-order explanation has no model forward to take


def test_many_readouts_gradient_is_the_sum_of_single_ones():
    model, x = MODELS["vit"]()
    params = list(model.parameters())
    explainer = Explainer(model)
    readouts = torch.zeros(2, 2, 5, dtype=DT)
    readouts[:, 0, 1] = 1.0
    readouts[:, 1, 0], readouts[:, 1, 4] = 1.0, -1.0
    both = explainer.explain_targets(x, readouts, create_graph=True)
    combined = torch.autograd.grad(both.contribution.square().sum(), params)
    singles = [torch.autograd.grad(explainer(x, readouts[:, t], create_graph=True).contribution.square().sum(),
                                   params) for t in range(2)]
    for actual, first, second in zip(combined, *singles):
        _assert_close(actual, first + second, RTOL_GRADIENT)


def test_bad_options_are_refused():
    model, x = MODELS["cnn"]()
    with pytest.raises(ValueError, match="parameter_gradient"):
        explain(model, x, TARGET, create_graph=True, parameter_gradient="partial")
    with pytest.raises(TypeError, match="create_graph must be a bool"):
        explain(model, x, TARGET, create_graph="yes")


def test_frozen_model_explains_with_create_graph():
    """No parameter requires a gradient: the explanation still keeps its graph and sums to the logit."""
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).to(DT)
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(2, 3, 2, 2, dtype=DT)
    explanation = explain(model, x, 0, create_graph=True)
    torch.testing.assert_close(explanation.contribution.sum((1, 2)), explanation.logit, rtol=1e-10, atol=0)


@pytest.mark.parametrize("family", ["relu_cnn", "cnn", "vit"])
def test_held_pass_is_the_model_forward_for_a_total_gradient(monkeypatch, family):
    """The held pass is the model's forward once per explanation with a total gradient, and not
    with fixed multipliers; with piecewise-constant multipliers only (the ReLU CNN) both give
    the same parameter gradient of the explanation."""
    model, x = MODELS[family]()
    explainer = Explainer(model)
    held_passes = []
    real_pass = executor.held_pass
    monkeypatch.setattr(executor, "held_pass", lambda *args: held_passes.append(1) or real_pass(*args))
    params = list(model.parameters())
    total = _gradients(explainer(x, TARGET, create_graph=True), params, logits=False)
    assert len(held_passes) == 1
    fixed = _gradients(explainer(x, TARGET, create_graph=True, parameter_gradient="fixed_multipliers"), params)
    assert len(held_passes) == 1
    if family == "relu_cnn":
        for actual, expected in zip(total, fixed):
            _assert_close(actual, expected, RTOL_SAME)


def test_fused_value_gradient_without_biases():
    """Bias-free convolution and linear head, ReLU and max pooling: the fused backend's logits have
    the model's own parameter gradient (weights only), and its explanation the reference's."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64, 5, bias=False)).to(DT)
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 1.5)
        model[1].weight.uniform_(0.5, 1.5)
        model[1].bias.uniform_(-0.5, 0.5)
    model.eval()
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    params = list(model.parameters())
    fused = Explainer(model, backend="auto")(x, TARGET, create_graph=True)
    reference = Explainer(model)(x, TARGET, create_graph=True)
    weights = torch.randn(fused.logits.shape, dtype=DT, generator=torch.Generator().manual_seed(6))
    for actual, expected in zip(torch.autograd.grad((fused.logits * weights).sum(), params, retain_graph=True),
                                torch.autograd.grad((model(x) * weights).sum(), params)):
        _assert_close(actual, expected, RTOL_GRADIENT)
    for actual, expected in zip(_gradients(fused, params, logits=False), _gradients(reference, params, logits=False)):
        _assert_close(actual, expected, RTOL_GRADIENT)


class _GatesFromParameters(nn.Module):
    """Pixel tokens; query, key and value projections of their own into SDPA; the result
    scaled by a sigmoid of another projection (a squeeze-excitation style gate); a head.
    The query and key projections and the gate's projection feed only gates."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.query, self.key, self.value, self.gate = (nn.Linear(3 if i == 0 else 8, 8)
                                                                   for i in range(5))
        self.head = nn.Linear(32, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.flatten(2).transpose(1, 2))
        heads = [projection(tokens).unsqueeze(1) for projection in (self.query, self.key, self.value)]
        attended = F.scaled_dot_product_attention(*heads).squeeze(1)
        return self.head((attended * torch.sigmoid(self.gate(tokens))).flatten(1))


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_fixed_multipliers_hold_gates_computed_with_parameters(backend):
    """With fixed multipliers the parameters that only feed gates (attention weights from
    query/key projections of their own, a sigmoid gate's projection) get no gradient from
    the explanation; with the total derivative they do (> 1e-6)."""
    torch.manual_seed(7)
    model = randomize_(_GatesFromParameters(), seed=7, scale=0.5).to(DT)
    x = torch.randn(2, 3, 2, 2, dtype=DT)
    feeding_gates = [model.query.weight, model.query.bias, model.key.weight, model.gate.weight, model.gate.bias]
    for parameter_gradient in ("fixed_multipliers", "total"):
        explanation = explain(model, x, TARGET, backend=backend, create_graph=True,
                              parameter_gradient=parameter_gradient)
        gradients = torch.autograd.grad(explanation.contribution.square().sum(), feeding_gates,
                                        allow_unused=True, materialize_grads=True)
        largest = [float(g.abs().max()) for g in gradients]
        if parameter_gradient == "fixed_multipliers":
            assert largest == [0.0] * len(largest)
        else:
            assert min(largest) > 1e-6
