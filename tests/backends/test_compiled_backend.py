"""The compiled backend: one traced graph per signature, equal to the reference, no host reads.

Most tests compile with the traced aten graph itself (``COMPILER`` swapped for the
identity): the trace is what decides the numbers and the ops, and Inductor's C++
compilation of every family would take many minutes on a CI machine. One test compiles
with Inductor. Tolerances are the fused backend's: relative (Frobenius) 1e-10 in
float64, 1e-5 in float32.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import re
import warnings

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from omenn_kernels import Explainer, InputError, ReadoutFunction, TargetError
from omenn_kernels.backends import compiled, direct_inductor, fused
from omenn_kernels.backends.layout import runs_channels_last
from omenn_kernels.readout import Readout
from omenn_kernels.testing import FAMILIES, randomize_, relative_distance

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
SYNC = torch.ops.aten._local_scalar_dense.default


@pytest.fixture
def traced(monkeypatch):
    """Compile with the traced graph itself."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


class _Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _assert_equal_explanations(got, want, dtype) -> None:
    for field in ("contribution", "weight", "bias"):
        assert relative_distance(getattr(got, field), getattr(want, field)) <= TOLERANCE[dtype], field
    assert relative_distance(got.logit, want.logit) <= TOLERANCE[dtype]
    assert relative_distance(got.logits, want.logits) <= TOLERANCE[dtype]
    assert torch.equal(got.target, want.target)


