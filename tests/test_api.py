"""The public API: ``explain``, ``Explainer``, ``Explanation``, ``quantus_explain``.

Small float64 models (a CNN with conv/BatchNorm/ReLU/max-pool/strided conv/GELU/
adaptive pooling/linear, and an MLP with LayerNorm), biases and norm statistics
randomized away from zero, random inputs, fixed seeds.

Tolerances (float64):
* completeness: ``|Σ_hw C − ŷ| / |ŷ| ≤ 1e-10`` with ``ŷ`` taken from ``model.eval()(x)``
  (rounding is ~1e-16 relative; 1e-10 leaves room for cancellation in the sums);
* identities between explanations computed by separate passes (contrastive
  read-outs, linearity in the read-out weights, Captum form): ``rtol=1e-9`` and
  ``atol=1e-12 · max|expected|`` (the rounding scale of the compared tensor);
* "model unchanged", "zero biases ⇒ C_b = 0" and "same model ⇒ same explanation":
  exact (bitwise).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn as nn

import omenn_kernels
import omenn_kernels.api as api
from omenn_kernels import (CaptureError, Explainer, Explanation, InputError, InputTypeError,
                           OmennError, TargetError, UnsupportedOpError, explain, quantus_explain)

DT = torch.float64
RTOL_COMPLETE = 1e-10  # relative completeness error in float64
RTOL_IDENTITY = 1e-9   # identities between separately computed explanations
K = 5                  # classes of every test model


# --------------------------------------------------------------------------- models


def _nonzero(shape, generator, low=0.2, high=1.2):
    """Random values of either sign with magnitude in [low, high): never (near) zero."""
    magnitude = torch.rand(shape, generator=generator, dtype=DT) * (high - low) + low
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0).to(DT)
    return magnitude * sign


def _randomize(model: nn.Module, seed: int) -> nn.Module:
    """Biases, BatchNorm/LayerNorm affine parameters and running statistics: random, non-zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.copy_(_nonzero(module.running_mean.shape, g))
                module.running_var.copy_(torch.rand(module.running_var.shape, generator=g, dtype=DT) * 1.5 + 0.5)
            if isinstance(getattr(module, "weight", None), torch.Tensor) and \
                    isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm)):
                module.weight.copy_(_nonzero(module.weight.shape, g, 0.5, 1.5))
            if isinstance(getattr(module, "bias", None), torch.Tensor):
                module.bias.copy_(_nonzero(module.bias.shape, g))
    return model


def make_cnn(seed: int = 0, dropout: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
              nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.GELU(), nn.AdaptiveAvgPool2d(1),
              nn.Flatten(), nn.Linear(8, K)]
    if dropout:
        layers.insert(3, nn.Dropout(0.5))
    return _randomize(nn.Sequential(*layers).to(DT), seed).eval()


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 16), nn.LayerNorm(16), nn.GELU(),
                          nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, K))
    return _randomize(model.to(DT), seed).eval()


