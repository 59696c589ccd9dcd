"""The graph walker (linearize/program.py): CONST / GATE / LIVE classification and errors.

Models are captured with ``omenn_kernels.capture.capture`` and classified by
``linearize``; nodes are found by the module that produced them and their aten op.
"""

from __future__ import annotations

import math
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omenn_kernels import Explainer, UnsupportedOpError, explain
from omenn_kernels.backends import executor
from omenn_kernels.capture import capture
from omenn_kernels.linearize import Kind, linearize
from omenn_kernels.linearize.registry import op_name
from rule_checks import DT, SqueezeExcite, assert_sums_to_logit


def _kinds(model: nn.Module, x: torch.Tensor) -> list[tuple[str, str, Kind]]:
    program = linearize(capture(model, x))
    return [(step.module_path, op_name(step.node.target), step.kind) for step in program.steps]


def _only(kinds, path: str, op: str) -> Kind:
    found = [k for p, o, k in kinds if p == path and o == op]
    assert len(found) == 1, (path, op, kinds)
    return found[0]


def _all(kinds, path: str) -> set[Kind]:
    return {k for p, _, k in kinds if p == path}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, sdpa: bool):
        super().__init__()
        self.heads, self.sdpa = heads, sdpa
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, t):
        b, n, d = t.shape
        split = lambda y: y.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q(t)), split(self.k(t)), split(self.v(t))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v)
        else:
            a = (q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)).softmax(-1)
            y = a @ v
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    """A ViT-like block: LayerNorm → attention → residual → LayerNorm → MLP (GELU) → residual."""

    def __init__(self, dim: int, sdpa: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, 2, sdpa)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, t):
        t = t + self.attn(self.norm1(t))
        return t + self.fc2(F.gelu(self.fc1(self.norm2(t))))


class TinyViT(nn.Module):
    def __init__(self, sdpa: bool, dim: int = 8):
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 2, stride=2)
        self.pos = nn.Parameter(torch.randn(1, 4, dim))
        self.block = Block(dim, sdpa)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        t = self.embed(x).flatten(2).transpose(1, 2) + self.pos * 0.5
        return self.head(self.block(t).mean(1))


@pytest.mark.parametrize("sdpa", [True, False])
def test_attention_query_and_key_projections_are_gates(sdpa):
    torch.manual_seed(0)
    model = TinyViT(sdpa).double()
    x = torch.randn(2, 3, 4, 4, dtype=DT)
    kinds = _kinds(model, x)
    assert _only(kinds, "block.attn.q", "aten.linear.default") is Kind.GATE
    assert _only(kinds, "block.attn.k", "aten.linear.default") is Kind.GATE
    assert _only(kinds, "block.attn.v", "aten.linear.default") is Kind.LIVE
    assert _only(kinds, "block.attn.proj", "aten.linear.default") is Kind.LIVE
    assert _only(kinds, "block.norm1", "aten.layer_norm.default") is Kind.LIVE
    assert _only(kinds, "block", "aten.gelu.default") is Kind.LIVE
    attn_ops = {(o, k) for p, o, k in kinds if p == "block.attn"}
    if sdpa:
        assert ("aten.scaled_dot_product_attention.default", Kind.LIVE) in attn_ops
    else:
        assert ("aten.softmax.int", Kind.GATE) in attn_ops or ("aten._softmax.default", Kind.GATE) in attn_ops
        matmuls = [k for o, k in attn_ops if o in ("aten.matmul.default", "aten.bmm.default")]
        assert Kind.GATE in matmuls and Kind.LIVE in matmuls  # Q·Kᵀ held, A·V live
    # The positional embedding's scaling does not depend on the input.
    assert _only(kinds, "", "aten.mul.Tensor") is Kind.CONST
    e = explain(model, x, 1)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-10)


class SENet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.se = SqueezeExcite(4, 2, "sigmoid")
        self.act = nn.Sigmoid()
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.act(self.se(self.conv(x))).mean((2, 3)))


def test_squeeze_excitation_branch_is_gate_and_sigmoid_activation_is_live():
    torch.manual_seed(1)
    model = SENet().double()
    x = torch.randn(2, 3, 4, 4, dtype=DT)
    kinds = _kinds(model, x)
    assert _all(kinds, "se.fc1") == {Kind.GATE}
    assert _all(kinds, "se.fc2") == {Kind.GATE}
    assert _only(kinds, "se", "aten.mean.dim") is Kind.GATE
    assert _only(kinds, "se", "aten.relu.default") is Kind.GATE
    assert _only(kinds, "se", "aten.sigmoid.default") is Kind.GATE
    assert _only(kinds, "se", "aten.mul.Tensor") is Kind.LIVE
    assert _only(kinds, "act", "aten.sigmoid.default") is Kind.LIVE
    assert _only(kinds, "conv", "aten.conv2d.default") is Kind.LIVE
    e = explain(model, x, 0)
    assert_sums_to_logit(e, model, x, 0, rtol=1e-10)


