"""Images decoded by PIL mode, each against a reference decoding written here with numpy.

8-bit references go through the same timm transform as a PIL RGB image and must match
exactly. High-bit-depth references are resized, cropped and normalized here with
``torch.nn.functional`` on float32 tensors and must match to 1e-6 (float32 arithmetic).
"""

import math
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from omenn_kernels.bulk.images import ImageFiles, ImageList, decode_image, list_images
from omenn_kernels.bulk.model_source import _SHIPPED_DATA_CONFIG, image_transform

TIMM_CONFIG = {"input_size": (3, 64, 64), "interpolation": "bicubic", "mean": IMAGENET_DEFAULT_MEAN,
               "std": IMAGENET_DEFAULT_STD, "crop_pct": 0.875, "crop_mode": "center"}
CONFIGS = {"shipped": _SHIPPED_DATA_CONFIG, "timm": TIMM_CONFIG}
HEIGHT, WIDTH = 90, 110
INT32_MAX = 2**31 - 1


@pytest.fixture(params=sorted(CONFIGS))
def config(request) -> dict:
    return CONFIGS[request.param]


def _load(path: Path, config: dict) -> tuple[torch.Tensor | None, str | None]:
    """The model input (or the failure message) the bulk dataset gives for the one image at ``path``."""
    dataset = ImageFiles(ImageList(path.parent, (path.name,), (-1,), ()), image_transform(config, normalize=True))
    index, tensor, error = dataset[0]
    assert index == 0 and (tensor is None) != (error is None)
    return tensor, error


def _reference_8bit(rgb: np.ndarray, config: dict) -> torch.Tensor:
    assert rgb.dtype == np.uint8 and rgb.shape[-1] == 3
    return image_transform(config, normalize=True)(Image.fromarray(rgb))


def _reference_float(rgb: np.ndarray, config: dict) -> torch.Tensor:
    """Resize the shortest edge to floor(size / crop_pct) (antialiased, clamped to [0, 1]), centre crop, normalize."""
    x = torch.from_numpy(np.ascontiguousarray(rgb.transpose(2, 0, 1), dtype=np.float32))[None]
    size = config["input_size"][1]
    short = math.floor(size / config["crop_pct"])
    height, width = x.shape[-2:]
    target = (short, int(short * width / height)) if height <= width else (int(short * height / width), short)
    if target != (height, width):
        x = F.interpolate(x, size=target, mode=config["interpolation"], align_corners=False, antialias=True)
        x = x.clamp(0, 1)
    top, left = round((target[0] - size) / 2), round((target[1] - size) / 2)
    x = x[0, :, top:top + size, left:left + size]
    mean, std = (torch.tensor(config[k], dtype=torch.float32).view(3, 1, 1) for k in ("mean", "std"))
    return (x - mean) / std


