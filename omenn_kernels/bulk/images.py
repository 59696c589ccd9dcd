"""Image sources for bulk explanation: a flat folder or an ImageFolder-style tree.

The file list is sorted, so every process and every resumed run sees the same index
for the same image. An image that cannot be read is not an error here: the dataset
returns its failure, and the run records the image as failed and goes on.

Images are decoded by PIL mode into what the model expects: an RGB image whose values
span [0, 1] before normalization (see :func:`decode_image`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

from ..errors import ImageDecodeError, ImageSourceError

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
        ImageSourceError: ``root`` is not a folder, no image files were found (suffixes:
            png, jpg, jpeg, bmp, gif, tif, tiff, webp, ppm), or both class folders and
            loose images are present.
    """
    root = Path(root)
    if not root.is_dir():
        raise ImageSourceError(f"image folder not found: {root}")
    loose = _image_files(root.iterdir())
    # Each folder is walked once: its images decide whether it is a class folder.
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    files_of = {folder: _image_files(folder.rglob("*")) for folder in folders}
    class_dirs = [folder for folder in folders if files_of[folder]]
    if loose and class_dirs:
        raise ImageSourceError(f"{root} holds both images and class folders ({class_dirs[0].name}/, ...); "
                         "give a flat folder of images or one sub-folder per class")
    if loose:
        return ImageList(root, tuple(p.name for p in loose), (-1,) * len(loose), ())
    if not class_dirs:
        raise ImageSourceError(f"no images found in {root} (suffixes: {', '.join(sorted(IMAGE_SUFFIXES))})")
    names = tuple(d.name for d in class_dirs)
    numbered = all(name.isdigit() for name in names)
    paths: list[str] = []
    labels: list[int] = []
    for position, folder in enumerate(class_dirs):
        files = files_of[folder]
        paths.extend(str(p.relative_to(root)) for p in files)
        labels.extend([int(folder.name) if numbered else position] * len(files))
    return ImageList(root, tuple(paths), tuple(labels), names)


# 8-bit modes PIL's convert("RGB") decodes as they are: gray replicated, palette looked up,
# bilevel as 0/255, YCbCr by the JPEG (ITU-R BT.601) matrix, CMYK by PIL's naive formula
# R = (255 - C)(255 - K)/255 (any embedded ICC profile is not applied), RGBX without its pad byte.
_CONVERTED_8BIT_MODES = frozenset({"RGB", "L", "P", "1", "YCbCr", "CMYK", "RGBX"})
_ALPHA_MODES = frozenset({"RGBA", "LA", "PA"})
# A transparent colour (PNG tRNS) or an RGBA palette makes these modes transparent too.
_KEYED_MODES = frozenset({"RGB", "L", "P"})
_UINT16_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N"})
_INT32_MAX = 2**31 - 1
SUPPORTED_MODES = tuple(sorted(_CONVERTED_8BIT_MODES | _ALPHA_MODES | _UINT16_MODES | {"I", "F"}))


def _has_transparency(image: Image.Image) -> bool:
    if image.mode in _ALPHA_MODES or "transparency" in image.info:
        return True
    return image.mode == "P" and image.palette is not None and image.palette.mode.endswith("A")


def _composite_on_white(image: Image.Image) -> Image.Image:
    """Alpha-composite an image onto white, rounded to 8 bits: ``round(c·a/255 + 255·(1 - a/255))``."""
    rgba = np.asarray(image.convert("RGBA"), dtype=np.float64)
    alpha = rgba[..., 3:] / 255.0
    return Image.fromarray(np.rint(rgba[..., :3] * alpha + 255.0 * (1.0 - alpha)).astype(np.uint8))


def _single_tag(value: object) -> int:
    # TIFF tags hold one value per sample; a gray image has one sample.
    return int(value[0]) if isinstance(value, tuple) else int(value)


def _integer_maximum(image: Image.Image) -> int:
    """The largest value the samples of an integer-mode image can hold, from its declared bit depth.

    The I;16 modes hold 16-bit samples. Mode "I" is PIL's 32-bit signed integer; it holds
    16-bit data in PNGs (older Pillow versions open 16-bit gray PNGs as "I") and PPM/PGMs
    (Pillow scales any maxval above 255 to 16 bits), and the declared BitsPerSample and
    SampleFormat (unsigned unless 2, signed) in TIFFs; anywhere else it is taken as 32-bit signed.
    """
    if image.mode in _UINT16_MODES or image.format in ("PNG", "PPM"):
        return 2**16 - 1
    if image.format == "TIFF":
        tags = image.tag_v2  # type: ignore[attr-defined]
        bits = _single_tag(tags.get(258, 1))
        signed = _single_tag(tags.get(339, 1)) == 2
        return 2 ** (bits - 1) - 1 if signed else 2**bits - 1
    return _INT32_MAX


