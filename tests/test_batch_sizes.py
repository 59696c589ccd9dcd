"""One capture serves every batch size of at least 2: no new ``torch.export``, no new linearization.
One compiled graph, traced at the first batch's size, serves every other size in chunks.

Explanations at every size equal a reference run at that size alone (float64, relative
Frobenius 1e-10). A batch of one and a forward that fixes its batch size are captured for
their own shape, and stay exact. A forward that mixes samples is refused the chunked graph
at other sizes, and stays exact.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import omenn_kernels.api as api
from omenn_kernels import Explainer
from omenn_kernels.backends import compiled
from omenn_kernels.readout import ReadoutFunction
from omenn_kernels.testing import FAMILIES, randomize_, relative_distance

TOLERANCE = 1e-10


@pytest.fixture
def counted(monkeypatch) -> dict[str, int]:
    """How often ``torch.export`` and the linearizer run (spies around the real functions)."""
    counts = {"export": 0, "linearize": 0}
    export, linearize = torch.export.export, api.linearize

    def counted_export(*args, **kwargs):
        counts["export"] += 1
        return export(*args, **kwargs)

    def counted_linearize(*args, **kwargs):
        counts["linearize"] += 1
        return linearize(*args, **kwargs)
    monkeypatch.setattr(torch.export, "export", counted_export)
    monkeypatch.setattr(api, "linearize", counted_linearize)
    return counts


def _check(got, want) -> None:
    for field in ("contribution", "weight", "bias", "logit", "logits"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= TOLERANCE, field


@pytest.mark.parametrize("name", ["vit", "resnet"])
def test_one_capture_serves_every_batch_size(name, counted):
    family = FAMILIES[name]
    torch.manual_seed(3)
    model = randomize_(family.build(), seed=3).double().eval()
    explainer = Explainer(model, backend="fused")
    images = {size: torch.randn(size, 3, family.size, family.size, dtype=torch.float64) for size in (3, 2, 5)}
    got = {size: (explainer(x, 1), explainer(x, 1)) for size, x in images.items()}
    assert counted == {"export": 1, "linearize": 1}
    for size, x in images.items():
        want = Explainer(model, backend="reference")(x, 1)
        for explanation in got[size]:
            _check(explanation, want)


def _label_and_runner_up(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, 2, K) read-outs: each sample's label, and its runner-up logit (a read-out of the prediction)."""
    label = torch.zeros_like(logits).scatter(1, labels[:, None], 1.0)
    runner_up = torch.zeros_like(logits).scatter(1, logits.masked_fill(label.bool(), float("-inf")).argmax(1,
                                                                                                  keepdim=True), 1.0)
    return torch.stack([label, runner_up], 1)


def _top_two(logits: torch.Tensor) -> torch.Tensor:
    """(B, 2, K) read-outs of each sample's two highest logits."""
    return torch.zeros(*logits.shape[:1], 2, logits.shape[1], dtype=logits.dtype).scatter(
        2, logits.topk(2).indices[..., None], 1.0)


def test_one_compiled_graph_serves_batch_sizes_2_to_9(counted, monkeypatch):
    """Traced once at the first size (4); the others run it in chunks of 4, the last one filled
    up, and equal the fused backend's explanation at their own size; a read-out function's
    per-sample labels are chunked with the images."""
    traced = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: traced.append(example[0].shape[0]) or graph)
    family = FAMILIES["cnn"]
    torch.manual_seed(7)
    model = randomize_(family.build(), seed=7).double().eval()
    explainer, per_size = Explainer(model, backend="compiled"), Explainer(model, backend="fused")
    readouts = ReadoutFunction(_top_two)
    for size in (4, 2, 9, 3, 7, 5, 8, 6):
        x = torch.randn(size, 3, family.size, family.size, dtype=torch.float64)
        target = torch.randint(0, 5, (size,))
        labelled = ReadoutFunction(_label_and_runner_up, (target,))
        first, again = explainer(x, target), explainer(x, target)
        assert torch.equal(first.weight, again.weight)  # the chunked graph's numbers from the first call on
        _check(first, per_size(x, target))
        _check(explainer.explain_targets(x, labelled), per_size.explain_targets(x, labelled))
        _check(explainer.explain_targets(x, readouts), per_size.explain_targets(x, readouts))
    assert traced == [4, 4, 4]  # one graph per read-out: class indices and two read-out functions
    assert counted == {"export": 2, "linearize": 2}
    (program, _), = explainer._programs.values()
    for key, explanation in compiled.explanations(program).items():
        assert key[1][0][0] is None and explanation.batch == 4
        assert explanation.batches == dict.fromkeys((2, 9, 3, 7, 5, 8, 6), True)


