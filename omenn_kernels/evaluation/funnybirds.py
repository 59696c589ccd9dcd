"""The FunnyBirds explanation-quality protocol (Hesse et al., ICCV 2023) on the synthetic parts data set.

The protocol is reimplemented here for :class:`omenn_kernels.evaluation.parts_dataset.PartsDataset`
(or any object with the same interface). It scores attribution methods on

- completeness: the controlled synthetic data check (CSDC), the preservation check (PC), the
  deletion check (DC) and distractibility (D), at the threshold that maximizes
  ``(CSDC + PC + DC) / 3 + D``;
- correctness: single deletion (SD);
- contrastivity: target sensitivity (TS);

and the model on accuracy and background independence (BI). ``mX`` is the mean of completeness,
correctness and contrastivity.

Part importance follows FunnyBirds: the sum of the attribution over an item's part-map mask
dilated by a max-pool of odd size ``k``. FunnyBirds uses ``k = 5`` at 256 px; :func:`dilation_size`
scales it to the image side (``k = 3`` at 96 px).

An attribution method is any callable ``explain(images (B, 3, H, W), targets (B,)) -> (B, H, W)``
(per-pixel attribution, already summed over channels).

Conventions where FunnyBirds' code leaves a case open (they do not arise on a test split in which
every part is drawn):

- items (slots and background objects) are only those drawn in the image; a slot that is absent is
  never important, never irrelevant and takes no part in SD;
- an item is *relevant* when its single removal lowers the target logit by at least 5 % of
  ``|original logit|`` (and by more than 0); D counts the others as irrelevant, BI counts the
  relevant background objects;
- a metric that no image qualifies for (CSDC with no correctly classified image, D with no irrelevant
  item, SD with no defined correlation, TS with no image passing its assumption) is NaN, and so is
  every aggregate built from it. Threshold selection then leaves out the undefined terms.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from torch import Tensor, nn
from tqdm.auto import tqdm

from omenn_kernels.evaluation.parts_dataset import BACKGROUND_LABEL_BASE, SLOTS

__all__ = [
    "DEFAULT_THRESHOLDS",
    "RELEVANCE_FRACTION",
    "AttributionMethod",
    "FunnyBirdsScores",
    "aggregate_scores",
    "dilation_size",
    "evaluate",
    "important_items",
    "part_importances",
    "select_threshold",
]

DEFAULT_THRESHOLDS: np.ndarray = np.linspace(0.01, 0.50, 80)
"""FunnyBirds' thresholds ``t``: an item is important when its importance exceeds ``t`` times the
sum of the whole attribution map."""

RELEVANCE_FRACTION: float = 0.05
"""An item is relevant when its removal lowers the target logit by at least this fraction of
``|original logit|``."""

AttributionMethod = Callable[[Tensor, Tensor], Tensor]
"""``explain(images (B, 3, H, W), targets (B,)) -> attributions (B, H, W)``."""

_SLOT_BITS = np.array([1 << i for i in range(len(SLOTS))], dtype=np.int64)
_ALL_SLOTS_BITS = (1 << len(SLOTS)) - 1


class _PartsDatasetInterface(Protocol):
    """What the protocol needs of a parts data set (see ``parts_dataset.PartsDataset``)."""

    def __len__(self) -> int: ...

    def render(
        self, index: int, *, remove_parts: Iterable[str] = (), remove_background: Iterable[int] = ()
    ) -> dict: ...

    def minimal_sufficient_part_sets(self, label: int) -> list[frozenset[str]]: ...

    def target_sensitivity_pair(self, label: int) -> tuple[int, int]: ...

    def shared_slots(self, label_a: int, label_b: int) -> tuple[str, ...]: ...


@dataclasses.dataclass(frozen=True)
class FunnyBirdsScores:
    """FunnyBirds scores of one attribution method on one model.

    ``csdc``, ``preservation_check``, ``deletion_check`` and ``distractibility`` are taken at
    ``best_threshold``; the ``*_curve`` fields hold them at every threshold of ``thresholds``.
    ``accuracy`` and ``background_independence`` depend on the model only. NaN marks a metric
    that no image qualified for (see the module docstring).
    """

    accuracy: float
    background_independence: float
    csdc: float
    preservation_check: float
    deletion_check: float
    distractibility: float
    single_deletion: float
    target_sensitivity: float
    completeness: float
    correctness: float
    contrastivity: float
    mx: float
    best_threshold: float
    num_images: int
    num_correct: int
    """Images the model classifies correctly (the images CSDC is computed on)."""
    num_distractibility: int
    """Images with at least one irrelevant item (the images D is computed on)."""
    num_single_deletion: int
    """Images whose SD correlation is defined."""
    num_target_sensitivity: int
    """Images that pass TS' assumption (each contributes two scores)."""
    num_background_objects: int
    """Background objects over all images (what BI is computed on)."""
    thresholds: tuple[float, ...]
    csdc_curve: tuple[float, ...]
    preservation_curve: tuple[float, ...]
    deletion_curve: tuple[float, ...]
    distractibility_curve: tuple[float, ...]

    def to_dict(self) -> dict[str, Any]:
        """The scores as a JSON-friendly dict (curves as lists)."""
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in dataclasses.asdict(self).items()
        }


