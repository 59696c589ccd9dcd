"""Parameter gradients of OMENN explanations, checked against an independent torch.func OMENN.

What is checked, for a tiny CNN (conv / BatchNorm / SiLU / strided conv / GELU /
adaptive pooling / linear; left in train mode) and a tiny one-block ViT (class token,
position embedding, written-out softmax attention, LayerNorms, GELU MLP):

1. ``explain(..., backend="reference")`` gives the same ``C``, ``C_w``, ``C_b`` as the
   OMENN written here, and that ``C`` sums to the model's own logit;
2. with ``create_graph=True, parameter_gradient="total"``, the gradient of an
   attribution loss ``L(θ) = Σ R·C + Σ R_w·C_w + Σ R_b·C_b`` with respect to every
   parameter equals ``torch.func.grad`` of the same loss of the OMENN written here,
   whose multipliers (activation ξ, LayerNorm 1/σ, attention matrix A) are recomputed
   from the model's own forward at θ, so that dL/dθ includes how they move with θ;
3. the same with ``parameter_gradient="fixed_multipliers"`` against the OMENN written
   here with every multiplier detached;
4. the two kinds of gradient differ, so that (2) cannot pass by ignoring the multipliers.

(2) and (3) run on three backends: the fused one differentiates its own ops twice, the
compiled one its traced graph.

Why the OMENN written here is independent of the library: it shares none of its code
(no capture, no rule registry, no backend). Each model's linearized network is written
out by hand, rule by rule, on (value, ones) pairs with full-shape ones channels, from
DESIGN.md §2, and its derivatives are taken with torch.func (``grad`` nested in ``grad``)
instead of ``torch.autograd.grad(create_graph=True)``. Only the multipliers come from
the model's own forward (recorded by forward hooks in eval semantics), as the rule book
defines them.

Tolerances (float64): rtol 1e-9, atol 1e-11 for explanations and gradients (rounding is
~1e-15 relative; the margin covers the sums over pixels, channels and tokens);
completeness to 1e-10 relative; total and fixed-multiplier gradients must differ by more
than 1e-6 relative.
"""

from __future__ import annotations

import math
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import omenn_kernels
from omenn_kernels.backends import compiled

DT = torch.float64
RTOL = 1e-9
ATOL = 1e-11
RTOL_COMPLETE = 1e-10
MIN_TOTAL_VS_FIXED = 1e-6
TARGET = torch.tensor([1, 3])