def _composite_on_white(rgb: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    a = alpha.astype(np.float64)[..., None] / 255
    return np.rint(rgb * a + 255 * (1 - a)).astype(np.uint8)


def _gray3(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, -1)


def _png_bytes(samples: np.ndarray, color_type: int) -> bytes:
    """A 16-bit PNG written by hand (PIL does not write 16-bit RGB): IHDR, one IDAT, IEND."""
    height, width = samples.shape[:2]
    rows = b"".join(b"\x00" + samples[y].astype(">u2").tobytes() for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def _gray_l(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    gray = rng.integers(0, 256, (HEIGHT, WIDTH), dtype=np.uint8)
    Image.fromarray(gray).save(folder / "l.png")
    return folder / "l.png", _gray3(gray)


def _palette(rng: np.random.Generator) -> tuple[Image.Image, np.ndarray, np.ndarray]:
    indices = rng.integers(0, 256, (HEIGHT, WIDTH), dtype=np.uint8)
    palette = rng.integers(0, 256, (256, 3), dtype=np.uint8)
    image = Image.frombytes("P", (WIDTH, HEIGHT), indices.tobytes())
    image.putpalette(palette.tobytes())
    return image, indices, palette


def _palette_p(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    image, indices, palette = _palette(rng)
    image.save(folder / "p.png")
    return folder / "p.png", palette[indices]


def _palette_transparent(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    image, indices, palette = _palette(rng)
    alpha = rng.integers(0, 256, 256, dtype=np.uint8)
    image.save(folder / "p_alpha.png", transparency=alpha.tobytes())
    return folder / "p_alpha.png", _composite_on_white(palette[indices], alpha[indices])


def _rgba(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    rgba = rng.integers(0, 256, (HEIGHT, WIDTH, 4), dtype=np.uint8)
    Image.fromarray(rgba).save(folder / "rgba.png")
    return folder / "rgba.png", _composite_on_white(rgba[..., :3], rgba[..., 3])


def _gray_alpha(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    la = rng.integers(0, 256, (HEIGHT, WIDTH, 2), dtype=np.uint8)
    Image.fromarray(la).save(folder / "la.png")
    return folder / "la.png", _composite_on_white(_gray3(la[..., 0]), la[..., 1])


def _cmyk(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    cmyk = rng.integers(0, 256, (HEIGHT, WIDTH, 4), dtype=np.uint8)
    Image.frombytes("CMYK", (WIDTH, HEIGHT), cmyk.tobytes()).save(folder / "cmyk.tif")
    ink = 255 - cmyk.astype(np.float64)
    return folder / "cmyk.tif", np.rint(ink[..., :3] * ink[..., 3:] / 255).astype(np.uint8)


def _bilevel(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    bits = rng.random((HEIGHT, WIDTH)) < 0.5
    Image.fromarray(bits).save(folder / "bits.png")
    return folder / "bits.png", _gray3(bits.astype(np.uint8) * 255)


def _rgb48_png(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    samples = rng.integers(0, 2**16, (HEIGHT, WIDTH, 3), dtype=np.uint16)
    (folder / "rgb48.png").write_bytes(_png_bytes(samples, color_type=2))
    # Pillow opens 16-bit RGB PNGs as 8-bit RGB: the high byte of each sample.
    return folder / "rgb48.png", (samples >> 8).astype(np.uint8)


EIGHT_BIT = {"L": _gray_l, "P": _palette_p, "P+transparency": _palette_transparent, "RGBA": _rgba,
             "LA": _gray_alpha, "CMYK": _cmyk, "1": _bilevel, "RGB 48-bit PNG": _rgb48_png}


@pytest.mark.parametrize("case", sorted(EIGHT_BIT))
def test_8bit_modes_match_the_numpy_decoding(case, config, tmp_path):
    path, reference = EIGHT_BIT[case](tmp_path, np.random.default_rng(sorted(EIGHT_BIT).index(case)))
    tensor, error = _load(path, config)
    assert error is None, error
    assert torch.equal(tensor, _reference_8bit(reference, config))


def test_ycbcr_matches_the_bt601_matrix(tmp_path):
    ycc = np.random.default_rng(20).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    Image.frombytes("YCbCr", (WIDTH, HEIGHT), ycc.tobytes()).save(tmp_path / "ycc.tif")
    y, cb, cr = (ycc[..., i].astype(np.float64) for i in range(3))
    rgb = np.stack([y + 1.402 * (cr - 128), y - 0.344136 * (cb - 128) - 0.714136 * (cr - 128),
                    y + 1.772 * (cb - 128)], -1)
    reference = np.clip(np.rint(rgb), 0, 255)
    with Image.open(tmp_path / "ycc.tif") as image:
        assert image.mode == "YCbCr"
        decoded = decode_image(image)
    # PIL converts in fixed point: one level of 255 off at most.
    assert np.abs(np.asarray(decoded, dtype=np.float64) - reference).max() <= 1


def test_8bit_rgb_gives_the_tensors_of_a_plain_rgb_conversion(parts_folder, config, tmp_path):
    rng = np.random.default_rng(21)
    for shape in [(HEIGHT, WIDTH, 3), (61, 47, 3), (96, 96, 3)]:
        Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8)).save(tmp_path / f"rgb_{shape[0]}.png")
    drawn = [parts_folder / p for p in list_images(parts_folder).paths[:3]]
    transform = image_transform(config, normalize=True)
    for path in drawn + sorted(tmp_path.glob("rgb_*.png")):
        with Image.open(path) as image:
            assert image.mode == "RGB"
            expected = transform(image.convert("RGB"))
        tensor, error = _load(path, config)
        assert error is None and torch.equal(tensor, expected), path


def _uint16_png(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    samples = rng.integers(0, 2**16, (HEIGHT, WIDTH), dtype=np.uint16)
    Image.fromarray(samples).save(folder / "i16.png")
    return folder / "i16.png", samples / 65535


def _uint16_big_endian_tiff(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    samples = rng.integers(0, 2**16, (HEIGHT, WIDTH), dtype=np.uint16)
    Image.frombytes("I;16B", (WIDTH, HEIGHT), samples.astype(">u2").tobytes()).save(folder / "i16b.tif")
    return folder / "i16b.tif", samples / 65535


def _int_16bit_pgm(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    samples = rng.integers(0, 2**16, (HEIGHT, WIDTH), dtype=np.uint16)
    (folder / "i.pgm").write_bytes(f"P5\n{WIDTH} {HEIGHT}\n65535\n".encode() + samples.astype(">u2").tobytes())
    return folder / "i.pgm", samples / 65535


def _int_32bit_tiff(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    samples = rng.integers(0, INT32_MAX, (HEIGHT, WIDTH), dtype=np.int32, endpoint=True)
    Image.fromarray(samples).save(folder / "i32.tif")
    return folder / "i32.tif", samples / INT32_MAX


def _float_tiff(folder: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray]:
    values = rng.random((HEIGHT, WIDTH), dtype=np.float32)
    Image.fromarray(values).save(folder / "f.tif")
    return folder / "f.tif", values


HIGH_DEPTH = {"I;16 PNG": (_uint16_png, "I;16"), "I;16B TIFF": (_uint16_big_endian_tiff, "I;16B"),
              "I 16-bit PGM": (_int_16bit_pgm, "I"), "I 32-bit TIFF": (_int_32bit_tiff, "I"),
              "F TIFF": (_float_tiff, "F")}


@pytest.mark.parametrize("case", sorted(HIGH_DEPTH))
def test_high_bit_depth_modes_are_scaled_by_their_range(case, config, tmp_path):
    write, mode = HIGH_DEPTH[case]
    path, gray = write(tmp_path, np.random.default_rng(30 + sorted(HIGH_DEPTH).index(case)))
    with Image.open(path) as image:
        assert image.mode == mode
    tensor, error = _load(path, config)
    assert error is None, error
    # A 16-bit PNG converted with convert("RGB") comes out white (every sample clipped to 255).
    torch.testing.assert_close(tensor, _reference_float(_gray3(gray), config), rtol=0, atol=1e-6)


def test_16bit_image_of_8bit_values_matches_the_8bit_pipeline(config, tmp_path):
    # A smooth image away from 0 and 255: PIL's 8-bit resampling clips its intermediate (horizontal pass)
    # image to 0..255, which moves bicubic overshoots on noise by many levels.
    coarse = np.random.default_rng(40).integers(40, 216, (9, 11), dtype=np.uint8)
    gray = np.asarray(Image.fromarray(coarse).resize((WIDTH, HEIGHT), Image.Resampling.BILINEAR))
    Image.fromarray(gray).save(tmp_path / "l.png")
    Image.fromarray(gray.astype(np.uint16) * 257).save(tmp_path / "i16.png")
    eight, _ = _load(tmp_path / "l.png", config)
    sixteen, _ = _load(tmp_path / "i16.png", config)
    # PIL resizes 8-bit images in fixed point and rounds each pass to 8 bits; the float path does not
    # round: at most one level of 255 apart before normalization.
    tolerance = 1 / 255 / min(config["std"]) + 1e-6
    torch.testing.assert_close(sixteen, eight, rtol=0, atol=tolerance)


@pytest.mark.parametrize("values", ["out of range", "not finite"])
def test_float_image_outside_unit_range_is_refused(values, tmp_path):
    image = np.random.default_rng(50).uniform(-0.5, 1.5, (HEIGHT, WIDTH)).astype(np.float32)
    if values == "not finite":
        image = image.clip(0, 1)
        image[3, 4] = np.nan
    Image.fromarray(image).save(tmp_path / "f.tif")
    tensor, error = _load(tmp_path / "f.tif", TIMM_CONFIG)
    assert tensor is None and error.startswith("ImageDecodeError: mode F values span ")
    assert "outside [0, 1]" in error
    if values == "out of range":
        assert f"[{float(image.min()):g}, {float(image.max()):g}]" in error


def test_negative_int_image_is_refused(tmp_path):
    samples = np.random.default_rng(51).integers(-1000, 65536, (HEIGHT, WIDTH), dtype=np.int32)
    Image.fromarray(samples).save(tmp_path / "i.tif")
    tensor, error = _load(tmp_path / "i.tif", TIMM_CONFIG)
    assert tensor is None
    assert error == (f"ImageDecodeError: mode I values span [{samples.min()}, {samples.max()}], outside the "
                     f"declared range [0, {INT32_MAX}]; the image is not rescaled or clipped")


def test_unsupported_mode_is_refused_by_name(tmp_path):
    lab = np.random.default_rng(52).integers(0, 256, (HEIGHT, WIDTH, 3), dtype=np.uint8)
    Image.frombytes("LAB", (WIDTH, HEIGHT), lab.tobytes()).save(tmp_path / "lab.tif")
    tensor, error = _load(tmp_path / "lab.tif", TIMM_CONFIG)
    assert tensor is None and error.startswith("ImageDecodeError: mode LAB is not supported")


def test_float_image_needs_a_transform_of_tensor_steps(tmp_path):
    path, _ = _uint16_png(tmp_path, np.random.default_rng(53))
    images = ImageList(tmp_path, (path.name,), (-1,), ())
    _, tensor, error = ImageFiles(images, lambda image: torch.from_numpy(np.array(image)))[0]
    assert tensor is None and error.startswith("ImageDecodeError: mode I;16 is decoded as a float image")
    border = image_transform({**TIMM_CONFIG, "crop_mode": "border"}, normalize=True)
    _, tensor, error = ImageFiles(images, border)[0]
    assert tensor is None and "CenterCropOrPad" in error
