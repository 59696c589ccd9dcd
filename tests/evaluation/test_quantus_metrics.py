"""Tests of the Quantus metric wrappers on cases with known answers."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from omenn_kernels.evaluation import quantus_metrics as qm

SIDE = 8
NUM_CLASSES = 10


class ChannelSharedLinear(nn.Module):
    """A linear classifier whose weight is the same on the three channels."""

    def __init__(self) -> None:
        super().__init__()
        weight = torch.randn(NUM_CLASSES, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(1))
        self.weight = nn.Parameter(weight.expand(NUM_CLASSES, 3, SIDE, SIDE).clone())

    def forward(self, images: Tensor) -> Tensor:
        return torch.einsum("bchw,kchw->bk", images, self.weight)


@pytest.fixture(scope="module")
def model() -> ChannelSharedLinear:
    return ChannelSharedLinear().eval()


def grey_images(count: int, low: float = 0.0, seed: int = 0) -> Tensor:
    """Images whose three channels are equal, values in [low, 1)."""
    grey = low + (1 - low) * torch.rand(count, 1, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))
    return grey.expand(count, 3, SIDE, SIDE).contiguous()


def exact_contribution(model: ChannelSharedLinear, images: Tensor, targets: Tensor) -> Tensor:
    """Each pixel's exact share of the target logit (summed over channels)."""
    return (images * model.weight[targets]).sum(dim=1).detach()


TARGETS = torch.tensor([0, 3, 7, 9])


def faithfulness(model, images, attributions, **kwargs) -> np.ndarray:
    """Faithfulness correlation of a batch explained for ``TARGETS``, with few small subsets."""
    kwargs = {"nr_runs": 20, "subset_size": 20} | kwargs
    return qm.faithfulness_correlation(model, images, TARGETS[: len(images)], attributions, **kwargs)


def test_exact_contribution_has_faithfulness_one_with_zero_baseline(model):
    # With baseline 0, removing a feature lowers the logit by its own contribution: a third of
    # its pixel's attribution (channels are equal), so the subset sums are exactly 3x the drops.
    images = grey_images(4)
    attributions = exact_contribution(model, images, TARGETS)
    scores = faithfulness(model, images, attributions)
    assert scores.shape == (4,) and scores.dtype == np.float64
    np.testing.assert_allclose(scores, 1.0, atol=1e-5)
    np.testing.assert_allclose(faithfulness(model, images, -attributions), -1.0, atol=1e-5)
    random = torch.rand(4, SIDE, SIDE, generator=torch.Generator().manual_seed(5))
    assert np.all(np.abs(faithfulness(model, images, random)) < 0.9)


def test_black_baseline_is_the_image_minimum(model):
    # Images with a black pixel: Quantus' "black" is 0 and agrees with the default baseline 0.
    images = grey_images(4)
    images[:, :, 0, 0] = 0.0
    attributions = exact_contribution(model, images, TARGETS)
    black = faithfulness(model, images, attributions, perturb_baseline="black")
    # Both correlations are computed from float32 logits: equal up to their rounding (1e-6).
    np.testing.assert_allclose(black, faithfulness(model, images, attributions), rtol=1e-6)
    # Images without one: "black" is each image's minimum and the exact contribution to a 0
    # baseline no longer matches the drops exactly.
    bright = grey_images(4, low=0.4)
    black = faithfulness(model, bright, exact_contribution(model, bright, TARGETS), perturb_baseline="black")
    assert np.all(black < 0.999)


def test_faithfulness_is_seeded_and_leaves_numpy_rng_alone(model):
    images = grey_images(4, seed=2)
    attributions = torch.rand(4, SIDE, SIDE, generator=torch.Generator().manual_seed(3))
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    first = faithfulness(model, images, attributions, seed=7)
    np.testing.assert_array_equal(np.random.get_state()[1], before)
    again = faithfulness(model, images, attributions, seed=7)
    other = faithfulness(model, images, attributions, seed=8)
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)


