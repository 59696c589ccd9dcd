"""Overlays and completeness reports read back from an attribution store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

from ..errors import ImageSourceError, OptionError, StoreError
from ..visualize import overlay_grid, postprocess
from .images import transform_image
from .model_source import image_transform
from .store import EXPLAINED, AttributionStore
from .targets import NO_CLASS


def target_names(pairs: np.ndarray) -> list[str]:
    """'7' or '7−3' for each (positive, negative) class pair."""
    return [f"{p}" if n == NO_CLASS else f"{p}−{n}" for p, n in pairs.tolist()]


def completeness(store: AttributionStore, indices: list[int] | None = None) -> list[dict]:
    """Per explained image and target: the explained read-out, the sum of contributions,
    and their absolute and relative difference."""
    status = store.status()
    chosen = np.flatnonzero(status == EXPLAINED) if indices is None else np.asarray(indices)
    if chosen.size == 0:
        return []
    sums = store.read("contribution", chosen).astype(np.float64).sum((-2, -1))
    explained = store.read("explained", chosen).astype(np.float64)
    pairs = store.read("targets", chosen)
    paths = store.paths()
    rows = []
    for row, index in enumerate(chosen.tolist()):
        for t, name in enumerate(target_names(pairs[row])):
            error = abs(sums[row, t] - explained[row, t])
            rows.append({"image": index, "path": paths[index], "target": name,
                         "explained": explained[row, t], "sum_of_contributions": sums[row, t],
                         "absolute_error": error, "relative_error": error / max(abs(explained[row, t]), 1e-12)})
    return rows


def _check_folder(out: Path) -> None:
    """Raise OptionError if ``out`` is a file, or its path runs through one (checked before any reading)."""
    for folder in (out, *out.parents):
        if folder.exists():
            if not folder.is_dir():
                where = "is a file, not a folder" if folder == out else f"cannot be created: {folder} is a file"
                raise OptionError(f"the overlay folder {out} {where}; give a folder for target<t>.png")
            return


def write_overlays(store: AttributionStore, out: str | Path, *, indices: list[int] | None = None,
                   limit: int = 16, source: str | Path | None = None, postprocessed: bool = False) -> list[Path]:
    """One PNG per target: the contribution maps of the chosen images over the images.

    Args:
        store: the store to read.
        out: folder for ``target<t>.png``.
        indices: images to draw (default: the first ``limit`` explained ones).
        limit: how many images at most.
        source: the image folder (default: the one recorded in the store).
        postprocessed: draw the paper's post-processed maps (positive part, clipped,
            smoothed) instead of the raw signed ones.

    Raises:
        StoreError: the store holds no explained image to draw, or a chunk file of it that
            cannot be decoded.
        OptionError: an index that is out of range or not explained; ``out`` is a file, or
            a folder that cannot be created.
        ImageSourceError: an image file is no longer in the source folder.
        ImageDecodeError: an image file that no longer decodes.
    """
    out = Path(out)
    _check_folder(out)
    status = store.status()
    if indices is None:
        indices = np.flatnonzero(status == EXPLAINED)[:limit].tolist()
    if not indices:
        raise StoreError("the store holds no explained image to draw")
    not_explained = [i for i in indices if not 0 <= i < store.num_images or status[i] != EXPLAINED]
    if not_explained:
        raise OptionError(f"images {not_explained} are not explained in the store (out of range, failed or pending)")
    indices = indices[:limit]
    root = Path(source or store.attrs["source"])
    paths = store.paths()
    display = image_transform(store.attrs["data_config"], normalize=False)
    images = []
    for i in indices:
        file = root / paths[i]
        if not file.is_file():
            raise ImageSourceError(f"image {i} ({paths[i]}) is not in {root}; pass the source folder")
        with Image.open(file) as image:
            images.append(transform_image(image, display))
    images_tensor = torch.stack(images)
    contributions = torch.from_numpy(store.read("contribution", indices).astype(np.float32))
    explained = store.read("explained", indices)
    pairs = store.read("targets", indices)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise OptionError(f"cannot create the overlay folder {out}: {error.strerror or error}") from error
    written = []
    for t in range(contributions.shape[1]):
        maps = contributions[:, t]
        if postprocessed:
            maps = postprocess(maps)
        titles = [f"{Path(paths[i]).name}: {target_names(pairs[row])[t]}, ŷ {explained[row, t]:.2f}, "
                  f"ΣC {contributions[row, t].double().sum().item():.2f}" for row, i in enumerate(indices)]
        path = out / f"target{t}.png"
        overlay_grid(images_tensor, maps, path=path, titles=titles, postprocessed=postprocessed)
        written.append(path)
    return written
