"""Small float64 models for the tests of explanations differentiable with respect to the parameters.

Not a test module. Every bias, norm affine, norm statistic, token and positional
embedding is random and non-zero. The CNN and the ViT are smooth in the parameters;
the ReLU CNN has ReLU and max pooling, whose multipliers are piecewise constant (it
explains without the model's forward as its held pass): finite differences hold there away from the kinks,
and its random inputs and parameters are nowhere within a step of one.
"""

from __future__ import annotations

import timm
import torch
from torch import nn

from omenn_kernels.testing import randomize_

DT = torch.float64


class SmallCNN(nn.Module):
    """Conv/BatchNorm/SiLU, strided conv/BatchNorm/GELU, average pooling, LayerNorm, linear head."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.SiLU(),
            nn.Conv2d(4, 6, 3, stride=2, padding=1), nn.BatchNorm2d(6), nn.GELU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.features(x)))


def small_cnn(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The CNN and a (2, 3, 8, 8) input."""
    torch.manual_seed(seed)
    model = randomize_(SmallCNN(), seed=seed, scale=0.5).to(DT)
    return model, torch.randn(2, 3, 8, 8, dtype=DT)


class ReluCNN(nn.Module):
    """Conv/BatchNorm/ReLU/max pooling, conv/BatchNorm/ReLU, average pooling, linear head."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(4, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def relu_cnn(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """The ReLU CNN and a (2, 3, 8, 8) input."""
    torch.manual_seed(seed)
    model = randomize_(ReluCNN(), seed=seed, scale=0.5).to(DT)
    return model, torch.randn(2, 3, 8, 8, dtype=DT)


def small_vit(seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    """timm's ViT (patch embedding, class token, positional embedding, LayerNorm, SDPA
    attention, GELU MLP) with one block of width 16 and 4 patches, and a (2, 3, 16, 16) input."""
    torch.manual_seed(seed)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8,
                              embed_dim=16, depth=1, num_heads=2, num_classes=5)
    model = randomize_(model, seed=seed, scale=0.5).to(DT)
    return model, torch.randn(2, 3, 16, 16, dtype=DT)


MODELS = {"cnn": small_cnn, "vit": small_vit, "relu_cnn": relu_cnn}
# Models with multipliers that change smoothly with the parameters (GELU, SiLU, LayerNorm,
# attention), where holding them fixed changes the parameter gradient.
SMOOTH = ["cnn", "vit"]
