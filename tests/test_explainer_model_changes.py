"""An ``Explainer`` stays true to its model, and is thread-safe.

* Structural changes a capture bakes in (forward hooks and pre-hooks, global module
  hooks, replaced submodules, re-bound parameters, a forward set on an instance, plain
  attributes such as ``self.scale`` or timm's ``global_pool``) are
  noticed at the next call: the model is captured again, and the explanation equals a
  fresh ``Explainer``'s and sums to the changed model's logit. In-place updates
  (optimizer steps, ``load_state_dict``, ``train()``/``eval()``) are not structural and
  are not captured again.
* Concurrent calls (threads sharing an ``Explainer``, several ``Explainer`` objects, an
  explanation while the same model is being captured) give the results of sequential
  calls.

Small float64 models with randomized biases and norm statistics, random inputs.
Tolerances (float64): completeness ``|Σ C − ŷ| / |ŷ| ≤ 1e-10`` against the changed
model's own output; an explanation after a re-capture against a fresh ``Explainer``'s:
``rtol=1e-12, atol=1e-14`` (both run the same captured graph; measured bitwise equal);
concurrent against sequential results: bitwise.
"""

from __future__ import annotations

import logging
import threading
import types

import pytest
import torch
import torch.nn as nn

import omenn_kernels.api as api
from omenn_kernels import Explainer, Explanation
from omenn_kernels.capture import capture as real_capture
from omenn_kernels.testing import randomize_

DT = torch.float64
K = 5
RTOL_COMPLETE = 1e-10