def _gray_to_unit_rgb(image: Image.Image) -> torch.Tensor:
    """A single-channel integer or float image as a float32 (3, H, W) tensor in [0, 1], refusing other values."""
    values = np.asarray(image, dtype=np.float64)
    maximum = 1 if image.mode == "F" else _integer_maximum(image)
    low, high = float(values.min()), float(values.max())
    if not (np.isfinite(values).all() and low >= 0 and high <= maximum):
        allowed = "[0, 1]" if image.mode == "F" else f"the declared range [0, {maximum}]"
        raise ImageDecodeError(f"mode {image.mode} values span [{low:g}, {high:g}], outside {allowed}; "
                               "the image is not rescaled or clipped")
    gray = torch.from_numpy((values / maximum).astype(np.float32))
    return gray.expand(3, *gray.shape).contiguous()


def decode_image(image: Image.Image) -> Image.Image | torch.Tensor:
    """Decode ``image`` by its mode into an RGB image whose values span [0, 1] before normalization.

    8-bit modes give a PIL RGB image, exactly what ``convert("RGB")`` gives for RGB, L, P,
    1, YCbCr, CMYK (PIL's naive conversion, no ICC profile) and RGBX. Transparent images
    (RGBA, LA, PA, a palette with transparency, a transparent colour) are alpha-composited
    onto white, as a viewer shows them, and rounded to 8 bits. Higher bit depths give a
    float32 (3, H, W) tensor in [0, 1], gray replicated to 3 channels: the I;16 modes are
    divided by 65535, mode "I" by its declared range (see :func:`_integer_maximum`), and
    mode "F" is used as it is. PIL opens 16-bit RGB(A) PNGs as 8-bit RGB(A) (the high byte
    of each sample), which are decoded as 8-bit images.

    Raises:
        ImageDecodeError: a mode not listed here, integer values outside the declared
            range, float values outside [0, 1] or not finite, or a high-bit-depth image
            with a transparent colour.
    """
    mode = image.mode
    if mode in _ALPHA_MODES or (mode in _KEYED_MODES and _has_transparency(image)):
        return _composite_on_white(image)
    if mode in _CONVERTED_8BIT_MODES:
        return image.convert("RGB")
    if mode in _UINT16_MODES or mode in ("I", "F"):
        if "transparency" in image.info:
            raise ImageDecodeError(f"mode {mode} with a transparent colour is not supported")
        return _gray_to_unit_rgb(image)
    raise ImageDecodeError(f"mode {mode} is not supported (supported: {', '.join(SUPPORTED_MODES)})")


def transform_image(image: Image.Image, transform: Callable[[Image.Image], torch.Tensor]) -> torch.Tensor:
    """Decode ``image`` (:func:`decode_image`) and apply the model's input ``transform`` to it.

    An 8-bit image goes through ``transform`` as a PIL RGB image. A float image keeps its
    precision: ``transform`` must then be a torchvision ``Compose`` of tensor-safe
    evaluation steps (resize, centre crop, border trim, to tensor, normalize, as timm's
    ``create_transform`` builds them), which are run on the float tensor, clamping to
    [0, 1] after each resize as the 8-bit pipeline clips to 0..255.

    Raises:
        ImageDecodeError: the image cannot be decoded, or it is a float image and
            ``transform`` has a step that does not take float tensors in [0, 1].
    """
    decoded = decode_image(image)
    if isinstance(decoded, Image.Image):
        return transform(decoded)
    from timm.data.transforms import MaybeToTensor, ResizeKeepRatio, TrimBorder
    from torchvision import transforms

    resizing = (transforms.Resize, ResizeKeepRatio)
    # CenterCropOrPad (timm's "border" crop mode) pads with 0..255 values, so it is not among them.
    tensor_safe = (*resizing, transforms.CenterCrop, TrimBorder, MaybeToTensor, transforms.Normalize)
    steps = transform.transforms if isinstance(transform, transforms.Compose) else [transform]
    for step in steps:
        if not isinstance(step, tensor_safe):
            raise ImageDecodeError(f"mode {image.mode} is decoded as a float image, which the transform step "
                                   f"{step!r} does not take (it needs 8-bit PIL images)")
    for step in steps:
        decoded = step(decoded)
        if isinstance(step, resizing):
            decoded = decoded.clamp_(0.0, 1.0)
    return decoded


class ImageFiles(Dataset):
    """Loads image ``i`` of an :class:`ImageList`, decodes it by mode and applies ``transform``.

    ``transform`` maps a PIL RGB image to the model's input tensor; for images with more
    than 8 bits per sample it must be one that :func:`transform_image` can run on a float
    tensor (timm's evaluation transform is). Returns ``(index, image or None, error
    message or None)``: a file that cannot be decoded or transformed is returned as a
    failure instead of raising; the message names the image mode where the mode is why.
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
                tensor = transform_image(image, self.transform)
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
