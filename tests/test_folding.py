"""Capture-time folding of eval-mode BatchNorm into the convolution before it (omenn_kernels/folding.py).

The folded program must give the unfolded one's explanation — weight, bias and logit —
on every backend, and the same parameter gradient on the training path. Models in
float64 with every bias, BN affine and running statistic randomized; tolerance 1e-10
relative (folding changes only the rounding of ``W·s`` and ``b·s + t``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision

from omenn_kernels import Explainer, folding
from omenn_kernels.backends import compiled, fused, reference
from omenn_kernels.capture import capture
from omenn_kernels.linearize import linearize
from omenn_kernels.readout import Readout
from omenn_kernels.testing import randomize_, relative_distance

TOLERANCE = 1e-10
aten = torch.ops.aten


class ConvBn(nn.Module):
    """Every kind of pair: biased and bias-free, grouped (depthwise), strided and padded,
    1-D, an affine-free BN, and a BN after a pooling (not a convolution: not folded)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.depthwise = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8, affine=False),
                                       nn.GELU())
        self.pooled = nn.Sequential(nn.MaxPool2d(2), nn.BatchNorm2d(8))
        self.line = nn.Sequential(nn.Conv1d(8, 6, 3, padding=2, dilation=2), nn.BatchNorm1d(6, eps=1e-3))
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pooled(self.depthwise(self.stem(x)))
        x = self.line(x.flatten(2)).relu()
        return self.head(x.mean(-1))


class SharedConvolution(nn.Module):
    """A convolution whose output feeds its BatchNorm and a skip connection: not folded."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return self.head((self.bn(y).relu() + y).mean((2, 3)))


def _model(build) -> nn.Module:
    return randomize_(build().double().eval(), seed=3)


def _programs(model: nn.Module, x: torch.Tensor):
    return linearize(capture(model, x)), linearize(capture(model, x, fold_batch_norm=False))


def _ops(program) -> list:
    return [step.node.target for step in program.steps]


MODELS = {"pairs": ConvBn, "resnet18": lambda: torchvision.models.resnet18(num_classes=7)}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", [reference, fused], ids=["reference", "fused"])
def test_folded_explanation_equals_unfolded(name: str, backend) -> None:
    model = _model(MODELS[name])
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    folded, unfolded = _programs(model, x)
    remaining = _ops(folded).count(aten._native_batch_norm_legit_no_training.default)
    assert remaining == (1 if name == "pairs" else 0)  # only the BN after the max pooling stays
    assert _ops(unfolded).count(aten._native_batch_norm_legit_no_training.default) == (4 if name == "pairs" else 20)
    target = torch.tensor([0, 2, 1])
    got = backend.explain_batch(folded, model, x, Readout(target))
    want = backend.explain_batch(unfolded, model, x, Readout(target))
    for part, name_ in ((0, "weight"), (1, "bias"), (2, "logit")):
        assert relative_distance(got[part], want[part]) < TOLERANCE, name_
    assert relative_distance(got[2], model(x).gather(1, target[:, None])[:, 0]) < TOLERANCE


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("parameter_gradient", [None, "total"])
def test_compiled_input_gradients_take_one_copy_of_each_kernel(name: str, parameter_gradient, monkeypatch) -> None:
    """In a traced explanation no folded kernel is computed twice, nor kept for the backward
    beside its parameter. First-order: each folded kernel is a constant of the graph
    (:mod:`~omenn_kernels.backends.parameter_only`), read by the forward convolution and its
    input gradient. Differentiable: the folded kernels are computed from the trained
    parameters in the graph, and each input gradient is ``convᵀ(dy·s, W)``
    (:func:`~omenn_kernels.folding.scale_gradients_not_kernels`). Both equal the unfolded
    reference's explanation."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)  # the traced graph, run as it is
    model = _model(MODELS[name])
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    folded, unfolded = _programs(model, x)
    target = Readout(torch.tensor([2, 0, 1]))
    want = reference.explain_batch(unfolded, model, x, target)
    for _ in range(2):  # the eager first call, then the traced graph
        got = compiled.explain_batch(folded, model, x, target, parameter_gradient)
    assert compiled.replays(folded, model, x, target, parameter_gradient)
    for part, name_ in ((0, "weight"), (1, "bias"), (2, "logit")):
        assert relative_distance(got[part].detach(), want[part]) < TOLERANCE, name_
    (explanation,) = compiled.explanations(folded).values()
    nodes = list(explanation.graph.graph.nodes)
    convolutions = [n for n in nodes if n.target is aten.convolution.default]
    backward = [n for n in nodes if str(n.target) in folding._INPUT_GRADIENTS]
    kernels = [n.args[2] for n in backward]
    folded_count = 3 if name == "pairs" else 20
    assert aten.mul.Tensor not in [kernel.target for kernel in kernels]
    if parameter_gradient is None:
        hoisted = [k for k in kernels if k.op == "get_attr" and k.target.startswith("_parameter_derived_")]
        assert len(hoisted) == folded_count
        assert set(hoisted) <= {n.args[1] for n in convolutions}  # the forward's own constant
    else:
        assert sum(kernel.op == "placeholder" for kernel in kernels) == folded_count  # the trained parameters


def test_shared_convolution_output_is_not_folded() -> None:
    model = _model(SharedConvolution)
    x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
    folded, unfolded = _programs(model, x)
    assert _ops(folded) == _ops(unfolded)


def test_parameter_updates_after_capture_are_followed() -> None:
    """The folded kernel and bias are computed from the parameters at every call."""
    model = _model(ConvBn)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    explainer = Explainer(model, backend="fused")
    explainer(x, target=1)
    with torch.no_grad():
        model.stem[0].weight.mul_(1.5)
        model.stem[1].running_var.add_(0.7)
        model.stem[1].bias.add_(0.3)
        model.line[0].bias.sub_(0.2)
    got = explainer(x, target=1)
    want = Explainer(model, backend="reference")(x, target=1)
    assert relative_distance(got.weight, want.weight) < TOLERANCE
    assert relative_distance(got.bias, want.bias) < TOLERANCE


@pytest.mark.parametrize("parameter_gradient", ["total", "fixed_multipliers"])
def test_parameter_gradient_flows_to_convolution_and_norm(parameter_gradient: str) -> None:
    """The training path: the gradient of a loss of the explanation with respect to the
    convolution's kernel and bias and the BN's γ and β equals the unfolded pair's."""
    model = _model(ConvBn)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    folded, unfolded = _programs(model, x)
    parameters = [model.stem[0].weight, model.stem[1].weight, model.stem[1].bias, model.line[0].weight,
                  model.line[0].bias, model.line[1].weight, model.line[1].bias]
    gradients = []
    for program in (folded, unfolded):
        weight, bias, logit, *_ = fused.explain_batch(program, model, x, Readout(torch.tensor([1, 4])),
                                                  parameter_gradient)
        loss = (weight * x).pow(2).sum() + bias.sum() + logit.sum()
        gradients.append(torch.autograd.grad(loss, parameters))
    for got, want in zip(*gradients):
        assert relative_distance(got, want) < TOLERANCE
