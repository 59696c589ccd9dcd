"""Tests of the FunnyBirds-style synthetic parts data set."""

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from omenn_kernels.evaluation import parts_dataset as pd
from omenn_kernels.evaluation.parts_dataset import (
    BACKGROUND_LABEL_BASE,
    PATCH,
    RESOLUTION,
    SLOTS,
    PartsDataset,
    collate_parts,
)

# Images used by the pixel-level checks; 0..49 covers every class once.
SAMPLE = (0, 7, 13, 21, 38, 49)


@pytest.fixture(scope="module")
def test_set() -> PartsDataset:
    return PartsDataset("test", 200, seed=5)


@pytest.fixture(scope="module")
def train_set() -> PartsDataset:
    return PartsDataset("train", 400, seed=5)


def _changed(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Pixels (H, W) where two images differ in any channel."""
    return (a != b).any(dim=0)


# ------------------------------------------------------------------ outputs


def test_output_types_shapes_and_ranges(test_set: PartsDataset) -> None:
    for index in SAMPLE:
        sample = test_set[index]
        assert set(sample) == {"image", "label", "part_map", "present_parts",
                               "background_objects", "index"}
        image, part_map = sample["image"], sample["part_map"]
        assert image.dtype == torch.float32 and image.shape == (3, RESOLUTION, RESOLUTION)
        assert part_map.dtype == torch.int64 and part_map.shape == (RESOLUTION, RESOLUTION)
        assert 0.0 <= image.min() and image.max() <= 1.0
        assert sample["label"] == index % test_set.num_classes and isinstance(sample["label"], int)
        assert sample["index"] == index
        n = sample["background_objects"]
        assert 1 <= n <= 4
        allowed = set(range(len(SLOTS) + 1)) | {BACKGROUND_LABEL_BASE + k for k in range(n)}
        assert set(part_map.unique().tolist()) <= allowed
        assert sample["present_parts"] == SLOTS
        # Pixel noise: the flat-coloured body is not flat in the image.
        body = part_map == 0
        assert image[:, body].std(dim=1).min() > 0.01


def test_other_resolution_and_collate() -> None:
    data = PartsDataset("train", 8, resolution=64, seed=1)
    batch = next(iter(DataLoader(data, batch_size=8, collate_fn=collate_parts)))
    assert batch["image"].shape == (8, 3, 64, 64) and batch["part_map"].shape == (8, 64, 64)
    assert batch["label"].tolist() == list(range(8))
    assert batch["present_parts"] == [data[i]["present_parts"] for i in range(8)]
    assert torch.equal(batch["image"][3], data[3]["image"])


def test_default_lengths_and_drop_defaults() -> None:
    train, test = PartsDataset("train"), PartsDataset("test")
    assert (len(train), len(test)) == (20000, 1000)
    assert train.drop_parts and not test.drop_parts
    assert train.num_classes == 50 and len(train.classes) == 50


# ------------------------------------------------------------------ determinism


def test_same_seed_same_images_other_seed_or_split_differs(test_set: PartsDataset) -> None:
    again = PartsDataset("test", 200, seed=5)
    other_seed = PartsDataset("test", 200, seed=6)
    other_split = PartsDataset("train", 200, seed=5, drop_parts=False)
    for index in SAMPLE:
        a, b = test_set[index], again[index]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["part_map"], b["part_map"])
        assert torch.equal(test_set.render(index, remove_parts=["wing"])["image"],
                           again.render(index, remove_parts=["wing"])["image"])
        for other in (other_seed[index], other_split[index]):
            assert other["label"] == a["label"]
            assert not torch.equal(other["image"], a["image"])
            assert not torch.equal(other["part_map"], a["part_map"])


# ------------------------------------------------------------------ masks and interventions


@pytest.mark.parametrize("index", SAMPLE)
def test_removing_a_part_changes_exactly_its_mask(test_set: PartsDataset, index: int) -> None:
    full = test_set[index]
    for k, slot in enumerate(SLOTS, start=1):
        mask = full["part_map"] == k
        assert mask.any()
        removed = test_set.render(index, remove_parts=[slot])
        assert torch.equal(_changed(full["image"], removed["image"]), mask)
        assert torch.equal(removed["part_map"][~mask], full["part_map"][~mask])
        assert not (removed["part_map"] == k).any()
        assert removed["present_parts"] == tuple(s for s in SLOTS if s != slot)
        assert removed["label"] == full["label"]
        assert removed["background_objects"] == full["background_objects"]


@pytest.mark.parametrize("index", SAMPLE)
def test_removing_a_background_object_changes_exactly_its_mask(test_set: PartsDataset,
                                                               index: int) -> None:
    full = test_set[index]
    for k in range(full["background_objects"]):
        label = BACKGROUND_LABEL_BASE + k
        mask = full["part_map"] == label
        removed = test_set.render(index, remove_background=[k])
        assert torch.equal(_changed(full["image"], removed["image"]), mask)
        assert torch.equal(removed["part_map"][~mask], full["part_map"][~mask])
        assert not (removed["part_map"] == label).any()
        assert removed["present_parts"] == SLOTS


def test_combined_interventions_remove_only_what_they_name(test_set: PartsDataset) -> None:
    rng = np.random.default_rng(0)
    for index in SAMPLE:
        full = test_set[index]
        parts = [s for s in SLOTS if rng.random() < 0.5]
        objects = [k for k in range(full["background_objects"]) if rng.random() < 0.5]
        labels = [SLOTS.index(s) + 1 for s in parts] + [BACKGROUND_LABEL_BASE + k for k in objects]
        mask = torch.isin(full["part_map"], torch.tensor(labels, dtype=torch.int64))
        removed = test_set.render(index, remove_parts=parts, remove_background=objects)
        assert torch.equal(removed["image"][:, ~mask], full["image"][:, ~mask])
        assert not torch.isin(removed["part_map"], torch.tensor(labels, dtype=torch.int64)).any()
        assert removed["present_parts"] == tuple(s for s in SLOTS if s not in parts)
        everything = test_set.render(index, remove_parts=SLOTS,
                                     remove_background=range(full["background_objects"]))
        assert everything["present_parts"] == () and not everything["part_map"].any()


@pytest.mark.parametrize("index", SAMPLE)
def test_parts_do_not_overlap(test_set: PartsDataset, index: int) -> None:
    full = test_set[index]["part_map"]
    for k, slot in enumerate(SLOTS, start=1):
        alone = test_set.render(index, remove_parts=[s for s in SLOTS if s != slot])["part_map"]
        assert torch.equal(alone == k, full == k)


def test_parts_of_different_slots_are_disjoint_in_the_canonical_frame() -> None:
    u, v = np.meshgrid(np.arange(-45, 45, 0.2), np.arange(-30, 35, 0.2))
    per_slot = {
        slot: np.any([shape.contains(u, v)
                      for variant in pd._VARIANTS[slot] for shape, _ in variant.layers], axis=0)
        for slot in SLOTS
    }
    for a, b in itertools.combinations(SLOTS, 2):
        assert not (per_slot[a] & per_slot[b]).any(), (a, b)


def test_variants_differ_in_shape_and_colour() -> None:
    u, v = np.meshgrid(np.arange(-45, 45, 0.5), np.arange(-30, 35, 0.5))
    for slot in SLOTS:
        variants = pd._VARIANTS[slot]
        assert 4 <= len(variants) <= 6
        colours = [variant.layers[0][1] for variant in variants]
        assert len(set(colours)) == len(colours), slot
        masks = [np.any([s.contains(u, v) for s, _ in variant.layers], axis=0) for variant in variants]
        for m1, m2 in itertools.combinations(masks, 2):
            assert (m1 ^ m2).sum() > 0.2 * min(m1.sum(), m2.sum()), slot


def test_every_part_covers_a_patch(test_set: PartsDataset) -> None:
    seen = set()
    for index in range(test_set.num_classes * 3):
        sample = test_set[index]
        for k, slot in enumerate(SLOTS, start=1):
            assert int((sample["part_map"] == k).sum()) >= PATCH * PATCH, (index, slot)
            seen.add((slot, test_set.classes[sample["label"]][slot]))
    assert seen == {(slot, i) for slot in SLOTS for i in range(test_set.variants[slot])}


# ------------------------------------------------------------------ part dropping


def test_train_split_drops_parts_in_about_half_the_images(train_set: PartsDataset) -> None:
    complete = PartsDataset("train", 400, seed=5, drop_parts=False)
    dropped = 0
    for index in range(len(train_set)):
        sample = train_set[index]
        present = sample["present_parts"]
        assert 1 <= len(present) <= len(SLOTS)
        drawn = {SLOTS[k - 1] for k in sample["part_map"].unique().tolist() if 1 <= k <= len(SLOTS)}
        assert drawn == set(present)
        if len(present) < len(SLOTS):
            dropped += 1
            if dropped <= 5:
                # Dropping is the same as removing those parts from the complete image.
                gone = [s for s in SLOTS if s not in present]
                reference = complete.render(index, remove_parts=gone)
                assert torch.equal(reference["image"], sample["image"])
                assert torch.equal(reference["part_map"], sample["part_map"])
    assert 0.4 * len(train_set) < dropped < 0.6 * len(train_set)


def test_test_split_and_disabled_dropping_keep_all_parts() -> None:
    for data in (PartsDataset("test", 60, seed=2),
                 PartsDataset("train", 60, seed=2, drop_parts=False)):
        assert all(data[i]["present_parts"] == SLOTS for i in range(len(data)))
    forced = PartsDataset("test", 60, seed=2, drop_parts=True)
    assert any(len(forced[i]["present_parts"]) < len(SLOTS) for i in range(len(forced)))


# ------------------------------------------------------------------ classes


def _brute_force_minimal_sufficient(classes: list[tuple[int, ...]],
                                    label: int) -> set[frozenset[int]]:
    """All slot sets, kept when sufficient and no proper subset of them is sufficient."""
    own = classes[label]

    def sufficient(subset: frozenset[int]) -> bool:
        return all(any(other[i] != own[i] for i in subset)
                   for j, other in enumerate(classes) if j != label)

    subsets = [frozenset(c) for r in range(len(SLOTS) + 1)
               for c in itertools.combinations(range(len(SLOTS)), r)]
    return {s for s in subsets
            if sufficient(s) and not any(t < s and sufficient(t) for t in subsets)}


def test_classes_are_unique_and_minimal_sufficient_sets_match_brute_force(
        test_set: PartsDataset) -> None:
    classes = [tuple(c[s] for s in SLOTS) for c in test_set.classes]
    assert len(classes) == 50 and len(set(classes)) == 50
    assert all(0 <= c[i] < test_set.variants[s] for c in classes for i, s in enumerate(SLOTS))
    assert PartsDataset("train", 5, seed=99).classes == test_set.classes
    for label in range(50):
        expected = {frozenset(SLOTS[i] for i in s)
                    for s in _brute_force_minimal_sufficient(classes, label)}
        got = test_set.minimal_sufficient_part_sets(label)
        assert len(got) == len(set(got)) and set(got) == expected
        assert got and all(len(s) > 1 for s in got)


def test_target_sensitivity_pairs(test_set: PartsDataset) -> None:
    for label in range(50):
        b, c = test_set.target_sensitivity_pair(label)
        assert (b, c) == test_set.target_sensitivity_pair(label)
        assert len({label, b, c}) == 3
        at_three = test_set.classes_at_distance(label, 3)
        assert b in at_three and c in at_three
        shared_b, shared_c = test_set.shared_slots(label, b), test_set.shared_slots(label, c)
        assert len(shared_b) == len(shared_c) == 2 and not set(shared_b) & set(shared_c)
        for slot in SLOTS:
            same = test_set.classes[label][slot] == test_set.classes[b][slot]
            assert (slot in shared_b) == same


def test_classes_at_distance_partitions_the_classes(test_set: PartsDataset) -> None:
    for label in (0, 17, 49):
        groups = [test_set.classes_at_distance(label, d) for d in range(len(SLOTS) + 1)]
        assert groups[0] == [label]
        assert sorted(itertools.chain(*groups)) == list(range(50))
        for d, group in enumerate(groups):
            assert all(len(test_set.shared_slots(label, j)) == len(SLOTS) - d for j in group)


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("kwargs", [
    {"split": "val"}, {"split": "train", "length": 0}, {"split": "train", "length": 2.5},
    {"split": "test", "resolution": 16}, {"split": "test", "resolution": 96.0},
    {"split": "test", "seed": -1}, {"split": "test", "drop_parts": "yes"},
])
def test_bad_constructor_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        PartsDataset(**kwargs)


def test_bad_render_and_class_arguments(test_set: PartsDataset) -> None:
    n = test_set[3]["background_objects"]
    with pytest.raises(IndexError):
        test_set[len(test_set)]
    with pytest.raises(IndexError):
        test_set.render(-1)
    with pytest.raises(TypeError):
        test_set.render(1.0)
    with pytest.raises(ValueError, match="head"):
        test_set.render(3, remove_parts=["head"])
    with pytest.raises(TypeError):
        test_set.render(3, remove_parts="beak")
    for k in (n, -1, "0"):
        with pytest.raises(ValueError):
            test_set.render(3, remove_background=[k])
    for call in (lambda: test_set.minimal_sufficient_part_sets(50),
                 lambda: test_set.target_sensitivity_pair(-1),
                 lambda: test_set.classes_at_distance(0, 6),
                 lambda: test_set.shared_slots(0, 50)):
        with pytest.raises(ValueError):
            call()
    with pytest.raises(ValueError):
        collate_parts([])
