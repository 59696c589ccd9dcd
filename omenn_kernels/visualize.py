"""Display of OMENN contribution maps.

A contribution map ``C`` of shape ``(H, W)`` (or ``(B, H, W)``) gives, per pixel,
its share of the explained logit; values are signed and sum to the logit.  The
paper shows only positive contributions after quantile-based outlier removal and
mean-filter smoothing; :func:`postprocess` does exactly that, and
:func:`overlay` / :func:`overlay_grid` draw a map over its image.

Drawing uses :class:`matplotlib.figure.Figure` with an explicit
:class:`~matplotlib.backends.backend_agg.FigureCanvasAgg`, never ``pyplot``: the
user's global backend and pyplot's figure registry are left untouched, and a
figure is freed as soon as the caller drops it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.axes import Axes
from matplotlib.figure import Figure

__all__ = ["postprocess", "overlay", "overlay_grid"]

# Half-precision maps are processed in float32 and cast back: averaging and
# quantile interpolation in 16 bits would lose visible precision.
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def postprocess(
    contribution: torch.Tensor,
    *,
    positive_only: bool = True,
    clip_quantile: float | None = 0.99,
    smooth: int | None = 3,
) -> torch.Tensor:
    """Prepare a contribution map for display, as in the OMENN paper.

    Each image of the batch is processed on its own, in this order:

    1. If ``positive_only``, negative contributions are set to 0.
    2. If ``clip_quantile`` is given, outliers are clipped.  With
       ``positive_only`` the threshold is the ``clip_quantile`` quantile of the
       image's strictly positive values and values above it are lowered to it;
       otherwise it is the quantile of ``|C|`` over all pixels and ``C`` is
       clipped symmetrically to ``[-t, t]``.  Quantiles interpolate linearly,
       like :func:`torch.quantile`.
    3. If ``smooth`` is given, a ``smooth x smooth`` mean filter is applied.
       Near the borders the mean is taken over the part of the window that lies
       inside the image (count-normalized averaging, no padding values), so
       borders are neither darkened, as zero padding would do, nor biased
       towards the edge pixel, as replicate padding would do.  A constant map
       stays constant.

    Args:
        contribution: floating-point map of shape ``(H, W)`` or ``(B, H, W)``,
            on any device.  It is not modified.
        positive_only: keep only positive contributions.
        clip_quantile: quantile in ``(0, 1]`` at which to clip, or ``None`` to
            skip clipping.  ``1.0`` clips at the maximum, i.e. changes nothing.
        smooth: odd positive window size of the mean filter, or ``None`` to
            skip smoothing.  ``1`` changes nothing.

    Returns:
        A new tensor with the shape, dtype and device of ``contribution``,
        detached from any autograd graph (it is meant for display).  An image
        with no positive value (all zero or all negative) gives all zeros with
        ``positive_only``, never NaN.

    Raises:
        TypeError: ``contribution`` is not a floating-point tensor, or
            ``smooth`` is not an integer.
        ValueError: ``contribution`` has the wrong number of dimensions, an
            empty spatial size or non-finite values; ``clip_quantile`` is
            outside ``(0, 1]``; ``smooth`` is even or not positive.
    """
    if not isinstance(contribution, torch.Tensor):
        raise TypeError(f"contribution must be a torch.Tensor, got {type(contribution).__name__}")
    if not contribution.is_floating_point():
        raise TypeError(f"contribution must be a floating-point tensor, got dtype {contribution.dtype}")
    if contribution.ndim not in (2, 3):
        raise ValueError(
            "contribution must have ndim 2 (H, W) or 3 (B, H, W), "
            f"got ndim {contribution.ndim} with shape {tuple(contribution.shape)}"
        )
    if contribution.shape[-1] == 0 or contribution.shape[-2] == 0:
        raise ValueError(f"contribution has an empty spatial size: shape {tuple(contribution.shape)}")
    if clip_quantile is not None and not 0.0 < clip_quantile <= 1.0:
        raise ValueError(f"clip_quantile must be in (0, 1] or None, got {clip_quantile}")
    if smooth is not None:
        # bool is an int subclass; True would silently mean a 1x1 window.
        if isinstance(smooth, bool) or not isinstance(smooth, int):
            raise TypeError(f"smooth must be an int or None, got {type(smooth).__name__}")
        if smooth <= 0 or smooth % 2 == 0:
            raise ValueError(f"smooth must be a positive odd window size or None, got {smooth}")
    if not bool(torch.isfinite(contribution).all()):
        raise ValueError("contribution contains NaN or infinite values")

    work_dtype = torch.float32 if contribution.dtype in _LOW_PRECISION else contribution.dtype
    # copy=True: the result must never alias the caller's tensor, even when
    # every step is disabled.
    x = contribution.detach().to(dtype=work_dtype, copy=True)
    batched = x.ndim == 3
    if not batched:
        x = x.unsqueeze(0)
    if x.shape[0] == 0:
        return x.to(contribution.dtype)
    b, h, w = x.shape
    flat = x.reshape(b, h * w)

    if positive_only:
        flat = flat.clamp(min=0)
    if clip_quantile is not None:
        if positive_only:
            # Quantile of the positive values only: the many zeros left by the
            # previous step would otherwise pull the threshold down.
            t = _masked_row_quantile(flat, flat > 0, clip_quantile)
            flat = torch.minimum(flat, t.unsqueeze(1))
        else:
            t = _masked_row_quantile(flat.abs(), None, clip_quantile).unsqueeze(1)
            flat = torch.maximum(torch.minimum(flat, t), -t)

    x = flat.reshape(b, h, w)
    if smooth is not None and smooth > 1:
        # count_include_pad=False divides each window sum by the number of
        # in-image pixels: the count-normalized border handling documented above.
        x = F.avg_pool2d(
            x.unsqueeze(1), kernel_size=smooth, stride=1, padding=smooth // 2, count_include_pad=False
        ).squeeze(1)

    if not batched:
        x = x.squeeze(0)
    return x.to(contribution.dtype)


def _masked_row_quantile(values: torch.Tensor, keep: torch.Tensor | None, q: float) -> torch.Tensor:
    """Per-row ``q`` quantile of the kept entries, interpolated like torch.quantile.

    torch.quantile cannot take a different number of values per row and refuses
    inputs above 2**24 elements, hence this sort-based version.

    Args:
        values: ``(B, N)`` tensor.
        keep: ``(B, N)`` boolean mask of the entries to use, or ``None`` for all.
        q: quantile in ``(0, 1]``.

    Returns:
        ``(B,)`` tensor of quantiles; 0 for a row with no kept entry.
    """
    if keep is None:
        count = torch.full((values.shape[0],), values.shape[1], device=values.device)
        ordered = values.sort(dim=1).values
    else:
        count = keep.sum(dim=1)
        # Dropped entries sort to the end, past the `count` kept ones.
        ordered = values.masked_fill(~keep, math.inf).sort(dim=1).values
    # float64 ranks: float32 cannot index exactly past 2**24 pixels.
    rank = (count - 1).clamp(min=0).to(torch.float64) * q
    lower = ordered.gather(1, rank.floor().long().unsqueeze(1)).squeeze(1)
    upper = ordered.gather(1, rank.ceil().long().unsqueeze(1)).squeeze(1)
    quantile = torch.lerp(lower, upper, (rank - rank.floor()).to(values.dtype))
    # A row without kept entries reads +inf above (NaN after lerp); 0 is the
    # right threshold there since the row holds no positive value to clip.
    return torch.where(count > 0, quantile, torch.zeros_like(quantile))


def overlay(
    image: torch.Tensor,
    contribution: torch.Tensor,
    *,
    path: str | os.PathLike[str] | None = None,
    alpha: float = 0.5,
    cmap: str | None = None,
    title: str | None = None,
    postprocessed: bool = False,
) -> Figure:
    """Draw a contribution map over its image.

    The image is min-max normalized to ``[0, 1]`` over all its values (a constant
    image shows black) and drawn in grayscale or colour; the map is drawn on top
    with opacity ``alpha``, with a colorbar and no axis ticks.

    Args:
        image: ``(3, H, W)`` colour, ``(1, H, W)`` or ``(H, W)`` grayscale image,
            any float range, any device.
        contribution: map of shape ``(H, W)`` or ``(1, H, W)``.
        path: if given, the figure is written there as a PNG (whatever the
            suffix), creating missing parent folders.
        alpha: opacity of the heatmap, in ``[0, 1]``.
        cmap: matplotlib colormap name; defaults to ``"bwr"`` for a raw map and
            ``"inferno"`` for a postprocessed one.
        title: axes title.
        postprocessed: ``False`` for a raw signed map, drawn with a diverging
            colormap whose limits are symmetric around 0, so that white means
            "no contribution"; ``True`` for a non-negative map (the output of
            :func:`postprocess` with ``positive_only=True``), drawn with a
            sequential colormap from 0 to its maximum.

    Returns:
        The figure.  It is not registered with pyplot, so nothing global needs
        closing: it is freed when the caller drops it, whether or not ``path``
        was given; it can be saved again with ``fig.savefig``.

    Raises:
        TypeError: ``image`` or ``contribution`` is not a tensor.
        ValueError: a shape is not one of the accepted ones, the image and the
            map differ in size, ``alpha`` is outside ``[0, 1]``, the map is not
            finite, or ``postprocessed`` is true while the map has negatives.
    """
    img, values = _check_pair(image, contribution, postprocessed=postprocessed)
    _check_alpha(alpha)
    fig = _new_figure(1, 1, *values.shape, has_title=title is not None)
    _draw_panel(fig, fig.add_subplot(1, 1, 1), img, values,
                alpha=alpha, cmap=cmap, title=title, postprocessed=postprocessed)
    if path is not None:
        _save(fig, path)
    return fig


def overlay_grid(
    images: torch.Tensor,
    contributions: torch.Tensor,
    *,
    path: str | os.PathLike[str] | None = None,
    titles: list[str] | tuple[str, ...] | None = None,
    ncols: int | None = None,
    alpha: float = 0.5,
    cmap: str | None = None,
    postprocessed: bool = False,
) -> Figure:
    """Draw a batch of contribution maps over their images, one panel each.

    Each panel is drawn as by :func:`overlay`, with its own colorbar: maps of
    different images (or classes) have different scales.

    Args:
        images: ``(B, C, H, W)`` with ``C`` 1 or 3, or ``(B, H, W)`` grayscale.
        contributions: ``(B, H, W)`` maps.
        path: if given, the figure is written there as a PNG, creating missing
            parent folders.
        titles: one title per image, or ``None``.
        ncols: panels per row; defaults to ``min(B, 4)``.
        alpha: opacity of the heatmaps, in ``[0, 1]``.
        cmap: colormap name, as for :func:`overlay`.
        postprocessed: as for :func:`overlay`.

    Returns:
        The figure (not registered with pyplot, see :func:`overlay`).

    Raises:
        TypeError: ``images`` or ``contributions`` is not a tensor.
        ValueError: wrong shapes, batch sizes or number of titles, a
            non-positive ``ncols``, or any error of :func:`overlay`.
    """
    if not isinstance(images, torch.Tensor) or not isinstance(contributions, torch.Tensor):
        raise TypeError("images and contributions must be torch.Tensor")
    if images.ndim not in (3, 4):
        raise ValueError(f"images must be (B, C, H, W) or (B, H, W), got shape {tuple(images.shape)}")
    if contributions.ndim != 3:
        raise ValueError(f"contributions must be (B, H, W), got shape {tuple(contributions.shape)}")
    batch = images.shape[0]
    if contributions.shape[0] != batch:
        raise ValueError(
            f"images shape {tuple(images.shape)} and contributions shape "
            f"{tuple(contributions.shape)} have different batch sizes"
        )
    if batch == 0:
        raise ValueError("overlay_grid needs at least one image, got an empty batch")
    if titles is not None and len(titles) != batch:
        raise ValueError(f"got {len(titles)} titles for {batch} images")
    if ncols is None:
        ncols = min(batch, 4)
    elif ncols <= 0:
        raise ValueError(f"ncols must be positive, got {ncols}")
    _check_alpha(alpha)
    pairs = [_check_pair(images[i], contributions[i], postprocessed=postprocessed) for i in range(batch)]

    nrows = math.ceil(batch / ncols)
    ncols = min(ncols, batch)
    fig = _new_figure(nrows, ncols, *pairs[0][1].shape, has_title=titles is not None)
    for i, (img, values) in enumerate(pairs):
        _draw_panel(fig, fig.add_subplot(nrows, ncols, i + 1), img, values, alpha=alpha,
                    cmap=cmap, title=None if titles is None else titles[i], postprocessed=postprocessed)
    if path is not None:
        _save(fig, path)
    return fig


def _check_alpha(alpha: float) -> None:
    """Reject an opacity matplotlib would refuse only at draw time."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _check_pair(
    image: torch.Tensor, contribution: torch.Tensor, *, postprocessed: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Validate one image and its map and convert them for display.

    Everything is checked before a figure exists, so that an error leaves no
    half-drawn figure behind.

    Returns:
        The image as ``(H, W)`` or ``(H, W, 3)`` float32 in ``[0, 1]`` and the
        map as ``(H, W)`` float32, both NumPy arrays on the CPU.
    """
    if not isinstance(image, torch.Tensor) or not isinstance(contribution, torch.Tensor):
        raise TypeError(
            f"image and contribution must be torch.Tensor, got {type(image).__name__} "
            f"and {type(contribution).__name__}"
        )
    if image.ndim == 3 and image.shape[0] in (1, 3):
        img_hw = tuple(image.shape[1:])
    elif image.ndim == 2:
        img_hw = tuple(image.shape)
    else:
        raise ValueError(f"image must be (3, H, W), (1, H, W) or (H, W), got shape {tuple(image.shape)}")
    if contribution.ndim == 3 and contribution.shape[0] == 1:
        map_hw = tuple(contribution.shape[1:])
    elif contribution.ndim == 2:
        map_hw = tuple(contribution.shape)
    else:
        raise ValueError(f"contribution must be (H, W) or (1, H, W), got shape {tuple(contribution.shape)}")
    if img_hw != map_hw:
        raise ValueError(
            f"image shape {tuple(image.shape)} and contribution shape {tuple(contribution.shape)} "
            "differ in height and width"
        )
    if 0 in img_hw:
        raise ValueError(f"image has an empty spatial size: shape {tuple(image.shape)}")

    img = image.detach().to(device="cpu", dtype=torch.float32)
    low, high = img.min(), img.max()
    img = (img - low) / (high - low) if high > low else torch.zeros_like(img)
    if img.ndim == 3:
        # imshow wants channels last; a single channel is drawn as a grayscale (H, W).
        img = img.permute(1, 2, 0) if img.shape[0] == 3 else img[0]

    values = contribution.detach().to(device="cpu", dtype=torch.float32).reshape(map_hw)
    if not bool(torch.isfinite(values).all()):
        raise ValueError("contribution contains NaN or infinite values")
    if postprocessed and bool((values < 0).any()):
        raise ValueError(
            "postprocessed=True expects a non-negative map, but the contribution has negative "
            "values; pass postprocessed=False for a signed map"
        )
    return img.numpy(), values.numpy()


def _new_figure(nrows: int, ncols: int, height: int, width: int, *, has_title: bool) -> Figure:
    """Create an Agg-backed figure whose panels follow the image's aspect ratio."""
    # Longest image side 4 in, shortest at least 1 in so extreme aspect ratios
    # stay legible; 1 in more per panel for the colorbar, a little for titles.
    scale = 4.0 / max(height, width)
    panel_w = max(width * scale, 1.0) + 1.0
    panel_h = max(height * scale, 1.0) + (0.4 if has_title else 0.0)
    fig = Figure(figsize=(panel_w * ncols, panel_h * nrows), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself as fig.canvas
    return fig


def _draw_panel(
    fig: Figure,
    ax: Axes,
    image: np.ndarray,
    values: np.ndarray,
    *,
    alpha: float,
    cmap: str | None,
    title: str | None,
    postprocessed: bool,
) -> None:
    """Draw one image, its heatmap and the heatmap's colorbar on ``ax``."""
    if image.ndim == 2:
        ax.imshow(image, cmap="gray", vmin=0.0, vmax=1.0, interpolation="nearest")
    else:
        ax.imshow(image, interpolation="nearest")
    peak = float(np.abs(values).max())
    # A map of zeros still needs a non-degenerate colour range.
    limit = peak if peak > 0 else 1.0
    if postprocessed:
        heat = ax.imshow(values, cmap=cmap or "inferno", vmin=0.0, vmax=limit,
                         alpha=alpha, interpolation="nearest")
    else:
        heat = ax.imshow(values, cmap=cmap or "bwr", vmin=-limit, vmax=limit,
                         alpha=alpha, interpolation="nearest")
    fig.colorbar(heat, ax=ax)
    ax.set_xticks([])
    ax.set_yticks([])
    if title is not None:
        ax.set_title(title)


def _save(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` as a PNG at ``path``, creating its parent folders."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target, format="png")