def _model(name: str, dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    family = FAMILIES[name]
    torch.manual_seed(5)
    model = randomize_(family.build(), seed=5).to(dtype).eval()
    return model, torch.randn(2, 3, family.size, family.size, dtype=dtype)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_compiled_equals_reference_on_every_family(name, traced):
    """float64, one class per image (every kind of target: the test below, on a ViT and a CNN).

    In the CNNs with max pooling, max pooling reads the value at each window's arg-max with a
    gather over rows of channels, whose result is channels-last, as ATen's pooling keeps it,
    so that every convolution of the compiled graph reads channels-last activations."""
    model, x = _model(name, torch.float64)
    reference, explainer = Explainer(model, backend="reference"), Explainer(model, backend="compiled")
    target = torch.tensor([0, 2])
    expected = reference(x, target)
    for _ in range(2):  # the first call of a signature runs eagerly and compiles; the second runs the graph
        _assert_equal_explanations(explainer(x, target), expected, torch.float64)
    if name in ("cnn", "resnet", "vgg"):
        program, _ = explainer.program(x)
        (explanation,) = compiled.explanations(program).values()
        nodes = list(explanation.graph.graph.nodes)
        assert any("max_pool_indices" in str(node.target) for node in nodes)
        inputs = [node.args[0].meta["val"] for node in nodes if node.target is torch.ops.aten.convolution.default]
        assert inputs and all(value.is_contiguous(memory_format=torch.channels_last) for value in inputs)


def _compiled_graph(name: str = "vit") -> tuple[torch.nn.Module, torch.fx.Graph]:
    """A family's model and the traced graph of its compiled explanation, whose numbers
    (first call and replay) are checked against the reference's."""
    model, x = _model(name, torch.float64)
    explainer = Explainer(model, backend="compiled")
    expected = Explainer(model, backend="reference")(x, 1)
    for _ in range(2):
        _assert_equal_explanations(explainer(x, 1), expected, torch.float64)
    program, _ = explainer.program(x)
    (explanation,) = compiled.explanations(program).values()
    return model, explanation.graph.graph


def test_the_traced_attention_is_one_block_where_eager_runs_it_in_chunks(traced, monkeypatch):
    """The CPU's eager attention runs over chunks of heads written into slices of a buffer;
    the traced graph computes it whole (its compiler blocks the loops, and writes into
    slices would become scatters): one softmax per attention layer, no ``out=`` ops."""
    from omenn_kernels.linearize.rules import attention

    monkeypatch.setattr(attention, "_CHUNK_BYTES", 1)  # one head per chunk when eager
    monkeypatch.setattr(attention, "weights_fit_one_chunk", lambda q, k: True)  # written out, not the op
    model, graph = _compiled_graph()
    targets = [str(node.target) for node in graph.nodes if node.op == "call_function"]
    layers = sum(isinstance(m, torch.nn.MultiheadAttention) or type(m).__name__ == "Attention"
                 for m in model.modules())
    assert layers and sum("softmax" in t for t in targets) == layers
    assert not [t for t in targets if t.endswith("_out") or ".out" in t]


@pytest.mark.parametrize("weights_fit_one_chunk", [True, False], ids=["written-out", "never-written"])
def test_attention_weights_larger_than_one_chunk_are_never_written_in_the_graph(weights_fit_one_chunk, traced,
                                                                                monkeypatch):
    """On the CPU, attention whose weights do not fit in one chunk runs ``omenn::attention``
    in the traced graph: no value of T×T per head, forward or backward, and the reference's
    numbers. Weights that fit are written out (the check sees them there)."""
    from omenn_kernels.linearize.rules import attention

    if not weights_fit_one_chunk:
        monkeypatch.setattr(attention, "_CHUNK_BYTES", 0)
    model, graph = _compiled_graph()
    tokens = model.patch_embed.num_patches + model.num_prefix_tokens
    square = [node for node in graph.nodes
              if isinstance(node.meta.get("val"), torch.Tensor) and node.meta["val"].shape[-2:] == (tokens, tokens)]
    calls = [node for node in graph.nodes if node.target == torch.ops.omenn.attention.default]
    layers = len(model.blocks)
    if weights_fit_one_chunk:
        assert len(square) >= layers and not calls
    else:
        assert not square and len(calls) == layers


@pytest.mark.parametrize("name, dtype", [("vit", torch.float64), ("cnn", torch.float64), ("cnn", torch.float32)],
                         ids=["vit-float64", "cnn-float64", "cnn-float32"])
def test_compiled_equals_reference_for_every_kind_of_target(name, dtype, traced):
    """The predicted class, an int, indices, contrastive read-out weights and several read-outs."""
    model, x = _model(name, dtype)
    reference, explainer = Explainer(model, backend="reference"), Explainer(model, backend="compiled")
    classes = reference(x).logits.shape[1]
    contrast = torch.zeros(classes, dtype=dtype)
    contrast[0], contrast[1] = 1.0, -1.0
    readouts = torch.randn(2, 3, classes, dtype=dtype)
    targets = (None, 1, torch.tensor([0, 2]), contrast)
    expected = [reference(x, target) for target in targets]
    expected_readouts = reference.explain_targets(x, readouts)
    for _ in range(2):  # compiled, then replayed
        for target, want in zip(targets, expected):
            _assert_equal_explanations(explainer(x, target), want, dtype)
        _assert_equal_explanations(explainer.explain_targets(x, readouts), expected_readouts, dtype)


def test_a_float32_cnn_in_channels_last_compiles_without_falling_back(traced):
    """The eager first call and the traced graph run a CNN's layers in the same layout.

    In float32 two layouts round a convolution differently, and on a ReLU network the
    explanation follows which pre-activations round to either side of 0: with the pooled
    values channels-last in the graph but the fused C++ activations writing contiguous
    results in the eager call, ResNet-18's traced explanation of one of these batches
    differed from the eager one by 8e-3 relative and fell back to the fused backend."""
    model, _ = _model("resnet", torch.float32)
    explainer = Explainer(model, backend="compiled")
    for seed in range(6):
        x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(seed))
        compiled.explanations(explainer.program(x)[0]).clear()  # traced and checked on this batch
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            for _ in range(2):
                explainer(x, None)
        program, _ = explainer.program(x)
        assert runs_channels_last(program, x) and compiled.replays(program, model, x, Readout(None))


