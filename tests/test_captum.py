"""OMENN against Captum on networks of conv / linear / BatchNorm / ReLU / max-pool.

For such networks every OMENN multiplier is the layer's derivative (ReLU: ξ = 1[x>0];
max-pool routes to the arg-max; BN, conv, linear, average pooling and residual sums
are linear), so ``Σ_c C_w ⊙ X`` must equal Captum's ``InputXGradient`` summed over
channels (the paper's VGG figure caption), and ``C_w`` the gradient itself.

Every bias, BN affine parameter and BN running statistic is randomized (PyTorch
initializes them to 0 / 1, which would hide mistakes). Float64 throughout.
Tolerances: 1e-10 relative (to the largest attribution) for the attributions and the
gradient; the gradient is recovered as attribution / x only where |x| > 1e-3.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torchvision
from captum.attr import InputXGradient

from omenn_kernels import explain

DT = torch.float64
RTOL = 1e-10


def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Random biases, BN affine parameters and running statistics; weights rescaled per layer."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                c = module.num_features
                module.weight.copy_(torch.rand(c, generator=g, dtype=DT) + 0.5)
                module.bias.copy_(torch.randn(c, generator=g, dtype=DT) * 0.3)
                module.running_mean.copy_(torch.randn(c, generator=g, dtype=DT) * 0.3)
                module.running_var.copy_(torch.rand(c, generator=g, dtype=DT) + 0.5)
            elif isinstance(module, (nn.Conv2d, nn.Linear)):
                fan_in = module.weight[0].numel()
                weight = torch.randn(module.weight.shape, generator=g, dtype=DT)
                module.weight.copy_(weight * (2.0 / fan_in) ** 0.5)
                if module.bias is not None:
                    module.bias.copy_(torch.randn(module.bias.shape, generator=g, dtype=DT) * 0.2)
    return model.eval()


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(),
                         nn.Linear(16, 5))


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.BatchNorm2d(8), nn.ReLU(),
        nn.MaxPool2d(3, stride=1, padding=1), nn.Flatten(), nn.Linear(8 * 2 * 2, 5))


def vgg_like() -> nn.Module:
    """VGG's pattern: [conv-BN-ReLU]×2, max-pool, conv-ReLU, max-pool, classifier with dropout."""
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2, 2),
        nn.AdaptiveAvgPool2d((2, 2)), nn.Flatten(),
        nn.Linear(16 * 2 * 2, 32), nn.ReLU(inplace=True), nn.Dropout(0.5),
        nn.Linear(32, 32), nn.ReLU(inplace=True), nn.Dropout(0.5), nn.Linear(32, 5))


def resnet18() -> nn.Module:
    return torchvision.models.resnet18(num_classes=5)


MODELS = {
    "mlp": (mlp, (3, 3, 8, 8)),
    "small_cnn": (small_cnn, (3, 3, 8, 8)),
    "vgg_like": (vgg_like, (2, 3, 16, 16)),
    "resnet18": (resnet18, (2, 3, 32, 32)),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_weight_times_input_equals_captum_input_x_gradient(name):
    build, shape = MODELS[name]
    torch.manual_seed(0)
    model = randomize(build().double(), seed=len(name))
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=DT)
    target = torch.arange(1, shape[0] + 1)  # a different class per image
    e = explain(model, x, target)
    logits = model(x).detach()
    torch.testing.assert_close(e.logit, logits.gather(1, target[:, None])[:, 0], rtol=1e-12, atol=1e-12)

    attributions = InputXGradient(model).attribute(x.clone().requires_grad_(True), target=target).detach()
    scale = attributions.abs().max()
    torch.testing.assert_close((e.weight * x).sum(1), attributions.sum(1), rtol=RTOL, atol=RTOL * scale)
    torch.testing.assert_close(e.weight * x, attributions, rtol=RTOL, atol=RTOL * scale)

    # C_w is the gradient: attribution / x where x is not tiny.
    usable = x.abs() > 1e-3
    assert usable.float().mean() > 0.99
    gradient = attributions[usable] / x[usable]
    torch.testing.assert_close(e.weight[usable], gradient, rtol=1e-9,
                               atol=RTOL * e.weight.abs().max().item())
    # The biases do contribute (C_b is not trivially zero) and the explanation is complete.
    assert e.bias.abs().max() > 1e-3
    torch.testing.assert_close(e.contribution.sum((1, 2)), e.logit, rtol=1e-10, atol=1e-10 * scale)
