"""Image sources for bulk explanation: a flat folder or an ImageFolder-style tree.

The file list is sorted, so every process and every resumed run sees the same index
for the same image. An image that cannot be read is not an error here: the dataset
returns its failure, and the run records the image as failed and goes on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch
from PIL import Image
from torch.utils.data import Dataset

IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm"})


@dataclass(frozen=True)
class ImageList:
    """The images of a source folder.

    Attributes:
        root: the folder.
        paths: image paths relative to ``root``, sorted.
        labels: per image, its class index, or -1 in a flat folder.
        classes: the class folder names (empty for a flat folder); the label of a
            folder is its position in this sorted list, or its name if every class
            folder is named by an integer (e.g. ``0/``, ``1/``, ... for model classes).
    """

    root: Path
    paths: tuple[str, ...]
    labels: tuple[int, ...]
    classes: tuple[str, ...]

    @property
    def has_labels(self) -> bool:
        return bool(self.classes)


def _image_files(paths: Iterable[Path]) -> list[Path]:
    return sorted(p for p in paths if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def list_images(root: str | Path) -> ImageList:
    """Find the images under ``root``: one sub-folder per class, or images directly in it.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: no image files were found (suffixes: png, jpg, jpeg, bmp, gif, tif,
            tiff, webp, ppm), or both class folders and loose images are present.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder not found: {root}")
    loose = _image_files(root.iterdir())
    # Each folder is walked once: its images decide whether it is a class folder.
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files_of = {folder: _image_files(folder.rglob("*")) for folder in folders}
    class_dirs = [folder for folder in folders if files_of[folder]]
    if loose and class_dirs:
        raise ValueError(f"{root} holds both images and class folders ({class_dirs[0].name}/, ...); "
                         "give a flat folder of images or one sub-folder per class")
    if loose:
        return ImageList(root, tuple(p.name for p in loose), (-1,) * len(loose), ())
    if not class_dirs:
        raise ValueError(f"no images found in {root} (suffixes: {', '.join(sorted(IMAGE_SUFFIXES))})")
    names = tuple(d.name for d in class_dirs)
    numbered = all(name.isdigit() for name in names)
    paths: list[str] = []
    labels: list[int] = []
    for position, folder in enumerate(class_dirs):
        files = files_of[folder]
        paths.extend(str(p.relative_to(root)) for p in files)
        labels.extend([int(folder.name) if numbered else position] * len(files))
    return ImageList(root, tuple(paths), tuple(labels), names)


class ImageFiles(Dataset):
    """Loads image ``i`` of an :class:`ImageList` and applies ``transform`` (PIL → tensor).

    Returns ``(index, image or None, error message or None)``: a file that cannot be
    decoded or transformed is returned as a failure instead of raising.
    """

    def __init__(self, images: ImageList, transform: Callable[[Image.Image], torch.Tensor]) -> None:
        self.images = images
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        path = self.images.root / self.images.paths[index]
        try:
            with Image.open(path) as image:
                tensor = self.transform(image.convert("RGB"))
        except Exception as error:  # a corrupt file must not stop the run: it is recorded as failed
            return index, None, f"{type(error).__name__}: {error}"
        return index, tensor, None


def collate_images(samples: list[tuple[int, torch.Tensor | None, str | None]]) -> dict:
    """Collate :class:`ImageFiles` samples: the readable images stacked, the failures listed."""
    readable = [(i, t) for i, t, _ in samples if t is not None]
    return {
        "indices": [i for i, _, _ in samples],
        "readable": [i for i, _ in readable],
        "images": torch.stack([t for _, t in readable]) if readable else None,
        "errors": {i: e for i, _, e in samples if e is not None},
    }
