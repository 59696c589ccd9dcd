"""Model outputs as they come: a tensor, a tuple or list, a dict or ``ModelOutput``, and ``output=``.

A float64 model with two heads returns its logits in each container; the explanation of
the selected head must equal the explanation of a single-output model holding that head
alone (same parameters): elementwise, ``rtol=1e-9`` and ``atol=1e-12·max|C|``; and it must
sum to the selected logit, ``|Σ C − ŷ| / |ŷ| ≤ 1e-10``. Biases are randomized.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from transformers.utils import ModelOutput

from omenn_kernels import CaptureError, Explainer, OutputError, UnsupportedOpError, explain, explainer_for
from omenn_kernels.backends import compiled
from omenn_kernels.losses import attribution_consistency
from omenn_kernels.testing import randomize_

DT = torch.float64
RTOL_COMPLETE = 1e-10
K = 5


class TwoHeads(nn.Module):
    """A small CNN with a main and an auxiliary head, returned in the container ``kind``."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.features = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.GELU(),
                                      nn.AdaptiveAvgPool2d(2), nn.Flatten())
        self.head = nn.Linear(24, K)
        self.aux_head = nn.Sequential(nn.ReLU(), nn.Linear(24, K))

    def forward(self, x):
        features = self.features(x)
        logits, aux = self.head(features), self.aux_head(features)
        if self.kind == "tuple":
            return logits, aux, features
        if self.kind == "list":
            return [logits, aux]
        if self.kind == "dict":
            return {"logits": logits, "aux_logits": aux}
        if self.kind == "model_output":
            return Output(logits=logits, aux_logits=aux)
        return {"scores": logits, "aux_logits": aux}  # no default


@dataclasses.dataclass
class Output(ModelOutput):
    """A Hugging Face ``ModelOutput`` with two tensors (a dict and a dataclass at once)."""

    logits: torch.Tensor | None = None
    aux_logits: torch.Tensor | None = None


class Single(nn.Module):
    """The features of ``model`` followed by one of its heads: the explanation to compare with."""

    def __init__(self, model: TwoHeads, head: nn.Module, scale: float = 1.0) -> None:
        super().__init__()
        self.features, self.chosen, self.scale = model.features, head, scale

    def forward(self, x):
        return self.chosen(self.features(x)) * self.scale


def _model(kind: str) -> TwoHeads:
    return randomize_(TwoHeads(kind), seed=3).to(DT).eval()


def _x() -> torch.Tensor:
    return torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(7), dtype=DT)


def _assert_same(got, want) -> None:
    scale = float(want.contribution.abs().max())
    torch.testing.assert_close(got.contribution, want.contribution, rtol=1e-9, atol=1e-12 * scale)
    torch.testing.assert_close(got.weight, want.weight, rtol=1e-9, atol=1e-12 * float(want.weight.abs().max()))


@pytest.fixture
def traced_compiler(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


@pytest.mark.parametrize("backend", ["reference", "fused", "compiled"])
@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "model_output"])
def test_the_default_output_is_the_first_element_or_the_logits_entry(kind, backend, traced_compiler):
    model, x = _model(kind), _x()
    e = explain(model, x, 2, backend=backend)
    _assert_same(e, explain(Single(model, model.head), x, 2, backend="reference"))
    with torch.no_grad():
        logits = model.head(model.features(x))
    assert float(((e.contribution.sum((1, 2)) - logits[:, 2]).abs() / logits[:, 2].abs()).max()) <= RTOL_COMPLETE


@pytest.mark.parametrize("backend", ["fused"])  # the selection is made at capture, before any backend
@pytest.mark.parametrize("kind, selector", [("tuple", 1), ("tuple", -2), ("list", 1), ("dict", "aux_logits"),
                                            ("model_output", "aux_logits"), ("model_output", 1),
                                            ("no_default", "aux_logits")])
def test_an_index_or_a_key_selects_another_output(kind, selector, backend, traced_compiler):
    model, x = _model(kind), _x()
    e = Explainer(model, backend=backend, output=selector)(x, 4)
    _assert_same(e, explain(Single(model, model.aux_head), x, 4, backend="reference"))


@pytest.mark.parametrize("backend", ["reference", "fused", "compiled"])
def test_a_function_of_the_output_is_traced_with_the_model(backend, traced_compiler):
    model, x = _model("dict"), _x()
    e = explain(model, x, 1, backend=backend, output=lambda out: 3.0 * out["aux_logits"])
    _assert_same(e, explain(Single(model, model.aux_head, scale=3.0), x, 1, backend="reference"))


def test_several_read_outs_and_the_predicted_class_use_the_selected_output():
    model, x = _model("tuple"), _x()
    with torch.no_grad():
        aux = model.aux_head(model.features(x))
    predicted = explain(model, x, None, output=1)
    assert torch.equal(predicted.target, aux.argmax(1))
    readouts = torch.randn(3, 2, K, dtype=DT, generator=torch.Generator().manual_seed(1))
    many = Explainer(model, output=1).explain_targets(x, readouts)
    want = (readouts * aux.unsqueeze(1)).sum(-1)
    assert float(((many.contribution.sum((-2, -1)) - want).abs() / want.abs()).max()) <= RTOL_COMPLETE


def test_losses_and_kept_explainers_take_the_selector():
    model, x = _model("dict"), _x()
    frozen = _model("dict")
    kept = explainer_for(model, "fused", "aux_logits")
    assert explainer_for(model, "fused", "aux_logits") is kept
    assert explainer_for(model, "fused") is not kept
    loss = attribution_consistency(model, frozen, x, 0, output="aux_logits")
    loss.loss.backward()
    assert model.aux_head[1].weight.grad is not None and model.head.weight.grad is None
    torch.testing.assert_close(loss.logits, model.aux_head(model.features(x)), rtol=1e-12, atol=0.0)


@pytest.mark.parametrize("kind, selector, message", [
    ("no_default", None, r"returns a dict with keys \['scores', 'aux_logits'\], which has no default logits"),
    ("dict", "missing", r"output='missing' is not a key of the model's output, a dict with keys"),
    ("tuple", 3, r"output=3 is not an index of the model's output, a tuple of 3 elements"),
    ("dict", lambda out: out["logits"].shape, r"of the model's output \(a dict .*\) is a Size, not a tensor"),
])
def test_an_output_that_nothing_selects_is_an_output_error_naming_its_type(kind, selector, message):
    with pytest.raises(OutputError, match=message) as info:
        explain(_model(kind), _x(), 0, output=selector)
    assert isinstance(info.value, CaptureError)


@pytest.mark.parametrize("selector", [1.5, True, ["logits"]])
def test_a_selector_of_another_type_is_a_type_error(selector):
    with pytest.raises(TypeError, match=f"output must be None, an index, a key or a function .* got "
                                        f"{type(selector).__name__}"):
        Explainer(_model("tuple"), output=selector)


def test_an_unsupported_op_names_its_module_path_without_the_selection():
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, K), nn.Softmax(-1)).to(DT)
    with pytest.raises(UnsupportedOpError) as info:
        explain(model, _x(), 0)
    assert info.value.module_path == "2"
