"""Tests of omenn_kernels.visualize: post-processing and drawing of contribution maps."""

from __future__ import annotations

import re

import matplotlib.image
import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from omenn_kernels.visualize import overlay, overlay_grid, postprocess

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def _signed_map(gen: torch.Generator, *shape: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Random map with both signs, like a real contribution map."""
    return torch.randn(*shape, generator=gen, dtype=dtype)


def _reference(x: torch.Tensor, *, positive_only: bool, q: float | None, k: int | None) -> torch.Tensor:
    """Slow, independent version of postprocess for one (H, W) map."""
    x = x.clone()
    if positive_only:
        x[x < 0] = 0
    if q is not None:
        if positive_only:
            pos = x[x > 0]
            if pos.numel():
                x = torch.minimum(x, torch.quantile(pos, q))
        else:
            t = torch.quantile(x.abs().flatten(), q)
            x = x.clamp(-t, t)
    if k is not None:
        h, w = x.shape
        r = k // 2
        out = torch.empty_like(x)
        for i in range(h):
            for j in range(w):
                # Mean over the in-image part of the window (count-normalized).
                out[i, j] = x[max(i - r, 0) : i + r + 1, max(j - r, 0) : j + r + 1].mean()
        x = out
    return x


# --- postprocess --------------------------------------------------------------


def test_negatives_removed(gen: torch.Generator) -> None:
    x = _signed_map(gen, 2, 9, 11)
    out = postprocess(x, clip_quantile=None, smooth=None)
    assert (x < 0).any()
    assert (out >= 0).all()
    torch.testing.assert_close(out, x.clamp(min=0))


def test_negatives_removed_before_smoothing(gen: torch.Generator) -> None:
    x = _signed_map(gen, 9, 11)
    assert (postprocess(x, clip_quantile=None, smooth=3) >= 0).all()


@pytest.mark.parametrize("q", [0.5, 0.9, 0.99])
def test_clipping_positive_only_at_quantile_of_positive_values(gen: torch.Generator, q: float) -> None:
    x = _signed_map(gen, 3, 16, 16)
    out = postprocess(x, clip_quantile=q, smooth=None)
    for i in range(x.shape[0]):
        t = torch.quantile(x[i][x[i] > 0], q)
        torch.testing.assert_close(out[i], torch.minimum(x[i].clamp(min=0), t))
        torch.testing.assert_close(out[i].max(), t)


def test_clipping_signed_is_symmetric_at_quantile_of_abs(gen: torch.Generator) -> None:
    x = _signed_map(gen, 2, 16, 16)
    out = postprocess(x, positive_only=False, clip_quantile=0.8, smooth=None)
    for i in range(x.shape[0]):
        t = torch.quantile(x[i].abs().flatten(), 0.8)
        torch.testing.assert_close(out[i], x[i].clamp(-t, t))
        assert out[i].max() == pytest.approx(float(t))
        assert out[i].min() == pytest.approx(-float(t))


def test_quantile_one_changes_nothing(gen: torch.Generator) -> None:
    x = _signed_map(gen, 7, 8)
    torch.testing.assert_close(postprocess(x, clip_quantile=1.0, smooth=None), x.clamp(min=0))
    torch.testing.assert_close(postprocess(x, positive_only=False, clip_quantile=1.0, smooth=None), x)


@pytest.mark.parametrize("k", [3, 5])
def test_smoothing_interior_pixel_is_window_mean(gen: torch.Generator, k: int) -> None:
    x = _signed_map(gen, 10, 12)
    out = postprocess(x, positive_only=False, clip_quantile=None, smooth=k)
    r = k // 2
    for i, j in [(r, r), (5, 6), (10 - r - 1, 12 - r - 1)]:
        expected = x[i - r : i + r + 1, j - r : j + r + 1].mean()
        torch.testing.assert_close(out[i, j], expected)


def test_smoothing_border_is_count_normalized(gen: torch.Generator) -> None:
    x = _signed_map(gen, 6, 7)
    out = postprocess(x, positive_only=False, clip_quantile=None, smooth=3)
    torch.testing.assert_close(out[0, 0], x[:2, :2].mean())  # corner: 2x2 in-image pixels
    torch.testing.assert_close(out[0, 3], x[:2, 2:5].mean())  # edge: 2x3 in-image pixels


@pytest.mark.parametrize("k", [3, 5, 15])
def test_constant_map_stays_constant(gen: torch.Generator, k: int) -> None:
    c = float(torch.rand((), generator=gen)) + 0.5
    x = torch.full((6, 9), c, dtype=torch.float64)
    out = postprocess(x, smooth=k)  # default clipping too: the quantile of a constant is itself
    torch.testing.assert_close(out, x)


@pytest.mark.parametrize("positive_only", [True, False])
def test_full_pipeline_matches_reference(gen: torch.Generator, positive_only: bool) -> None:
    x = _signed_map(gen, 2, 8, 9)
    out = postprocess(x, positive_only=positive_only, clip_quantile=0.9, smooth=3)
    for i in range(x.shape[0]):
        torch.testing.assert_close(out[i], _reference(x[i], positive_only=positive_only, q=0.9, k=3))


def test_input_not_modified_and_not_aliased(gen: torch.Generator) -> None:
    x = _signed_map(gen, 2, 8, 8)
    before = x.clone()
    postprocess(x)
    postprocess(x, positive_only=False)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    # Every step disabled: still a new tensor, so writing to it leaves x alone.
    out = postprocess(x, positive_only=False, clip_quantile=None, smooth=None)
    assert out.data_ptr() != x.data_ptr()
    out.zero_()
    torch.testing.assert_close(x, before, rtol=0, atol=0)


def test_batch_and_single_agree(gen: torch.Generator) -> None:
    x = _signed_map(gen, 4, 10, 13)
    # Make images differ in scale, so a batch-wide quantile would be caught.
    x = x * torch.tensor([0.1, 1.0, 10.0, 100.0], dtype=x.dtype).view(4, 1, 1)
    batch = postprocess(x)
    assert batch.shape == x.shape
    for i in range(x.shape[0]):
        single = postprocess(x[i])
        assert single.shape == x[i].shape
        torch.testing.assert_close(batch[i], single)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_dtype_and_shape_preserved(gen: torch.Generator, dtype: torch.dtype) -> None:
    x = _signed_map(gen, 2, 8, 8).to(dtype)
    out = postprocess(x)
    assert out.dtype == dtype
    assert out.shape == x.shape
    expected = postprocess(x.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_preserved_and_matches_cpu(gen: torch.Generator) -> None:
    x = _signed_map(gen, 3, 12, 12, dtype=torch.float32)
    out = postprocess(x.cuda())
    assert out.device.type == "cuda"
    torch.testing.assert_close(out.cpu(), postprocess(x))


def test_result_is_detached(gen: torch.Generator) -> None:
    x = _signed_map(gen, 5, 5).requires_grad_()
    assert not postprocess(x).requires_grad


@pytest.mark.parametrize("positive_only", [True, False])
def test_all_zero_map_gives_zeros(positive_only: bool) -> None:
    out = postprocess(torch.zeros(2, 5, 6), positive_only=positive_only)
    assert not out.isnan().any()
    torch.testing.assert_close(out, torch.zeros(2, 5, 6), rtol=0, atol=0)


def test_all_negative_image_gives_zeros_without_affecting_others(gen: torch.Generator) -> None:
    x = _signed_map(gen, 2, 6, 6)
    x[0] = -x[0].abs() - 0.1
    out = postprocess(x)
    assert not out.isnan().any()
    torch.testing.assert_close(out[0], torch.zeros(6, 6, dtype=x.dtype), rtol=0, atol=0)
    torch.testing.assert_close(out[1], postprocess(x[1]))


def test_single_positive_pixel_is_kept(gen: torch.Generator) -> None:
    x = -torch.rand(5, 5, generator=gen, dtype=torch.float64)
    x[2, 3] = 4.0
    out = postprocess(x, smooth=None)
    expected = torch.zeros_like(x)
    expected[2, 3] = 4.0
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize("shape", [(5,), (1, 2, 5, 5), ()])
def test_wrong_ndim_rejected(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"ndim 2 \(H, W\) or 3 \(B, H, W\)"):
        postprocess(torch.rand(shape))


@pytest.mark.parametrize("q", [0.0, -0.1, 1.01, 2.0])
def test_bad_quantile_rejected(q: float) -> None:
    with pytest.raises(ValueError, match=r"clip_quantile must be in \(0, 1\]"):
        postprocess(torch.rand(4, 4), clip_quantile=q)


@pytest.mark.parametrize("k", [0, -3, 2, 4])
def test_bad_smooth_rejected(k: int) -> None:
    with pytest.raises(ValueError, match="smooth must be a positive odd window size"):
        postprocess(torch.rand(4, 4), smooth=k)


def test_non_float_and_non_finite_rejected() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        postprocess(torch.ones(4, 4, dtype=torch.int64))
    x = torch.rand(4, 4)
    x[1, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite"):
        postprocess(x)


# --- overlay ------------------------------------------------------------------


def _read_png(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        assert f.read(8) == PNG_SIGNATURE
    pixels = matplotlib.image.imread(path)
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    return pixels.shape[0], pixels.shape[1]


def test_overlay_writes_png_and_returns_figure(gen: torch.Generator, tmp_path) -> None:
    image = torch.randn(3, 16, 48, generator=gen) * 50 + 3  # arbitrary range
    contribution = _signed_map(gen, 16, 48)
    path = tmp_path / "nested" / "dir" / "wide.png"
    fig = overlay(image, contribution, path=path, title="class 7")
    assert isinstance(fig, Figure)
    assert isinstance(fig.canvas, FigureCanvasAgg)
    height, width = _read_png(path)
    assert width > 1.5 * height  # a 16x48 image gives a wide figure

    ax, colorbar = fig.axes  # the image axes and the colorbar's
    assert ax.get_title() == "class 7"
    assert len(ax.get_xticks()) == 0 and len(ax.get_yticks()) == 0
    base, heat = ax.images
    assert base.get_array().shape == (16, 48, 3)
    assert 0.0 <= base.get_array().min() and base.get_array().max() <= 1.0
    # Raw map: diverging colormap, symmetric limits around 0.
    peak = float(contribution.abs().max())
    assert heat.get_cmap().name == "bwr"
    assert heat.get_clim() == pytest.approx((-peak, peak))
    assert heat.get_alpha() == 0.5


def test_overlay_tall_grayscale_postprocessed(gen: torch.Generator, tmp_path) -> None:
    image = torch.rand(1, 48, 16, generator=gen)
    contribution = postprocess(_signed_map(gen, 1, 48, 16))
    path = tmp_path / "tall.png"
    fig = overlay(image, contribution, path=str(path), postprocessed=True, alpha=0.7)
    height, width = _read_png(path)
    assert height > 1.5 * width  # a 48x16 image gives a tall figure, colorbar included
    base, heat = fig.axes[0].images
    assert base.get_array().shape == (48, 16)
    assert heat.get_cmap().name == "inferno"
    assert heat.get_clim() == pytest.approx((0.0, float(contribution.max())))
    assert heat.get_alpha() == 0.7


def test_overlay_without_path_and_custom_cmap(gen: torch.Generator) -> None:
    fig = overlay(torch.rand(8, 8, generator=gen), _signed_map(gen, 8, 8), cmap="coolwarm")
    assert isinstance(fig, Figure)
    assert fig.axes[0].images[1].get_cmap().name == "coolwarm"


def test_overlay_shape_mismatch_names_both_shapes(gen: torch.Generator) -> None:
    msg = re.escape("(3, 8, 8)") + ".*" + re.escape("(8, 9)")
    with pytest.raises(ValueError, match=msg):
        overlay(torch.rand(3, 8, 8, generator=gen), _signed_map(gen, 8, 9))


def test_overlay_bad_arguments(gen: torch.Generator) -> None:
    with pytest.raises(ValueError, match=r"image must be \(3, H, W\)"):
        overlay(torch.rand(2, 8, 8, generator=gen), _signed_map(gen, 8, 8))
    with pytest.raises(ValueError, match="non-negative map"):
        overlay(torch.rand(8, 8, generator=gen), _signed_map(gen, 8, 8), postprocessed=True)
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        overlay(torch.rand(8, 8, generator=gen), _signed_map(gen, 8, 8), alpha=1.5)


def test_overlay_grid(gen: torch.Generator, tmp_path) -> None:
    images = torch.rand(3, 3, 12, 12, generator=gen)
    contributions = postprocess(_signed_map(gen, 3, 12, 12))
    path = tmp_path / "grid" / "g.png"
    fig = overlay_grid(images, contributions, path=path, titles=["a", "b", "c"], postprocessed=True)
    assert isinstance(fig, Figure)
    height, width = _read_png(path)
    assert width > 2 * height  # one row of three panels
    panels = [ax for ax in fig.axes if len(ax.images) == 2]
    assert [ax.get_title() for ax in panels] == ["a", "b", "c"]
    assert len(fig.axes) == 6  # three panels, three colorbars

    two_rows = overlay_grid(images, contributions, ncols=2)
    assert len([ax for ax in two_rows.axes if len(ax.images) == 2]) == 3


def test_overlay_grid_bad_arguments(gen: torch.Generator) -> None:
    images = torch.rand(3, 1, 8, 8, generator=gen)
    with pytest.raises(ValueError, match="different batch sizes"):
        overlay_grid(images, _signed_map(gen, 2, 8, 8))
    with pytest.raises(ValueError, match="2 titles for 3 images"):
        overlay_grid(images, _signed_map(gen, 3, 8, 8), titles=["a", "b"])
    with pytest.raises(ValueError, match=re.escape("(1, 8, 8)") + ".*" + re.escape("(8, 7)")):
        overlay_grid(images, _signed_map(gen, 3, 8, 7))