@pytest.mark.parametrize("name", ["vit", "cnn"])
def test_a_compiled_explanation_is_one_graph_and_reads_nothing_back(name, traced, monkeypatch):
    """After the first call, an explanation runs the traced graph alone: no rule, no interpreter,
    no ``_local_scalar_dense`` (a device sync on GPUs) besides the API's one input check."""
    model, x = _model(name, torch.float32)
    explainer = Explainer(model, backend="compiled")
    explainer(x, 1)
    program, _ = explainer.program(x)
    (explanation,) = compiled.explanations(program).values()
    assert isinstance(explanation.graph, torch.fx.GraphModule) and explanation.run is explanation.graph
    assert "omenn.linear_ones" in explanation.graph.code or "omenn.conv2d_ones" in explanation.graph.code

    def interpreted(*args, **kwargs):
        raise AssertionError("the fused backend's interpreter ran")
    monkeypatch.setattr(fused, "explain_batch", interpreted)
    with _Dispatched() as inside:
        compiled.explain_batch(program, model, x, Readout(torch.tensor([1, 1])))
    assert SYNC not in inside.ops
    with _Dispatched() as whole:
        e = explainer(x, 1)
    assert whole.ops.count(SYNC) == 1  # the API's finiteness check of the input
    torch.testing.assert_close(e.contribution.sum((1, 2)), e.logit, rtol=1e-4, atol=1e-4)


class _Order(TorchDispatchMode):
    """Appends ``"read"`` to ``order`` at every host read."""

    def __init__(self, order: list) -> None:
        super().__init__()
        self.order = order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is SYNC:
            self.order.append("read")
        return func(*args, **(kwargs or {}))


def test_a_replayed_graph_runs_before_the_input_check_is_read_and_nan_is_still_refused(traced):
    """On a GPU, the device runs the graph while the host waits for the finiteness verdict."""
    model, x = _model("cnn", torch.float32)
    explainer = Explainer(model, backend="compiled")
    bad = x.clone()
    bad[1, 2, 3, 4] = float("nan")
    with pytest.raises(InputError, match=r"1 NaN or Inf"):
        explainer(bad, 1)  # refused before anything is captured or compiled for it
    assert not explainer._programs
    first = explainer(x, 1)
    program, _ = explainer.program(x)
    ((key, traced_graph),) = compiled.explanations(program).items()
    order: list = []
    explanation = dataclasses.replace(traced_graph,
                                      run=lambda *inputs: order.append("graph") or traced_graph.run(*inputs))
    compiled.explanations(program)[key] = explanation
    with _Order(order):
        again = explainer(x, 1)
    assert order == ["graph", "read"]
    _assert_equal_explanations(again, first, torch.float32)
    with pytest.raises(InputError, match=r"1 NaN or Inf"):
        explainer(bad, 1)
    assert list(compiled.explanations(program).values()) == [explanation]  # kept, not marked failed
    _assert_equal_explanations(explainer(x, 1), first, torch.float32)


def test_a_compilation_is_logged_with_its_time(traced, caplog):
    """Compile time is reported at INFO, stage by stage, with the input and the kind of target it
    is for; the compiled explanation keeps the stages' times."""
    model, x = _model("mlp", torch.float64)
    explainer = Explainer(model, backend="compiled")
    with caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        explainer(x, torch.tensor([1, 0]))
    (message,) = [r.getMessage() for r in caplog.records if r.name == "omenn_kernels.compiled"]
    expected = re.escape(f"compiled the explanation of {type(model).__name__} for input {tuple(x.shape)} "
                         "torch.float64 and target indices in ")
    stages = ", ".join(re.escape(stage) + r" \d+\.\d s" for stage in compiled.STAGES)
    assert re.fullmatch(expected + r"\d+\.\d s \(" + stages + r"; \d+ aten nodes, \d+ shape-only values folded, "
                        r"\d+ parameter-only values kept, \d+ convolutions with reordered kernels\)",
                        message), message
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    assert tuple(kept.stages) == compiled.STAGES
    assert all(spent >= 0 for spent in kept.stages.values()) and sum(kept.stages.values()) <= kept.seconds