# --------------------------------------------------------------------------- models


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.act1 = nn.SiLU()
        self.conv2 = nn.Conv2d(4, 6, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.act2 = nn.GELU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(6, 5)

    def forward(self, x: Tensor) -> Tensor:
        x = self.act1(self.bn1(self.conv1(x)))
        x = self.act2(self.bn2(self.conv2(x)))
        return self.head(self.flatten(self.pool(x)))


class TinyViT(nn.Module):
    """4 patch tokens of an 8×8 image, a class token, one pre-norm block of 2 heads of width 4."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.patch_embed = nn.Conv2d(3, dim, kernel_size=4, stride=4)
        self.cls_token = nn.Parameter(torch.empty(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.empty(1, 5, dim))
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.softmax = nn.Softmax(dim=-1)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 5)

    def attention(self, x: Tensor) -> Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = self.softmax(q @ k.transpose(-2, -1) * (d // self.heads) ** -0.5)
        return (a @ v).transpose(1, 2).reshape(b, n, d)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = x + self.proj(self.attention(self.norm1(x)))
        x = x + self.fc2(self.act(self.fc1(self.norm2(x))))
        return self.head(self.norm(x)[:, 0])


def randomized(model: nn.Module, seed: int) -> nn.Module:
    """Every parameter and float buffer random and nonzero; BatchNorm running variances in [0.5, 1.5]."""
    g = torch.Generator().manual_seed(seed)
    model = model.to(DT)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=DT))
        for name, b in model.named_buffers():
            if name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g, dtype=DT))
            elif b.is_floating_point():
                b.copy_(torch.randn(b.shape, generator=g, dtype=DT))
    return model


def make_model(name: str) -> nn.Module:
    if name == "cnn":
        return randomized(TinyCNN(), seed=1).train()  # explain must use eval semantics anyway
    return randomized(TinyViT(), seed=2).eval()


def make_input() -> Tensor:
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3), dtype=DT)


# --------------------------------------------------------------------------- multipliers


@contextmanager
def eval_semantics(model: nn.Module) -> Iterator[None]:
    flags = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, flag in flags:
            module.training = flag


def multiplier(module: nn.Module, pre: Tensor, output: Tensor) -> Tensor:
    """The rule book's multiplier of a module, from its input ``pre`` and output in the model's forward."""
    if isinstance(module, nn.SiLU):
        return torch.sigmoid(pre)
    if isinstance(module, nn.GELU):
        return 0.5 * (1 + torch.erf(pre / math.sqrt(2)))
    if isinstance(module, nn.LayerNorm):
        return torch.rsqrt(pre.var(-1, unbiased=False, keepdim=True) + module.eps)
    return output  # nn.Softmax: the attention matrix A


def own_forward(model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
                x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """The model's own logits at θ = ``params`` (eval semantics) and its multipliers, by module name."""
    multipliers: dict[str, Tensor] = {}

    def record(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
            multipliers[name] = multiplier(module, inputs[0], output)
        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
               if isinstance(module, (nn.SiLU, nn.GELU, nn.LayerNorm, nn.Softmax))]
    try:
        with eval_semantics(model):
            logits = torch.func.functional_call(model, (params, buffers), (x,))
    finally:
        for handle in handles:
            handle.remove()
    return logits, multipliers


# --------------------------------------------------------------------------- rules on (value, ones)


def conv(value: Tensor, ones: Tensor, weight: Tensor, bias: Tensor,
         stride: int, padding: int) -> tuple[Tensor, Tensor]:
    """R2: the bias rides on S/stopgrad(S), S = the ones in the receptive field (padding counts 0)."""
    window = torch.ones(1, 1, *weight.shape[-2:], dtype=ones.dtype)
    covered = F.conv2d(ones.sum(1, keepdim=True), window, None, stride, padding)
    ones_out = covered / covered.detach()
    out = F.conv2d(value, weight, None, stride, padding) + bias.view(1, -1, 1, 1) * ones_out
    return out, ones_out.expand_as(out)


def batch_norm(value: Tensor, ones: Tensor, state: dict[str, Tensor], name: str,
               eps: float) -> tuple[Tensor, Tensor]:
    """R3 with the running statistics."""
    scale = state[f"{name}.weight"] / torch.sqrt(state[f"{name}.running_var"] + eps)
    shift = state[f"{name}.bias"] - state[f"{name}.running_mean"] * scale
    return value * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1) * ones, ones


