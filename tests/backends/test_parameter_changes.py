"""Every backend follows every change of a parameter's or buffer's values, by every route.

The compiled backend keeps values computed from the parameters between calls (folded
BatchNorm kernels, oneDNN-reordered kernels); a write through ``.data`` moves neither the
parameter's version counter nor its storage, so those caches compare values
(``backends/watched.py``). Each parameter and buffer kind of a small float32 model (a
convolution folded with its BatchNorm, one read as it is, a ViT's patch embedding, a
LayerNorm, linear layers) is changed through ``.data``, ``copy_``, ``load_state_dict``,
an optimizer step (with BatchNorm statistics updated in train mode) and an EMA update; the
next explanation must sum to the changed model's own logit and equal the reference
backend's. Most compiled explanations run their traced graph (``COMPILER`` swapped: the
caches are built before the compiler); the EMA teacher of ``attribution_distillation`` is
compiled with Inductor.

Tolerances (float32): completeness ``|Σ C − ŷ| ≤ 1e-4·(1 + |ŷ|)`` against the model's own
logit, whose stale value is off by more than 1e-2 here; fields against the reference
backend's: relative distance ≤ 1e-5; losses of the compiled and fused teachers: 1e-5
relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.losses import attribution_distillation
from omenn_kernels.testing import randomize_, relative_distance

TARGET = 1
CHANGED = ("stem.weight", "stem.bias", "norm.weight", "norm.bias", "norm.running_mean", "norm.running_var",
           "conv.weight", "conv.bias", "patch.weight", "ln.weight", "mlp.weight", "head.bias")


class _Hybrid(nn.Module):
    """A convolution folded with its BatchNorm, one without a norm, a patch embedding, then tokens
    through a LayerNorm and an MLP, averaged into a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.norm = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1)
        self.patch = nn.Conv2d(8, 16, 4, stride=4)
        self.ln, self.mlp, self.head = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.gelu(self.conv(F.relu(self.norm(self.stem(x)))))
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        return self.head(F.gelu(self.mlp(self.ln(tokens))).mean(1))


def _model(seed: int = 0) -> _Hybrid:
    torch.manual_seed(seed)
    return randomize_(_Hybrid(), seed=seed, scale=0.5).eval()


def _images(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


def _floating_state(model: nn.Module, other: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The floating-point parameters and buffers of two models of one architecture, in pairs."""
    return [(mine, theirs) for mine, theirs in zip(model.state_dict().values(), other.state_dict().values())
            if mine.is_floating_point()]


@pytest.fixture
def traced(monkeypatch) -> None:
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


def _assert_follows(explainer: Explainer, reference: Explainer, model: nn.Module, x: torch.Tensor,
                    changed: str) -> None:
    got = explainer(x, TARGET)
    with torch.no_grad():
        logit = model(x)[:, TARGET]
    error = (got.contribution.sum((1, 2)) - logit).abs().max()
    assert error <= 1e-4 * (1 + logit.abs().max()), f"after {changed}: sums to {got.logit}, the model gives {logit}"
    want = reference(x, TARGET)
    for field in ("weight", "bias", "logit"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= 1e-5, (changed, field)


def _change(model: nn.Module, name: str, route: str) -> None:
    """Scale the tensor ``name`` by 0.7 through ``route`` (statistics stay positive)."""
    tensor = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
    if route == "data":
        tensor.data.mul_(0.7)
    elif route == "copy_":
        with torch.no_grad():
            tensor.copy_(tensor * 0.7)
    else:
        state = model.state_dict()
        state[name] = state[name] * 0.7
        model.load_state_dict(state)


@pytest.mark.usefixtures("traced")
@pytest.mark.parametrize("backend", ["reference", "fused", "compiled"])
@pytest.mark.parametrize("route", ["data", "copy_", "load_state_dict"])
def test_each_parameter_and_buffer_changed_in_place_is_followed(backend, route):
    model, x = _model(), _images()
    explainer, reference = Explainer(model, backend=backend), Explainer(model, backend="reference")
    for _ in range(2):  # compiled, then replayed
        explainer(x, TARGET)
    for name in CHANGED:
        _change(model, name, route)
        _assert_follows(explainer, reference, model, x, f"{route} of {name}")


@pytest.mark.usefixtures("traced")
@pytest.mark.parametrize("backend", ["reference", "fused", "compiled"])
@pytest.mark.parametrize("route", ["optimizer step", "EMA update"])
def test_training_updates_are_followed(backend, route):
    """An optimizer step after a train-mode forward (BatchNorm statistics move too), and an EMA
    teacher's update written through ``.data``, as EMA code commonly does."""
    model, student, x = _model(), _model(seed=3), _images()
    explainer, reference = Explainer(model, backend=backend), Explainer(model, backend="reference")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    explainer(x, TARGET)
    for step in range(2):
        if route == "optimizer step":
            model.train()
            model(_images(seed=10 + step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            model.eval()
        else:
            for mine, theirs in _floating_state(model, student):
                mine.data.mul_(0.5).add_(theirs.data, alpha=0.5)
        _assert_follows(explainer, reference, model, x, f"{route} {step}")


def test_an_ema_teachers_compiled_loss_equals_its_fused_loss_after_ten_updates():
    """``attribution_distillation`` with an EMA teacher explained by the compiled backend (Inductor)
    and by the fused one: the same loss at every step."""
    student, x = _model(seed=3), _images()
    teachers = {"compiled": _model(), "fused": _model()}
    optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
    for step in range(10):
        losses = {backend: attribution_distillation(student, teacher, x, TARGET, backend="fused",
                                                    teacher_backend=backend).loss
                  for backend, teacher in teachers.items()}
        torch.testing.assert_close(losses["compiled"], losses["fused"], rtol=1e-5, atol=1e-6, msg=f"step {step}")
        losses["fused"].backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for teacher in teachers.values():
                for mine, theirs in _floating_state(teacher, student):
                    mine.data.lerp_(theirs.data, 0.3)


def test_a_watch_sees_every_change_of_value_once_per_watch():
    """Writes through ``.data``, through a transposed view, and of a NaN; copies shared by two watches;
    the comparison used off the CPU (multi-tensor kernels, one read-back), run here on CPU tensors."""
    from omenn_kernels.backends.watched import Watch, _differ_on_device

    weight = nn.Parameter(torch.randn(4, 3))
    statistics = torch.randn(5, dtype=torch.float64)
    steps = torch.arange(3)
    first, second = Watch([weight, statistics, steps]), Watch([weight.t(), statistics])
    assert first.changed() == [] and second.changed() == []
    weight.data.mul_(0.5)
    assert [t is weight for t in first.changed()] == [True]
    assert first.changed() == []  # seen
    assert len(second.changed()) == 1  # its transposed view (not contiguous: compared by torch.equal)
    second.tensors[0].data.add_(1.0)
    assert len(second.changed()) == 1 and [t is weight for t in first.changed()] == [True]
    statistics[2] = float("nan")
    assert [t is statistics for t in first.changed()] == [True] and len(second.changed()) == 1
    assert first.changed() == []  # NaN equals NaN bit for bit
    steps.data[0] = 7
    assert [t is steps for t in first.changed()] == [True]

    tensors = [torch.randn(3), torch.arange(4), torch.randn(0), torch.randn(2, 2), torch.tensor([True, False])]
    copies = [t.clone() for t in tensors]
    assert _differ_on_device(tensors, copies) == [False] * 5
    tensors[1][0], tensors[3][1, 1], tensors[4][1] = 9, tensors[3][1, 1] + 1, True
    assert _differ_on_device(tensors, copies) == [False, True, False, True, True]