def dilation_size(resolution: int) -> int:
    """FunnyBirds' part-mask dilation (5 at 256 px) scaled to an image side: ``2*round(2*res/256)+1``.

    Gives 3 at 96 px, 5 at 224 and 256 px, 1 (no dilation) below 64 px.
    """
    if isinstance(resolution, bool) or not isinstance(resolution, int) or resolution < 1:
        raise ValueError(f"resolution must be a positive int, got {resolution!r}")
    return 2 * round(2 * resolution / 256) + 1


def _check_dilation(dilation: int) -> None:
    if isinstance(dilation, bool) or not isinstance(dilation, int) or dilation < 1 or dilation % 2 == 0:
        raise ValueError(f"dilation must be an odd int >= 1 (a max-pool size), got {dilation!r}")


def _dilated_masks(part_map: Tensor, item_values: Sequence[int], dilation: int) -> np.ndarray:
    """(n_items, H*W) float64 masks ``part_map == value``, each dilated by a max-pool of size ``dilation``."""
    values = torch.as_tensor(list(item_values), dtype=part_map.dtype)
    masks = (part_map.cpu().unsqueeze(0) == values.view(-1, 1, 1)).to(torch.float32)
    if dilation > 1 and len(item_values) > 0:
        masks = F.max_pool2d(masks.unsqueeze(1), dilation, stride=1, padding=dilation // 2).squeeze(1)
    # Importances are mask @ attribution in numpy: far cheaper than torch ops on tensors this small.
    return masks.reshape(len(item_values), -1).numpy().astype(np.float64)


def part_importances(
    attribution: Tensor, part_map: Tensor, item_values: Sequence[int], dilation: int
) -> np.ndarray:
    """FunnyBirds part importances: the attribution summed over each item's dilated mask.

    Args:
        attribution: (H, W) per-pixel attribution.
        part_map: (H, W) integer map (1..5 slots, ``100 + k`` background object k).
        item_values: the part-map values of the items, in the order of the result.
        dilation: odd max-pool size applied to each item's mask (see :func:`dilation_size`).

    Returns:
        float64 array (len(item_values),).
    """
    _check_dilation(dilation)
    if not isinstance(attribution, Tensor) or not isinstance(part_map, Tensor):
        raise TypeError("attribution and part_map must be torch tensors")
    if attribution.ndim != 2 or attribution.shape != part_map.shape:
        raise ValueError(
            f"attribution and part_map must both be (H, W) of the same shape, got "
            f"{tuple(attribution.shape)} and {tuple(part_map.shape)}"
        )
    if part_map.is_floating_point():
        raise TypeError(f"part_map must be an integer tensor, got {part_map.dtype}")
    masks = _dilated_masks(part_map, item_values, dilation)
    return masks @ attribution.detach().cpu().to(torch.float64).numpy().ravel()


def important_items(importances: np.ndarray, total: float, thresholds: np.ndarray) -> np.ndarray:
    """(T, n_items) bool: item i is important at threshold t when ``importances[i] > t * total``.

    ``total`` is the sum of the whole attribution map, as in FunnyBirds.
    """
    importances = np.asarray(importances, dtype=np.float64)
    thresholds = np.asarray(thresholds, dtype=np.float64)
    if importances.ndim != 1 or thresholds.ndim != 1:
        raise ValueError("importances and thresholds must be 1-D")
    return importances[None, :] > thresholds[:, None] * float(total)


def _nan_free_terms(*curves: np.ndarray) -> list[np.ndarray]:
    return [curve for curve in curves if not np.all(np.isnan(curve))]


def select_threshold(
    csdc: np.ndarray, preservation: np.ndarray, deletion: np.ndarray, distractibility: np.ndarray
) -> int:
    """Index of the threshold that maximizes ``(CSDC + PC + DC) / 3 + D`` (the first one on ties).

    A curve that is NaN everywhere (undefined metric) is left out: the checks' mean is taken over
    the defined checks, and D is dropped when undefined.
    """
    curves = [
        np.asarray(curve, dtype=np.float64) for curve in (csdc, preservation, deletion, distractibility)
    ]
    if any(curve.ndim != 1 or curve.shape != curves[0].shape or curve.size == 0 for curve in curves):
        raise ValueError("the four curves must be non-empty 1-D arrays of the same length")
    for curve in curves:
        if np.any(np.isnan(curve)) and not np.all(np.isnan(curve)):
            raise ValueError("a curve must be either NaN everywhere (undefined) or nowhere")
    checks = _nan_free_terms(*curves[:3])
    if not checks:
        raise ValueError("CSDC, PC and DC are all undefined: no threshold can be selected")
    objective = np.mean(checks, axis=0)
    if not np.all(np.isnan(curves[3])):
        objective = objective + curves[3]
    return int(np.argmax(objective))


def aggregate_scores(
    csdc: float,
    preservation: float,
    deletion: float,
    distractibility: float,
    single_deletion: float,
    target_sensitivity: float,
) -> dict[str, float]:
    """FunnyBirds' aggregates: completeness ``((CSDC+PC+DC)/3 + D)/2``, correctness = SD,
    contrastivity = TS and ``mx`` = their mean (NaN propagates)."""
    completeness = ((csdc + preservation + deletion) / 3 + distractibility) / 2
    correctness = float(single_deletion)
    contrastivity = float(target_sensitivity)
    return {
        "completeness": float(completeness),
        "correctness": correctness,
        "contrastivity": contrastivity,
        "mx": float((completeness + correctness + contrastivity) / 3),
    }


def _bits_to_slots(bits: int) -> list[str]:
    return [slot for i, slot in enumerate(SLOTS) if bits >> i & 1]


def _slots_to_bits(slots: Iterable[str]) -> int:
    bits = 0
    for slot in slots:
        if slot not in SLOTS:
            raise ValueError(f"unknown slot {slot!r}; expected one of {SLOTS}")
        bits |= 1 << SLOTS.index(slot)
    return bits


class _ImageRecord:
    """One evaluated image: its rendering, item masks and the model outputs of its interventions."""

    def __init__(self, dataset: _PartsDatasetInterface, index: int, dilation: int | None) -> None:
        sample = dataset.render(index)
        image, part_map = sample["image"], sample["part_map"]
        if not isinstance(image, Tensor) or image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"dataset image {index} must be a (3, H, W) tensor")
        if not isinstance(part_map, Tensor) or part_map.shape != image.shape[1:]:
            raise ValueError(f"dataset part_map {index} must be an (H, W) tensor matching the image")
        self.index = index
        self.image = image.to(torch.float32)
        self.label = int(sample["label"])
        self.present_bits = _slots_to_bits(sample["present_parts"])
        self.num_background = int(sample["background_objects"])
        self.dilation = dilation_size(max(image.shape[1:])) if dilation is None else dilation
        item_values = list(range(1, len(SLOTS) + 1)) + [
            BACKGROUND_LABEL_BASE + k for k in range(self.num_background)
        ]
        self.masks = _dilated_masks(part_map, item_values, self.dilation)
        present_slots = (self.present_bits & _SLOT_BITS) != 0
        self.item_present = np.concatenate([present_slots, np.ones(self.num_background, dtype=bool)])
        # Model outputs (float64 logits) keyed by the removed slots as a bit set (0 = original)
        # and by background object.
        self.slot_logits: dict[int, np.ndarray] = {}
        self.background_logits: dict[int, np.ndarray] = {}

    def slot_prediction(self, removed_bits: int) -> int:
        return int(np.argmax(self.slot_logits[removed_bits & self.present_bits]))


