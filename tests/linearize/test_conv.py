"""R2: convolution with its bias spread over the valid positions of its receptive field.

The oracle is an explicit loop over output positions and kernel taps (no convolution
call): for each output channel j and position p, the bias share ``b_j·∂ŷ/∂y_j[p]`` is
divided by the number of *valid* (non-padding) input positions that p's taps reach and
added to each of them. Across the channels of p's group every valid position gets
``1/s`` of it, ``s = (C_in/groups) · #valid taps`` (the paper's ``K̃_b``, ``s_i = Σ c_Pi``).

Tolerances (float64): 1e-11 relative, 1e-13 absolute (sums of a few hundred terms).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn

from omenn_kernels import Explainer, explain
from omenn_kernels.linearize import lookup
from omenn_kernels.linearize.rules import conv as conv_rules
from omenn_kernels.linearize.rules.conv import convolved, receptive_ones
from omenn_kernels.linearize.values import Live
from rule_checks import ATOL, DT, RTOL, Headed, assert_complete, assert_sums_to_logit, gradient, randomize

aten = torch.ops.aten


def _padding_pairs(padding, kernel, dilation):
    """Per spatial axis (before, after) padding, including PyTorch's 'same' (extra on the right)."""
    if padding == "same":
        pairs = []
        for k, d in zip(kernel, dilation):
            total = d * (k - 1)
            pairs.append((total // 2, total - total // 2))
        return pairs
    return [(p, p) for p in padding]


def _taps(out_index, size, kernel, stride, before, dilation):
    """Valid input indices along one axis for one output index."""
    return [out_index * stride - before + t * dilation for t in range(kernel)
            if 0 <= out_index * stride - before + t * dilation < size]


def bias_share_loop(bias, grad_out, in_size, kernel, stride, padding, dilation):
    """C_b of a conv's bias by loops: (out channels, *out) grads -> (*in) shares."""
    pads = _padding_pairs(padding, kernel, dilation)
    out = torch.zeros(in_size, dtype=DT)
    for j in range(grad_out.shape[0]):
        for o in itertools.product(*[range(n) for n in grad_out.shape[1:]]):
            per_axis = [_taps(o[a], in_size[a], kernel[a], stride[a], pads[a][0], dilation[a])
                        for a in range(len(in_size))]
            positions = list(itertools.product(*per_axis))
            assert positions, "an output position sees only padding"
            share = bias[j].item() * grad_out[(j, *o)].item() / len(positions)
            for q in positions:
                out[q] += share
    return out


def _valid_count_loop(out_size, in_size, kernel, stride, padding, dilation):
    pads = _padding_pairs(padding, kernel, dilation)
    counts = torch.zeros(out_size, dtype=DT)
    for o in itertools.product(*[range(n) for n in out_size]):
        n = 1
        for a in range(len(in_size)):
            n *= len(_taps(o[a], in_size[a], kernel[a], stride[a], pads[a][0], dilation[a]))
        counts[o] = n
    return counts


def _conv_head(conv: nn.Conv2d, out_features: int) -> Headed:
    """Conv2d → Flatten → Linear(out_features, 3) without bias: the conv's bias is the only bias."""
    return Headed("conv", conv, out_features, 3)


CONVS = {
    # name: (in_channels, out_channels, kernel, stride, padding, dilation, groups, H, W)
    "pad1": (3, 4, 3, 1, 1, 1, 1, 6, 7),
    "stride2_pad1": (3, 4, 3, 2, 1, 1, 1, 7, 6),
    "dilation2_pad2": (2, 3, 3, 1, 2, 2, 1, 7, 7),
    "stride2_dilation2_pad1_kernel4x3": (2, 2, (4, 3), 2, 1, 2, 1, 9, 8),
    "groups2": (4, 6, 3, 1, 1, 1, 2, 5, 6),
    "depthwise": (4, 4, 3, 2, 1, 1, 4, 7, 7),
    "depthwise_multiplier2": (3, 6, 5, 1, 2, 1, 3, 6, 6),
    "same_odd": (3, 2, 3, "same", None, 2, 1, 6, 6),
    "same_even_kernel": (3, 2, (4, 2), "same", None, (1, 3), 1, 7, 6),
    "asymmetric_padding": (2, 3, (3, 5), (1, 2), (0, 2), 1, 1, 6, 9),
    # Whole non-overlapping patches: the value is one matrix product, S a sum per patch.
    "patchify": (3, 4, 2, 2, 0, 1, 1, 6, 8),
    "patchify_kernel3x2": (2, 3, (3, 2), (3, 2), 0, 1, 1, 6, 8),
    "patchify_groups2": (4, 6, 2, 2, 0, 1, 2, 6, 6),
}


def _conv_from(spec):
    cin, cout, kernel, stride, padding, dilation, groups, h, w = spec
    if stride == "same":
        stride, padding = 1, "same"
    as_pair = lambda v: (v, v) if isinstance(v, int) else tuple(v)  # noqa: E731
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups)
    kernel, stride, dilation = as_pair(kernel), as_pair(stride), as_pair(dilation)
    padding = padding if padding == "same" else as_pair(padding)
    return conv, (kernel, stride, padding, dilation), (cin, h, w)


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("name", list(CONVS))
def test_bias_spread_over_valid_receptive_field(name):
    conv, (kernel, stride, padding, dilation), (cin, h, w) = _conv_from(CONVS[name])
    out_shape = conv(torch.zeros(1, cin, h, w)).shape[1:]
    model = randomize(_conv_head(conv, out_shape.numel()), seed=len(name), scale=0.5).double()
    torch.manual_seed(1)
    x = torch.randn(2, cin, h, w, dtype=DT)
    target = 2
    e = explain(model, x, target)
    grad_out = model.head.weight[target].detach().view(out_shape)
    expected = bias_share_loop(model.conv.bias.detach(), grad_out, (h, w), kernel, stride, padding, dilation)
    for b in range(2):
        torch.testing.assert_close(e.bias[b], expected, rtol=RTOL, atol=ATOL)
    # The conv is linear: C_w is its gradient (autograd on the model itself), and C is complete.
    torch.testing.assert_close(e.weight, gradient(model, x, target), rtol=RTOL, atol=ATOL)
    assert_sums_to_logit(e, model, x, target, rtol=1e-12)


@pytest.mark.parametrize("name", ["pad1", "stride2_dilation2_pad1_kernel4x3", "groups2",
                                  "depthwise_multiplier2", "same_even_kernel", "patchify_kernel3x2",
                                  "patchify_groups2"])
def test_receptive_ones_counts(name):
    conv, (kernel, stride, padding, dilation), (cin, h, w) = _conv_from(CONVS[name])
    groups = conv.groups
    ones = torch.ones(2, cin, h, w, dtype=DT)
    s = receptive_ones(ones, conv.weight.shape, conv.stride, conv.padding, conv.dilation, groups)
    out_size = conv(torch.zeros(1, cin, h, w)).shape[2:]
    counts = _valid_count_loop(tuple(out_size), (h, w), kernel, stride, padding, dilation)
    assert s.shape == (2, groups, *out_size)
    torch.testing.assert_close(s, (cin // groups) * counts.expand(2, groups, *out_size), rtol=0, atol=0)


def test_receptive_ones_counts_only_real_positions():
    """Ones that are 0 (zero padding upstream) do not count; each group sums its own channels."""
    g = torch.Generator().manual_seed(4)
    ones = (torch.rand(1, 4, 5, 5, generator=g) > 0.3).to(DT)
    s = receptive_ones(ones, (4, 2, 3, 3), (1, 1), (1, 1), (1, 1), 2)
    expected = torch.zeros(1, 2, 5, 5, dtype=DT)
    for grp, oy, ox in itertools.product(range(2), range(5), range(5)):
        for c, ky, kx in itertools.product(range(2 * grp, 2 * grp + 2), range(3), range(3)):
            iy, ix = oy - 1 + ky, ox - 1 + kx
            if 0 <= iy < 5 and 0 <= ix < 5:
                expected[0, grp, oy, ox] += ones[0, c, iy, ix]
    torch.testing.assert_close(s, expected, rtol=0, atol=0)


def test_convolved_routes_bias_per_group_channel():
    """Unit level: ∂/∂O[c, q] = Σ_{j in c's group} Σ_p b_j g_j[p] / s(p) over p that see q."""
    gen = torch.Generator().manual_seed(5)
    cin, cout, groups, k, stride, pad = 4, 6, 2, 3, 2, 1
    x0 = torch.randn(1, cin, 6, 5, generator=gen, dtype=DT)
    weight = torch.randn(cout, cin // groups, k, k, generator=gen, dtype=DT)
    bias = torch.randn(cout, generator=gen, dtype=DT)
    x = x0.clone().requires_grad_(True)
    ones = torch.ones_like(x0, requires_grad=True)
    out = convolved(Live(x, ones), weight, bias, (stride, stride), (pad, pad), (1, 1), groups)
    g = torch.randn(out.value.shape, generator=gen, dtype=DT)
    (ones_grad,) = torch.autograd.grad((out.value * g).sum(), ones)
    # The value is the ordinary biased convolution, and the output ones stay 1.
    torch.testing.assert_close(out.value.detach(),
                               torch.nn.functional.conv2d(x0, weight, bias, stride, pad, 1, groups),
                               rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(out.ones.detach().expand_as(out.value), torch.ones_like(out.value), rtol=0, atol=0)
    expected = torch.zeros_like(x0)
    per_group_in, per_group_out = cin // groups, cout // groups
    for j in range(cout):
        grp = j // per_group_out
        for oy, ox in itertools.product(range(out.value.shape[2]), range(out.value.shape[3])):
            taps = [(iy, ix) for iy in _taps(oy, 6, k, stride, pad, 1) for ix in _taps(ox, 5, k, stride, pad, 1)]
            s = per_group_in * len(taps)
            for c in range(grp * per_group_in, (grp + 1) * per_group_in):
                for iy, ix in taps:
                    expected[0, c, iy, ix] += bias[j] * g[0, j, oy, ox] / s
    torch.testing.assert_close(ones_grad, expected, rtol=RTOL, atol=ATOL)


def test_rule_registered_for_conv_ops():
    for op in (aten.conv1d.default, aten.conv2d.default, aten.conv2d.padding, aten.conv3d.default,
               aten.convolution.default):
        assert lookup(op) is not None and lookup(op).name.startswith("R2")


class _Conv1dModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2, groups=1)
        self.conv2 = nn.Conv1d(4, 4, 2, padding=1, groups=2)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = self.conv2(torch.relu(self.conv(x.flatten(2))))
        return self.head(y.mean(-1))


class _Conv3dModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv3d(1, 4, (2, 3, 3), stride=(1, 2, 1), padding=1, dilation=(1, 1, 2))
        self.conv2 = nn.Conv3d(4, 4, 3, padding="same", groups=4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        y = self.conv2(torch.nn.functional.gelu(self.conv(x.unsqueeze(1))))
        return self.head(y.mean((2, 3, 4)))


@pytest.mark.parametrize("cls", [_Conv1dModel, _Conv3dModel])
def test_conv1d_conv3d_complete(cls):
    torch.manual_seed(2)
    model = randomize(cls(), seed=9, scale=0.5).double()
    x = torch.randn(2, 3, 5, 6, dtype=DT)
    e = explain(model, x, 1)
    assert_complete(e, model, x, 1, rtol=1e-10)
    assert e.bias.abs().max() > 1e-3  # the biases are really there


@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_bias_only_reached_by_padding_is_spread_over_the_real_pixels(backend):
    """R11': a 1×1 convolution with padding 1 adds its bias on a border that sees no pixel;
    there the bias is carried by the mean of the ones over the 16 real pixels, so each gets
    1/16 of it; inside, each pixel carries its own output position's bias."""
    model = randomize(_conv_head(nn.Conv2d(2, 2, 1, padding=1), 2 * 6 * 6), 4, scale=0.5).double()
    x = torch.randn(2, 2, 4, 4, dtype=DT)
    explainer = Explainer(model, backend=backend)
    for _ in range(2):  # the second call replays the first one's decision
        e = explainer(x, 0)
        assert_complete(e, model, x, 0, rtol=1e-10)
        per_position = torch.einsum("c,cyx->yx", model.conv.bias, model.head.weight[0].view(2, 6, 6)).detach()
        border = per_position.sum() - per_position[1:5, 1:5].sum()
        expected = per_position[1:5, 1:5] + border / 16
        torch.testing.assert_close(e.bias, expected.expand(2, 4, 4), rtol=RTOL, atol=ATOL)
    # Without a bias the same padding needs nothing.
    model = randomize(_conv_head(nn.Conv2d(2, 2, 1, padding=1, bias=False), 2 * 6 * 6), 3, scale=0.5).double()
    e = explain(model, x, 0)
    assert_sums_to_logit(e, model, x, 0, rtol=1e-12)
    torch.testing.assert_close(e.bias, torch.zeros_like(e.bias), rtol=0, atol=0)


@pytest.mark.parametrize("name, patch_product", [("patchify", True), ("patchify_kernel3x2", True),
                                                 ("patchify_groups2", False), ("stride2_pad1", False)])
def test_patchifying_convolution_is_one_matrix_product(monkeypatch, name, patch_product):
    """Whole non-overlapping patches (groups 1) take the matrix-product path, checked above
    against the loop oracle; every other convolution calls the convolution."""
    calls = []
    product = conv_rules._patch_product
    monkeypatch.setattr(conv_rules, "_patch_product", lambda x, w: calls.append(1) or product(x, w))
    conv, _, (cin, h, w) = _conv_from(CONVS[name])
    out_features = conv(torch.zeros(1, cin, h, w)).shape[1:].numel()
    model = randomize(_conv_head(conv, out_features), seed=3, scale=0.5).double()
    explain(model, torch.randn(2, cin, h, w, dtype=DT), 0, backend="reference")
    assert bool(calls) == patch_product