def test_a_failed_compilation_warns_once_and_falls_back(monkeypatch):
    model, x = _model("cnn", torch.float64)

    def failing(graph, example):
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(compiled, "COMPILER", failing)
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    with pytest.warns(RuntimeWarning, match="could not compile .*RuntimeError: no C\\+\\+ compiler"):
        first = explainer(x, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        second = explainer(x, 1)
    for e in (first, second):
        _assert_equal_explanations(e, reference(x, 1), torch.float64)


def test_a_compiled_graph_that_differs_is_not_used(monkeypatch):
    model, x = _model("mlp", torch.float64)

    def wrong(graph, example):
        return lambda *inputs: tuple(t * 2 if t.is_floating_point() else t for t in graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", wrong)
    explainer = Explainer(model, backend="compiled")
    with pytest.warns(RuntimeWarning, match="differs from the fused backend's in its weight"):
        explainer(x, 1)
    _assert_equal_explanations(explainer(x, 1), Explainer(model, backend="reference")(x, 1), torch.float64)


def test_the_fused_check_explains_the_first_and_last_sample(traced, monkeypatch):
    """A first call and a new batch size are checked against the fused explanation of two samples."""
    model, _ = _model("mlp", torch.float64)
    x = torch.randn(5, *_.shape[1:], dtype=torch.float64)
    checked = []
    explain_batch = fused.explain_batch

    def recorded(program, model, images, *arguments):
        if type(images) is torch.Tensor:  # not the trace's fake ones
            checked.append(images.clone())
        return explain_batch(program, model, images, *arguments)
    monkeypatch.setattr(fused, "explain_batch", recorded)
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    for batch in (x, torch.cat([x, x[:2].flip(0)])):
        checked.clear()
        _assert_equal_explanations(explainer(batch, 1), reference(batch, 1), torch.float64)
        assert len(checked) == 1 and torch.equal(checked[0], batch[[0, -1]])


def test_a_graph_wrong_on_a_sample_not_checked_against_fused_is_not_used(monkeypatch):
    """Its incompleteness there has the fused backend explain the whole batch, which differs."""
    model, _ = _model("mlp", torch.float64)
    x = torch.randn(5, *_.shape[1:], dtype=torch.float64)

    def wrong_in_the_middle(graph, example):
        def run(*inputs):
            weight, *rest = graph(*inputs)
            return (weight.index_fill(0, torch.tensor([2]), 1.0), *rest)
        return run
    monkeypatch.setattr(compiled, "COMPILER", wrong_in_the_middle)
    explainer = Explainer(model, backend="compiled")
    with pytest.warns(RuntimeWarning, match="differs from the fused backend's in its weight"):
        first = explainer(x, 1)
    _assert_equal_explanations(first, Explainer(model, backend="reference")(x, 1), torch.float64)


class _Float32RMSNorm(torch.nn.Module):
    """Hugging Face Llama's RMSNorm: computed in float32 whatever the input's type."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        computed = hidden.to(torch.float32)
        computed = computed * torch.rsqrt(computed.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * computed.to(hidden.dtype)


@pytest.mark.parametrize("in_float32", [True, False], ids=["float32-norm", "float64"])
def test_a_graph_computing_in_float32_is_held_to_float32s_tolerance(monkeypatch, in_float32):
    """A float64 model that computes its norm in float32, as Llama does, rounds to float32 there:
    its compiled graph, here scaled by 1 + 1e-7 as float32 kernels that round otherwise give, is
    used; the same graph of a model computing in float64 throughout is not (1e-8 relative)."""
    torch.manual_seed(3)
    norm = _Float32RMSNorm(16) if in_float32 else torch.nn.LayerNorm(16)
    model = randomize_(torch.nn.Sequential(torch.nn.Linear(8, 16), norm, torch.nn.GELU(),
                                           torch.nn.Linear(16, 4)), seed=3).double().eval()
    x = torch.randn(3, 8, dtype=torch.float64)

    def rounding_as_float32(graph, example):
        return lambda *inputs: tuple(t * (1 + 1e-7) if t.is_floating_point() else t for t in graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", rounding_as_float32)
    explainer = Explainer(model, backend="compiled")
    program, _ = explainer.program(x)
    assert compiled.computing_dtype(program.captured.graph, x) == (torch.float32 if in_float32 else torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        explainer(x, 1)
    (kept,) = compiled.explanations(program).values()
    if in_float32:
        assert not caught and isinstance(kept, compiled.CompiledExplanation)
    else:
        assert kept is compiled._FAILED
        assert [str(w.message) for w in caught] == [
            "omenn_kernels: the compiled explanation of Sequential differs from the fused backend's in its weight "
            "by more than 1e-08 relative; this signature runs on the fused backend"]


def test_every_call_of_a_signature_gives_the_compiled_graphs_numbers(monkeypatch):
    """The first call too (its numbers are those of the compile-time check run), so results do
    not depend on which call compiled: here the graph rounds unlike the fused backend (its
    floating outputs scaled by 1 + 1e-12, within the check's tolerance)."""
    model, x = _model("cnn", torch.float64)

    def rounding_otherwise(graph, example):
        return lambda *inputs: tuple(t * (1 + 1e-12) if t.is_floating_point() else t for t in graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", rounding_otherwise)
    explainer = Explainer(model, backend="compiled")
    first, second = explainer(x, 1), explainer(x, 1)
    for field in ("contribution", "weight", "bias", "logit", "logits"):
        assert torch.equal(getattr(first, field), getattr(second, field)), field
    eager = Explainer(model, backend="fused")(x, 1)
    assert not torch.equal(first.weight, eager.weight)
    _assert_equal_explanations(first, eager, torch.float64)


def test_in_half_precision_the_compiled_graph_is_held_to_its_logits_and_completeness(monkeypatch):
    """bfloat16: a correct graph is used (its weight may differ from the fused backend's by
    rounding); one that lost its map (all zeros) is not complete and is not used."""
    model, x = _model("cnn", torch.float32)
    model, x = model.to(torch.bfloat16), x.to(torch.bfloat16)
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        Explainer(model, backend="compiled")(x)

    def lost_map(graph, example):
        return lambda *inputs: (lambda w, b, *rest: (w * 0, b * 0, *rest))(*graph(*inputs))
    monkeypatch.setattr(compiled, "COMPILER", lost_map)
    with pytest.warns(RuntimeWarning, match=r"compiled explanation of .* is not complete"):
        Explainer(model, backend="compiled")(x)


def test_under_autocast_to_bfloat16_the_compiled_graph_is_used(traced):
    """Autocast computes in bfloat16 from float32 images: the graph is held to its logits and
    completeness, as with bfloat16 images, not to float32's tolerance (under which every such
    signature fell back to the fused backend)."""
    model, x = _model("vit", torch.float32)
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings(), torch.autocast("cpu", dtype=torch.bfloat16):
        warnings.filterwarnings("error", message="omenn_kernels")
        for _ in range(2):
            explanation = explainer(x, 1)
    program, _ = explainer.program(x)
    (compiled_explanation,) = compiled.explanations(program).values()
    assert isinstance(compiled_explanation, compiled.CompiledExplanation)
    assert explanation.logit.dtype == torch.bfloat16


def test_a_cnn_under_autocast_falls_back_with_the_cause_named(traced):
    """Fused ops traced as their aten math run below autocast, which then casts nothing inside
    them: a convolution meets a bfloat16 input with a float32 bias. The signature runs on the
    fused backend, after one warning that names the cause."""
    model, x = _model("cnn", torch.float32)
    explainer = Explainer(model, backend="compiled")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.warns(RuntimeWarning, match=r"could not compile .*BFloat16.*runs on the fused backend"):
            explanation = explainer(x, 1)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="omenn_kernels")
            again = explainer(x, 1)
    assert torch.equal(again.weight, explanation.weight)  # the fused backend both times, same layout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = Explainer(model, backend="fused")(x, 1)
    assert relative_distance(explanation.logits, want.logits) <= 5e-2


@pytest.mark.parametrize("name, device", [("vit", "cpu"), ("cnn", "cpu"), ("vit", "cuda"), ("cnn", "cuda"),
                                          ("efficientnet", "cuda")],
                         ids=["vit-cpu", "cnn-cpu", "vit-cuda", "cnn-cuda", "efficientnet-cuda"])
def test_the_ops_traced_as_aten_math_equal_the_reference(name, device, traced, monkeypatch):
    """The decomposition table of a trace on each device (:func:`~omenn_kernels.ops.traced_as_aten`),
    run on the CPU: float64, equal to the reference; the graph calls no fused op but those the
    table keeps (on CUDA: attention, the convolution's ones backward and max pooling's arg-max;
    on the CPU the C++ ops of the linear layers' forward, of max pooling's arg-max and of the
    convolution's ones backward)."""
    from omenn_kernels import ops

    table = ops.traced_as_aten(torch.device(device))
    cpu_table, cuda_table = ops.traced_as_aten(torch.device("cpu")), ops.traced_as_aten(torch.device("cuda"))
    omenn = torch.ops.omenn
    cpu_only = {omenn.conv2d_ones_backward.default, omenn.max_pool_indices.default}  # to their C++ ops
    assert cpu_table and set(cpu_table) - cpu_only < set(cuda_table)
    monkeypatch.setattr(compiled, "traced_as_aten", lambda *_: table)
    model, x = _model(name, torch.float64)
    reference, explainer = Explainer(model, backend="reference"), Explainer(model, backend="compiled")
    target = torch.tensor([1, 0])
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        for _ in range(2):
            _assert_equal_explanations(explainer(x, target), reference(x, target), torch.float64)
    program, _ = explainer.program(x)
    (explanation,) = compiled.explanations(program).values()
    called = {node.target for node in explanation.graph.graph.nodes if node.op == "call_function"}
    assert not called & set(table)
    if device == "cuda":
        kept = {"omenn.attention.default", "omenn.attention_backward_dv.default",
                "omenn.conv2d_ones_backward.default", "omenn.max_pool_indices.default"}
        assert {str(op) for op in called if str(op).startswith("omenn.")} <= kept
    else:  # the C++ ops, without the custom ops' Python
        cpp = {omenn.linear_ones_cpu.default}
        if name == "cnn":
            cpp |= {omenn.max_pool_indices_cpu.default, omenn.conv2d_ones_backward_cpu.default}
        assert cpp <= called
    assert any(str(op).startswith(("aten.convolution", "aten.mm", "aten.bmm")) for op in called)


def test_compiled_explanations_are_kept_per_signature_and_bounded(traced, monkeypatch):
    monkeypatch.setattr(compiled, "MAX_COMPILED", 2)
    model, x = _model("mlp", torch.float64)
    explainer = Explainer(model, backend="compiled")
    traces = []
    make_fx = compiled.make_fx
    monkeypatch.setattr(compiled, "make_fx", lambda f, **kwargs: traces.append(1) or make_fx(f, **kwargs))
    for target in (1, 1, None, torch.randn(2, 10, dtype=torch.float64)):
        explainer(x, target)
    assert len(traces) == 3  # indices, predicted, weights
    program, _ = explainer.program(x)
    assert [key[0] for key in compiled.explanations(program)] == ["predicted", "weights"]


@pytest.mark.parametrize("name, graph_layouts", [("cnn", [True]), ("vit", [False, True])])
def test_images_and_targets_of_any_layout_reach_a_graph_in_the_layout_it_was_compiled_for(name, graph_layouts,
                                                                                          monkeypatch):
    """A compiled graph assumes its inputs' strides (Inductor's code asserts them; this
    compiler too). On the CPU a CNN's images run channels-last, whatever their layout; other
    models' channels-last images get a graph of their own, and images of other strides run
    contiguous. Strided targets are passed on contiguous, and ``C_w`` comes back contiguous
    for contiguous images."""
    def with_strides_asserted(graph, example):
        strides = [t.stride() for t in example]

        def run(*inputs):
            assert [t.stride() for t in inputs] == strides, "a graph ran on inputs of other strides"
            return graph(*inputs)
        return run

    monkeypatch.setattr(compiled, "COMPILER", with_strides_asserted)
    model, x = _model(name, torch.float64)
    reference, explainer = Explainer(model, backend="reference"), Explainer(model, backend="compiled")
    weights = torch.randn(reference(x).logits.shape[1], 2, dtype=torch.float64).t()  # (B, K), transposed
    laid_out = [x, x.contiguous(memory_format=torch.channels_last), x.transpose(2, 3).contiguous().transpose(2, 3)]
    for images in laid_out * 2:
        for target in (weights, weights.contiguous()):
            explanation = explainer(images, target)
            _assert_equal_explanations(explanation, reference(images, target), torch.float64)
            assert explanation.weight.is_contiguous() or images is laid_out[1]
    program, _ = explainer.program(x)
    assert sorted(key[1][1] for key in compiled.explanations(program)) == graph_layouts  # channels-last or not


def test_images_run_channels_last_only_where_their_channels_are_at_dim_one(traced):
    """The CNN family with another declared feature axis keeps its images' layout."""
    model, x = _model("cnn", torch.float64)
    for feature_dim, channels_last in ((1, True), (-1, False)):
        explainer = Explainer(model, backend="compiled", feature_dim=feature_dim)
        expected = Explainer(model, backend="reference", feature_dim=feature_dim)(x, 1)
        for _ in range(2):
            _assert_equal_explanations(explainer(x, 1), expected, torch.float64)
        program, _ = explainer.program(x)
        assert runs_channels_last(program, x) is channels_last
        assert [key[1][1] for key in compiled.explanations(program)] == [channels_last]


@pytest.mark.parametrize("wrapper", ["C++", "Python"])
def test_inductor_compiles_the_explanation_and_follows_parameter_updates(wrapper, monkeypatch):
    """Real Inductor compilations (C++ kernels on the CPU): equal to the reference, and an in-place
    parameter update (an optimizer step) is seen by the compiled explanation. A graph of few
    FLOPs gets a C++ wrapper, a larger one (here: the bound lowered below it) Python's."""
    if wrapper == "Python":
        monkeypatch.setattr(compiled, "CPP_WRAPPER_FLOPS_PER_THREAD", 0)
    torch.manual_seed(6)
    model = randomize_(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.ReLU(),
                                           torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5)), seed=6).eval()
    x = torch.randn(2, 3, 6, 6)
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")  # a fallback would warn
        explainer(x, 2)
        _assert_equal_explanations(explainer(x, 2), reference(x, 2), torch.float32)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
        _assert_equal_explanations(explainer(x, 2), reference(x, 2), torch.float32)
    program, _ = explainer.program(x)
    run = next(iter(compiled.explanations(program).values())).run
    assert isinstance(run, direct_inductor.CompiledGraph)  # Inductor's graph compiler, without AOTAutograd
    assert ("inductor_entry" in run.source_code) == (wrapper == "C++")  # the C++ wrapper's entry point
    # The same architecture with other weights, captured and traced again, reads Inductor's code
    # back from its on-disk cache (as a new process would) and explains with its own weights.
    other = randomize_(copy.deepcopy(model), seed=7)
    hits = counters["inductor"]["fxgraph_cache_hit"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        _assert_equal_explanations(Explainer(other, backend="compiled")(x, 2),
                                   Explainer(other, backend="reference")(x, 2), torch.float32)
    assert counters["inductor"]["fxgraph_cache_hit"] == hits + 1


def test_a_graph_the_cpp_wrapper_cannot_compile_gets_the_python_wrapper_without_a_warning(monkeypatch, caplog):
    import torch._inductor.compile_fx as inductor_entry

    real, real_direct = inductor_entry.compile_fx, direct_inductor.compile_graph

    def without_cpp_wrapper(graph, example, config_patches=None, **kwargs):
        if (config_patches or {}).get("cpp_wrapper"):
            raise RuntimeError("no C++ wrapper here")
        return real(graph, example, config_patches=config_patches, **kwargs)

    def directly_without_cpp_wrapper(graph, example, cpp_wrapper):
        if cpp_wrapper:
            raise RuntimeError("no C++ wrapper here")
        return real_direct(graph, example, cpp_wrapper)
    monkeypatch.setattr(inductor_entry, "compile_fx", without_cpp_wrapper)
    monkeypatch.setattr(direct_inductor, "compile_graph", directly_without_cpp_wrapper)
    model, x = _model("cnn", torch.float32)
    explainer = Explainer(model, backend="compiled")
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        warnings.filterwarnings("error", message="omenn_kernels")  # a fallback to the fused backend would warn
        explainer(x, 1)
        _assert_equal_explanations(explainer(x, 1), Explainer(model, backend="reference")(x, 1), torch.float32)
    assert "C++ wrapper did not compile the explanation (RuntimeError: no C++ wrapper here)" in caplog.text
    program, _ = explainer.program(x)
    run = next(iter(compiled.explanations(program).values())).run
    assert "def call(" in run.source_code and "inductor_entry" not in run.source_code  # the Python wrapper


def test_a_readout_function_is_compiled_with_its_arguments_as_inputs(traced, monkeypatch):
    """A :class:`ReadoutFunction` (the bulk runner's targets: predicted, labels, contrasts) is
    traced into the graph; new argument values are read at every call, not baked in."""
    model, x = _model("cnn", torch.float64)
    reference, explainer = Explainer(model, backend="reference"), Explainer(model, backend="compiled")

    def label_minus_predicted(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Two read-outs per image: the label, and the label minus the predicted class."""
        label, predicted = (torch.zeros_like(logits).scatter(1, c.unsqueeze(1), 1.0)  # one_hot reads values
                            for c in (labels, logits.argmax(-1)))
        return torch.stack([label, label - predicted], 1)

    traces = []
    make_fx = compiled.make_fx
    monkeypatch.setattr(compiled, "make_fx", lambda f, **kwargs: traces.append(1) or make_fx(f, **kwargs))
    for labels in (torch.tensor([0, 3]), torch.tensor([4, 1]), torch.tensor([2, 2])):
        readouts = ReadoutFunction(label_minus_predicted, (labels,))
        _assert_equal_explanations(explainer.explain_targets(x, readouts),
                                   reference.explain_targets(x, readouts), torch.float64)
    assert len(traces) == 1
    program, _ = explainer.program(x)
    (key,) = compiled.explanations(program)
    assert key[0] == "function" and isinstance(compiled.explanations(program)[key].graph, torch.fx.GraphModule)


def test_a_readout_function_of_the_wrong_shape_is_a_clear_error(traced):
    model, x = _model("mlp", torch.float64)
    with pytest.raises(TargetError, match=r"returned shape \(2, 10\) .* of shape \(2, T, 10\)"):
        Explainer(model, backend="compiled").explain_targets(x, ReadoutFunction(lambda logits: logits))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["cnn", "vit"])
def test_inductor_on_cuda_equals_reference_and_outlives_the_next_run(name, full_float32_on_cuda):
    """Inductor with the Triton kernels (``triton_op``) under CUDA graphs, float32 without TF32
    (relative 1e-4, the fused CUDA test's bound): every run equals the reference, and an
    explanation kept by the caller is not overwritten by the next run of the same graph."""
    family = FAMILIES[name]
    torch.manual_seed(7)
    model = randomize_(family.build(), seed=7).cuda().eval()
    inputs = [torch.randn(2, 3, family.size, family.size, device="cuda") for _ in range(2)]
    explainer, reference = Explainer(model, backend="compiled"), Explainer(model, backend="reference")
    expected = [reference(x) for x in inputs]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")  # a fallback to the fused backend warns
        kept = [explainer(inputs[i % 2]) for i in range(5)]  # eager + compile, CUDA graph warm-up, record, replays
    for i, got in enumerate(kept):
        for field in ("contribution", "weight", "bias"):
            assert relative_distance(getattr(got, field), getattr(expected[i % 2], field)) <= 1e-4, (i, field)
    program, _ = explainer.program(inputs[0])
    assert isinstance(next(iter(compiled.explanations(program).values())), compiled.CompiledExplanation)
