"""The fused backend against the reference, and the fused ops' registrations.

The fused backend keeps one ones value per pixel and runs ``omenn::`` ops (C++ on the
CPU, Triton on CUDA) for activations, convolutions and attention; it must give the
reference's C, C_w and C_b: relative error (Frobenius) ≤ 1e-5 in float32 and ≤ 1e-10
in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from omenn_kernels import Explainer, explain, native
from omenn_kernels.linearize.rules.norm import normalized
from omenn_kernels.linearize.values import Live, channels_last
from omenn_kernels.ops import activation, attention, batch_norm_ones, conv_bias, layer_norm_ones, linear_ones, max_pool
from omenn_kernels.testing import FAMILIES, python_entered, randomize_, relative_distance

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}


def _both(model, x, target=None):
    reference = Explainer(model, backend="reference")(x, target)
    fused = Explainer(model, backend="fused")(x, reference.target)
    return reference, fused


# float32 on one family of each kind of layer (MLP, CNN, transformer, residual CNN, ConvNeXt,
# nn.MultiheadAttention); every family in float64.
FLOAT32_FAMILIES = ["mlp", "cnn", "vit", "resnet", "convnext", "torchvision_vit"]


@pytest.mark.parametrize("name, dtype", [(name, torch.float64) for name in FAMILIES]
                         + [(name, torch.float32) for name in FLOAT32_FAMILIES],
                         ids=[f"{name}-float64" for name in FAMILIES] + [f"{name}-float32" for name in FLOAT32_FAMILIES])
def test_fused_equals_reference_on_every_family(name, dtype):
    family = FAMILIES[name]
    torch.manual_seed(3)
    model = randomize_(family.build(), seed=3).to(dtype).eval()
    x = torch.randn(2, 3, family.size, family.size, dtype=dtype)
    reference, fused = _both(model, x)
    for field in ("contribution", "weight", "bias"):
        assert relative_distance(getattr(fused, field), getattr(reference, field)) <= TOLERANCE[dtype], field
    torch.testing.assert_close(fused.logit, reference.logit, rtol=TOLERANCE[dtype], atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["cnn", "vit"])
def test_fused_under_autocast_follows_the_reference(name, dtype):
    """Under CPU autocast (a float32 model, low-precision matmuls and convolutions) the
    fused backend runs, and agrees with the reference under the same autocast to the
    low precision's rounding (2e-2 relative; bf16 keeps 8 mantissa bits)."""
    family = FAMILIES[name]
    torch.manual_seed(4)
    model = randomize_(family.build(), seed=4).eval()
    x = torch.randn(2, 3, family.size, family.size)
    with torch.autocast("cpu", dtype=dtype):
        reference, fused = _both(model, x, 1)
    assert relative_distance(fused.contribution.float(), reference.contribution.float()) <= 2e-2
    assert relative_distance(fused.logit.float(), reference.logit.float()) <= 2e-2


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("create_graph", [False, True], ids=["first_order", "differentiable"])
def test_a_cnn_explains_channels_last_on_the_cpu(memory_format, create_graph):
    """ATen's CPU convolutions run faster on channels-last activations, and so does a CNN's fused
    explanation: its convolutions read channels-last values (and, first-order, so do their input
    gradients; a differentiable explanation's reference rules, here GELU's, lay their gradients out
    as autograd's formulas do), no activation is copied to change its layout (only the images
    are, and ``C_w`` back), and ``C_w`` comes back in the images' layout; the parameters'
    gradient of a loss on the explanation computes each weight gradient from two tensors of
    the same layout (oneDNN reorders mixed ones, at many times the cost). A ViT, whose
    convolution cuts patches, keeps contiguous images contiguous."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.convolved, self.input_grads, self.copied, self.weight_grads = [], [], [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.convolution_backward.default and args[1].shape[1] > 1:
                self.weight_grads.append((channels_last(args[0]), channels_last(args[1])))
            if func in (torch.ops.omenn.conv2d_ones.default, torch.ops.aten.convolution.default):
                self.convolved.append(args[0])  # the linearized convolutions, or the model's (a total gradient)
            if func is torch.ops.omenn.conv2d_input_grad.default:
                self.input_grads.append(args[0])
            if func in (torch.ops.aten.clone.default, torch.ops.aten.copy_.default):
                self.copied.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    for name, runs_channels_last in (("cnn", True), ("vit", False)):
        if not runs_channels_last and memory_format == torch.channels_last:
            continue  # channels-last images given to a ViT are taken as they come
        family = FAMILIES[name]
        model = randomize_(family.build()).eval()
        x = torch.randn(2, 3, family.size, family.size).contiguous(memory_format=memory_format)
        explainer = Explainer(model, backend="fused")
        explainer(x, 1)
        with Seen() as seen:
            explanation = explainer(x, 1, create_graph=create_graph)
        assert explanation.weight.stride() == x.stride()
        read = seen.convolved + ([] if create_graph else seen.input_grads)
        assert len(seen.convolved) >= (3 if runs_channels_last else 1)
        assert all(channels_last(t) is runs_channels_last for t in read if t.shape[1] > 1), name
        if runs_channels_last:  # the images, C_w and the ones' window sums (one channel)
            assert all(shape[1] <= 3 for shape in seen.copied if len(shape) == 4), seen.copied
        if create_graph:  # the parameters' gradient: the convolutions' weight gradients read one layout
            with Seen() as seen:
                explanation.contribution.square().sum().backward()
            assert seen.weight_grads and all(output == input for output, input in seen.weight_grads)
            assert (True, True) in seen.weight_grads if runs_channels_last else (True, True) not in seen.weight_grads


def test_auto_backend_is_the_fused_one_on_the_cpu():
    model = randomize_(FAMILIES["cnn"].build()).double().eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    auto = explain(model, x, 1, backend="auto")
    fused = explain(model, x, 1, backend="fused")
    assert torch.equal(auto.contribution, fused.contribution)


def test_auto_backend_tiers_from_the_eager_backend_of_the_device(monkeypatch):
    """``auto`` tiers from fused on the CPU and from the reference on CUDA, the faster eager
    backend measured on each; on any other device it runs the reference and does not tier.

    The choice is made from the input's device alone; a meta tensor stands for another device.
    """
    from omenn_kernels import backends

    ran = []
    monkeypatch.setattr(backends.reference, "explain_batch", lambda *args: ran.append("reference"))
    monkeypatch.setattr(backends.tiered, "explain_batch",
                        lambda *args, eager: ran.append(("tiered", eager.__name__.rsplit(".", 1)[-1])))
    backends.Backend("auto").explain(None, None, torch.empty(1, 3, 4, 4, device="meta"), None)
    backends.Backend("auto").explain(None, None, torch.empty(1, 3, 4, 4), None)
    assert ran == ["reference", ("tiered", "fused")]
    assert backends.resolved_name("auto", torch.device("cuda")) == "reference"
    assert backends._tiers("auto", torch.device("cuda")) and not backends._tiers("auto", torch.device("meta"))


def test_fused_backend_runs_the_fused_ops(monkeypatch):
    """Activations and per-pixel convolutions go through the omenn:: ops on the CPU."""
    calls = {"activation": 0, "conv": 0}

    def counting(name, op):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return op(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(activation, "activation", counting("activation", activation.activation))
    monkeypatch.setattr(conv_bias, "conv2d_ones", counting("conv", conv_bias.conv2d_ones))
    model = randomize_(FAMILIES["cnn"].build()).eval()
    explain(model, torch.randn(2, 3, 32, 32), 0, backend="fused")
    # cnn: ReLU, SiLU, GELU; three convolutions, the second after a max pool (per-channel
    # ones, summed over the channels on the way in).
    assert calls == {"activation": 3, "conv": 3}


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_autograd_registration",
                                                "test_faketensor", "test_aot_dispatch_dynamic"))


def _layer_norm_call(op):
    torch.manual_seed(2)
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ones = torch.rand(2, 5, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True)
    return op(x, ones, weight, bias, 1e-5)[:2], (x, ones, weight, bias)


def _linear_call(op):
    torch.manual_seed(3)
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    ones = torch.rand(2, 5, 1, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(9, dtype=torch.float64, requires_grad=True)
    return op(x, ones, weight, bias, 3, 9), (x, ones, weight, bias)


def _activation_call(op):
    torch.manual_seed(4)
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    return (op(x, "gelu", 0.0),), (x,)


@pytest.mark.parametrize("fused_op, call", [(layer_norm_ones.layer_norm_ones, _layer_norm_call),
                                             (linear_ones.linear_ones, _linear_call),
                                             (activation.activation, _activation_call)],
                         ids=["layer_norm_ones", "linear_ones", "activation"])
def test_a_fused_op_called_eagerly_is_the_op_without_the_dispatcher(fused_op, call):
    """Called eagerly, a :class:`~omenn_kernels.ops.FusedOp` runs its function under an
    autograd.Function of the op's own backward; under a dispatch mode (here FlopCounterMode,
    as under a trace) the call is the op's. Both give the same values and first and second
    derivatives (float64, bitwise: the same functions run)."""
    from torch.utils.flop_counter import FlopCounterMode

    eager_outputs, eager_inputs = call(fused_op)
    with FlopCounterMode(display=False):
        op_outputs, op_inputs = call(fused_op)
    assert type(eager_outputs[0].grad_fn).__name__.endswith("FunctionBackward")
    assert type(op_outputs[0].grad_fn).__name__.startswith("GeneratedBackwardFor_omenn_")
    results = []
    for outputs, inputs in ((eager_outputs, eager_inputs), (op_outputs, op_inputs)):
        torch.manual_seed(6)
        readout = sum((output * torch.randn_like(output)).sum() for output in outputs)
        first = torch.autograd.grad(readout, inputs, create_graph=True, allow_unused=True)
        differentiable = [g for g in first if g is not None and g.requires_grad]  # ξ and 1/σ are held
        second = torch.autograd.grad(sum(g.square().sum() for g in differentiable), inputs,
                                     allow_unused=True) if differentiable else ()
        results.append([*outputs, *first, *second])
    assert len(results[0]) == len(results[1])
    for got, want in zip(*results):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "silu", "relu", "leaky_relu", "hardswish"])
def test_opcheck_activation(kind):
    x = torch.randn(2, 5, 7, requires_grad=True)
    _opcheck(torch.ops.omenn.activation.default, (x, kind, 0.1))
    _opcheck(torch.ops.omenn.activation_backward.default, (torch.randn(2, 5, 7), x.detach(), kind, 0.1))


def _cpu_kernel_calls():
    """A call of each op whose CPU kernel is in csrc/, with the Python math that computes the
    same bits: the conv's ones backward from small integers and window sums that are powers of
    two, so that every sum and quotient is exact."""
    x, grad = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    conv_grad, grad_ones = torch.randint(-4, 5, (2, 3, 4, 5)).float(), torch.randint(-4, 5, (2, 1, 4, 5)).float()
    bias, window_sum = torch.randint(-4, 5, (3,)).float(), 2.0 ** torch.randint(0, 4, (2, 1, 4, 5))
    share = ((conv_grad * bias[:, None, None]).sum(1, keepdim=True) + grad_ones) / window_sum
    ones, weight, linear_bias = torch.rand(2, 5, 1), torch.randn(4, 7), torch.randn(4)
    images = torch.randn(2, 16, 7, 9)  # channels-last pooling from 16 channels
    native.load_cpu_kernels()  # a build failure fails here
    return [*[(torch.ops.omenn.max_pool_indices_cpu.default, (pooled, *geometry),
               lambda pooled=pooled, geometry=geometry: max_pool.indices(pooled, *geometry))
              for pooled, geometry in ((images, ([3, 2], [2, 2], [1, 0], [1, 1], True)),
                                       (images[:, :3], ([2, 2], [], [0, 0], [1, 1], False)),
                                       (x, ([3], [2], [1], [1], False)),
                                       (images[:, :4, None], ([1, 2, 2], [1, 2, 2], [0, 0, 0], [1, 1, 1], False)))],
            (torch.ops.omenn.linear_ones_cpu.default, (x, ones, weight, linear_bias),
             lambda: linear_ones.value_and_ones(x, ones, weight, linear_bias, 0, 4)),
            (torch.ops.omenn.linear_ones_cpu.default, (x, ones, weight, None),
             lambda: linear_ones.value_and_ones(x, ones, weight, None, 0, 4)),
            (torch.ops.omenn.activation_cpu.default, (x, "leaky_relu", 0.2),
             lambda: torch.nn.functional.leaky_relu(x, 0.2)),
            (torch.ops.omenn.activation_backward_cpu.default, (grad, x, "leaky_relu", 0.2),
             lambda: torch.where(x > 0, grad, grad * 0.2)),
            (torch.ops.omenn.conv2d_ones_backward_cpu.default,
             (conv_grad, grad_ones, bias, window_sum, [7, 9], [3, 3], [2, 2], [1, 1], [1, 1]),
             lambda: torch.nn.functional.fold(share.flatten(2).expand(-1, 9, -1), [7, 9], 3, padding=1, stride=2))]


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_ones_gradient_summed_in_aten_equals_the_op(memory_format, with_bias):
    """What a compiled explanation on the CPU traces for a convolution's ones backward (the sum
    over channels in aten, then the C++ op without a bias) against the op; float64 to 1e-12."""
    grad = torch.randn(2, 5, 4, 6, dtype=torch.float64).contiguous(memory_format=memory_format)
    grad_ones = torch.randn(2, 1, 4, 6, dtype=torch.float64)
    bias = torch.randn(5, dtype=torch.float64) if with_bias else None
    window_sum = torch.randint(0, 10, (2, 1, 4, 6)).double()  # 0 where a window sees only padding
    geometry = ([8, 11], [3, 3], [2, 2], [1, 1], [1, 1])
    got = conv_bias.ones_gradient_summed_in_aten(grad, grad_ones, bias, window_sum, *geometry)
    want = conv_bias.conv2d_ones_backward(grad, grad_ones, bias, window_sum, *geometry)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_cpu_ops_are_their_cpp_kernels():
    """The ops give their references' results, pass opcheck, and reach the kernel from the
    dispatcher: a call runs no Python of this package or of torch.library (whose custom ops
    run a Python autograd kernel and a Python wrapper per call)."""
    for op, args, reference in _cpu_kernel_calls():
        _opcheck(op, args)
        got, want = op(*args), reference()
        if isinstance(want, tuple):
            assert len(got) == len(want) and all(torch.equal(g, w) for g, w in zip(got, want))
        else:
            assert torch.equal(got, want)
        entered = python_entered(lambda: op(*args))
        assert entered == [], f"{op} ran Python per call: {entered}"


@pytest.mark.parametrize("kind", ["gelu", "gelu_tanh", "silu", "relu", "leaky_relu", "hardswish"])
def test_activation_op_equals_its_reference(kind):
    """The op against the rule's reference math (ξ held), value and input gradient, float64 to 1e-12."""
    x = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    grad = torch.randn_like(x)
    got, want = activation.activation(x, kind, 0.1), activation.reference(x, kind, 0.1)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.autograd.grad(got, x, grad)[0], torch.autograd.grad(want, x, grad)[0],
                               rtol=1e-12, atol=1e-14)


def test_activation_op_gradient_is_the_detached_multiplier():
    x = torch.randn(3, 11, dtype=torch.float64, requires_grad=True)
    y = activation.activation(x, "gelu", 0.0)
    grad = torch.randn_like(y)
    (dx,) = torch.autograd.grad(y, x, grad)
    phi = 0.5 * (1 + torch.erf(x.detach() / math.sqrt(2)))
    torch.testing.assert_close(y.detach(), x.detach() * phi, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(dx, grad * phi, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("ones_channels", [1, 5])
def test_batch_norm_ones_equals_the_reference_rule(ones_channels):
    """Against R3 written with autograd: ``x·s + b'·O``, ones shared or per channel."""
    x = torch.randn(2, 5, 4, 3, dtype=torch.float64, requires_grad=True)
    ones = torch.ones(2, ones_channels, 4, 3, dtype=torch.float64, requires_grad=True)
    scale, shift = torch.randn(5, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    value = batch_norm_ones.batch_norm_ones(x, ones, scale, shift)
    expected = x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1) * ones
    grad = torch.randn_like(value)
    got = torch.autograd.grad(value, [x, ones], grad)
    want = torch.autograd.grad(expected, [x, ones], grad)
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    _opcheck(torch.ops.omenn.batch_norm_ones.default, (x, ones, scale, shift))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("ones_features", [1, 7])
def test_layer_norm_ones_equals_the_reference_rule(ones_features, affine):
    """Against R3' written with autograd (the rule's ``normalized``), float64 to 1e-12: the
    value, the input's and the ones' gradients, and the parameters' gradient of a loss on
    those gradients (fixed multipliers: ``1/σ`` held). That second differentiation must not
    reach the input, whose gradient does not depend on it (``1/σ`` is saved detached)."""
    torch.manual_seed(5)
    x = torch.randn(2, 5, 7, dtype=torch.float64, requires_grad=True)
    ones = torch.rand(2, 5, ones_features, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, dtype=torch.float64, requires_grad=True) if affine else None
    bias = torch.randn(7, dtype=torch.float64, requires_grad=True) if affine else None
    value, ones_bar, _inverse_scale = layer_norm_ones.layer_norm_ones(x, ones, weight, bias, 1e-5)
    expected = normalized(Live(x, ones), x.detach(), [-1], weight, bias, 1e-5)
    torch.testing.assert_close(value, expected.value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ones_bar, expected.ones, rtol=0, atol=0)
    grad, grad_bar = torch.randn_like(value), torch.randn_like(ones_bar)
    got = torch.autograd.grad((value * grad).sum() + (ones_bar * grad_bar).sum(), [x, ones], create_graph=True)
    want = torch.autograd.grad((expected.value * grad).sum() + (expected.ones * grad_bar).sum(), [x, ones],
                               create_graph=True)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    if affine:
        readout = torch.randn_like(ones)
        losses = [(g_x.square().sum() + (g_ones * readout).sum()) for g_x, g_ones in (got, want)]
        got_params, want_params = (torch.autograd.grad(loss, [weight, bias], retain_graph=True) for loss in losses)
        for g, w in zip(got_params, want_params):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
        assert torch.autograd.grad(losses[0], x, allow_unused=True)[0] is None
    _opcheck(torch.ops.omenn.layer_norm_ones.default, (x, ones, weight, bias, 1e-5))


@pytest.mark.parametrize("silent,receiving", [(slice(0, 6), (6, 9)), (slice(3, 6), (0, 9))],
                         ids=["one_block_receives", "two_blocks_receive"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias_free"])
@pytest.mark.parametrize("ones_features", [1, 6])
def test_linear_ones_equals_the_reference_rule_with_gate_only_features(ones_features, silent, receiving,
                                                                       with_bias):
    """Against R1 written with autograd, when two thirds of the outputs get no gradient
    (the receiving features one block, or two: then the whole product is taken)."""
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    ones = torch.ones(2, 5, ones_features, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(9, 6, dtype=torch.float64)
    bias = torch.randn(9, dtype=torch.float64) if with_bias else None
    value, ones_bar = linear_ones.linear_ones(x, ones, weight, bias, *receiving)
    expected_bar = ones.mean(-1, keepdim=True)
    expected = torch.nn.functional.linear(x, weight, None) + (0 if bias is None else bias * expected_bar)
    grad = torch.randn_like(value)
    grad[..., silent] = 0  # e.g. the query and key thirds of a qkv projection
    grad_bar = torch.randn_like(ones_bar)
    got = torch.autograd.grad((value * grad).sum() + (ones_bar * grad_bar).sum(), [x, ones])
    want = torch.autograd.grad((expected * grad).sum() + (expected_bar * grad_bar).sum(), [x, ones])
    torch.testing.assert_close(value, expected, rtol=0, atol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    _opcheck(torch.ops.omenn.linear_ones.default, (x, ones, weight, bias, *receiving))


def _conv_inputs(dtype=torch.float32, patchify: bool = False):
    """A strided, padded, dilated grouped convolution, or one that cuts the input into 3×3 patches."""
    x = torch.randn(2, 4, 9, 9 if patchify else 8, dtype=dtype, requires_grad=True)
    ones = torch.ones(2, 1, *x.shape[2:], dtype=dtype, requires_grad=True)
    groups = 1 if patchify else 2
    weight, bias = torch.randn(6, 4 // groups, 3, 3, dtype=dtype), torch.randn(6, dtype=dtype)
    stride, padding, dilation = ([3, 3], [0, 0], [1, 1]) if patchify else ([2, 1], [1, 2], [1, 2])
    window_sum = torch.nn.functional.conv2d(ones.detach(), ones.new_ones(1, 1, 3, 3), None, stride,
                                            padding, dilation).float()
    return x, ones, window_sum, weight, bias, stride, padding, dilation, groups


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias_free"])
def test_opcheck_conv2d_ones(with_bias):
    x, ones, window_sum, weight, bias, *geometry = _conv_inputs()
    _opcheck(torch.ops.omenn.conv2d_ones.default, (x, ones, window_sum, weight, bias if with_bias else None,
                                                   *geometry))


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias_free"])
@pytest.mark.parametrize("patchify", [False, True], ids=["general", "patchify"])
def test_conv2d_ones_gradients_equal_the_reference_rule(patchify, with_bias):
    """Against R2 written with autograd: ``conv(x) + b·S/stopgrad(S)`` (patchifying
    convolutions take their own input-gradient path on the CPU)."""
    x, ones, window_sum, weight, bias, stride, padding, dilation, groups = _conv_inputs(torch.float64, patchify)
    if not with_bias:
        bias = torch.zeros_like(bias)  # the reference's bias; the op is called without one
    assert conv_bias.cuts_patches(x, weight.shape, stride, padding, dilation, groups) == patchify
    value, ones_out = conv_bias.conv2d_ones(x, ones, window_sum, weight, bias if with_bias else None, stride,
                                            padding, dilation, groups)
    grad, grad_ones = torch.randn_like(value), torch.randn_like(ones_out)
    dx, dones = torch.autograd.grad((value * grad).sum() + (ones_out * grad_ones).sum(), [x, ones])
    s = torch.nn.functional.conv2d(ones, ones.new_ones(1, 1, 3, 3), None, stride, padding, dilation)
    share = s / s.detach()
    expected = torch.nn.functional.conv2d(x, weight, None, stride, padding, dilation, groups) \
        + bias.view(1, -1, 1, 1) * share
    ex, eones = torch.autograd.grad((expected * grad).sum() + (share * grad_ones).sum(), [x, ones])
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, ex, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dones, eones, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "bias_free"])
def test_conv2d_ones_differentiates_twice_alike_in_both_layouts(with_bias):
    """Channels-last images take other paths in the ones' backward (the sum over channels as
    one product over rows of channels) and in its derivative (the bias's gradient, the
    output gradient's gradient laid out as it): the same second derivatives as contiguous
    ones, float64 to 1e-12, and gradients in the layout of what they are gradients of."""
    x, ones, window_sum, weight, bias, stride, padding, dilation, groups = _conv_inputs(torch.float64)
    weight.requires_grad_(True)
    bias = bias.requires_grad_(True) if with_bias else None
    results = []
    for memory_format in (torch.contiguous_format, torch.channels_last):
        laid_out = x.detach().contiguous(memory_format=memory_format).requires_grad_(True)
        value, ones_out = conv_bias.conv2d_ones(laid_out, ones, window_sum, weight, bias, stride, padding,
                                                dilation, groups)
        torch.manual_seed(1)  # the same values in both layouts (randn_like fills memory in order)
        grad = torch.randn(value.shape, dtype=value.dtype).contiguous(memory_format=memory_format).requires_grad_(True)
        grad_ones = torch.randn(ones_out.shape, dtype=ones_out.dtype)
        dx, dones = torch.autograd.grad([value, ones_out], [laid_out, ones], [grad, grad_ones], create_graph=True)
        assert dx.stride() == laid_out.stride()
        differentiated = [grad, weight] + ([bias] if with_bias else [])
        second = torch.autograd.grad((dx * torch.cos(laid_out)).sum() + (dones * torch.sin(ones)).sum(),
                                     differentiated)
        assert second[0].stride() == grad.stride()
        results.append([dx, dones, *second])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bias_free_conv2d_ones_backward_reads_no_output_gradient(monkeypatch):
    """A bias-free convolution does no work for its bias: its ones' gradient comes from the
    ones' own gradient alone (a NaN output gradient leaves it finite and exact), and the
    backward calls the ones kernel without a bias, whose channel reduction is then skipped."""
    x, ones, window_sum, weight, _bias, stride, padding, dilation, groups = _conv_inputs(torch.float64)
    value, ones_out = conv_bias.conv2d_ones(x, ones, window_sum, weight, None, stride, padding, dilation, groups)
    grad_ones = torch.randn_like(ones_out)
    seen = []
    real = torch.ops.omenn.conv2d_ones_backward_cpu.default

    def spy(grad, grad_ones, bias, *rest):
        seen.append(bias)
        return real(grad, grad_ones, bias, *rest)

    monkeypatch.setattr(conv_bias, "_conv2d_ones_backward_cpu", spy)
    (dones,) = torch.autograd.grad([value, ones_out], [ones],
                                   [torch.full_like(value, float("nan")), grad_ones])
    assert seen == [None]
    s = torch.nn.functional.conv2d(ones, ones.new_ones(1, 1, 3, 3), None, stride, padding, dilation)
    (expected,) = torch.autograd.grad(((s / s.detach()) * grad_ones).sum(), [ones])
    torch.testing.assert_close(dones, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape, kernel, stride, padding, dilation, ceil_mode", [
    ((2, 20, 9, 11), [3, 3], [2, 2], [1, 1], [1, 1], False),   # channels-last inside
    ((2, 3, 9, 11), [2, 3], [], [0, 1], [2, 1], True),          # RGB: channels-first
    ((2, 5, 13), [3], [2], [1], [1], True),                    # 1-D
    ((1, 4, 5, 6, 7), [2, 2, 2], [2, 1, 2], [1, 0, 1], [1, 1, 1], False),  # 3-D
], ids=["2d_channels_last", "2d_rgb_ceil", "1d", "3d"])
def test_max_pool_indices_are_the_poolings(shape, kernel, stride, padding, dilation, ceil_mode):
    """The arg-max of ATen's pooling, in the input's layout (channels-first for a contiguous input,
    channels-last for a channels-last one), from Python and from C++; ties (a quantized input) at
    the first maximum."""
    x = torch.randn(*shape).mul(2).round()
    pool = {3: torch.nn.functional.max_pool1d, 4: torch.nn.functional.max_pool2d,
            5: torch.nn.functional.max_pool3d}[x.dim()]
    want = pool(x, kernel, stride or None, padding, dilation, ceil_mode, return_indices=True)[1]
    layouts = [x] + ([x.contiguous(memory_format=torch.channels_last)] if x.dim() == 4 else [])
    for given, layout in zip(layouts, [torch.contiguous_format, torch.channels_last]):
        for op in (max_pool.max_pool_indices, max_pool.max_pool_indices_cpu):
            got = op(given, kernel, stride, padding, dilation, ceil_mode)
            assert torch.equal(got, want) and got.is_contiguous(memory_format=layout), (op, layout, got.stride())
        _opcheck(torch.ops.omenn.max_pool_indices.default, (given, kernel, stride, padding, dilation, ceil_mode))


def _attention_inputs(with_bias: bool):
    q, k = torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    v = torch.randn(2, 3, 7, 8, requires_grad=True)
    bias = torch.randn(1, 3, 7, 7) if with_bias else None
    return q, k, v, bias, 0.35


@pytest.mark.parametrize("with_bias", [False, True])
def test_opcheck_attention(with_bias):
    _opcheck(torch.ops.omenn.attention.default, _attention_inputs(with_bias))


def test_attention_op_gives_only_dv_equal_to_weights_transposed_times_grad():
    q, k, v, bias, scale = _attention_inputs(True)
    out, lse = attention.attention(q, k, v, bias, scale)
    weights = torch.softmax(q @ k.transpose(-2, -1) * scale + bias, -1)
    torch.testing.assert_close(out, weights @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(q @ k.transpose(-2, -1) * scale + bias, -1))
    grad = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, v, grad)
    torch.testing.assert_close(dv, weights.transpose(-2, -1) @ grad, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["cnn", "vit", "convnext", "efficientnet", "swin"])
def test_fused_on_cuda_equals_reference(name, full_float32_on_cuda):
    family = FAMILIES[name]
    torch.manual_seed(4)
    model = randomize_(family.build(), seed=4).cuda().eval()
    x = torch.randn(2, 3, family.size, family.size, device="cuda")
    reference, fused = _both(model, x)
    for field in ("contribution", "weight", "bias"):
        assert relative_distance(getattr(fused, field), getattr(reference, field)) <= 1e-4, field
