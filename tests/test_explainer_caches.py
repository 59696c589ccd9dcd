"""What an ``Explainer`` keeps between calls is bounded, and read-out functions compile whatever
their arguments.

* At most ``MAX_PROGRAMS`` programs (one per input signature), the least recently used
  dropped first; one used again is not captured again.
* A ``ReadoutFunction`` with arguments that are not tensors (a number, a tuple) is compiled
  with their values baked in, one graph per value, and explains what the fused backend
  explains; one with an unhashable argument (a list) runs on the fused backend.

Small float64 models with randomized biases and norm statistics, random inputs; compiled
explanations run their traced graph. Tolerance against the fused backend: 1e-12 relative.
"""

from __future__ import annotations

import pytest
import torch

import omenn_kernels.api as api
from omenn_kernels import Explainer, ReadoutFunction
from omenn_kernels.backends import compiled
from omenn_kernels.testing import relative_distance

from test_explainer_model_changes import captures, make_cnn, make_input  # noqa: F401 (captures: a fixture)


def test_programs_are_bounded_least_recently_used_first(captures, monkeypatch):
    monkeypatch.setattr(api, "MAX_PROGRAMS", 3)
    model = make_cnn()
    explainer = Explainer(model, backend="fused")
    sizes = [4, 5, 6, 7, 8]
    for size in sizes:
        explainer(make_input(size=size), 1)
        explainer(make_input(size=4), 1)  # kept the most recently used
    assert len(explainer._programs) == 3
    assert captures.count((3, 3, 4, 4)) == 1
    explainer(make_input(size=5), 1)  # dropped since: captured again
    assert captures.count((3, 3, 5, 5)) == 2
    assert len(explainer._programs) == 3


def _top_k(logits: torch.Tensor, k: int, scales: tuple[float, ...]) -> torch.Tensor:
    """Each image's k largest logits, weighted by ``scales``, as (B, 1, K) read-out weights."""
    weights = torch.zeros_like(logits)
    top = logits.topk(k, dim=1).indices
    weights.scatter_(1, top, torch.tensor(scales[:k], dtype=logits.dtype).expand(logits.shape[0], k))
    return weights.unsqueeze(1)


def test_a_readout_function_with_plain_arguments_is_compiled(monkeypatch):
    graphs = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graphs.append(graph) or graph)
    model, x = make_cnn(), make_input()
    explainer, fused = Explainer(model, backend="compiled"), Explainer(model, backend="fused")
    for k in (2, 3, 2):
        readout = ReadoutFunction(_top_k, (k, (1.0, -0.5, 0.25)))
        for _ in range(2):  # compiled, then replayed
            got = explainer.explain_targets(x, readout)
        want = fused.explain_targets(x, readout)
        for field in ("weight", "bias", "logit"):
            assert relative_distance(getattr(got, field), getattr(want, field)) <= 1e-12, (k, field)
    assert len(graphs) == 2  # one per value of k
    listed = ReadoutFunction(_top_k, (2, [1.0, -0.5]))
    got, want = explainer.explain_targets(x, listed), fused.explain_targets(x, listed)
    assert relative_distance(got.contribution, want.contribution) <= 1e-12
    assert len(graphs) == 2