def test_faithfulness_rejects_bad_input(model):
    images = grey_images(2)
    targets = TARGETS[:2]
    attributions = exact_contribution(model, images, targets)
    with pytest.raises(ValueError, match="subset_size"):
        qm.faithfulness_correlation(model, images, targets, attributions, subset_size=3 * SIDE * SIDE)
    with pytest.raises(ValueError, match="attributions must be"):
        qm.faithfulness_correlation(model, images, targets, attributions[:, :-1])
    with pytest.raises(ValueError, match="targets"):
        qm.faithfulness_correlation(model, images, TARGETS, attributions)
    with pytest.raises(ValueError, match="finite"):
        qm.faithfulness_correlation(model, images, targets, attributions * math.nan)
    with pytest.raises(ValueError, match="images"):
        qm.faithfulness_correlation(model, images[:, :1], targets, attributions)
    with pytest.raises(ValueError, match="nr_runs"):
        qm.faithfulness_correlation(model, images, targets, attributions, nr_runs=1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        qm.faithfulness_correlation(model, images, targets, attributions.tolist())
    model.train()
    try:
        with pytest.raises(ValueError, match="eval mode"):
            qm.faithfulness_correlation(model, images, targets, attributions)
    finally:
        model.eval()


def part_maps_with_square(count: int) -> Tensor:
    """Bird parts (slot 2) in the top-left 2x2 square, a background object and body elsewhere."""
    part_maps = torch.zeros(count, SIDE, SIDE, dtype=torch.int64)
    part_maps[:, :2, :2] = 2
    part_maps[:, 5:, 5:] = 100  # a background object: not part of the mask
    return part_maps


def test_bird_part_mask_keeps_slots_only():
    part_maps = torch.tensor([[[0, 1, 2], [3, 4, 5], [6, 100, 103]]])
    mask = qm.bird_part_mask(part_maps)
    assert mask.shape == (1, 1, 3, 3)
    np.testing.assert_array_equal(mask[0, 0], [[0, 1, 1], [1, 1, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="integer"):
        qm.bird_part_mask(part_maps.float())


def test_relevance_mass_accuracy_hand_cases():
    images = grey_images(3)
    part_maps = part_maps_with_square(3)
    attributions = torch.zeros(3, SIDE, SIDE)
    attributions[0, :2, :2] = torch.tensor([[1.0, 2.0], [3.0, 4.0]])  # all inside: 1
    attributions[1, :2, :2] = 1.5  # 6 inside ...
    attributions[1, 4, 4] = 6.0  # ... and 6 outside: 0.5
    attributions[2] = torch.rand(SIDE, SIDE, generator=torch.Generator().manual_seed(0)) + 0.1
    part_maps[2] = 0  # no visible part: undefined
    scores = qm.relevance_mass_accuracy(images, TARGETS[:3], attributions, part_maps)
    np.testing.assert_allclose(scores[:2], [1.0, 0.5], rtol=1e-6)
    assert math.isnan(scores[2])
    # signed: 6 inside of a total 6 - 2 = 4; absolute values: 6 inside of 6 + 2
    attributions[1, 4, 4] = -2.0
    signed = qm.relevance_mass_accuracy(images[1:2], TARGETS[1:2], attributions[1:2], part_maps[1:2])
    np.testing.assert_allclose(signed, [1.5], rtol=1e-6)
    absolute = qm.relevance_mass_accuracy(
        images[1:2], TARGETS[1:2], attributions[1:2], part_maps[1:2], absolute=True
    )
    np.testing.assert_allclose(absolute, [0.75], rtol=1e-6)


def test_pointing_game_hit_miss_and_empty_mask():
    images = grey_images(3)
    part_maps = part_maps_with_square(3)
    attributions = torch.rand(3, SIDE, SIDE, generator=torch.Generator().manual_seed(4))
    attributions[0, 1, 0] = 5.0  # maximum inside the mask: hit
    attributions[1, 6, 6] = 5.0  # maximum on the background object: miss
    attributions[2, 1, 1] = 5.0
    part_maps[2] = 0  # no visible part: undefined (Quantus itself would report a hit)
    scores = qm.pointing_game(images, TARGETS[:3], attributions, part_maps)
    assert scores[:2].tolist() == [1.0, 0.0]
    assert math.isnan(scores[2])
    # a large negative value wins only with absolute values
    attributions[1, 0, 1] = -9.0
    one = (images[1:2], TARGETS[1:2], attributions[1:2], part_maps[1:2])
    assert qm.pointing_game(*one).tolist() == [0.0]
    assert qm.pointing_game(*one, absolute=True).tolist() == [1.0]


def test_localisation_rejects_bad_input():
    images = grey_images(2)
    attributions = torch.rand(2, SIDE, SIDE)
    with pytest.raises(ValueError, match="part_maps"):
        qm.relevance_mass_accuracy(images, TARGETS[:2], attributions, part_maps_with_square(3))
    with pytest.raises(ValueError, match="part_maps"):
        qm.pointing_game(images, TARGETS[:2], attributions, part_maps_with_square(2)[:, :-1])
    with pytest.raises(ValueError, match="attributions"):
        qm.pointing_game(images, TARGETS[:2], attributions[:, None], part_maps_with_square(2))


@pytest.mark.skipif(not os.path.exists("/tmp/dataset_ready"), reason="the real parts data set is not ready")
def test_localisation_on_real_part_maps():
    from omenn_kernels.evaluation.parts_dataset import PartsDataset

    samples = [PartsDataset("test", length=3)[i] for i in range(3)]
    images = torch.stack([sample["image"] for sample in samples])
    part_maps = torch.stack([sample["part_map"] for sample in samples])
    targets = torch.tensor([sample["label"] for sample in samples])
    inside = torch.from_numpy(qm.bird_part_mask(part_maps)[:, 0])
    assert inside.sum() > 0 and (inside < 1).any()
    # Attribution on the parts only (random positive values there): all mass inside, maximum inside.
    attributions = inside * (torch.rand(inside.shape, generator=torch.Generator().manual_seed(0)) + 0.5)
    np.testing.assert_allclose(qm.relevance_mass_accuracy(images, targets, attributions, part_maps), 1.0)
    assert qm.pointing_game(images, targets, attributions, part_maps).tolist() == [1.0, 1.0, 1.0]
    # The same values off the parts: no mass inside, maximum outside.
    outside = (1 - inside) * (torch.rand(inside.shape, generator=torch.Generator().manual_seed(1)) + 0.5)
    np.testing.assert_allclose(qm.relevance_mass_accuracy(images, targets, outside, part_maps), 0.0)
    assert qm.pointing_game(images, targets, outside, part_maps).tolist() == [0.0, 0.0, 0.0]
