"""Tests of the FunnyBirds protocol on a hand-made parts data set with a linear model.

The fake data set draws each part as a 2x2 block inside its slot's 4x4 cell (the block's
position encodes the variant) and two background objects as 6x6 blocks. The model is linear in
the pixels: class c gives weight ``SLOT_WEIGHTS[s]`` to slot s's block of c's variant, so its
logit is the sum of ``SLOT_WEIGHTS`` over the slots where the image matches c, and
``x * W_c`` summed over channels (input x gradient) is its exact explanation.
"""

from __future__ import annotations

import itertools
import math
import os

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from omenn_kernels.evaluation import funnybirds as fb
from omenn_kernels.evaluation.parts_dataset import BACKGROUND_LABEL_BASE, SLOTS

SIDE = 32
SLOT_WEIGHTS = np.array([1.0, 1.2, 1.4, 1.6, 1.8])  # logit gained per matching part
BIAS_CLASS = 49  # the only class with a bias: what a bird without parts is classified as
NUM_CLASSES = 50
NUM_VARIANTS = 4
PART_COLOUR = torch.tensor([0.9, 0.6, 0.3])
BACKGROUND_VALUE = 0.5
NUM_OBJECTS = 2


def slot_block(slot: int, variant: int) -> tuple[slice, slice]:
    """Pixels of a slot's part of the given variant: a 2x2 block in the slot's 4x4 cell."""
    row, col = 4 + 2 * (variant // 2), 2 + 6 * slot + 2 * (variant % 2)
    return slice(row, row + 2), slice(col, col + 2)


def object_block(obj: int) -> tuple[slice, slice]:
    return slice(20, 26), slice(4 + 12 * obj, 10 + 12 * obj)


class FakePartsDataset:
    """Implements the PartsDataset interface with exactly known pixels and masks."""

    def __init__(self, num_images: int = 8) -> None:
        rng = np.random.default_rng(0)
        combos = rng.choice(NUM_VARIANTS ** len(SLOTS), NUM_CLASSES, replace=False)
        self.num_classes = NUM_CLASSES
        self.variants = {slot: NUM_VARIANTS for slot in SLOTS}
        # class c's variant of slot i is the i-th base-4 digit of a distinct random number
        self.classes = tuple(
            {slot: int(combo) // NUM_VARIANTS**i % NUM_VARIANTS for i, slot in enumerate(SLOTS)}
            for combo in combos
        )
        usable = [label for label in range(NUM_CLASSES - 1) if self._ts_pairs(label)]
        self.labels = usable[:num_images]
        assert len(self.labels) == num_images
        self.render_calls = 0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict:
        return self.render(index)

    def render(self, index: int, *, remove_parts=(), remove_background=()) -> dict:
        self.render_calls += 1
        remove_parts, remove_background = set(remove_parts), set(remove_background)
        if not remove_parts <= set(SLOTS):
            raise ValueError(f"unknown slots {remove_parts - set(SLOTS)}")
        if not remove_background <= set(range(NUM_OBJECTS)):
            raise ValueError("background object out of range")
        label = self.labels[index]
        noise = torch.rand(3, SIDE, SIDE, generator=torch.Generator().manual_seed(index)) * 0.05
        image, part_map = noise, torch.zeros(SIDE, SIDE, dtype=torch.int64)
        for obj in range(NUM_OBJECTS):
            if obj not in remove_background:
                image[(slice(None), *object_block(obj))] = BACKGROUND_VALUE
                part_map[object_block(obj)] = BACKGROUND_LABEL_BASE + obj
        present = tuple(slot for slot in SLOTS if slot not in remove_parts)
        for slot in present:
            i = SLOTS.index(slot)
            block = slot_block(i, self.classes[label][slot])
            image[(slice(None), *block)] = PART_COLOUR.view(3, 1, 1)
            part_map[block] = i + 1
        return {
            "image": image,
            "label": label,
            "part_map": part_map,
            "present_parts": present,
            "background_objects": NUM_OBJECTS,
            "index": index,
        }

    def shared_slots(self, label_a: int, label_b: int) -> tuple[str, ...]:
        return tuple(s for s in SLOTS if self.classes[label_a][s] == self.classes[label_b][s])

    def classes_at_distance(self, label: int, distance: int) -> list[int]:
        return [c for c in range(NUM_CLASSES) if len(SLOTS) - len(self.shared_slots(label, c)) == distance]

    def _ts_pairs(self, label: int) -> list[tuple[int, int]]:
        near = self.classes_at_distance(label, 3)
        return [
            (a, b)
            for a, b in itertools.combinations(near, 2)
            if not set(self.shared_slots(label, a)) & set(self.shared_slots(label, b))
        ]

    def target_sensitivity_pair(self, label: int) -> tuple[int, int]:
        return self._ts_pairs(label)[0]

    def minimal_sufficient_part_sets(self, label: int) -> list[frozenset[str]]:
        def sufficient(part_set: tuple[str, ...]) -> bool:
            return not any(
                all(self.classes[c][s] == self.classes[label][s] for s in part_set)
                for c in range(NUM_CLASSES)
                if c != label
            )

        found: list[frozenset[str]] = []
        for size in range(1, len(SLOTS) + 1):
            for part_set in itertools.combinations(SLOTS, size):
                if sufficient(part_set) and not any(f <= set(part_set) for f in found):
                    found.append(frozenset(part_set))
        return found


class PartsLinearModel(nn.Module):
    """logit_c = sum of SLOT_WEIGHTS over the slots where the image shows c's variant (+ bias)."""

    def __init__(self, dataset: FakePartsDataset, background_weight: float = 0.0) -> None:
        super().__init__()
        weight = torch.zeros(NUM_CLASSES, 3, SIDE, SIDE, dtype=torch.float64)
        for c, variants in enumerate(dataset.classes):
            for i, slot in enumerate(SLOTS):
                block = slot_block(i, variants[slot])
                weight[(c, slice(None), *block)] = (
                    SLOT_WEIGHTS[i] / 4 / PART_COLOUR.sum().item()
                )  # 4 pixels of summed colour
        # A model that uses the background: every class gains background_weight from object 0.
        weight[(slice(None), slice(None), *object_block(0))] = background_weight / 36 / (3 * BACKGROUND_VALUE)
        self.weight = nn.Parameter(weight.float())
        bias = torch.zeros(NUM_CLASSES)
        bias[BIAS_CLASS] = 0.5
        self.bias = nn.Parameter(bias)
        self.grad_modes: list[bool] = []

    def forward(self, images: Tensor) -> Tensor:
        self.grad_modes.append(torch.is_grad_enabled())
        return torch.einsum("bchw,kchw->bk", images, self.weight) + self.bias


def exact_method(model: PartsLinearModel):
    """Input x weight of the linear model: each pixel's exact share of the logit."""

    def explain(images: Tensor, targets: Tensor) -> Tensor:
        return (images * model.weight[targets]).sum(dim=1).detach()

    return explain


def input_x_gradient(model: nn.Module):
    """Input x gradient through autograd (equal to exact_method for the linear model)."""

    def explain(images: Tensor, targets: Tensor) -> Tensor:
        images = images.clone().requires_grad_(True)
        logits = model(images)
        (grad,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), images)
        return (images * grad).sum(dim=1).detach()

    return explain


def with_mass_on_object(method, mass: float):
    """The wrapped method plus ``mass`` spread uniformly over background object 0."""

    def explain(images: Tensor, targets: Tensor) -> Tensor:
        attribution = method(images, targets).clone()
        attribution[(slice(None), *object_block(0))] += mass / 36
        return attribution

    return explain


def random_method(seed: int):
    generator = torch.Generator().manual_seed(seed)

    def explain(images: Tensor, targets: Tensor) -> Tensor:
        return torch.rand(images.shape[0], *images.shape[-2:], generator=generator)

    return explain


@pytest.fixture(scope="module")
def dataset() -> FakePartsDataset:
    return FakePartsDataset(num_images=8)


@pytest.fixture(scope="module")
def model(dataset: FakePartsDataset) -> PartsLinearModel:
    return PartsLinearModel(dataset).eval()


def run(model, dataset, methods, **kwargs):
    kwargs.setdefault("dilation", 3)
    kwargs.setdefault("progress", False)
    return fb.evaluate(model, dataset, methods, list(range(len(dataset))), **kwargs)


# ---------------------------------------------------------------------------------------
# Building blocks against hand computations


def test_dilation_size_scales_funnybirds_kernel():
    assert fb.dilation_size(256) == 5
    assert fb.dilation_size(224) == 5
    assert fb.dilation_size(96) == 3
    assert fb.dilation_size(32) == 1
    with pytest.raises(ValueError, match="resolution"):
        fb.dilation_size(0)


def test_part_importances_with_dilation_match_hand_sums():
    attribution = torch.arange(25, dtype=torch.float32).view(5, 5)
    part_map = torch.zeros(5, 5, dtype=torch.int64)
    part_map[2, 2] = 1
    part_map[0, 0] = BACKGROUND_LABEL_BASE
    values = [1, BACKGROUND_LABEL_BASE, 3]  # item 3 is absent
    # No dilation: the pixels themselves.
    np.testing.assert_allclose(fb.part_importances(attribution, part_map, values, 1), [12.0, 0.0, 0.0])
    # 3x3 dilation: rows/cols 1..3 around (2, 2) -> sum_{r,c in 1..3} (5r + c) = 90 + 18;
    # the corner (0, 0) grows to rows/cols 0..1 -> 0 + 1 + 5 + 6.
    np.testing.assert_allclose(fb.part_importances(attribution, part_map, values, 3), [108.0, 12.0, 0.0])
    # 5x5 dilation of the centre covers the whole map: 0 + ... + 24.
    assert fb.part_importances(attribution, part_map, [1], 5)[0] == pytest.approx(300.0)


def test_part_importances_rejects_bad_input():
    part_map = torch.zeros(4, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="dilation"):
        fb.part_importances(torch.rand(4, 4), part_map, [1], 2)
    with pytest.raises(ValueError, match="same shape"):
        fb.part_importances(torch.rand(4, 5), part_map, [1], 3)
    with pytest.raises(TypeError, match="integer"):
        fb.part_importances(torch.rand(4, 4), part_map.float(), [1], 3)


def test_important_items_compares_with_fraction_of_total():
    important = fb.important_items(np.array([1.0, 3.0, 6.0]), 10.0, np.array([0.05, 0.2, 0.5]))
    np.testing.assert_array_equal(important, [[True, True, True], [False, True, True], [False, False, True]])


def test_select_threshold_maximizes_checks_plus_distractibility():
    csdc = np.array([1.0, 0.8, 0.2])
    pc = np.array([1.0, 0.9, 0.5])
    dc = np.array([0.4, 0.6, 0.9])
    d = np.array([0.2, 0.5, 0.9])
    # objectives: 2.4/3 + 0.2 = 1.0, 2.3/3 + 0.5 = 1.2667, 1.6/3 + 0.9 = 1.4333
    assert fb.select_threshold(csdc, pc, dc, d) == 2
    # ties go to the first threshold, as in FunnyBirds
    assert fb.select_threshold(np.ones(3), np.ones(3), np.ones(3), np.ones(3)) == 0
    # an undefined CSDC is left out: (PC + DC) / 2 + D = 0.9, 1.25, 1.6
    assert fb.select_threshold(np.full(3, np.nan), pc, dc, d) == 2
    # an undefined D is left out: (CSDC + PC + DC) / 3 = 0.8, 0.767, 0.533
    assert fb.select_threshold(csdc, pc, dc, np.full(3, np.nan)) == 0
    with pytest.raises(ValueError, match="same length"):
        fb.select_threshold(csdc, pc, dc, d[:2])
    with pytest.raises(ValueError, match="NaN"):
        fb.select_threshold(np.array([1.0, np.nan, 0.2]), pc, dc, d)


def test_aggregate_scores_hand_arithmetic():
    scores = fb.aggregate_scores(0.9, 0.6, 0.3, 0.5, 0.7, 0.8)
    assert scores["completeness"] == pytest.approx((0.6 + 0.5) / 2)
    assert scores["correctness"] == pytest.approx(0.7)
    assert scores["contrastivity"] == pytest.approx(0.8)
    assert scores["mx"] == pytest.approx((0.55 + 0.7 + 0.8) / 3)
    assert math.isnan(fb.aggregate_scores(math.nan, 0.6, 0.3, 0.5, 0.7, 0.8)["mx"])


# ---------------------------------------------------------------------------------------
# The protocol on the linear model


def test_fake_dataset_is_classified_correctly(dataset, model):
    images = torch.stack([dataset[i]["image"] for i in range(len(dataset))])
    assert model(images).argmax(1).tolist() == dataset.labels


def test_exact_explanation_scores_perfectly(dataset, model):
    scores = run(model, dataset, {"exact": exact_method(model)})["exact"]
    assert scores.num_images == len(dataset)
    assert scores.accuracy == 1.0
    assert scores.background_independence == 1.0  # the model has no weight on the background
    assert scores.num_background_objects == NUM_OBJECTS * len(dataset)
    assert scores.best_threshold == pytest.approx(0.01)
    for value in (scores.csdc, scores.preservation_check, scores.deletion_check, scores.distractibility):
        assert value == 1.0
    assert scores.single_deletion == 1.0  # importances ordered exactly like the logit drops
    assert scores.target_sensitivity == 1.0
    assert scores.num_target_sensitivity == len(dataset)
    assert scores.completeness == scores.correctness == scores.contrastivity == scores.mx == 1.0
    # Above the largest part's share 1.8 / 7 no part is important: CSDC 0, PC 0 (all parts
    # removed), DC 0 (nothing removed), and no background object is important either (D = 1).
    high = np.array(scores.thresholds) > SLOT_WEIGHTS.max() / SLOT_WEIGHTS.sum()
    assert high.any()
    for curve, expected in (
        (scores.csdc_curve, 0.0),
        (scores.preservation_curve, 0.0),
        (scores.deletion_curve, 0.0),
        (scores.distractibility_curve, 1.0),
    ):
        np.testing.assert_array_equal(np.array(curve)[high], expected)


def test_autograd_method_under_no_grad_matches_exact_method(dataset, model):
    model.grad_modes.clear()
    with torch.no_grad():  # methods still get gradients
        scores = run(model, dataset, {"ixg": input_x_gradient(model), "exact": exact_method(model)})
    assert scores["ixg"].to_dict() == scores["exact"].to_dict()
    # input_x_gradient's own forward passes ran with grad enabled
    assert model.grad_modes.count(True) >= 1


def test_model_forward_passes_are_made_without_grad(dataset, model):
    model.grad_modes.clear()
    run(model, dataset, {"exact": exact_method(model)})
    assert model.grad_modes and not any(model.grad_modes)


def test_reversed_explanation_fails_target_sensitivity(dataset, model):
    exact = exact_method(model)
    scores = run(model, dataset, {"reversed": lambda images, targets: -exact(images, targets)})["reversed"]
    assert scores.target_sensitivity == 0.0
    assert scores.single_deletion == pytest.approx(0.0, abs=1e-12)  # the ranking is exactly reversed


def test_mass_on_irrelevant_background_object_lowers_distractibility(dataset, model):
    mass = 6.0  # importance 6 of total 7 + 6: important below t = 6/13, not above
    scores = run(model, dataset, {"distracted": with_mass_on_object(exact_method(model), mass)})["distracted"]
    thresholds = np.array(scores.thresholds)
    # each image has two irrelevant items (the background objects); one of them is important
    expected = np.where(thresholds < mass / (SLOT_WEIGHTS.sum() + mass), 0.5, 1.0)
    np.testing.assert_array_equal(scores.distractibility_curve, expected)
    assert scores.num_distractibility == len(dataset)
    # at t = 0.01 every part is still important (shares 1/13 .. 1.8/13): checks 1, D 0.5
    assert scores.best_threshold == pytest.approx(0.01)
    assert (scores.csdc, scores.preservation_check, scores.deletion_check) == (1.0, 1.0, 1.0)
    assert scores.distractibility == 0.5
    assert scores.completeness == pytest.approx(0.75)


def test_background_independence_of_a_model_using_the_background(dataset):
    model = PartsLinearModel(dataset, background_weight=1.0).eval()
    scores = run(model, dataset, {"exact": exact_method(model)})["exact"]
    # removing object 0 lowers every logit by 1 >= 5% of 8; removing object 1 changes nothing
    assert scores.accuracy == 1.0
    assert scores.background_independence == 0.5


def test_random_explanation_scores_clearly_worse(dataset, model):
    scores = run(model, dataset, {"exact": exact_method(model), "random": random_method(0)})
    exact, random = scores["exact"], scores["random"]
    assert random.mx < exact.mx - 0.25
    assert random.single_deletion < 0.8
    assert random.completeness < 0.9


def test_results_are_independent_of_batch_size(dataset, model):
    methods = {"exact": exact_method(model), "distracted": with_mass_on_object(exact_method(model), 3.0)}
    small = run(model, dataset, methods, batch_size=3)
    large = run(model, dataset, methods, batch_size=64)
    for name in methods:
        assert small[name].to_dict() == large[name].to_dict()


def test_interventions_are_rendered_once_and_methods_called_batched(dataset, model):
    calls: list[int] = []

    def counted(images: Tensor, targets: Tensor) -> Tensor:
        calls.append(len(targets))
        return exact_method(model)(images, targets)

    dataset.render_calls = 0
    run(model, dataset, {"a": counted}, batch_size=64)
    renders_one = dataset.render_calls
    # per image: the original, 5 single parts, 2 objects, the 2 TS sets, and the PC/DC sets;
    # with the exact explanation PC/DC only need the subsets where parts fall below threshold
    assert len(calls) == 1  # one batched call: label + the two TS classes for every image
    assert calls[0] == 3 * len(dataset)
    dataset.render_calls = 0
    run(model, dataset, {"a": counted, "b": counted}, batch_size=64)
    assert dataset.render_calls == renders_one  # the second method reuses every intervention
    assert renders_one <= len(dataset) * (1 + 5 + NUM_OBJECTS + 2 + 32)


def test_bad_inputs_raise(dataset, model):
    exact = {"exact": exact_method(model)}
    with pytest.raises(ValueError, match="empty"):
        fb.evaluate(model, dataset, exact, [], progress=False)
    with pytest.raises(TypeError, match="ints"):
        fb.evaluate(model, dataset, exact, [0.5], progress=False)
    with pytest.raises(ValueError, match="outside"):
        fb.evaluate(model, dataset, exact, [len(dataset)], progress=False)
    with pytest.raises(ValueError, match="non-empty mapping"):
        fb.evaluate(model, dataset, {}, [0], progress=False)
    with pytest.raises(ValueError, match="dilation"):
        fb.evaluate(model, dataset, exact, [0], dilation=4, progress=False)
    with pytest.raises(ValueError, match="thresholds"):
        fb.evaluate(model, dataset, exact, [0], thresholds=[], progress=False)
    with pytest.raises(ValueError, match="batch_size"):
        fb.evaluate(model, dataset, exact, [0], batch_size=0, progress=False)
    with pytest.raises(ValueError, match=r"\(B, H, W\)"):
        fb.evaluate(model, dataset, {"bad": lambda x, t: x}, [0], progress=False)
    with pytest.raises(ValueError, match="non-finite"):
        fb.evaluate(model, dataset, {"nan": lambda x, t: x[:, 0] * math.nan}, [0], progress=False)
    model.train()
    try:
        with pytest.raises(ValueError, match="eval mode"):
            fb.evaluate(model, dataset, exact, [0], progress=False)
    finally:
        model.eval()


# ---------------------------------------------------------------------------------------
# End to end on the real data set


@pytest.mark.skipif(not os.path.exists("/tmp/dataset_ready"), reason="the real parts data set is not ready")
def test_end_to_end_on_real_dataset():
    from omenn_kernels.evaluation.parts_dataset import PartsDataset

    torch.manual_seed(0)
    real = PartsDataset("test", length=4)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 5, stride=4), nn.ReLU(), nn.Flatten(), nn.LazyLinear(real.num_classes)
    )
    model(real[0]["image"][None])  # materialize the lazy layer
    model.eval()
    scores = fb.evaluate(
        model, real, {"ixg": input_x_gradient(model), "random": random_method(1)}, range(4), progress=False
    )
    for result in scores.values():
        record = result.to_dict()
        assert record["num_images"] == 4
        assert len(record["csdc_curve"]) == len(fb.DEFAULT_THRESHOLDS)
        assert 0.0 <= record["accuracy"] <= 1.0
        assert 0.0 <= record["preservation_check"] <= 1.0 and 0.0 <= record["deletion_check"] <= 1.0
        assert record["num_background_objects"] >= 4
        assert 0.0 <= record["background_independence"] <= 1.0
