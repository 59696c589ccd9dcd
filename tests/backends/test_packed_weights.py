"""Convolutions of constant kernels on oneDNN with reordered weights (backends/packed_weights.py).

A float32 CNN's compiled explanation (strides, groups, dilation, a folded BatchNorm, a
kernel read as the parameter itself, max pooling) against the reference backend, 1e-5
relative (float32: oneDNN sums in another order), before and after its parameters change in
every way a training loop changes them; float64 and differentiable graphs keep ATen's.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensor

from omenn_kernels import Explainer, native
from omenn_kernels.backends import compiled, fused, packed_weights
from omenn_kernels.backends.packed_weights import packing_available
from omenn_kernels.ops import traced_as_aten
from omenn_kernels.testing import change_in_every_way, randomize_, relative_distance

pytestmark = pytest.mark.skipif(not packing_available(), reason="this PyTorch has no oneDNN convolutions")

TOLERANCE = 1e-5
PACKED = {"omenn.conv2d_packed_cpu.default", "omenn.conv2d_input_grad_packed_cpu.default"}


class _ConvNet(nn.Module):
    """Five convolutions of every kind the pass takes: folded into a BatchNorm, strided, grouped,
    dilated, and one without a norm (its kernel is the parameter itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.GELU(),
            nn.Conv2d(8, 8, 3, padding=1, groups=4), nn.BatchNorm2d(8), nn.SiLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 12, 3, padding=2, dilation=2, bias=False), nn.BatchNorm2d(12), nn.GELU(),
            nn.Conv2d(12, 12, 1), nn.GELU(),
            nn.Conv2d(12, 6, 3, stride=2, padding=1))
        self.head = nn.Linear(6, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


def _model(dtype: torch.dtype = torch.float32) -> _ConvNet:
    return randomize_(_ConvNet().to(dtype), seed=5).eval()


def _images(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 3, 17, 15, dtype=dtype, generator=torch.Generator().manual_seed(6))


def _called(explainer: Explainer, x: torch.Tensor) -> list[str]:
    program, _ = explainer.program(x)
    (explanation,) = compiled.explanations(program).values()
    return [str(node.target) for node in explanation.graph.graph.nodes if node.op == "call_function"]


def _assert_close(got, want) -> None:
    for field in ("weight", "bias", "logit"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= TOLERANCE, field


@pytest.mark.parametrize("compiler", ["traced", "inductor"])
def test_every_convolution_and_input_gradient_runs_packed_and_follows_the_parameters(compiler, monkeypatch):
    if compiler == "traced":
        monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model, x = _model(), _images()
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")  # no fallback to the fused backend
        for _ in range(2):  # compiled, then replayed
            _assert_close(explainer(x, 1), reference(x, 1))
    called = _called(explainer, x)
    assert called.count("omenn.conv2d_packed_cpu.default") == 5
    # The 1×1 convolution cuts patches: its input gradient is a matrix product.
    assert called.count("omenn.conv2d_input_grad_packed_cpu.default") == 4
    assert not {"aten.convolution.default", "aten.convolution_backward.default"} & set(called)
    native.load_cpu_kernels()  # which defines the op
    reorders = torch.ops.omenn.packed_weight_reorders
    before = reorders()
    explainer(x, 1)
    assert reorders() == before  # a replay reorders no weight
    for _ in range(2):
        change_in_every_way(model, torch.randn(4, 3, 17, 15), rebound=model.features[10].weight)
        _assert_close(explainer(x, 1), reference(x, 1))
        assert reorders() == before + 9  # every kernel changed: each reordered once per packed op
        before = reorders()


def test_under_onednn_convolutions_the_fused_explanation_is_the_packed_graphs(monkeypatch):
    """The fused backend under ``OneDNNConvolutions`` runs every convolution and input gradient that
    the packed graph runs through the packed ops (five and four; window sums of the ones too), and
    gives the packed graph's explanation (run uncompiled) to 1e-6 relative, float32: the same ops."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model, x = _model(), _images()
    packed_graph = Explainer(model, backend="compiled")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        want = packed_graph(x, 1)
    assert PACKED <= set(_called(packed_graph, x))
    calls = {"convolution": 0, "input gradient": 0}
    convolution, input_gradient = packed_weights.conv2d_packed_cpu, packed_weights.conv2d_input_grad_packed_cpu

    def counted(name, op):
        def call(activation, weight, *args):
            calls[name] += weight.shape[:2] != (1, 1)  # not a window sum of the ones
            return op(activation, weight, *args)
        return call

    monkeypatch.setattr(packed_weights, "conv2d_packed_cpu", counted("convolution", convolution))
    monkeypatch.setattr(packed_weights, "conv2d_input_grad_packed_cpu", counted("input gradient", input_gradient))
    explainer = Explainer(model, backend="fused")
    with packed_weights.OneDNNConvolutions(traced_as_aten(x.device)):
        got = explainer(x, 1)
    assert calls == {"convolution": 5, "input gradient": 4}
    for field in ("weight", "bias", "logit"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= 1e-6, field


def test_float64_and_differentiable_explanations_keep_atens_convolutions(monkeypatch):
    """oneDNN has no float64 convolution; a differentiable graph differentiates its convolutions."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model, x = _model(torch.float64), _images(torch.float64)
    explainer = Explainer(model, backend="compiled")
    for _ in range(2):
        explainer(x, 1)
    assert not PACKED & set(_called(explainer, x))
    model = _model()
    explainer = Explainer(model, backend="compiled")
    for _ in range(2):
        explainer(_images(), 1, create_graph=True).contribution.sum().backward()
    assert not PACKED & set(_called(explainer, _images()))


@pytest.mark.parametrize("fault, batch", [("rounding", 2), ("rounding", 4), ("raises", 2), ("wrong graph", 2),
                                          ("wrong graph", 4)])
def test_a_packed_graph_that_fails_its_checks_is_compiled_again_with_atens(fault, batch, monkeypatch, caplog):
    """Where oneDNN's rounding does not pass the checks against the fused backend, the signature is
    compiled with ATen's convolutions, without a warning, from the same trace. A fault of the
    packed convolution itself (standing for oneDNN's rounding) is found on the fused explanation
    of the check's samples with oneDNN's convolutions, before any packed graph is compiled; a
    packing pass that raises, before it compiles; a wrong packed graph, by its compiled check.
    The fused backend explains the check's pair (twice: with ATen's and with oneDNN's
    convolutions), never the whole batch of four."""
    explained = []  # the batch sizes the fused backend explained (not traced)
    explain_batch = fused.explain_batch

    def counted_explain_batch(program, model, x, *args):
        if not isinstance(x, FakeTensor):
            explained.append(x.shape[0])
        return explain_batch(program, model, x, *args)

    monkeypatch.setattr(fused, "explain_batch", counted_explain_batch)
    compilations = []
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: compilations.append(graph) or graph)
    pack, make_fx, traces = compiled.pack_constant_convolutions, compiled.make_fx, []

    def counted_make_fx(*args, **kwargs):
        traces.append(args[0])
        return make_fx(*args, **kwargs)

    monkeypatch.setattr(compiled, "make_fx", counted_make_fx)
    if fault == "rounding":
        convolution = packed_weights.conv2d_packed_cpu

        def rounded_otherwise(x, weight, bias, *args):
            return convolution(x, weight, None, *args)  # the bias dropped

        monkeypatch.setattr(packed_weights, "conv2d_packed_cpu", rounded_otherwise)
    else:
        def faulty(graph: torch.fx.GraphModule) -> int:
            if fault == "raises":
                raise RuntimeError("no oneDNN here")
            replaced = pack(graph)
            for node in graph.graph.nodes:
                if str(node.target) == "omenn.conv2d_packed_cpu.default":
                    node.update_arg(2, None)  # drop a bias
            graph.recompile()
            return replaced

        monkeypatch.setattr(compiled, "pack_constant_convolutions", faulty)
    model, x = _model(), _images().repeat(batch // 2, 1, 1, 1)
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    with warnings.catch_warnings(), caplog.at_level("INFO", logger="omenn_kernels.compiled"):
        warnings.filterwarnings("error", message="omenn_kernels")
        for _ in range(2):
            _assert_close(explainer(x, 1), reference(x, 1))
    assert explained == [2, 2]
    assert not PACKED & set(_called(explainer, x))
    assert "aten.convolution.default" in _called(explainer, x)
    assert any("with oneDNN's convolutions did not pass its checks" in r.getMessage() for r in caplog.records)
    assert len(traces) == 1
    assert len(compilations) == (2 if fault == "wrong graph" else 1)  # the wrong graph's found compiled
    assert not PACKED & {str(node.target) for node in compilations[-1].graph.nodes}
    native.load_cpu_kernels()
    assert torch.ops.omenn.clear_packed_weights() == 0  # the failed graph's kernels are not kept


class _PatchEmbedding(nn.Module):
    """A ViT's shape of work: one patch convolution, then products with 1,000 times its FLOPs."""

    def __init__(self) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, 16, 4, stride=4)
        self.mlp = nn.Sequential(*(layer for _ in range(4) for layer in (nn.Linear(16, 512), nn.GELU(),
                                                                          nn.Linear(512, 16))))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mlp(self.patches(x).flatten(2).transpose(1, 2)).mean(1))