def make_cnn(seed: int = 0, classes: int = K) -> nn.Sequential:
    """Conv, BatchNorm, ReLU, conv, GELU, pooling, linear head: float64, random biases and statistics."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
                          nn.Conv2d(6, 8, 3, padding=1, stride=2), nn.GELU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, classes))
    return randomize_(model.to(DT), seed=seed, scale=0.5).eval()


def make_input(batch: int = 3, seed: int = 0, size: int = 8) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(100 + seed), dtype=DT)


def new_linear(inputs: int, outputs: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return randomize_(nn.Linear(inputs, outputs).to(DT), seed=seed, scale=0.5)


@pytest.fixture
def captures(monkeypatch) -> list[tuple[int, ...]]:
    """The input shapes of the captures the Explainers make during the test."""
    calls: list[tuple[int, ...]] = []

    def counting(model, example, output=None):
        calls.append(tuple(example.shape))
        return real_capture(model, example, output)

    monkeypatch.setattr(api, "capture", counting)
    return calls


def assert_true_to_model(e: Explanation, model: nn.Module, x: torch.Tensor, target: int) -> None:
    """``e`` sums to the model's own logit (eval mode, hooks included) and equals a fresh Explainer's."""
    with torch.no_grad():
        logit = model(x)[:, target]
    assert float(((e.contribution.sum((1, 2)) - logit).abs() / logit.abs()).max()) <= RTOL_COMPLETE
    fresh = Explainer(model)(x, target)
    for field in ("contribution", "weight", "bias", "logit"):
        torch.testing.assert_close(getattr(e, field), getattr(fresh, field), rtol=1e-12, atol=1e-14)


def recapture_logged(caplog, fragment: str) -> bool:
    return any("capturing Sequential again" in r.getMessage() and fragment in r.getMessage()
               for r in caplog.records)


# --------------------------------------------------------------------------- structural changes


def test_forward_hook_added_after_the_first_call(captures, caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    before = explainer(x, 2)
    model[3].register_forward_hook(lambda module, inputs, output: output * 1.7)
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        after = explainer(x, 2)
    assert len(captures) == 2
    assert recapture_logged(caplog, "the forward hooks of '3' changed")
    assert not torch.allclose(after.contribution, before.contribution)
    assert_true_to_model(after, model, x, 2)


def test_forward_hook_removed_after_the_first_call(captures):
    model, x = make_cnn(), make_input()
    handle = model[-1].register_forward_hook(lambda module, inputs, output: output * -0.8 + 0.3)
    explainer = Explainer(model)
    hooked = explainer(x, 1)
    assert_true_to_model(hooked, model, x, 1)
    handle.remove()
    captures.clear()
    plain = explainer(x, 1)
    assert len(captures) == 1
    assert not torch.allclose(plain.logit, hooked.logit)
    assert_true_to_model(plain, model, x, 1)


def test_forward_pre_hook_added_after_the_first_call(caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    explainer(x, 0)
    shift = torch.randn(1, 6, 8, 8, generator=torch.Generator().manual_seed(3), dtype=DT)
    model[2].register_forward_pre_hook(lambda module, args: (args[0] * 1.3 + shift,))
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        e = explainer(x, 0)
    assert_true_to_model(e, model, x, 0)
    assert recapture_logged(caplog, "the forward pre-hooks of '2' changed")


def test_global_module_forward_hook(captures):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    before = explainer(x, 4)
    activation = model[4]
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, inputs, output: output * 0.5 + 0.25 if module is activation else None)
    try:
        after = explainer(x, 4)
        assert len(captures) == 2
        assert not torch.allclose(after.contribution, before.contribution)
        assert_true_to_model(after, model, x, 4)
    finally:
        handle.remove()
    captures.clear()
    removed = explainer(x, 4)
    assert len(captures) == 1
    assert_true_to_model(removed, model, x, 4)


def test_submodule_replaced_by_another_kind(caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    explainer(x, 3)
    model[2] = nn.SiLU()
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        e = explainer(x, 3)
    assert_true_to_model(e, model, x, 3)
    assert recapture_logged(caplog, "the submodule '2' was replaced (ReLU by SiLU)")


def test_head_replaced_with_another_class_count():
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    explainer(x, 1)
    model[-1] = new_linear(8, 7, seed=4)
    e = explainer(x, 6)  # a class the old head does not have
    assert e.logits.shape == (3, 7)
    assert_true_to_model(e, model, x, 6)


def test_parameters_rebound_to_another_shape(caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    explainer(x, 1)
    head = new_linear(8, 7, seed=5)
    model[-1].weight, model[-1].bias = head.weight, head.bias
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        e = explainer(x, 6)
    assert_true_to_model(e, model, x, 6)
    assert recapture_logged(caplog, "parameter '7.weight' changed from shape (5, 8)")


def test_parameter_rebound_to_new_values_of_the_same_shape(captures, caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    before = explainer(x, 2)
    model[0].weight = nn.Parameter(torch.randn(model[0].weight.shape, dtype=DT))
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        after = explainer(x, 2)
    assert len(captures) == 2
    assert recapture_logged(caplog, "parameter '0.weight' was re-bound to another tensor")
    assert not torch.allclose(after.contribution, before.contribution)
    assert_true_to_model(after, model, x, 2)


def test_tied_parameter_untied_by_rebinding():
    # The capture binds a tied parameter once; after untying, the two layers differ.
    torch.manual_seed(0)
    model = randomize_(nn.Sequential(nn.Flatten(), nn.Linear(48, 48), nn.GELU(), nn.Linear(48, 48), nn.ReLU(),
                                     nn.Linear(48, K)).to(DT), seed=0, scale=0.5).eval()
    x = make_input(seed=1, size=4)
    model[3].weight = model[1].weight
    explainer = Explainer(model)
    assert_true_to_model(explainer(x, 2), model, x, 2)
    model[3].weight = nn.Parameter(torch.randn(48, 48, dtype=DT) / 7)
    assert_true_to_model(explainer(x, 2), model, x, 2)


def test_forward_replaced_on_an_instance(caplog):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    explainer(x, 0)
    conv = model[3]
    original = conv.forward
    conv.forward = types.MethodType(lambda self, inputs: original(inputs) * 2.5 - 0.5, conv)
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        e = explainer(x, 0)
    assert_true_to_model(e, model, x, 0)
    assert recapture_logged(caplog, "the forward of '3' was replaced on the instance")


class _Scaled(nn.Module):
    """A layer that multiplies by a plain float attribute, which a capture bakes into its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0
        self.mode = "plain"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale if self.mode == "plain" else x * self.scale - 1.0


@pytest.mark.parametrize("change", ["number", "string"])
def test_plain_attribute_changed_after_the_first_call(change, captures, caplog):
    model, x = make_cnn(), make_input()
    model.insert(3, _Scaled())
    explainer = Explainer(model)
    before = explainer(x, 2)
    if change == "number":
        model[3].scale = -2.0
        logged = "the attribute '3.scale' changed from 1.0 to -2.0"
    else:
        model[3].mode = "shifted"
        logged = "the attribute '3.mode' changed from 'plain' to 'shifted'"
    with caplog.at_level(logging.INFO, logger="omenn_kernels.api"):
        after = explainer(x, 2)
    explainer(x, 2)
    assert len(captures) == 2  # once more after the change, not again while it stays
    assert recapture_logged(caplog, logged)
    assert not torch.allclose(after.logit, before.logit)
    assert_true_to_model(after, model, x, 2)


