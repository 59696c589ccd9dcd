"""The two classifiers the project ships for the synthetic parts data set.

Both take a (B, 3, 96, 96) image batch with values in [0, 1] and return (B, num_classes)
logits. The CNN takes the image as it is (its first BatchNorm absorbs the input's
offset and scale); the ViT maps it to about zero mean and unit spread first, inside its
forward, because without that its training plateaus for several epochs.

Every operation has an OMENN rule: convolutions and linear layers with biases,
BatchNorm, LayerNorm, ReLU, GELU, max and average pooling, softmax attention, and
residual sums. Neither model has data-dependent
Python control flow or in-place operations, so ``torch.export`` captures them whole.
"""

from __future__ import annotations

from timm.models.vision_transformer import VisionTransformer
from torch import Tensor, nn

from ..errors import ModelLoadError

IMAGE_SIZE = 96
CNN_DEFAULTS: dict[str, object] = {"widths": (32, 64, 128)}
VIT_DEFAULTS: dict[str, object] = {"embed_dim": 64, "depth": 4, "num_heads": 4, "mlp_ratio": 2.0}
# Fixed input normalization of the ViT: [0, 1] -> [-2, 2]. Constants, not data statistics.
VIT_INPUT_CENTER = 0.5
VIT_INPUT_SCALE = 4.0


class ResidualBlock(nn.Module):
    """Two 3x3 conv/BatchNorm layers whose output is added to the block's input, then ReLU."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=True)
        self.bn1 = nn.BatchNorm2d(channels)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=True)
        self.bn2 = nn.BatchNorm2d(channels)
        self.relu2 = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        """``relu(x + bn2(conv2(relu(bn1(conv1(x))))))``."""
        branch = self.bn2(self.conv2(self.relu1(self.bn1(self.conv1(x)))))
        return self.relu2(x + branch)


def _conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=True),
            nn.BatchNorm2d(out_channels), nn.ReLU()]


class PartsCNN(nn.Module):
    """A small residual CNN: 96 px in, three stages at 24, 12 and 6 px, global average pooling.

    The stem (stride-2 conv, then 2x2 max pooling) brings the image to 24x24; each later
    stage starts with a conv/BatchNorm/ReLU and a 2x2 max pooling and every stage ends
    with a residual block.
    """

    def __init__(self, num_classes: int = 50, widths: tuple[int, int, int] = (32, 64, 128)) -> None:
        super().__init__()
        if num_classes < 1:
            raise ModelLoadError(f"num_classes must be positive, got {num_classes}")
        if len(widths) != 3 or any(int(w) < 1 for w in widths):
            raise ModelLoadError(f"widths must be three positive channel counts, got {widths!r}")
        w1, w2, w3 = (int(w) for w in widths)
        self.stem = nn.Sequential(*_conv_bn_relu(3, w1, stride=2), nn.MaxPool2d(2))
        self.stage1 = ResidualBlock(w1)
        self.stage2 = nn.Sequential(*_conv_bn_relu(w1, w2), nn.MaxPool2d(2), ResidualBlock(w2))
        self.stage3 = nn.Sequential(*_conv_bn_relu(w2, w3), nn.MaxPool2d(2), ResidualBlock(w3))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(w3, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes) of an image batch (B, 3, H, W)."""
        features = self.stage3(self.stage2(self.stage1(self.stem(x))))
        return self.head(self.pool(features).flatten(1))


def parts_cnn(num_classes: int = 50, widths: tuple[int, int, int] | list[int] = (32, 64, 128)) -> nn.Module:
    """The shipped residual CNN (conv with bias, BatchNorm, ReLU, max pooling, residual sums)."""
    return PartsCNN(num_classes, tuple(widths))


class PartsViT(VisionTransformer):
    """timm's ``VisionTransformer`` that first maps its [0, 1] input to [-2, 2]: ``(x - 0.5) * 4``.

    Parameters and state_dict keys are exactly timm's.
    """

    def forward(self, x: Tensor) -> Tensor:
        """Logits (B, num_classes) of an image batch (B, 3, 96, 96) with values in [0, 1]."""
        return super().forward((x - VIT_INPUT_CENTER) * VIT_INPUT_SCALE)


def parts_vit(num_classes: int = 50, embed_dim: int = 64, depth: int = 4, num_heads: int = 4,
              mlp_ratio: float = 2.0) -> nn.Module:
    """The shipped ViT: timm ``VisionTransformer`` at 96 px, patch 8 (144 tokens), class token.

    Learned positional embedding, pre-norm blocks with LayerNorm, softmax attention and a
    GELU MLP; the head reads the class token. No dropout, no layer scale. The input is
    normalized inside the model (:class:`PartsViT`).
    """
    if num_classes < 1:
        raise ModelLoadError(f"num_classes must be positive, got {num_classes}")
    if embed_dim % num_heads != 0:
        raise ModelLoadError(f"embed_dim ({embed_dim}) must be a multiple of num_heads ({num_heads})")
    return PartsViT(img_size=IMAGE_SIZE, patch_size=8, in_chans=3, num_classes=num_classes,
                    embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_ratio=mlp_ratio,
                    qkv_bias=True, class_token=True, global_pool="token", act_layer=nn.GELU)


ARCHITECTURES = {"cnn": parts_cnn, "vit": parts_vit}
DEFAULTS = {"cnn": CNN_DEFAULTS, "vit": VIT_DEFAULTS}
INPUT_NORMALIZATION = {"cnn": "none",
                       "vit": f"(x - {VIT_INPUT_CENTER}) * {VIT_INPUT_SCALE}, inside the model's forward"}


def build(arch: str, num_classes: int = 50, **hyper_parameters: object) -> nn.Module:
    """Build ``"cnn"`` or ``"vit"`` with the given hyper-parameters (the defaults for the others)."""
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unknown architecture {arch!r}; expected one of {sorted(ARCHITECTURES)}")
    unknown = set(hyper_parameters) - set(DEFAULTS[arch])
    if unknown:
        raise ModelLoadError(f"unknown hyper-parameters for {arch!r}: {sorted(unknown)}; "
                         f"expected a subset of {sorted(DEFAULTS[arch])}")
    return ARCHITECTURES[arch](num_classes, **{**DEFAULTS[arch], **hyper_parameters})