class _Inner(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _Outer(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.block = nn.Sequential(nn.Conv2d(2, 2, 1), _Inner(fn))
        self.head = nn.Linear(2 * 3 * 3, 2)

    def forward(self, x):
        return self.head(self.block(x).flatten(1))


@pytest.mark.parametrize("fn,op,kind_words", [
    (torch.abs, "aten.abs.default", "R5'"),
    (lambda y: torch.cummax(y, 2).values, "aten.cummax.default", "new rule"),
    (lambda y: torch.log_softmax(y, 3), "aten.log_softmax.int", "log Σ exp"),
])
def test_unsupported_op_is_named_with_module_path_and_rule_kind(fn, op, kind_words):
    model = _Outer(fn).double()
    x = torch.randn(1, 2, 3, 3, dtype=DT)
    captured = capture(model, x)
    with pytest.raises(UnsupportedOpError) as info:
        linearize(captured)  # reported before anything runs
    err = info.value
    assert err.op == op
    assert err.module_path == "block.1"
    assert kind_words in err.rule_kind
    assert op in str(err) and "block.1" in str(err)
    with pytest.raises(UnsupportedOpError):
        explain(model, x, 0)


def test_ops_on_constants_need_no_rule():
    """abs/cumsum on parameters only: CONST, computed normally, no error."""

    class ConstMath(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 9, dtype=DT))

        def forward(self, x):
            return x.flatten(1) @ torch.cumsum(self.w.abs(), 1).T

    model = ConstMath()
    x = torch.randn(2, 1, 3, 3, dtype=DT)
    kinds = _kinds(model, x)
    assert {k for _, o, k in kinds if o in ("aten.abs.default", "aten.cumsum.default")} == {Kind.CONST}
    e = explain(model, x, 1)
    torch.testing.assert_close(e.weight[:, 0].flatten(1), torch.cumsum(model.w.abs(), 1)[1].detach().expand(2, 9),
                               rtol=1e-12, atol=1e-13)


class _ScaledSigmoid(nn.Module):
    """An activation written as 2·σ(y) − 1 (= tanh(y/2)): σ multiplies a CONST, not a LIVE tensor."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(3 * 3 * 3, 2)

    def forward(self, x):
        return self.head((2 * torch.sigmoid(self.conv(x)) - 1).flatten(1))


def test_sigmoid_scaled_by_a_constant_is_an_activation():
    torch.manual_seed(2)
    model = _ScaledSigmoid().double()
    x = torch.randn(2, 2, 3, 3, dtype=DT)
    e = explain(model, x, 1)
    assert_sums_to_logit(e, model, x, 1, rtol=1e-10)
    # 2σ(y) − 1 = tanh(y/2): the same explanation as nn.Tanh on y/2 (ξ and f(0) = 0 agree).
    xg = x.clone().requires_grad_(True)
    y = model.conv(xg)
    xi = ((2 * torch.sigmoid(y) - 1) / y).detach()
    (cw,) = torch.autograd.grad(model.head((y * xi).flatten(1))[:, 1].sum(), xg)
    torch.testing.assert_close(e.weight, cw, rtol=1e-10, atol=1e-13)


class _Rows(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)


def test_a_program_prints_as_a_table_of_its_nodes():
    """``print(program)``: a header, then per node its name, op, kind, rule and module path."""
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), _Rows(), nn.Linear(4 * 4 * 4, 2)).to(DT)
    program = linearize(capture(model, torch.randn(2, 3, 6, 6, dtype=DT)))
    lines = str(program).splitlines()
    assert len(lines) == 2 + len(program.steps)
    table = {line.split()[0]: line.split() for line in lines[2:]}
    assert table["conv2d"][1:4] == ["aten.conv2d.default", "live", "R2"] and table["conv2d"][-1] == "0"
    assert table["relu"][-1] == "1" and table["linear"][-1] == "3"
    assert table["sym_size_int_1"][1:4] == ["aten.sym_size.int", "const", "-"]  # the symbolic batch size


@pytest.mark.parametrize("released", [True, False], ids=["released", "kept"])
def test_a_forward_holds_a_value_only_until_its_last_read(released, monkeypatch):
    """The executor drops each value after the last step that reads it: at the end of a deep
    network's forward only what autograd saved is still alive (the linear outputs, which the
    activations keep), not every activation output. The check is shown to see the difference."""
    depth = 12
    model = nn.Sequential(*[layer for _ in range(depth) for layer in (nn.Linear(16, 16), nn.GELU())]).eval()
    x = torch.randn(4, 16)
    program, _ = Explainer(model, backend="fused").program(x)
    if not released:
        monkeypatch.setattr(type(program), "released_after", property(lambda p: tuple(() for _ in p.steps)))
    results: list[weakref.ref] = []
    alive_at_the_last_step: list[int] = []
    last = sum(step.kind is Kind.LIVE for step in program.steps) - 1

    def implementation(rule):
        def run(*args, **kwargs):
            if len(results) == last:
                alive_at_the_last_step.append(sum(ref() is not None for ref in results))
            result = (rule.fused or rule.reference)(*args, **kwargs)
            results.append(weakref.ref(result.value))
            return result
        return run

    inputs = x.clone().requires_grad_(True)
    output, _ = executor.forward(program, model, inputs, x.new_ones(4, 1).requires_grad_(True), implementation)
    assert output.value.shape == (4, 16) and len(results) == 2 * depth
    if released:
        assert alive_at_the_last_step == [depth]  # the saved linear outputs: activation outputs dropped
    else:
        assert alive_at_the_last_step == [2 * depth - 1]