def test_timm_global_pool_changed_after_the_first_call(captures):
    """parts_vit (timm's VisionTransformer) pooled by its class token, then by the average of its tokens."""
    from omenn_kernels.models import parts_vit

    torch.manual_seed(0)
    model = randomize_(parts_vit(depth=1).to(DT), seed=0, scale=0.5).eval()
    x = torch.randn(2, 3, 96, 96, generator=torch.Generator().manual_seed(1), dtype=DT)
    explainer = Explainer(model, backend="fused")
    explainer(x, 1)
    model.global_pool = "avg"
    after = explainer(x, 1)
    assert len(captures) == 2
    with torch.no_grad():
        logit = model(x)[:, 1]
    assert float(((after.contribution.sum((1, 2)) - logit).abs() / logit.abs()).max()) <= RTOL_COMPLETE


def test_in_place_updates_and_mode_changes_are_not_captured_again(captures):
    model, x = make_cnn(), make_input()
    explainer = Explainer(model)
    before = explainer(x, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for step in range(2):
        optimizer.zero_grad()
        model(make_input(seed=10 + step)).square().mean().backward()
        optimizer.step()
        explainer(x, 1)
    model.eval()
    model.load_state_dict(make_cnn(seed=9).state_dict())
    after = explainer(x, 1)
    assert len(captures) == 1
    assert not torch.allclose(after.contribution, before.contribution)
    assert_true_to_model(after, model, x, 1)


# --------------------------------------------------------------------------- threads


def run_in_threads(functions: list) -> list:
    """Start one thread per function at once (behind a barrier); their results, or the errors they raised."""
    barrier = threading.Barrier(len(functions))
    results: list = [None] * len(functions)

    def run(index: int) -> None:
        barrier.wait()
        try:
            results[index] = functions[index]()
        except Exception as error:  # reported by the test, with the thread's result
            results[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(functions))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def assert_bitwise_equal(a: Explanation, b: Explanation) -> None:
    for field in ("contribution", "weight", "bias", "logit", "target", "logits"):
        assert torch.equal(getattr(a, field), getattr(b, field)), field


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_four_threads_on_a_fresh_explainer(captures, backend):
    model = make_cnn()
    inputs = [make_input(seed=s) for s in range(4)]
    one_by_one = Explainer(model, backend=backend)
    sequential = [one_by_one(x, s % K) for s, x in enumerate(inputs)]
    captures.clear()
    explainer = Explainer(model, backend=backend)
    results = run_in_threads([lambda x=x, s=s: explainer(x, s % K) for s, x in enumerate(inputs)])
    for result, expected in zip(results, sequential):
        assert isinstance(result, Explanation), result
        assert_bitwise_equal(result, expected)
    assert len(captures) == 1  # one signature, captured once


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_explain_two_models_in_two_threads_at_once(backend):
    models, inputs = [make_cnn(seed=1), make_cnn(seed=2, classes=7)], [make_input(seed=1), make_input(seed=2)]
    sequential = [api.explain(m, x, 4, backend=backend) for m, x in zip(models, inputs)]
    results = run_in_threads([lambda m=m, x=x: api.explain(m, x, 4, backend=backend)
                              for m, x in zip(models, inputs)])
    for result, expected in zip(results, sequential):
        assert isinstance(result, Explanation), result
        assert_bitwise_equal(result, expected)


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_explanations_while_the_same_model_is_captured_in_another_thread(backend):
    # torch.export swaps the model's parameters for fake tensors while it traces it, and
    # while any thread exports, torch.library's wrapper of a custom op's kernel edits
    # process-global fx metadata: the fused ops run under CAPTURE_LOCK.
    model, x = make_cnn(), make_input()
    explainer = Explainer(model, backend=backend)
    expected = explainer(x, 3)
    done = threading.Event()
    problems: list = []
    explained = []

    def explain_repeatedly() -> None:
        while not done.is_set():
            try:
                result = explainer(x, 3)
                if not torch.equal(result.contribution, expected.contribution):
                    problems.append("an explanation changed")
            except Exception as error:  # collected: the assertion below shows it
                problems.append(error)
            explained.append(1)

    def capture_repeatedly() -> None:
        try:
            for batch in range(4, 8):
                Explainer(model).program(make_input(batch=batch))
        finally:
            done.set()

    results = run_in_threads([explain_repeatedly, capture_repeatedly])
    assert results == [None, None] and problems == [], (results, problems[:3])
    assert explained
    assert_bitwise_equal(explainer(x, 3), expected)