def make_input(kind: str, batch: int = 3, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    size = 8 if kind == "cnn" else 4
    return torch.randn(batch, 3, size, size, generator=g, dtype=DT)


MAKERS = {"cnn": make_cnn, "mlp": make_mlp}


def _logits(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The model's own output in eval semantics (the model is in eval mode here)."""
    assert not any(m.training for m in model.modules())
    with torch.no_grad():
        return model(x)


def _assert_close(actual, expected, rtol=RTOL_IDENTITY):
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-12 * max(scale, 1e-300))


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _relative_error(total: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((total - expected).abs() / expected.abs()).max())


# --------------------------------------------------------------------------- 1. completeness


def _target_forms(batch: int):
    g = torch.Generator().manual_seed(7)
    return {
        "int": (3, torch.full((batch,), 3)),
        "0d_tensor": (torch.tensor(2), torch.full((batch,), 2)),
        "B_tensor": (torch.tensor([0, 4, 2]), torch.tensor([0, 4, 2])),
        "list": ([1, 3, 0], torch.tensor([1, 3, 0])),
        "K_weights": (w := _nonzero((K,), g), w.expand(batch, K)),
        "BK_weights": (w2 := _nonzero((batch, K), g), w2),
        "None": (None, None),
    }


@pytest.mark.parametrize("form", list(_target_forms(3)))
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_completeness_for_every_target_form(kind, form):
    model, x = MAKERS[kind](), make_input(kind)
    target, expected_target = _target_forms(x.shape[0])[form]
    logits = _logits(model, x)
    if expected_target is None:
        expected_target = logits.argmax(1)

    e = explain(model, x, target)

    assert isinstance(e, Explanation)
    b, c, h, w = x.shape
    assert e.contribution.shape == (b, h, w) and e.bias.shape == (b, h, w)
    assert e.weight.shape == (b, c, h, w) and e.logit.shape == (b,)
    for t in (e.contribution, e.weight, e.bias, e.logit):
        assert t.dtype == DT and not t.requires_grad and torch.isfinite(t).all()

    if expected_target.is_floating_point():
        expected = (logits * expected_target).sum(1)
        torch.testing.assert_close(e.target.to(DT), expected_target, rtol=0, atol=0)
    else:
        expected = logits.gather(1, expected_target[:, None]).squeeze(1)
        assert e.target.shape == (b,) and not e.target.is_floating_point()
        assert torch.equal(e.target.long(), expected_target)
    assert float(expected.abs().min()) > 1e-3  # the seeds give read-outs well away from 0

    # Σ_hw C = ŷ (model's own logit) to 1e-10 relative, in float64.
    assert _relative_error(e.contribution.sum((1, 2)), expected) <= RTOL_COMPLETE
    assert _relative_error(e.logit, expected) <= RTOL_COMPLETE
    assert float(e.completeness_error().max()) <= RTOL_COMPLETE
    # C = Σ_c C_w ⊙ X + C_b.
    _assert_close(e.contribution, (e.weight * x).sum(1) + e.bias)


def test_none_target_is_the_predicted_class_per_image():
    model, x = make_mlp(seed=2), make_input("mlp", batch=6, seed=2)
    with torch.no_grad():  # a small (non-zero) head bias, so that the images disagree
        model[-1].bias.mul_(0.01)
        model[-1].weight.mul_(5)
    predicted = _logits(model, x).argmax(1)
    assert predicted.unique().numel() > 1  # the batch does not all predict one class
    e = Explainer(model)(x)
    assert torch.equal(e.target, predicted)


def test_same_call_twice_gives_bitwise_equal_explanations():
    model, x = make_cnn(), make_input("cnn")
    e1, e2 = explain(model, x, 1), explain(model, x, 1)
    for a, b in [(e1.contribution, e2.contribution), (e1.weight, e2.weight), (e1.bias, e2.bias)]:
        assert _bitwise_equal(a, b)


def _explain_inside(context, model, x, target) -> Explanation:
    """``explain`` inside ``context`` gives the C it gives outside; returns the one from outside."""
    reference = explain(model, x, target)
    with context:
        e = explain(model, x, target)
    _assert_close(e.contribution, reference.contribution)
    return reference


def test_explain_under_no_grad_and_with_an_input_that_requires_grad():
    model, x = make_cnn(), make_input("cnn")
    reference = _explain_inside(torch.no_grad(), model, x, 2)
    x_grad = x.clone().requires_grad_(True)
    e = explain(model, x_grad, 2)
    _assert_close(e.contribution, reference.contribution)
    assert x_grad.grad is None and not e.contribution.requires_grad


# --------------------------------------------------------------------------- 2. contrastive / linear


def _onehot(index: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(index), K).to(DT)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_contrastive_readout_is_difference_of_class_explanations(kind):
    model, x = MAKERS[kind](), make_input(kind)
    explainer = Explainer(model)
    a, b = 1, 3
    ea, eb = explainer(x, a), explainer(x, b)
    eab = explainer(x, _onehot(a) - _onehot(b))
    _assert_close(eab.contribution, ea.contribution - eb.contribution)
    _assert_close(eab.weight, ea.weight - eb.weight)
    _assert_close(eab.bias, ea.bias - eb.bias)
    _assert_close(eab.logit, ea.logit - eb.logit)
    logits = _logits(model, x)
    assert _relative_error(eab.contribution.sum((1, 2)), logits[:, a] - logits[:, b]) <= RTOL_COMPLETE

    # Per image, different pairs: (B, K) weights.
    pa, pb = torch.tensor([0, 2, 4]), torch.tensor([1, 1, 3])
    weights = torch.nn.functional.one_hot(pa, K).to(DT) - torch.nn.functional.one_hot(pb, K).to(DT)
    ep = explainer(x, weights)
    _assert_close(ep.contribution, explainer(x, pa).contribution - explainer(x, pb).contribution)


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_explanation_is_linear_in_readout_weights(kind):
    model, x = MAKERS[kind](), make_input(kind)
    explainer = Explainer(model)
    g = torch.Generator().manual_seed(3)
    w1, w2 = torch.randn(x.shape[0], K, generator=g, dtype=DT), torch.randn(x.shape[0], K, generator=g, dtype=DT)
    e1, e2, e12 = explainer(x, w1), explainer(x, w2), explainer(x, 2 * w1 + 3 * w2)
    for field in ("contribution", "weight", "bias", "logit"):
        _assert_close(getattr(e12, field), 2 * getattr(e1, field) + 3 * getattr(e2, field))
    # A class index and its one-hot weights are the same read-out.
    eo, ei = explainer(x, _onehot(4)), explainer(x, 4)
    for field in ("contribution", "weight", "bias", "logit"):
        _assert_close(getattr(eo, field), getattr(ei, field))


@pytest.mark.parametrize("backend", ["reference", "fused"])
@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_many_readouts_share_a_forward_and_equal_single_calls(kind, backend):
    """``explain_targets``: T read-outs per image from one forward equal T separate calls."""
    model, x = MAKERS[kind](), make_input(kind)
    explainer = Explainer(model, backend=backend)
    g = torch.Generator().manual_seed(5)
    readouts = torch.randn(x.shape[0], 4, K, generator=g, dtype=DT)
    readouts[:, 0] = _onehot(2)
    many = explainer.explain_targets(x, readouts)
    assert many.contribution.shape == (x.shape[0], 4, *x.shape[2:]) and many.weight.shape == (x.shape[0], 4, *x.shape[1:])
    _assert_close(many.logits, _logits(model, x))
    for t in range(4):
        single = explainer(x, readouts[:, t])
        for field in ("contribution", "weight", "bias", "logit"):
            _assert_close(getattr(many, field)[:, t], getattr(single, field))
    assert float(many.completeness_error().max()) <= RTOL_COMPLETE


def test_many_readouts_chosen_from_the_logits():
    """A callable chooses the read-outs from the shared forward's logits (here: top-2)."""
    model, x = MAKERS["cnn"](), make_input("cnn")
    explainer = Explainer(model)
    seen = []

    def top2(logits):
        seen.append(logits)
        return torch.nn.functional.one_hot(logits.topk(2, -1).indices, K).to(logits.dtype)

    many = explainer.explain_targets(x, top2)
    assert len(seen) == 1 and not seen[0].requires_grad
    top = _logits(model, x).topk(2, -1).indices
    _assert_close(many.contribution[:, 1], explainer(x, top[:, 1]).contribution)


@pytest.mark.parametrize("readouts, message", [
    (torch.zeros(3, 2, K, dtype=torch.long), "floating-point"),
    (torch.zeros(3, 2, K + 1, dtype=DT), r"shape \(3, T, 5\)"),
    (torch.zeros(2, 2, K, dtype=DT), r"shape \(3, T, 5\)"),
    (torch.zeros(3, 0, K, dtype=DT), "T ≥ 1"),
    (torch.full((3, 1, K), float("nan"), dtype=DT), "NaN"),
    ([[0.0] * K] * 3, "must be a"),
    (lambda logits: logits, r"shape \(3, T, 5\)"),
])
def test_many_readouts_reject_bad_weights(readouts, message):
    with pytest.raises(TargetError, match=message):
        Explainer(MAKERS["cnn"]()).explain_targets(make_input("cnn"), readouts)


# --------------------------------------------------------------------------- 3. zero biases


def _zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "bias", None), torch.Tensor):
                module.bias.zero_()  # conv/linear biases, BatchNorm/LayerNorm beta
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.running_mean.zero_()  # running_var stays random
    return model