def test_a_batch_of_one_has_its_own_capture(counted):
    family = FAMILIES["cnn"]
    torch.manual_seed(4)
    model = randomize_(family.build(), seed=4).double().eval()
    explainer = Explainer(model, backend="fused")
    for size in (1, 4, 1, 2):
        x = torch.randn(size, 3, family.size, family.size, dtype=torch.float64)
        _check(explainer(x, 2), Explainer(model, backend="reference")(x, 2))
    assert counted["linearize"] == 2 + 4  # batch 1 and batch ≥ 2 here; one each for the four reference runs


class _FixedBatch(nn.Module):
    """A forward written for one batch size: ``view(4, -1)`` fixes it."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv(x)).view(4, -1))


def test_a_forward_that_fixes_its_batch_size_is_captured_per_size(counted):
    torch.manual_seed(5)
    model = randomize_(_FixedBatch(), seed=5).double().eval()
    explainer = Explainer(model, backend="fused")
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    _check(explainer(x, 0), Explainer(model, backend="reference")(x, 0))
    (key,) = explainer._programs
    assert key[0] == (4, 3, 6, 6)  # not shared with other batch sizes
    with pytest.raises(Exception, match="shape"):
        explainer(torch.randn(3, 3, 6, 6, dtype=torch.float64), 0)  # the model's own forward fails on it


class _MixesSamples(_FixedBatch):
    """A forward in which every sample's logits depend on the others (centred over the batch)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv(x)).flatten(1)
        return self.head(hidden - hidden.mean(0, keepdim=True))


def test_a_forward_that_mixes_samples_is_not_run_in_chunks(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    torch.manual_seed(8)
    model = randomize_(_MixesSamples(), seed=8).double().eval()
    explainer = Explainer(model, backend="compiled")
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64)
    _check(explainer(x, 1), Explainer(model, backend="reference")(x, 1))
    x = torch.randn(3, 3, 6, 6, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="run in chunks of 4 samples, .* on a batch of 3; batches of 3 run on the "
                                            "fused backend"):
        _check(explainer(x, 1), Explainer(model, backend="reference")(x, 1))
    _check(explainer(x, 1), Explainer(model, backend="reference")(x, 1))
    (program, _), = explainer._programs.values()
    (explanation,) = compiled.explanations(program).values()
    assert explanation.batches == {3: False}


class _BranchOnBatch(_FixedBatch):
    """A forward whose ops depend on the batch size: export records the range its graph holds for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.conv(x)).flatten(1)
        if x.shape[0] > 6:
            hidden = 2 * hidden
        return self.head(hidden)


def test_batch_sizes_outside_the_captured_range_are_captured_again(counted):
    torch.manual_seed(6)
    model = randomize_(_BranchOnBatch(), seed=6).double().eval()
    explainer = Explainer(model, backend="fused")
    for size in (3, 5, 8, 6, 9):
        x = torch.randn(size, 3, 6, 6, dtype=torch.float64)
        _check(explainer(x, 4), Explainer(model, backend="reference")(x, 4))
    assert counted["export"] == 2 + 5  # sizes 2..6 share one capture, sizes from 7 on another; 5 references