@pytest.mark.parametrize("model, dtype, events", [
    ("convolutions", torch.float32, ["check oneDNN", "compile", "check"]),
    ("convolutions", torch.float64, ["compile", "check"]),
    ("patch embedding", torch.float32, ["compile", "check"])])
def test_only_a_graph_to_be_packed_is_checked_with_onednn_before_it_is_compiled(model, dtype, events, monkeypatch):
    """The checks against the fused backend, in the order they run: for a float32 graph whose
    convolutions weigh, the fused explanation with oneDNN's convolutions, then the packed graph,
    compiled; a float64 graph (ATen's convolutions) and one whose convolutions are under a tenth
    of its products are not packed, and are compiled and checked once."""
    ran = []
    check = compiled._mismatch

    def recorded_check(*args, **kwargs):
        ran.append("check oneDNN" if "oneDNN" in kwargs.get("subject", "") else "check")
        return check(*args, **kwargs)

    monkeypatch.setattr(compiled, "_mismatch", recorded_check)
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: ran.append("compile") or graph)
    if model == "convolutions":
        model, x = _model(dtype), _images(dtype)
    else:
        model, x = randomize_(_PatchEmbedding(), seed=5).eval(), _images()[..., :16, :12]
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")  # no fallback to the fused backend
        explainer(x, 1)
    assert ran == events
    assert bool(PACKED & set(_called(explainer, x))) == (len(events) == 3)