def linear(value: Tensor, ones: Tensor, weight: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """R1: the bias rides on the mean of the ones over the contracted features."""
    ones_mean = ones.mean(-1, keepdim=True)
    out = value @ weight.T + bias * ones_mean
    return out, ones_mean.expand_as(out)


def layer_norm(value: Tensor, ones: Tensor, state: dict[str, Tensor], name: str,
               inverse_std: Tensor) -> tuple[Tensor, Tensor]:
    """R3': centring is linear, 1/σ is the multiplier, β rides on the mean of the ones."""
    ones_mean = ones.mean(-1, keepdim=True)
    centred = value - value.mean(-1, keepdim=True)
    out = centred * inverse_std * state[f"{name}.weight"] + state[f"{name}.bias"] * ones_mean
    return out, ones_mean.expand_as(out)


def residual(a: tuple[Tensor, Tensor], b: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """R7: values add, ones average."""
    return a[0] + b[0], (a[1] + b[1]) / 2


# --------------------------------------------------------------------------- linearized models

Linearized = Callable[[nn.Module, dict[str, Tensor], dict[str, Tensor], Tensor, Tensor], Tensor]


def linearized_cnn(model: TinyCNN, state: dict[str, Tensor], multipliers: dict[str, Tensor],
                   x: Tensor, ones: Tensor) -> Tensor:
    value, ones = conv(x, ones, state["conv1.weight"], state["conv1.bias"], stride=1, padding=1)
    value, ones = batch_norm(value, ones, state, "bn1", model.bn1.eps)
    value = value * multipliers["act1"]  # R4, SiLU(0) = 0
    value, ones = conv(value, ones, state["conv2.weight"], state["conv2.bias"], stride=2, padding=1)
    value, ones = batch_norm(value, ones, state, "bn2", model.bn2.eps)
    value = value * multipliers["act2"]  # R4, GELU(0) = 0
    # R13: adaptive pooling of the ones, renormalized to stay 1.
    pooled_ones = ones.mean((2, 3))
    value, ones = value.mean((2, 3)), pooled_ones / pooled_ones.detach()
    return linear(value, ones, state["head.weight"], state["head.bias"])[0]


def linearized_vit(model: TinyViT, state: dict[str, Tensor], multipliers: dict[str, Tensor],
                   x: Tensor, ones: Tensor) -> Tensor:
    value, ones = conv(x, ones, state["patch_embed.weight"], state["patch_embed.bias"],
                       stride=4, padding=0)
    value, ones = value.flatten(2).transpose(1, 2), ones.flatten(2).transpose(1, 2)
    batch, tokens, dim = value.shape
    # R12: the class token's share of the ones is spread evenly over all live positions.
    share = ones.mean((1, 2), keepdim=True)
    share = share / share.detach()
    value = torch.cat([state["cls_token"] * share, value], dim=1)
    ones = torch.cat([share.expand(batch, 1, dim), ones], dim=1)
    value = value + state["pos_embed"] * ones  # R7'
    stream = value, ones

    # R6: A is a multiplier; only the v third of qkv is live; the ones follow the value tokens.
    value, ones = layer_norm(*stream, state, "norm1", multipliers["norm1"])
    v, v_ones = linear(value, ones, state["qkv.weight"][2 * dim:], state["qkv.bias"][2 * dim:])
    heads = model.heads
    v = v.reshape(batch, tokens + 1, heads, dim // heads).transpose(1, 2)
    attended = (multipliers["softmax"] @ v).transpose(1, 2).reshape(batch, tokens + 1, dim)
    stream = residual(stream, linear(attended, v_ones, state["proj.weight"], state["proj.bias"]))

    value, ones = layer_norm(*stream, state, "norm2", multipliers["norm2"])
    value, ones = linear(value, ones, state["fc1.weight"], state["fc1.bias"])
    value = value * multipliers["act"]  # R4, GELU(0) = 0
    stream = residual(stream, linear(value, ones, state["fc2.weight"], state["fc2.bias"]))

    value, ones = layer_norm(*stream, state, "norm", multipliers["norm"])
    return linear(value[:, 0], ones[:, 0], state["head.weight"], state["head.bias"])[0]


LINEARIZED: dict[type, Linearized] = {TinyCNN: linearized_cnn, TinyViT: linearized_vit}


# --------------------------------------------------------------------------- independent OMENN


class IndependentExplanation(NamedTuple):
    contribution: Tensor
    weight: Tensor
    bias: Tensor
    own_logit: Tensor  # ŷ from the model's own forward, for completeness


def independent_explain(model: nn.Module, params: dict[str, Tensor], buffers: dict[str, Tensor],
                        x: Tensor, target: Tensor, detach_multipliers: bool) -> IndependentExplanation:
    """OMENN of ``model`` at θ = ``params``: C_w and the ones' gradient by torch.func.grad w.r.t. (X, O).

    The multipliers are computed outside the inner ``grad``, so they are constant w.r.t. X
    and O; they remain functions of θ unless ``detach_multipliers``.
    """
    logits, multipliers = own_forward(model, params, buffers, x)
    if detach_multipliers:
        multipliers = {name: m.detach() for name, m in multipliers.items()}
    state = {**params, **buffers}

    def explained_readout(x_live: Tensor, ones: Tensor) -> Tensor:
        linearized_logits = LINEARIZED[type(model)](model, state, multipliers, x_live, ones)
        return linearized_logits.gather(1, target[:, None]).sum()

    weight, ones_gradient = torch.func.grad(explained_readout, argnums=(0, 1))(x, torch.ones_like(x))
    bias = ones_gradient.sum(1)
    contribution = (weight * x).sum(1) + bias
    return IndependentExplanation(contribution, weight, bias, logits.gather(1, target[:, None])[:, 0])


class LossWeights(NamedTuple):
    contribution: Tensor  # R  (B, H, W)
    weight: Tensor        # R_w (B, C, H, W)
    bias: Tensor          # R_b (B, H, W)


def make_loss_weights(x: Tensor) -> LossWeights:
    g = torch.Generator().manual_seed(4)
    b, c, h, w = x.shape
    return LossWeights(torch.randn(b, h, w, generator=g, dtype=DT),
                       torch.randn(b, c, h, w, generator=g, dtype=DT),
                       torch.randn(b, h, w, generator=g, dtype=DT))


def attribution_loss(contribution: Tensor, weight: Tensor, bias: Tensor, r: LossWeights) -> Tensor:
    return (r.contribution * contribution).sum() + (r.weight * weight).sum() + (r.bias * bias).sum()


def independent_parameter_gradient(model: nn.Module, x: Tensor, r: LossWeights,
                                   detach_multipliers: bool) -> dict[str, Tensor]:
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    def loss(params: dict[str, Tensor]) -> Tensor:
        e = independent_explain(model, params, buffers, x, TARGET, detach_multipliers)
        return attribution_loss(e.contribution, e.weight, e.bias, r)

    return torch.func.grad(loss)(params)


def library_parameter_gradient(model: nn.Module, x: Tensor, r: LossWeights,
                               parameter_gradient: str, backend: str = "reference") -> dict[str, Tensor]:
    explainer = omenn_kernels.Explainer(model, backend=backend)
    if backend == "compiled":  # the first call of a signature runs the fused backend and compiles
        with warnings.catch_warnings():  # a fallback to the fused backend would test that again
            warnings.simplefilter("error", RuntimeWarning)
            explainer(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
    e = explainer(x, TARGET, create_graph=True, parameter_gradient=parameter_gradient)
    names, params = zip(*model.named_parameters())
    gradients = torch.autograd.grad(attribution_loss(e.contribution, e.weight, e.bias, r), params)
    return dict(zip(names, gradients))


def assert_gradients_equal(library: dict[str, Tensor], independent: dict[str, Tensor]) -> None:
    assert library.keys() == independent.keys()
    for name, expected in independent.items():
        torch.testing.assert_close(library[name], expected, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, name=name: f"d L / d {name}: {m}")


# --------------------------------------------------------------------------- tests

MODELS = ["cnn", "vit"]


@pytest.mark.parametrize("model_name", MODELS)
def test_first_order_matches_library(model_name: str) -> None:
    model, x = make_model(model_name), make_input()
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}
    independent = independent_explain(model, params, buffers, x, TARGET, detach_multipliers=True)
    library = omenn_kernels.explain(model, x, TARGET, backend="reference")

    torch.testing.assert_close(library.weight, independent.weight, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(library.bias, independent.bias, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(library.contribution, independent.contribution, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(independent.contribution.sum((1, 2)), independent.own_logit,
                               rtol=RTOL_COMPLETE, atol=0)
    torch.testing.assert_close(library.logit, independent.own_logit, rtol=RTOL_COMPLETE, atol=0)
    assert model.training == (model_name == "cnn")  # the flag of the train-mode model is kept


@pytest.mark.parametrize("backend", ["reference", "auto", "compiled"])
@pytest.mark.parametrize("parameter_gradient, detach_multipliers",
                         [("total", False), ("fixed_multipliers", True)])
@pytest.mark.parametrize("model_name", MODELS)
def test_parameter_gradient_matches_torch_func(monkeypatch, model_name: str, parameter_gradient: str,
                                               detach_multipliers: bool, backend: str) -> None:
    """"total" against the multipliers recomputed at θ; "fixed_multipliers" against them detached.
    Three backends: the fused one differentiates its own ops twice, the compiled one its
    traced graph (compiled here with the traced graph itself)."""
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    model, x = make_model(model_name), make_input()
    r = make_loss_weights(x)
    assert_gradients_equal(library_parameter_gradient(model, x, r, parameter_gradient, backend),
                           independent_parameter_gradient(model, x, r, detach_multipliers=detach_multipliers))


@pytest.mark.parametrize("model_name", MODELS)
def test_total_and_fixed_multiplier_gradients_differ(model_name: str) -> None:
    model, x = make_model(model_name), make_input()
    r = make_loss_weights(x)
    total = library_parameter_gradient(model, x, r, "total")
    fixed = library_parameter_gradient(model, x, r, "fixed_multipliers")
    total_vector = torch.cat([g.flatten() for g in total.values()])
    fixed_vector = torch.cat([g.flatten() for g in fixed.values()])
    relative = (total_vector - fixed_vector).norm() / total_vector.norm()
    assert relative > MIN_TOTAL_VS_FIXED, f"total and fixed-multiplier gradients differ by only {relative:.3g}"