class _InterventionQueue:
    """Collects the renders a set of images needs, then runs them through the model in batches."""

    def __init__(self) -> None:
        self._pending: list[tuple[_ImageRecord, str, int]] = []
        self._queued: set[tuple[int, str, int]] = set()

    def slots_removed(self, record: _ImageRecord, removed_bits: int) -> None:
        removed_bits &= record.present_bits  # removing an absent part changes nothing
        self._add(record, "slots", removed_bits, record.slot_logits)

    def background_removed(self, record: _ImageRecord, obj: int) -> None:
        self._add(record, "background", obj, record.background_logits)

    def _add(self, record: _ImageRecord, kind: str, key: int, cache: dict[int, np.ndarray]) -> None:
        marker = (id(record), kind, key)
        if key not in cache and marker not in self._queued:
            self._queued.add(marker)
            self._pending.append((record, kind, key))

    def run(
        self, model: nn.Module, dataset: _PartsDatasetInterface, batch_size: int, device: torch.device
    ) -> None:
        pending, self._pending, self._queued = self._pending, [], set()
        for start in range(0, len(pending), batch_size):
            batch = pending[start : start + batch_size]
            images = torch.stack([_render(dataset, record, kind, key) for record, kind, key in batch])
            logits = _forward(model, images, device)
            for (record, kind, key), row in zip(batch, logits):
                cache = record.slot_logits if kind == "slots" else record.background_logits
                cache[key] = row


def _render(dataset: _PartsDatasetInterface, record: _ImageRecord, kind: str, key: int) -> Tensor:
    if kind == "slots" and key == 0:
        return record.image
    if kind == "slots":
        image = dataset.render(record.index, remove_parts=_bits_to_slots(key))["image"]
    else:
        image = dataset.render(record.index, remove_background=(key,))["image"]
    if image.shape != record.image.shape:
        raise ValueError(f"intervention on image {record.index} changed the image shape")
    return image.to(torch.float32)


def _forward(model: nn.Module, images: Tensor, device: torch.device) -> np.ndarray:
    with torch.no_grad():
        logits = model(images.to(device))
    if not isinstance(logits, Tensor) or logits.ndim != 2 or logits.shape[0] != images.shape[0]:
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"model must map (B, 3, H, W) images to (B, classes) logits, got {got}")
    return logits.detach().to("cpu", torch.float64).numpy()


def _model_device(model: nn.Module) -> torch.device:
    for tensor in model.parameters():
        return tensor.device
    for tensor in model.buffers():
        return tensor.device
    return torch.device("cpu")


def _relevant(drops: np.ndarray, original_logit: float) -> np.ndarray:
    return (drops >= RELEVANCE_FRACTION * abs(original_logit)) & (drops > 0)


class _ModelOutcomes:
    """Method-independent facts about one image, from the model's outputs on its interventions."""

    def __init__(self, record: _ImageRecord, dataset: _PartsDatasetInterface) -> None:
        original = record.slot_logits[0]
        label = record.label
        if not 0 <= label < original.shape[0]:
            raise ValueError(
                f"label {label} of image {record.index} is outside the model's {original.shape[0]} classes"
            )
        self.prediction = int(np.argmax(original))
        self.correct = self.prediction == label
        label_logit = original[label]
        slot_drops = np.array(
            [
                label_logit - record.slot_logits[bit & record.present_bits][label]
                for bit in _SLOT_BITS.tolist()
            ]
        )
        background_drops = np.array(
            [label_logit - record.background_logits[k][label] for k in range(record.num_background)]
        )
        self.slot_drops = slot_drops
        self.background_relevant = _relevant(background_drops, label_logit)
        relevant = _relevant(np.concatenate([slot_drops, background_drops]), label_logit)
        self.irrelevant = ~relevant & record.item_present

        c1, c2 = (int(c) for c in dataset.target_sensitivity_pair(label))
        self.ts_classes = (c1, c2)
        bits_a = _slots_to_bits(dataset.shared_slots(label, c1))
        bits_b = _slots_to_bits(dataset.shared_slots(label, c2))
        self.ts_slots = (
            np.flatnonzero(bits_a & _SLOT_BITS),
            np.flatnonzero(bits_b & _SLOT_BITS),
        )
        without_a = record.slot_logits[bits_a & record.present_bits]
        without_b = record.slot_logits[bits_b & record.present_bits]
        # FunnyBirds' assumption: each class's own shared parts matter more to it than the other's.
        self.ts_valid = bool(without_a[c1] < without_b[c1] and without_b[c2] < without_a[c2])

    def targets(self, label: int) -> list[int]:
        """The distinct targets a method must explain for this image."""
        wanted = [label, self.prediction] + (list(self.ts_classes) if self.ts_valid else [])
        return list(dict.fromkeys(wanted))


class _MethodTally:
    """Running sums of one method's per-image scores."""

    def __init__(self, num_thresholds: int) -> None:
        self.csdc = np.zeros(num_thresholds)
        self.num_correct = 0
        self.preservation = np.zeros(num_thresholds)
        self.deletion = np.zeros(num_thresholds)
        self.num_images = 0
        self.distracted = np.zeros(num_thresholds)
        self.num_distractibility = 0
        self.single_deletion: list[float] = []
        self.target_sensitivity: list[float] = []
        self.num_target_sensitivity = 0


def _explain_all(
    method: AttributionMethod,
    name: str,
    records: list[_ImageRecord],
    outcomes: list[_ModelOutcomes],
    batch_size: int,
    device: torch.device,
) -> dict[tuple[int, int], tuple[np.ndarray, float]]:
    """Importances (slots then background objects) and attribution total per (record position, target)."""
    rows = [
        (pos, target) for pos, record in enumerate(records) for target in outcomes[pos].targets(record.label)
    ]
    explained: dict[tuple[int, int], tuple[np.ndarray, float]] = {}
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        images = torch.stack([records[pos].image for pos, _ in batch]).to(device)
        targets = torch.tensor([target for _, target in batch], dtype=torch.long, device=device)
        with torch.enable_grad():
            attributions = method(images, targets)
        height, width = images.shape[-2:]
        if not isinstance(attributions, Tensor) or tuple(attributions.shape) != (len(batch), height, width):
            raise ValueError(
                f"method {name!r} must return a (B, H, W) = {(len(batch), height, width)} tensor, got "
                f"{tuple(attributions.shape) if isinstance(attributions, Tensor) else type(attributions)}"
            )
        attributions = attributions.detach().to("cpu", torch.float64).numpy().reshape(len(batch), -1)
        if not np.all(np.isfinite(attributions)):
            raise ValueError(f"method {name!r} returned non-finite attributions")
        for (pos, target), attribution in zip(batch, attributions):
            explained[(pos, target)] = (records[pos].masks @ attribution, float(attribution.sum()))
    return explained


def _important_slot_bits(important: np.ndarray, present_bits: int) -> np.ndarray:
    """(T,) bit sets of the important drawn slots, from a (T, n_items) importance mask."""
    return (important[:, : len(SLOTS)].astype(np.int64) @ _SLOT_BITS) & present_bits


def _validate_inputs(
    model: nn.Module,
    dataset: _PartsDatasetInterface,
    methods: Mapping[str, AttributionMethod],
    indices: Sequence[int],
    thresholds: np.ndarray,
    dilation: int | None,
    batch_size: int,
) -> list[int]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("model must be in eval mode (call model.eval())")
    if not isinstance(methods, Mapping) or not methods:
        raise ValueError("methods must be a non-empty mapping of name -> attribution method")
    for name, method in methods.items():
        if not isinstance(name, str) or not callable(method):
            raise TypeError(f"methods must map str names to callables, got {name!r}: {type(method).__name__}")
    if thresholds.ndim != 1 or thresholds.size == 0 or not np.all(np.isfinite(thresholds)):
        raise ValueError("thresholds must be a non-empty 1-D array of finite numbers")
    if dilation is not None:
        _check_dilation(dilation)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    index_list = []
    for index in indices:
        if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"indices must be ints, got {index!r}")
        if not 0 <= int(index) < len(dataset):
            raise ValueError(f"index {index} is outside the data set (length {len(dataset)})")
        index_list.append(int(index))
    if not index_list:
        raise ValueError("indices must not be empty")
    return index_list


def _nan_mean(total: float | np.ndarray, count: int) -> float | np.ndarray:
    return total / count if count else total * math.nan


def evaluate(
    model: nn.Module,
    dataset: _PartsDatasetInterface,
    methods: Mapping[str, AttributionMethod],
    indices: Sequence[int],
    *,
    thresholds: Sequence[float] | np.ndarray = DEFAULT_THRESHOLDS,
    dilation: int | None = None,
    batch_size: int = 32,
    progress: bool = True,
) -> dict[str, FunnyBirdsScores]:
    """Run the FunnyBirds protocol for several attribution methods on one model.

    The method-independent model outputs (original image, each single-slot removal, each
    background-object removal, TS' interventions) are computed once per image; the outputs of
    slot-removal interventions are cached per (image, set of removed slots) and shared across
    methods and thresholds (PC and DC need at most 32 distinct sets per image). Images are taken
    ``batch_size`` at a time; each method is called on batches of up to ``batch_size`` rows, one row
    per distinct target an image needs (its label, its prediction when different, and TS' two classes
    when the image passes TS' assumption). Model forward passes run under ``torch.no_grad``;
    methods are called under ``torch.enable_grad``.

    Args:
        model: maps (B, 3, H, W) images to (B, classes) logits; must be in eval mode.
        dataset: a ``PartsDataset`` or an object with the same interface.
        methods: name -> ``explain(images, targets) -> (B, H, W)`` attributions.
        indices: data-set indices of the images to evaluate.
        thresholds: the thresholds ``t`` (default FunnyBirds' ``linspace(0.01, 0.5, 80)``).
        dilation: odd max-pool size for the part masks; None picks :func:`dilation_size` of the
            larger image side (3 at 96 px, FunnyBirds' 5 at 256 px).
        batch_size: images per chunk, rows per model forward pass and per method call.
        progress: show a tqdm progress bar over the images.

    Returns:
        method name -> :class:`FunnyBirdsScores`.
    """
    thresholds = np.asarray(thresholds, dtype=np.float64)
    index_list = _validate_inputs(model, dataset, methods, indices, thresholds, dilation, batch_size)
    device = _model_device(model)
    num_thresholds = thresholds.size
    tallies = {name: _MethodTally(num_thresholds) for name in methods}
    sufficient_sets: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    num_correct = 0
    num_background = 0
    num_background_relevant = 0

    with tqdm(total=len(index_list), desc="FunnyBirds", disable=not progress) as bar:
        for start in range(0, len(index_list), batch_size):
            chunk = index_list[start : start + batch_size]
            records = [_ImageRecord(dataset, index, dilation) for index in chunk]

            queue = _InterventionQueue()
            for record in records:
                queue.slots_removed(record, 0)
                for bit in _SLOT_BITS.tolist():
                    queue.slots_removed(record, bit)
                for obj in range(record.num_background):
                    queue.background_removed(record, obj)
                c1, c2 = dataset.target_sensitivity_pair(record.label)
                queue.slots_removed(record, _slots_to_bits(dataset.shared_slots(record.label, c1)))
                queue.slots_removed(record, _slots_to_bits(dataset.shared_slots(record.label, c2)))
            queue.run(model, dataset, batch_size, device)

            outcomes = [_ModelOutcomes(record, dataset) for record in records]
            for record, outcome in zip(records, outcomes):
                num_correct += outcome.correct
                num_background += record.num_background
                num_background_relevant += int(outcome.background_relevant.sum())
                if record.label not in sufficient_sets:
                    sufficient_sets[record.label] = _sufficient_set_matrix(dataset, record.label)

            explained = {
                name: _explain_all(method, name, records, outcomes, batch_size, device)
                for name, method in methods.items()
            }
            # PC keeps only the important slots, DC removes them; both explain the prediction.
            check_bits: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
            for name in methods:
                check_bits[name] = []
                for pos, (record, outcome) in enumerate(zip(records, outcomes)):
                    importances, total = explained[name][(pos, outcome.prediction)]
                    important = _important_slot_bits(
                        important_items(importances, total, thresholds), record.present_bits
                    )
                    kept_removed = record.present_bits & ~important
                    for bits in np.unique(np.concatenate([kept_removed, important])).tolist():
                        queue.slots_removed(record, bits)
                    check_bits[name].append((kept_removed, important))
            queue.run(model, dataset, batch_size, device)

            for name in methods:
                _score_chunk(
                    tallies[name],
                    records,
                    outcomes,
                    explained[name],
                    check_bits[name],
                    sufficient_sets,
                    thresholds,
                )
            bar.update(len(records))

    accuracy = num_correct / len(index_list)
    background_independence = 1 - num_background_relevant / num_background if num_background else math.nan
    return {
        name: _finalize(tally, thresholds, accuracy, background_independence, num_correct, num_background)
        for name, tally in tallies.items()
    }


def _sufficient_set_matrix(dataset: _PartsDatasetInterface, label: int) -> tuple[np.ndarray, np.ndarray]:
    """(m, 5) bool membership of the minimal sufficient part sets of ``label``, and their sizes."""
    part_sets = list(dataset.minimal_sufficient_part_sets(label))
    if not part_sets or any(len(part_set) == 0 for part_set in part_sets):
        raise ValueError(f"class {label} needs at least one non-empty minimal sufficient part set")
    membership = np.array(
        [[slot in part_set for slot in SLOTS] for part_set in part_sets], dtype=np.float64
    )
    for part_set in part_sets:
        _slots_to_bits(part_set)  # rejects unknown slot names
    return membership, membership.sum(axis=1)


