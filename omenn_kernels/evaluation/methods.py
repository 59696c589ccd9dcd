"""The attribution methods the explanation-quality benchmark compares.

Every method is a callable ``explain(images (B, 3, H, W), targets (B,)) -> (B, H, W)``:
one attribution per pixel (channels summed), for the given target classes. The
established methods come from maintained libraries (Captum, Zennit); only the
token-grid Grad-CAM of a ViT, which Captum's ``LayerGradCam`` cannot express (it
averages gradients over every dimension after the channel one), is written here.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from ..api import Explainer
from ..visualize import postprocess

AttributionMethod = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def omenn(model: nn.Module, *, backend: str = "auto") -> AttributionMethod:
    """OMENN contributions: they sum to the explained logit."""
    explainer = Explainer(model, backend=backend)
    return lambda images, targets: explainer(images, targets).contribution


def omenn_postprocessed(model: nn.Module, *, backend: str = "auto") -> AttributionMethod:
    """OMENN with the paper's display post-processing (positive part, 99 % clip, 3×3 mean)."""
    raw = omenn(model, backend=backend)
    return lambda images, targets: postprocess(raw(images, targets))


def _captum(method, **kwargs) -> AttributionMethod:
    def explain(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        inputs = images.detach().clone().requires_grad_(True)
        return method.attribute(inputs, target=targets, **kwargs).detach().sum(1)
    return explain


def saliency(model: nn.Module) -> AttributionMethod:
    """Captum ``Saliency``: absolute input gradient."""
    from captum.attr import Saliency
    return _captum(Saliency(model))


def input_x_gradient(model: nn.Module) -> AttributionMethod:
    """Captum ``InputXGradient``."""
    from captum.attr import InputXGradient
    return _captum(InputXGradient(model))


def integrated_gradients(model: nn.Module, *, steps: int = 50) -> AttributionMethod:
    """Captum ``IntegratedGradients`` from a black (zero) baseline, as FunnyBirds runs it."""
    from captum.attr import IntegratedGradients
    return _captum(IntegratedGradients(model), n_steps=steps, baselines=0.0)


def grad_cam(model: nn.Module, layer: nn.Module) -> AttributionMethod:
    """Captum ``LayerGradCam`` on a convolutional ``layer``, upsampled bilinearly to the image."""
    from captum.attr import LayerAttribution, LayerGradCam
    method = LayerGradCam(model, layer)

    def explain(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cam = method.attribute(images, target=targets, relu_attributions=True).detach()
        return LayerAttribution.interpolate(cam, tuple(images.shape[2:]), "bilinear").sum(1)
    return explain


def token_grad_cam(model: nn.Module, layer: nn.Module, grid: tuple[int, int],
                   prefix_tokens: int) -> AttributionMethod:
    """Grad-CAM on the patch tokens (B, T, D) that ``layer`` outputs, laid out on ``grid``.

    The usual ViT adaptation: the class/register tokens (the first ``prefix_tokens``)
    are dropped, the patch tokens form a (D, h, w) feature map, channel weights are
    the gradients averaged over the grid, the map is ReLU(Σ_d w_d A_d), upsampled
    bilinearly to the image.
    """
    def explain(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        captured: list[torch.Tensor] = []
        handle = layer.register_forward_hook(lambda module, args, output: captured.append(output))
        try:
            with torch.enable_grad():
                logits = model(images)
                tokens = captured[-1]
                (gradient,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), tokens)
        finally:
            handle.remove()
        if tokens.shape[1] != prefix_tokens + grid[0] * grid[1]:
            raise ValueError(f"the layer outputs {tokens.shape[1]} tokens, expected {prefix_tokens} prefix "
                             f"tokens and a {grid[0]}×{grid[1]} grid")
        patches, gradient = tokens[:, prefix_tokens:].detach(), gradient[:, prefix_tokens:]
        cam = F.relu((gradient.mean(1, keepdim=True) * patches).sum(-1))
        cam = cam.reshape(-1, 1, *grid)
        return F.interpolate(cam, size=tuple(images.shape[2:]), mode="bilinear", align_corners=False)[:, 0]
    return explain


def _conv_batch_norm_pairs(model: nn.Module) -> list[tuple[list[str], str]]:
    """Names of every (convolution, BatchNorm) pair where the BatchNorm reads only that conv's output.

    Found on the module's torch.fx graph, so pairs outside ``nn.Sequential`` (inside a
    residual block, say) are merged too.
    """
    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    pairs = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules[node.target], nn.modules.batchnorm._BatchNorm):
            continue
        source = node.args[0]
        if (isinstance(source, torch.fx.Node) and source.op == "call_module"
                and isinstance(modules[source.target], nn.Conv2d) and len(source.users) == 1):
            pairs.append(([source.target], node.target))
    return pairs


def lrp_epsilon_plus_flat(model: nn.Module) -> AttributionMethod:
    """Zennit LRP with the ``EpsilonPlusFlat`` composite, each BatchNorm merged into its conv.

    The relevance starts as the target's logit, so a bias-free network's relevance sums
    to it. Residual additions have no Zennit rule outside torchvision ResNets; relevance
    passes them as a gradient does.
    """
    from zennit.attribution import Gradient
    from zennit.canonizers import NamedMergeBatchNorm
    from zennit.composites import EpsilonPlusFlat

    pairs = _conv_batch_norm_pairs(model)

    def explain(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        composite = EpsilonPlusFlat(canonizers=[NamedMergeBatchNorm(pairs)])
        with Gradient(model=model, composite=composite) as attributor:
            logits = model(images).detach()
            start = F.one_hot(targets, logits.shape[1]).to(images.dtype) * logits
            _, relevance = attributor(images.detach().clone().requires_grad_(True), start)
        return relevance.detach().sum(1)
    return explain


def random_attribution(*, seed: int = 0) -> AttributionMethod:
    """Uniform random attributions in [0, 1): the floor every method should clear."""
    generator = torch.Generator().manual_seed(seed)

    def explain(images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        values = torch.rand(images.shape[0], *images.shape[2:], generator=generator)
        return values.to(device=images.device, dtype=images.dtype)
    return explain
