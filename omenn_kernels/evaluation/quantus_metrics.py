"""Quantus (0.6) metrics for per-pixel attributions: faithfulness correlation and localisation.

Every function takes a batch of images (N, 3, H, W), their explained targets (N,) and the
attributions (N, H, W) (per-pixel, summed over channels), as torch tensors or numpy arrays, and
returns one score per image as a float64 numpy array.

- :func:`faithfulness_correlation` (Bhatt et al., 2020): Pearson correlation, over ``nr_runs``
  random subsets of ``subset_size`` input features, between the summed attribution of a subset
  and the logit drop when the subset is set to the baseline. Quantus' features are the C*H*W
  input values; each carries the attribution of its pixel (Quantus broadcasts the (N, 1, H, W)
  attribution over the channels). The baseline is 0, as the OMENN paper states; note that
  Quantus' ``"black"`` baseline is each image's minimum, which is not 0 for images without a
  black pixel (the parts data set's noisy images never reach 0).
- :func:`relevance_mass_accuracy` (Arras et al., 2022): the share of the attribution that lies
  inside the bird-part mask.
- :func:`pointing_game` (Zhang et al., 2018): 1 if a pixel of maximal attribution lies inside the
  bird-part mask, else 0.

The mask is the bird's parts: ``part_map`` values 1..5 (the slots), not the body or background
objects. Quantus draws its random subsets with numpy's global RNG, so
:func:`faithfulness_correlation` seeds it with ``seed`` for the call and restores its previous
state afterwards: results are reproducible and the caller's numpy random stream is untouched.
Quantus' own warnings are silenced (``disable_warnings=True`` plus a warnings filter for the
warnings it raises regardless of that flag).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import numpy as np
import quantus
import torch
from scipy import stats
from torch import nn

from omenn_kernels.evaluation.parts_dataset import SLOTS

__all__ = [
    "bird_part_mask",
    "faithfulness_correlation",
    "pointing_game",
    "relevance_mass_accuracy",
]

ArrayLike = torch.Tensor | np.ndarray


def _to_numpy(value: ArrayLike, name: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return value
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(value).__name__}")


def _checked_batch(
    images: ArrayLike, targets: ArrayLike, attributions: ArrayLike
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """images (N, 3, H, W) float32, targets (N,) int64, attributions (N, 1, H, W) float32."""
    x = _to_numpy(images, "images")
    y = _to_numpy(targets, "targets")
    a = _to_numpy(attributions, "attributions")
    if x.ndim != 4 or x.shape[1] != 3 or x.shape[0] == 0:
        raise ValueError(f"images must be a non-empty (N, 3, H, W) batch, got shape {x.shape}")
    if not np.issubdtype(x.dtype, np.floating) or not np.all(np.isfinite(x)):
        raise ValueError("images must be finite floating-point values")
    if y.shape != (x.shape[0],) or not np.issubdtype(y.dtype, np.integer) or np.any(y < 0):
        raise ValueError(
            f"targets must be {x.shape[0]} non-negative ints, got shape {y.shape}, dtype {y.dtype}"
        )
    if a.shape != (x.shape[0], *x.shape[2:]):
        raise ValueError(f"attributions must be (N, H, W) = {(x.shape[0], *x.shape[2:])}, got {a.shape}")
    if not np.issubdtype(a.dtype, np.floating) or not np.all(np.isfinite(a)):
        raise ValueError("attributions must be finite floating-point values")
    return x.astype(np.float32), y.astype(np.int64), a[:, None].astype(np.float32)


@contextlib.contextmanager
def _quiet_quantus() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", module="quantus")
        # A constant attribution or logit series makes a correlation undefined: the score is NaN.
        warnings.filterwarnings("ignore", category=stats.ConstantInputWarning)
        yield


@contextlib.contextmanager
def _seeded_numpy(seed: int) -> Iterator[None]:
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


def _model_device(model: nn.Module) -> str:
    for tensor in model.parameters():
        return str(tensor.device)
    return "cpu"


def faithfulness_correlation(
    model: nn.Module,
    images: ArrayLike,
    targets: ArrayLike,
    attributions: ArrayLike,
    *,
    nr_runs: int = 100,
    subset_size: int = 224,
    seed: int = 0,
    perturb_baseline: float | str = 0.0,
    batch_size: int = 64,
) -> np.ndarray:
    """Quantus' FaithfulnessCorrelation per image (Pearson, ``abs=False``, ``normalise=False``).

    Args:
        model: eval-mode classifier (N, 3, H, W) -> (N, classes) logits (its logits are compared).
        images: (N, 3, H, W) inputs.
        targets: (N,) explained classes.
        attributions: (N, H, W) per-pixel attributions.
        nr_runs: random subsets per image (Quantus' default 100).
        subset_size: input features (of the 3*H*W) per subset (Quantus' default 224).
        seed: seeds numpy's global RNG, which Quantus draws the subsets from (restored afterwards).
        perturb_baseline: value the subset is set to: 0 by default; any Quantus baseline
            (e.g. ``"black"``, the image minimum) is passed through.
        batch_size: images per Quantus batch.

    Returns:
        (N,) float64 correlations in [-1, 1]; NaN where the attribution sums or logit drops are constant.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if model.training:
        raise ValueError("model must be in eval mode (call model.eval())")
    x, y, a = _checked_batch(images, targets, attributions)
    num_features = int(np.prod(x.shape[1:]))
    for name, value in (("nr_runs", nr_runs), ("subset_size", subset_size), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if nr_runs < 2:
        raise ValueError("nr_runs must be at least 2 for a correlation")
    if subset_size >= num_features:
        raise ValueError(
            f"subset_size ({subset_size}) must be smaller than the {num_features} input features"
        )
    metric = quantus.FaithfulnessCorrelation(
        nr_runs=nr_runs,
        subset_size=subset_size,
        perturb_func=quantus.perturb_func.batch_baseline_replacement_by_indices,
        perturb_baseline=perturb_baseline,
        similarity_func=quantus.similarity_func.correlation_pearson,
        abs=False,
        normalise=False,
        return_aggregate=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    with _quiet_quantus(), _seeded_numpy(seed):
        scores = metric(
            model=model,
            x_batch=x,
            y_batch=y,
            a_batch=a,
            channel_first=True,
            device=_model_device(model),
            batch_size=batch_size,
        )
    return np.asarray(scores, dtype=np.float64)


def bird_part_mask(part_maps: ArrayLike) -> np.ndarray:
    """(N, 1, H, W) float32 mask of the bird's part pixels (``part_map`` values 1..5) of (N, H, W) maps."""
    maps = _to_numpy(part_maps, "part_maps")
    if maps.ndim != 3 or not np.issubdtype(maps.dtype, np.integer):
        raise ValueError(
            f"part_maps must be an (N, H, W) integer array, got shape {maps.shape}, dtype {maps.dtype}"
        )
    return ((maps >= 1) & (maps <= len(SLOTS)))[:, None].astype(np.float32)


def _localisation(
    metric_class: type[quantus.Metric],
    images: ArrayLike,
    targets: ArrayLike,
    attributions: ArrayLike,
    part_maps: ArrayLike,
    absolute: bool,
) -> np.ndarray:
    metric = metric_class(
        abs=absolute,
        normalise=False,
        return_aggregate=False,
        disable_warnings=True,
        display_progressbar=False,
    )
    x, y, a = _checked_batch(images, targets, attributions)
    mask = bird_part_mask(part_maps)
    if mask.shape[0] != x.shape[0] or mask.shape[2:] != x.shape[2:]:
        expected = (x.shape[0], *x.shape[2:])
        raise ValueError(f"part_maps must be (N, H, W) = {expected}, got {mask.shape[:1] + mask.shape[2:]}")
    with _quiet_quantus():
        scores = metric(model=None, x_batch=x, y_batch=y, a_batch=a, s_batch=mask, channel_first=True)
    scores = np.asarray(scores, dtype=np.float64)
    # Quantus 0.6 writes NaN into a bool array for an empty mask (which reads back as True).
    scores[mask.reshape(mask.shape[0], -1).sum(axis=1) == 0] = np.nan
    return scores


def relevance_mass_accuracy(
    images: ArrayLike,
    targets: ArrayLike,
    attributions: ArrayLike,
    part_maps: ArrayLike,
    *,
    absolute: bool = False,
) -> np.ndarray:
    """Quantus' RelevanceMassAccuracy per image: attribution inside the bird-part mask / total attribution.

    Args:
        images: (N, 3, H, W) inputs (for shape checks).
        targets: (N,) explained classes.
        attributions: (N, H, W) per-pixel attributions (signed unless ``absolute``).
        part_maps: (N, H, W) data-set part maps; the mask is values 1..5.
        absolute: take the attributions' absolute values first.

    Returns:
        (N,) float64; NaN where the mask is empty.
    """
    return _localisation(quantus.RelevanceMassAccuracy, images, targets, attributions, part_maps, absolute)


def pointing_game(
    images: ArrayLike,
    targets: ArrayLike,
    attributions: ArrayLike,
    part_maps: ArrayLike,
    *,
    absolute: bool = False,
) -> np.ndarray:
    """Quantus' PointingGame per image: 1.0 if a maximal-attribution pixel is in the bird-part mask, else 0.0.

    Args:
        images: (N, 3, H, W) inputs (for shape checks).
        targets: (N,) explained classes.
        attributions: (N, H, W) per-pixel attributions (signed unless ``absolute``).
        part_maps: (N, H, W) data-set part maps; the mask is values 1..5.
        absolute: take the attributions' absolute values first.

    Returns:
        (N,) float64 of 0.0/1.0; NaN where the mask is empty.
    """
    return _localisation(quantus.PointingGame, images, targets, attributions, part_maps, absolute)
