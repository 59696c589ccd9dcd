"""Models and helpers for testing and measuring OMENN on every supported family.

``relative_distance`` is how far one result is from another. ``randomize_`` gives a model random biases, norm statistics and affine parameters:
timm and torchvision initialize many of them to 0 or 1, which hides bias-routing
bugs. ``FAMILIES`` builds a small, randomly initialized model of each supported
family with its input size; ``FULL_SIZE`` the full-size ImageNet models.
``change_in_every_way`` changes a model's parameters as training loops and users do, and
``python_entered`` lists the Python a call runs (none for an op the dispatcher sends
straight to its C++ kernel).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .backends.compiled import relative_distance
from .capture import eval_semantics
from .readout import Readout

__all__ = ["FAMILIES", "FULL_SIZE", "Family", "change_in_every_way", "python_entered", "randomize_",
           "relative_completeness_error", "relative_distance"]


def randomize_(model: nn.Module, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Give every bias, norm affine, layer scale, token, positional embedding and BN statistic a random value.

    Weight matrices and kernels keep their initialization, unless it is all zeros
    (torchvision zero-initializes some classifier heads). Returns the model.
    """
    generator = torch.Generator().manual_seed(seed)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return (scale * torch.randn(t.shape, generator=generator, dtype=torch.float64)).to(t.dtype)

    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if param.dim() <= 1 and leaf == "weight":  # norm scales
                param.copy_(1 + noise(param))
            elif param.dim() <= 1 or any(k in name for k in ("token", "pos_embed", "relative_position",
                                                                  "class_embedding", "pos_embedding")):
                param.copy_(noise(param))
            elif bool((param == 0).all()):
                param.copy_(noise(param) / param[0].numel() ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("running_mean"):
                buffer.copy_(noise(buffer))
            elif name.endswith("running_var"):
                buffer.copy_((0.5 + torch.rand(buffer.shape, generator=generator, dtype=torch.float64)).to(buffer.dtype))
    return model


@dataclass(frozen=True)
class Family:
    """A model family: how to build a (randomly initialized) member and the input it takes."""

    build: Callable[[], nn.Module]
    size: int
    description: str


def _timm(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, **kwargs)
    return build


def _torchvision(name: str, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return getattr(torchvision.models, name)(**kwargs)
    return build


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 64), nn.GELU(), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 10))


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.SiLU(),
        nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.GELU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


_SMALL_VIT = dict(image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32,
                  mlp_dim=64, num_classes=10)

FAMILIES: dict[str, Family] = {
    "mlp": Family(_mlp, 16, "nn.Sequential MLP (Linear, GELU, ReLU)"),
    "cnn": Family(_cnn, 32, "nn.Sequential CNN (Conv, BatchNorm, ReLU, SiLU, GELU, max/avg pool, depthwise)"),
    "vit": Family(_timm("vit_tiny_patch16_224", img_size=64, num_classes=10), 64, "timm ViT-Ti/16"),
    "deit": Family(_timm("deit_tiny_distilled_patch16_224", img_size=64, num_classes=10), 64,
                   "timm DeiT-Ti distilled (class + distillation tokens)"),
    "swin": Family(_timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4, num_classes=10), 64,
                   "timm Swin-T (shifted windows, relative position bias)"),
    "convnext": Family(_timm("convnext_atto", num_classes=10), 64, "timm ConvNeXt-Atto"),
    "resnet": Family(_timm("resnet18", num_classes=10), 64, "timm ResNet-18"),
    "vgg": Family(_timm("vgg11", num_classes=10), 64, "timm VGG-11"),
    "efficientnet": Family(_timm("efficientnet_b0", num_classes=10), 64,
                           "timm EfficientNet-B0 (SiLU, squeeze-excitation)"),
    "mobilenetv3": Family(_timm("mobilenetv3_small_100", num_classes=10), 64,
                          "timm MobileNetV3-S (hardswish, hard-sigmoid SE)"),
    "regnet": Family(_timm("regnety_002", num_classes=10), 64, "timm RegNetY-200MF (SE)"),
    "beit": Family(_timm("beit_base_patch16_224", img_size=64, depth=2, num_classes=10), 64,
                   "timm BEiT-B (2 blocks; relative position bias, layer scale)"),
    "torchvision_resnet": Family(_torchvision("resnet18", num_classes=10), 64, "torchvision ResNet-18"),
    "torchvision_vgg": Family(_torchvision("vgg11_bn", num_classes=10), 64, "torchvision VGG-11-BN"),
    "torchvision_vit": Family(_torchvision("VisionTransformer", **_SMALL_VIT), 64,
                              "torchvision VisionTransformer (2 layers, nn.MultiheadAttention)"),
}

FULL_SIZE: dict[str, Family] = {
    name: Family(_timm(name), 224, f"timm {name}")
    for name in ("vit_base_patch16_224", "resnet50", "vgg16", "convnext_tiny")
}


def relative_completeness_error(model: nn.Module, x: torch.Tensor, explanation) -> float:
    """``max_b |Σ C_b − f(x)_b[t]| / |f(x)_b[t]|`` against the model's own eval-mode forward."""
    with eval_semantics(model), torch.no_grad():
        logits = model(x)
    expected = Readout.value(logits, explanation.target)
    total = explanation.contribution.flatten(1).sum(1)
    return float(((total - expected).abs() / expected.abs()).max())


def change_in_every_way(model: nn.Module, images: torch.Tensor, rebound: nn.Parameter) -> None:
    """An optimizer step (in train mode, on ``images``), every floating-point entry of the state
    dict moved and loaded, and ``rebound.data`` replaced by a new tensor; ``model`` ends in
    eval mode."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    model(images).square().mean().backward()
    optimizer.step()
    model.eval()
    state = {name: value + 0.1 * torch.rand_like(value) if value.is_floating_point() else value
             for name, value in model.state_dict().items()}
    model.load_state_dict(state)
    rebound.data = rebound.data * 1.5


def python_entered(call: Callable[[], object], where: tuple[str, ...] = ("omenn_kernels", "torch/_library")
                   ) -> list[str]:
    """The functions of files whose path holds one of ``where`` that ``call()`` enters."""
    entered: list[str] = []

    def profiler(frame, event, _arg):
        if event == "call" and any(part in frame.f_code.co_filename for part in where):
            entered.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profiler)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered
