"""Export's training graph made functional in place (omenn_kernels/eval_graph.py).

Where :func:`functionalized` rewrites a graph, the result computes the model's output
exactly (float64, equal to the model's own forward up to 1e-12 relative) and holds no
write, dropout or training-graph BatchNorm; the explanation captured through it equals the
one captured through ``run_decompositions({})`` (float64, 1e-10 relative: the graphs differ
in which shape ops alias). Where a rewrite would change what some node reads, it declines
and leaves the graph as it was.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import capture as capture_module
from omenn_kernels.backends import fused
from omenn_kernels.capture import _export, _SelectedOutput, capture, checked_selector, eval_semantics
from omenn_kernels.eval_graph import functionalized
from omenn_kernels.linearize import linearize
from omenn_kernels.readout import Readout
from omenn_kernels.testing import randomize_, relative_distance

aten = torch.ops.aten


class InPlaceBlock(nn.Module):
    """Conv, BatchNorm, ``ReLU(inplace=True)``, dropout, ``x += shortcut``, a read of a tensor
    after it was written in place, casts that round and that change nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.act = nn.ReLU(inplace=True)
        self.drop = nn.Dropout(0.3)
        self.shortcut = nn.Conv2d(3, 6, 1)
        self.head = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.drop(self.act(self.bn(self.conv(x))))
        y += self.shortcut(x).float().double()
        z = y.mul_(0.5)  # the readers of ``y`` below see the halved values
        return self.head(F.silu(y + z).mean((2, 3)).to(torch.float64))


class _Linear(nn.Module):
    def __init__(self, width: int = 5) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)


class WriteIntoView(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        y[:, :2].mul_(3.0)
        return y


class ViewReadBeforeWrite(_Linear):
    def __init__(self) -> None:
        super().__init__(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        pairs = y.view(-1, 3, 2)
        y.relu_()
        return pairs.sum(2) + y[:, :3]


class WriteInLowerPrecision(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x).float()
        y.add_(x)  # rounds to float32, where ``add`` would not
        return y.double()


class DropoutInTraining(_Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.linear(x), 0.0, training=True)


def _exported(model: nn.Module, x: torch.Tensor):
    with eval_semantics(model):
        return _export(_SelectedOutput(model, checked_selector(None)), x)


def _random(model: nn.Module) -> nn.Module:
    return randomize_(model.double().eval(), seed=2)


def test_training_graph_is_rewritten_to_the_functional_one() -> None:
    model = _random(InPlaceBlock())
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    program = _exported(model, x)
    assert functionalized(program)
    ops = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert not any(getattr(op, "_schema", None) is not None and op._schema.is_mutable for op in ops)
    assert aten.dropout.default not in ops and aten.batch_norm.default not in ops
    assert aten._native_batch_norm_legit_no_training.default in ops and ops.count(aten._to_copy.default) == 2
    assert not any(op in ops for op in (aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten.to.other))
    with torch.no_grad():
        assert relative_distance(program.module()(x), model(x.clone())) < 1e-12


def test_explanation_equals_the_retraced_graphs(monkeypatch) -> None:
    model = _random(InPlaceBlock())
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    target = Readout(torch.tensor([0, 3, 1]))
    rewritten = fused.explain_batch(linearize(capture(model, x)), model, x, target)
    monkeypatch.setattr(capture_module, "functionalized", lambda program: False)
    retraced = fused.explain_batch(linearize(capture(model, x)), model, x, target)
    for got, want, name in zip(rewritten, retraced, ("weight", "bias", "logit")):
        assert relative_distance(got, want) < 1e-10, name


@pytest.mark.parametrize("build", [WriteIntoView, ViewReadBeforeWrite, WriteInLowerPrecision, DropoutInTraining])
def test_graph_that_needs_the_retrace_is_left_unchanged(build) -> None:
    model = _random(build())
    x = torch.randn(3, 5 if build is not ViewReadBeforeWrite else 6, dtype=torch.float64)
    program = _exported(model, x)
    before = str(program.graph)
    assert not functionalized(program)
    assert str(program.graph) == before
    captured = capture(model, x)  # through run_decompositions
    assert not any(getattr(node.target, "_schema", None) is not None and node.target._schema.is_mutable
                   for node in captured.graph.nodes if node.op == "call_function")
