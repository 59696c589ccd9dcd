"""The output features of a linear layer that can receive a gradient, decided from the graph.

Features that only feed gates (a fused qkv projection's query and key thirds) get no
gradient for any input; those that can are found by following the features through the
structure operations. Tolerance of the explanation checks (float64): 1e-10 relative.
"""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn

from omenn_kernels import Explainer
from omenn_kernels.capture import capture
from omenn_kernels.linearize import linearize, receiving
from omenn_kernels.linearize.program import Kind
from omenn_kernels.ops import linear_ones as linear_op
from omenn_kernels.testing import randomize_


def _linear_steps(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, int] | None]:
    program = linearize(capture(model, x))
    return {step.module_path: step.receiving for step in program.steps
            if step.kind is Kind.LIVE and step.rule.receiving}


class _Tokens(nn.Module):
    """Pixels as tokens, one linear layer split by ``route`` into gate-feeding and LIVE parts."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.route = route
        self.mixed = nn.Linear(3, 8)
        self.head = nn.Linear(2, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.mixed(x.flatten(2).transpose(1, 2))
        if self.route == "gate_then_live":  # features 0:6 feed a sigmoid gate, 6:8 are LIVE
            gate, live = tokens[..., :6], tokens[..., 6:]
            scale = torch.sigmoid(gate.sum(-1, keepdim=True))
        elif self.route == "live_in_two_blocks":  # features 2:4 and 6:8 LIVE
            parts = tokens.view(*tokens.shape[:-1], 2, 4)
            gate, live = parts[..., :2].flatten(-2), parts[..., 2].add(parts[..., 3])
            scale = torch.sigmoid(gate.sum(-1, keepdim=True))
        else:  # ReLU in between: every feature may receive, dead or not at capture time
            live = torch.relu(tokens).view(*tokens.shape[:-1], 4, 2).sum(-2)
            scale = torch.ones_like(live[..., :1])
        return self.head(live * scale).mean(1)


@pytest.mark.parametrize("route,expected", [("gate_then_live", (6, 8)), ("live_in_two_blocks", None),
                                            ("relu", None)])
def test_receiving_features_follow_the_graph(route, expected):
    torch.manual_seed(0)
    model = randomize_(_Tokens(route).double().eval(), scale=0.5)
    x = torch.randn(3, 3, 4, 4, dtype=torch.float64)
    assert _linear_steps(model, x) == {"mixed": expected, "head": None}
    explainer = Explainer(model, backend="fused")
    want = Explainer(model, backend="reference")(x, 2)
    got = explainer(x, 2)
    for name in ("contribution", "weight", "bias"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-10, atol=1e-12)


def test_a_vit_qkv_receives_on_its_value_third_only():
    torch.manual_seed(0)
    model = randomize_(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2).eval())
    blocks = _linear_steps(model, torch.randn(2, 3, 32, 32))
    width = model.embed_dim
    for depth in range(2):
        assert blocks[f"blocks.{depth}.attn.qkv"] == (2 * width, 3 * width)
        assert blocks[f"blocks.{depth}.mlp.fc1"] is None
        assert blocks[f"blocks.{depth}.attn.proj"] is None
    assert blocks["head"] is None


def test_a_bias_free_qkv_multiplies_its_value_third_only(monkeypatch):
    """Without a bias the fused linear still runs (no ones work, the receiving block only)."""
    torch.manual_seed(0)
    model = randomize_(timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2,
                                         qkv_bias=False).double().eval())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    calls = []
    fused = linear_op.linear_ones

    def spy(x, ones, weight, bias, start, stop):
        calls.append((bias is None, start, stop, weight.shape[0]))
        return fused(x, ones, weight, bias, start, stop)

    monkeypatch.setattr(linear_op, "linear_ones", spy)
    got = Explainer(model, backend="fused")(x, 3)
    want = Explainer(model, backend="reference")(x, 3)
    width = model.embed_dim
    assert calls.count((True, 2 * width, 3 * width, 3 * width)) == 2
    for name in ("contribution", "weight", "bias"):
        torch.testing.assert_close(getattr(got, name), getattr(want, name), rtol=1e-10, atol=1e-12)


def test_a_value_too_large_to_follow_counts_every_feature(monkeypatch):
    monkeypatch.setattr(receiving, "MAX_FOLLOWED", 16)
    torch.manual_seed(0)
    model = randomize_(_Tokens("gate_then_live").double().eval(), scale=0.5)
    assert _linear_steps(model, torch.randn(3, 3, 4, 4, dtype=torch.float64)) == {"mixed": None, "head": None}