def _score_chunk(
    tally: _MethodTally,
    records: list[_ImageRecord],
    outcomes: list[_ModelOutcomes],
    explained: dict[tuple[int, int], tuple[np.ndarray, float]],
    check_bits: list[tuple[np.ndarray, np.ndarray]],
    sufficient_sets: dict[int, tuple[np.ndarray, np.ndarray]],
    thresholds: np.ndarray,
) -> None:
    for pos, (record, outcome) in enumerate(zip(records, outcomes)):
        label = record.label
        importances, total = explained[(pos, label)]
        important = important_items(importances, total, thresholds) & record.item_present[None, :]

        if outcome.correct:
            membership, sizes = sufficient_sets[label]
            covered = important[:, : len(SLOTS)].astype(np.float64) @ membership.T / sizes
            tally.csdc += covered.max(axis=1)
            tally.num_correct += 1

        kept_removed, removed = check_bits[pos]
        needed = np.unique(np.concatenate([kept_removed, removed])).tolist()
        prediction_after = {bits: record.slot_prediction(bits) for bits in needed}
        prediction = outcome.prediction
        tally.preservation += np.array([prediction_after[b] == prediction for b in kept_removed.tolist()])
        tally.deletion += np.array([prediction_after[b] != prediction for b in removed.tolist()])
        tally.num_images += 1

        if outcome.irrelevant.any():
            distracting = important & outcome.irrelevant[None, :]
            tally.distracted += distracting.sum(axis=1) / outcome.irrelevant.sum()
            tally.num_distractibility += 1

        drawn = np.flatnonzero(record.item_present[: len(SLOTS)])
        if drawn.size >= 2:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", stats.ConstantInputWarning)
                correlation = float(stats.spearmanr(outcome.slot_drops[drawn], importances[drawn])[0])
            if not math.isnan(correlation):
                tally.single_deletion.append((correlation + 1) / 2)

        if outcome.ts_valid:
            c1, c2 = outcome.ts_classes
            importances_c1 = explained[(pos, c1)][0]
            importances_c2 = explained[(pos, c2)][0]
            slots_a, slots_b = outcome.ts_slots
            # A is what the label shares with c1: it must matter more for c1; B likewise for c2.
            tally.target_sensitivity.append(
                float(importances_c1[slots_a].sum() > importances_c2[slots_a].sum())
            )
            tally.target_sensitivity.append(
                float(importances_c1[slots_b].sum() < importances_c2[slots_b].sum())
            )
            tally.num_target_sensitivity += 1


def _finalize(
    tally: _MethodTally,
    thresholds: np.ndarray,
    accuracy: float,
    background_independence: float,
    num_correct: int,
    num_background: int,
) -> FunnyBirdsScores:
    csdc = _nan_mean(tally.csdc, tally.num_correct)
    preservation = _nan_mean(tally.preservation, tally.num_images)
    deletion = _nan_mean(tally.deletion, tally.num_images)
    distractibility = 1 - _nan_mean(tally.distracted, tally.num_distractibility)
    single_deletion = float(np.mean(tally.single_deletion)) if tally.single_deletion else math.nan
    target_sensitivity = float(np.mean(tally.target_sensitivity)) if tally.target_sensitivity else math.nan
    best = select_threshold(csdc, preservation, deletion, distractibility)
    aggregates = aggregate_scores(
        float(csdc[best]),
        float(preservation[best]),
        float(deletion[best]),
        float(distractibility[best]),
        single_deletion,
        target_sensitivity,
    )
    return FunnyBirdsScores(
        accuracy=float(accuracy),
        background_independence=float(background_independence),
        csdc=float(csdc[best]),
        preservation_check=float(preservation[best]),
        deletion_check=float(deletion[best]),
        distractibility=float(distractibility[best]),
        single_deletion=single_deletion,
        target_sensitivity=target_sensitivity,
        completeness=aggregates["completeness"],
        correctness=aggregates["correctness"],
        contrastivity=aggregates["contrastivity"],
        mx=aggregates["mx"],
        best_threshold=float(thresholds[best]),
        num_images=tally.num_images,
        num_correct=num_correct,
        num_distractibility=tally.num_distractibility,
        num_single_deletion=len(tally.single_deletion),
        num_target_sensitivity=tally.num_target_sensitivity,
        num_background_objects=num_background,
        thresholds=tuple(thresholds.tolist()),
        csdc_curve=tuple(np.asarray(csdc, dtype=np.float64).tolist()),
        preservation_curve=tuple(preservation.tolist()),
        deletion_curve=tuple(deletion.tolist()),
        distractibility_curve=tuple(np.asarray(distractibility, dtype=np.float64).tolist()),
    )