@pytest.mark.parametrize("kind", ["cnn", "mlp"])
def test_zero_biases_give_exactly_zero_bias_map(kind):
    model, x = _zero_biases(MAKERS[kind]()), make_input(kind)
    if kind == "cnn":
        assert not torch.all(model[1].running_var == 1)
    for target in (0, 3, None):
        e = explain(model, x, target)
        assert torch.all(e.bias == 0), float(e.bias.abs().max())
        logits = _logits(model, x)
        expected = logits.gather(1, e.target[:, None]).squeeze(1)
        assert _relative_error((e.weight * x).sum((1, 2, 3)), expected) <= RTOL_COMPLETE


# --------------------------------------------------------------------------- 4. model unchanged


def _snapshot(model: nn.Module) -> dict:
    return {
        "params": [(n, p, p.detach().clone(), p.requires_grad, None if p.grad is None else p.grad.clone())
                   for n, p in model.named_parameters()],
        "buffers": [(n, b, b.clone()) for n, b in model.named_buffers()],
        "training": [(n, m.training) for n, m in model.named_modules()],
        "hooks": [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
                  for n, m in model.named_modules()],
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _assert_same_snapshot(model: nn.Module, before: dict) -> None:
    now = dict(model.named_parameters())
    assert list(now) == [n for n, *_ in before["params"]]
    for name, param, value, requires_grad, grad in before["params"]:
        assert now[name] is param, f"parameter {name} was replaced"
        assert _bitwise_equal(param, value), f"parameter {name} changed"
        assert param.requires_grad == requires_grad, f"requires_grad of {name} changed"
        if grad is None:
            assert param.grad is None, f"{name} got a gradient"
        else:
            assert _bitwise_equal(param.grad, grad), f"the gradient of {name} changed"
    buffers = dict(model.named_buffers())
    assert list(buffers) == [n for n, *_ in before["buffers"]]
    for name, buffer, value in before["buffers"]:
        assert buffers[name] is buffer and _bitwise_equal(buffer, value), f"buffer {name} changed"
    assert [(n, m.training) for n, m in model.named_modules()] == before["training"]
    assert [(n, dict(m._forward_hooks), dict(m._forward_pre_hooks), dict(m._backward_hooks))
            for n, m in model.named_modules()] == before["hooks"]
    state = model.state_dict()
    assert list(state) == list(before["state"])
    for key, value in before["state"].items():
        assert _bitwise_equal(state[key], value), f"state_dict['{key}'] changed"


def _flags(mode: str):
    def apply(model):
        if mode == "eval":
            model.eval()
            assert isinstance(model[3], nn.Dropout)
            model[3].train()   # the Dropout differs from its parent
        else:
            model.train()      # BatchNorm in training mode: batch statistics, running stats updated
            model[-1].eval()   # the head differs from its parent
        return model
    return apply


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_model_is_left_unchanged(mode):
    model = _flags(mode)(make_cnn(dropout=True))
    x = make_input("cnn")
    model[0].bias.requires_grad_(False)
    model[-1].weight.grad = torch.full_like(model[-1].weight, 0.5)

    calls = {"root_pre": 0, "root": 0, "conv_pre": 0, "conv": 0}

    def counter(key):
        def hook(*args):
            calls[key] += 1
        return hook

    model.register_forward_pre_hook(counter("root_pre"))
    model.register_forward_hook(counter("root"))
    assert isinstance(model[5], nn.Conv2d)
    model[5].register_forward_pre_hook(counter("conv_pre"))
    model[5].register_forward_hook(counter("conv"))

    torch.manual_seed(123)  # dropout may be active: same mask before and after
    out_before = model(x).detach().clone()
    before = _snapshot(model)

    explain(model, x, 2)
    Explainer(model)(x)  # predicted class, another code path
    _assert_same_snapshot(model, before)

    counts = dict(calls)
    torch.manual_seed(123)
    out_after = model(x)
    assert {k: calls[k] - counts[k] for k in calls} == {k: 1 for k in calls}
    assert _bitwise_equal(out_after, out_before)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_model_in_any_mode_is_explained_in_eval_semantics(mode):
    model = _flags(mode)(make_cnn(dropout=True))
    x = make_input("cnn")
    reference_model = copy.deepcopy(model).eval()
    e = explain(model, x, 1)
    ref = explain(reference_model, x, 1)
    for field in ("contribution", "weight", "bias", "logit"):
        torch.testing.assert_close(getattr(e, field), getattr(ref, field), rtol=1e-12, atol=1e-14)
    expected = _logits(reference_model, x)[:, 1]
    assert _relative_error(e.contribution.sum((1, 2)), expected) <= RTOL_COMPLETE
    # The training-mode output differs (batch statistics, dropout), so the check above is not vacuous.
    if mode == "train":
        with torch.no_grad():
            assert not torch.allclose(copy.deepcopy(model).train()(x)[:, 1], expected)


def test_explain_leaves_the_global_rng_state_alone():
    model, x = make_cnn(dropout=True).train(), make_input("cnn")
    state = torch.get_rng_state()
    explain(model, x, 0)
    assert torch.equal(torch.get_rng_state(), state)


# --------------------------------------------------------------------------- 5. Explainer caching


@pytest.fixture
def capture_counter(monkeypatch):
    calls = []
    original = api.capture

    def counting(model, example, output=None):
        calls.append(tuple(example.shape))
        return original(model, example, output)

    monkeypatch.setattr(api, "capture", counting)
    return calls


def test_explainer_captures_once_per_input_signature(capture_counter):
    model = make_cnn()
    explainer = Explainer(model)
    x1, x2 = make_input("cnn", seed=1), make_input("cnn", seed=2)
    e1 = explainer(x1, 0)
    e2 = explainer(x2, 4)
    explainer(x1, None)
    assert capture_counter == [tuple(x1.shape)] and len(explainer._programs) == 1
    for e, x in ((e1, x1), (e2, x2)):
        expected = _logits(model, x).gather(1, e.target[:, None]).squeeze(1)
        assert _relative_error(e.contribution.sum((1, 2)), expected) <= RTOL_COMPLETE

    x3 = make_input("cnn", batch=1, seed=3)
    e3 = explainer(x3, 2)
    assert capture_counter == [tuple(x1.shape), tuple(x3.shape)] and len(explainer._programs) == 2
    assert _relative_error(e3.contribution.sum((1, 2)), _logits(model, x3)[:, 2]) <= RTOL_COMPLETE
    explainer(x3, 1)
    explainer(x1, 1)
    assert len(capture_counter) == 2


def test_explainer_sees_parameters_and_buffers_updated_in_place(capture_counter):
    model, x = make_cnn(), make_input("cnn")
    explainer = Explainer(model)
    before = explainer(x, 3)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        model[0].weight.add_(0.3 * torch.randn(model[0].weight.shape, generator=g, dtype=DT))
        model[-1].bias.add_(1.0)
        model[1].running_mean.mul_(-2.0)
    after = explainer(x, 3)
    assert len(capture_counter) == 1
    assert not torch.allclose(after.contribution, before.contribution)
    assert _relative_error(after.contribution.sum((1, 2)), _logits(model, x)[:, 3]) <= RTOL_COMPLETE
    fresh = explain(model, x, 3)
    for field in ("contribution", "weight", "bias"):
        torch.testing.assert_close(getattr(after, field), getattr(fresh, field), rtol=1e-12, atol=1e-14)


def test_explainer_sees_load_state_dict_and_replaced_parameters(capture_counter):
    model, other, x = make_cnn(seed=0), make_cnn(seed=5), make_input("cnn")
    explainer = Explainer(model)
    explainer(x, 0)
    model.load_state_dict(other.state_dict())
    e = explainer(x, 0)
    _assert_close(e.contribution, explain(other, x, 0).contribution)
    assert len(capture_counter) == 2  # the explainer's one capture, and explain(other, ...)
    model[-1].weight = nn.Parameter(torch.randn(K, 8, dtype=DT))
    e = explainer(x, 0)
    assert _relative_error(e.contribution.sum((1, 2)), _logits(model, x)[:, 0]) <= RTOL_COMPLETE
    assert len(capture_counter) == 3  # a re-bound parameter is a structural change: captured again


# --------------------------------------------------------------------------- 6. Captum / Quantus


@pytest.fixture(scope="module")
def cnn_case():
    model, x = make_cnn(seed=2), make_input("cnn", seed=2)
    return model, x, Explainer(model)


def test_attribute_is_captum_convention(cnn_case):
    model, x, explainer = cnn_case
    target = torch.tensor([4, 0, 2])
    attributions = explainer.attribute(x, target)
    e = explainer(x, target)
    assert attributions.shape == x.shape and attributions.dtype == DT
    _assert_close(attributions, e.weight * x + e.bias[:, None] / x.shape[1])
    expected = _logits(model, x).gather(1, target[:, None]).squeeze(1)
    assert _relative_error(attributions.sum((1, 2, 3)), expected) <= RTOL_COMPLETE
    _assert_close(attributions.sum(1), e.contribution)


@pytest.mark.parametrize("numpy_dtype", [np.float64, np.float32])
def test_quantus_explain_as_quantus_calls_it(cnn_case, numpy_dtype):
    model, x, explainer = cnn_case
    x_np = x.numpy().astype(numpy_dtype)
    y_np = np.array([1, 3, 3])
    result = quantus_explain(model=model, inputs=x_np, targets=y_np, device="cpu")
    assert isinstance(result, np.ndarray) and result.shape == x.shape
    expected = explainer.attribute(torch.as_tensor(x_np).to(DT), torch.as_tensor(y_np))
    _assert_close(torch.as_tensor(result).to(DT), expected)

    reduced = quantus_explain(model=model, inputs=x_np, targets=y_np, device="cpu", reduce_channels=True)
    assert isinstance(reduced, np.ndarray) and reduced.shape == (x.shape[0], 1, x.shape[2], x.shape[3])
    _assert_close(torch.as_tensor(reduced).to(DT), expected.sum(1, keepdim=True))


# --------------------------------------------------------------------------- 7. bad inputs and targets


def test_error_hierarchy():
    assert issubclass(InputError, ValueError) and issubclass(TargetError, ValueError)
    assert issubclass(InputTypeError, TypeError)
    assert issubclass(UnsupportedOpError, NotImplementedError)
    assert issubclass(CaptureError, RuntimeError)
    for error in (InputError, InputTypeError, TargetError, UnsupportedOpError, CaptureError):
        assert issubclass(error, OmennError)
    assert set(omenn_kernels.__all__) >= {"explain", "Explainer", "Explanation", "quantus_explain",
                                           "OmennError", "InputError", "InputTypeError", "TargetError",
                                           "UnsupportedOpError", "CaptureError"}


def _with(x, index, value):
    x = x.clone()
    x[index] = value
    return x


X = make_input("cnn", batch=2)

BAD_INPUTS = {
    "list": (X.tolist(), InputTypeError, r"must be a torch\.Tensor, got list"),
    "numpy": (X.numpy(), InputTypeError, r"must be a torch\.Tensor, got ndarray"),
    "1d": (X[0, 0, 0], InputError, r"a batch \(B, \.\.\.\) with at least one dimension after the batch"),
    "3d": (X[0], InputError, r"the model's own forward fails on an input of shape \(3, 8, 8\)"),
    "5d": (X[None], InputError, r"the model's own forward fails on an input of shape \(1, 2, 3, 8, 8\)"),
    # explain() takes integer inputs as token ids (InputError: the CNN has no embedding layer)
    "int64": (X.long(), (InputError, InputTypeError), r"floating-point"),
    "bool": (X > 0, InputTypeError, r"floating-point.*torch\.bool"),
    "nan": (_with(X, (1, 2, 3, 4), float("nan")), InputError, r"1 NaN or Inf"),
    "+inf": (_with(X, (0, 0, 0, 0), float("inf")), InputError, r"1 NaN or Inf"),
    "-inf": (_with(X, (0, 1, 5, 0), float("-inf")), InputError, r"NaN or Inf"),
    "empty_batch": (X[:0], InputError, r"batch is empty"),
    "other_device": (X.to("meta"), InputError, r"device 'meta'.*'cpu'"),
    "float32_for_float64_model": (X.float(), InputTypeError, r"torch\.float32.*torch\.float64"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(case, cnn_case):
    x, error, message = BAD_INPUTS[case]
    model, _, explainer = cnn_case
    with pytest.raises(error, match=message):
        explain(model, x, 0)
    with pytest.raises(error, match=message):
        explainer(x, 0)


BAD_TARGETS = {
    "index_K": (K, r"out of range.*5 classes"),
    "index_minus_1": (-1, r"out of range.*-1"),
    "indices_out_of_range": (torch.tensor([0, 7]), r"out of range"),
    "indices_wrong_length": (torch.tensor([0, 1, 2]), r"3 target indices for a batch of 2"),
    "list_wrong_length": ([0], r"1 target indices for a batch of 2"),
    "indices_2d": (torch.zeros(2, 1, dtype=torch.long), r"integer targets.*\(B,\)"),
    "weights_K_minus_1": (torch.ones(K - 1, dtype=DT), r"read-out weights must have shape \(5,\) or \(2, 5\)"),
    "weights_wrong_batch": (torch.ones(3, K, dtype=DT), r"read-out weights must have shape"),
    "weights_K_plus_1": (torch.ones(2, K + 1, dtype=DT), r"read-out weights must have shape"),
    "weights_0d": (torch.tensor(1.0, dtype=DT), r"read-out weights must have shape"),
    "bool": (True, r"not a bool"),
    "bool_tensor": (torch.tensor([True, False]), r"not a bool"),
    "nan_weights": (torch.tensor([1.0, float("nan"), 0, 0, 0], dtype=DT), r"NaN or Inf"),
    "inf_weights": (torch.tensor([[1.0, 0, 0, 0, 0], [0, float("inf"), 0, 0, 0]], dtype=DT), r"NaN or Inf"),
    "string": ("cat", r"unsupported target type str"),
    "float": (1.0, r"unsupported target type float"),
}


@pytest.mark.parametrize("case", list(BAD_TARGETS))
def test_bad_target(case, cnn_case):
    target, message = BAD_TARGETS[case]
    model, x, explainer = cnn_case
    with pytest.raises(TargetError, match=message):
        explainer(x[:2], target)


def test_bad_model_or_backend():
    with pytest.raises(TypeError, match=r"nn\.Module.*function"):
        explain(lambda x: x, X, 0)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'"):
        explain(make_mlp(), make_input("mlp"), 0, backend="nope")


# --------------------------------------------------------------------------- 7. models OMENN cannot explain


class Square(nn.Module):
    def forward(self, x):
        return x * x


class Cummax(nn.Module):
    def forward(self, x):
        return torch.cummax(x, dim=-1).values


class LogSoftmax(nn.Module):
    def forward(self, x):
        return torch.log_softmax(x, dim=-1)


class Erfinv(nn.Module):
    def forward(self, x):
        return torch.erfinv(x)


class WithBody(nn.Module):
    """``head(body.<name>(stem(x)))``: the unsupported op sits at ``body.<name>``."""

    def __init__(self, name: str, module: nn.Module) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2, 3, padding=1)
        self.body = nn.Sequential()
        self.body.add_module(name, module)
        self.head = nn.Linear(2 * 4 * 4, K)

    def forward(self, x):
        return self.head(self.body(self.stem(x)).flatten(1))


def _small_x():
    return make_input("mlp", batch=2)


def test_product_of_two_live_tensors_is_unsupported():
    model = WithBody("square", Square()).to(DT)
    with pytest.raises(UnsupportedOpError, match=r"aten\.mul\.Tensor.*body\.square") as info:
        explain(model, _small_x(), 0)
    err = info.value
    assert isinstance(err, NotImplementedError) and isinstance(err, OmennError)
    assert err.op == "aten.mul.Tensor"
    assert err.module_path == "body.square"
    assert "R9" in err.rule_kind
    assert "R9" in str(err)


@pytest.mark.parametrize("name, module, op, kind", [
    ("scan", Cummax(), "aten.cummax.default", None),
    ("normalized", LogSoftmax(), "aten.log_softmax.int", "log Σ exp"),
    ("act", Erfinv(), "aten.erfinv.default", "R4"),
], ids=["cummax", "log_softmax", "erfinv"])
def test_op_without_rule_is_named_with_its_path(name, module, op, kind):
    model = WithBody(name, module).to(DT)
    with pytest.raises(UnsupportedOpError, match=re.escape(op) + r".*body\." + name + r".*would need") as info:
        explain(model, _small_x(), 0)
    err = info.value
    assert err.op == op and err.module_path == f"body.{name}" and err.rule_kind
    assert err.rule_kind in str(err)
    if kind:
        assert kind in err.rule_kind


class _Fc(nn.Module):
    """Holds ``fc = Linear(48, K)`` for the (B, 3, 4, 4) inputs of ``_small_x``; subclasses write forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(48, K)


class DataDependent(_Fc):
    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x.flatten(1))
        return -self.fc(x.flatten(1))


def test_data_dependent_control_flow_is_a_capture_error():
    with pytest.raises(CaptureError, match=r"torch\.export could not capture DataDependent\.forward") as info:
        explain(DataDependent().to(DT), _small_x(), 0)
    assert isinstance(info.value, RuntimeError)
    assert "data-dependent" in str(info.value)


class CountsCalls(_Fc):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=DT))

    def forward(self, x):
        self.calls += 1
        return self.fc(x.flatten(1))


def test_forward_that_mutates_a_buffer_is_a_capture_error():
    model = CountsCalls().to(DT)
    with pytest.raises(CaptureError, match=r"mutates 1 buffers"):
        explain(model, _small_x(), 0)
    assert model.calls.item() == 0


def test_softmax_output_is_unsupported():
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, K), nn.Softmax(dim=-1)).to(DT)
    with pytest.raises(UnsupportedOpError, match=r"softmax") as info:
        explain(model, _small_x(), 0)
    assert "softmax" in info.value.op


def test_sigmoid_output_is_an_elementwise_activation():
    # Not a gate (nothing multiplies it): R4, so the probabilities are explained completely.
    model, x = nn.Sequential(nn.Flatten(), nn.Linear(48, K), nn.Sigmoid()).to(DT).eval(), _small_x()
    e = explain(model, x, 3)
    assert _relative_error(e.contribution.sum((1, 2)), _logits(model, x)[:, 3]) <= RTOL_COMPLETE


class IgnoresInput(_Fc):
    def __init__(self, via_linear: bool) -> None:
        super().__init__()
        self.via_linear = via_linear

    def forward(self, x):
        if self.via_linear:
            return self.fc(torch.zeros(x.shape[0], 48, dtype=x.dtype))
        return self.fc.bias.expand(x.shape[0], K)


@pytest.mark.parametrize("via_linear", [False, True], ids=["bias", "linear_of_zeros"])
def test_output_independent_of_input_is_a_clear_error(via_linear):
    with pytest.raises(OmennError, match=r"does not depend on the input"):
        explain(IgnoresInput(via_linear).to(DT), _small_x(), 0)


@pytest.mark.parametrize("model, shape", [
    (nn.Conv2d(3, K, 1), r"\(2, 5, 4, 4\)"),
    (nn.Flatten(2), r"\(2, 3, 16\)"),
], ids=["4d", "3d"])
def test_output_that_is_not_batch_by_classes_is_a_clear_error(model, shape):
    with pytest.raises(OmennError, match=r"output has shape " + shape + r".*\(batch, num_classes\)"):
        explain(model.to(DT), _small_x(), 0)


# --------------------------------------------------------------------------- edge cases of use


class ZerosLike(_Fc):
    def forward(self, x):
        return self.fc((x + torch.zeros_like(x)).flatten(1) + x.new_zeros(x.shape[0], 48))


def test_shape_only_tensor_factories_are_constants():
    # zeros_like / new_zeros read only the input's shape: their result is CONST (R7').
    model, x = ZerosLike().to(DT).eval(), _small_x()
    e = explain(model, x, 1)
    assert _relative_error(e.contribution.sum((1, 2)), _logits(model, x)[:, 1]) <= RTOL_COMPLETE


def test_explain_inside_inference_mode():
    _explain_inside(torch.inference_mode(), make_mlp(), make_input("mlp"), 2)


def test_explain_an_inference_tensor():
    model, x = make_mlp(), make_input("mlp")
    with torch.inference_mode():
        x_inference = x.clone()
    e = explain(model, x_inference, 2)
    _assert_close(e.contribution, explain(model, x, 2).contribution)


def test_numpy_integer_scalar_target():
    model, x = make_mlp(), make_input("mlp")
    labels = np.array([2, 0, 1])
    e = explain(model, x, labels[0])  # np.int64, as from indexing a label array
    assert torch.equal(e.target, torch.full((x.shape[0],), 2))


class MeanPool(nn.Module):
    def forward(self, x):
        return x.mean((2, 3))


def test_quantus_explain_on_a_model_without_parameters():
    model, x = MeanPool().eval(), make_input("mlp")
    result = quantus_explain(model=model, inputs=x.numpy(), targets=np.array([0, 1, 2]), device="cpu")
    _assert_close(torch.as_tensor(result), Explainer(model).attribute(x, torch.tensor([0, 1, 2])))
