"""The compared attribution methods: shapes, defining identities, determinism, errors."""

import pytest
import torch
from torch import nn

import timm

from omenn_kernels.evaluation import methods
from omenn_kernels.testing import randomize_


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(8, 12, 3, padding=1), nn.BatchNorm2d(12), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    return randomize_(model).eval()


def _vit() -> nn.Module:
    torch.manual_seed(0)
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=24, depth=2, num_heads=2, num_classes=5)
    return randomize_(model).eval()


@pytest.fixture
def batch():
    generator = torch.Generator().manual_seed(1)
    return torch.rand(3, 3, 32, 32, generator=generator), torch.tensor([0, 3, 4])


def test_omenn_sums_to_the_logit(batch):
    images, targets = batch
    model = _cnn().double()
    images = images.double()
    attribution = methods.omenn(model, backend="reference")(images, targets)
    logits = model(images).gather(1, targets[:, None])[:, 0]
    assert attribution.shape == (3, 32, 32)
    torch.testing.assert_close(attribution.sum((1, 2)), logits, rtol=1e-10, atol=1e-10)


def test_omenn_postprocessed_is_nonnegative_and_follows_the_raw_map(batch):
    images, targets = batch
    model = _cnn()
    raw = methods.omenn(model)(images, targets)
    shown = methods.omenn_postprocessed(model)(images, targets)
    assert shown.shape == raw.shape and (shown >= 0).all()
    # where every contribution of a neighbourhood is negative, nothing is shown
    negative = torch.nn.functional.max_pool2d(raw.unsqueeze(1), 3, 1, 1)[:, 0] < 0
    assert (shown[negative] == 0).all()


def test_input_x_gradient_and_saliency_match_autograd(batch):
    images, targets = batch
    model = _cnn().double()
    images = images.double()
    inputs = images.clone().requires_grad_(True)
    (gradient,) = torch.autograd.grad(model(inputs).gather(1, targets[:, None]).sum(), inputs)
    torch.testing.assert_close(methods.input_x_gradient(model)(images, targets), (gradient * images).sum(1))
    torch.testing.assert_close(methods.saliency(model)(images, targets), gradient.abs().sum(1))


def test_integrated_gradients_is_complete_for_a_zero_baseline(batch):
    images, targets = batch
    model = _cnn().double()
    images = images.double()
    attribution = methods.integrated_gradients(model, steps=200)(images, targets)
    gap = model(images) - model(torch.zeros_like(images))
    # the Riemann approximation of 200 steps completes the logit gap to about 1 %
    torch.testing.assert_close(attribution.sum((1, 2)), gap.gather(1, targets[:, None])[:, 0],
                               rtol=0.02, atol=0.02)


def test_grad_cam_maps_are_nonnegative_and_image_sized(batch):
    images, targets = batch
    model = _cnn()
    cam = methods.grad_cam(model, model[4])(images, targets)
    assert cam.shape == (3, 32, 32) and (cam >= 0).all() and cam.abs().sum() > 0


def test_token_grad_cam_against_a_hand_computation(batch):
    images, targets = batch
    model = _vit().double()
    images = images.double()
    cam = methods.token_grad_cam(model, model.blocks[-1].norm1, (4, 4), model.num_prefix_tokens)(images, targets)
    captured = []
    handle = model.blocks[-1].norm1.register_forward_hook(lambda m, a, out: captured.append(out))
    logits = model(images)
    handle.remove()
    tokens = captured[0]
    (gradient,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), tokens)
    weights = gradient[:, 1:].mean(1)
    expected = torch.relu(torch.einsum("bd,btd->bt", weights, tokens[:, 1:].detach())).reshape(3, 1, 4, 4)
    expected = torch.nn.functional.interpolate(expected, size=(32, 32), mode="bilinear")[:, 0]
    torch.testing.assert_close(cam, expected)


def test_token_grad_cam_rejects_a_wrong_grid(batch):
    images, targets = batch
    model = _vit()
    with pytest.raises(ValueError, match="tokens"):
        methods.token_grad_cam(model, model.blocks[-1].norm1, (5, 5), 1)(images, targets)


def test_lrp_conserves_relevance_of_a_bias_free_relu_net(batch):
    images, targets = batch
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(),
                          nn.Linear(6 * 32 * 32, 5, bias=False)).double().eval()
    images = images.double()
    relevance = methods.lrp_epsilon_plus_flat(model)(images, targets)
    assert relevance.shape == (3, 32, 32)
    # the first layer's flat rule spreads all relevance it receives; without biases
    # and with a tiny epsilon, the total is the logit
    logits = model(images).gather(1, targets[:, None])[:, 0]
    torch.testing.assert_close(relevance.sum((1, 2)), logits, rtol=1e-3, atol=1e-4)


def test_random_attribution_is_seeded():
    images = torch.rand(2, 3, 8, 8)
    first = methods.random_attribution(seed=3)(images, torch.tensor([0, 1]))
    again = methods.random_attribution(seed=3)(images, torch.tensor([0, 1]))
    other = methods.random_attribution(seed=4)(images, torch.tensor([0, 1]))
    assert first.shape == (2, 8, 8)
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_lrp_merges_batch_norms_outside_sequential_and_restores_the_model():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 3, 3, padding=1)
            self.norm = nn.BatchNorm2d(3)

        def forward(self, x):
            return torch.relu(x + self.norm(self.conv(x)))

    torch.manual_seed(0)
    model = randomize_(nn.Sequential(Block(), nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                                     nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))).eval()
    assert methods._conv_batch_norm_pairs(model) == [(["0.conv"], "0.norm"), (["1"], "2")]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    images = torch.rand(2, 3, 16, 16)
    relevance = methods.lrp_epsilon_plus_flat(model)(images, torch.tensor([0, 2]))
    assert relevance.shape == (2, 16, 16) and torch.isfinite(relevance).all()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
