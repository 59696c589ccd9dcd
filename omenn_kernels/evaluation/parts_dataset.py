"""FunnyBirds-style synthetic parts data set, drawn on the fly with numpy.

The FunnyBirds benchmark (Hesse et al., ICCV 2023) renders 3-D birds in a browser, which
is far too slow here, so this module draws a 2-D stand-in that keeps what its metrics need:

* a bird made of a body (ellipse and head) and five part slots (:data:`SLOTS`), each with
  several variants that differ in shape *and* colour;
* 50 classes, each a unique combination of one variant per slot, chosen by a seeded search
  so that no single part identifies a class and every class has a target-sensitivity pair;
* 1-4 background distractor objects per image whose presence and look do not depend on
  the class;
* exact integer part masks: shapes are tested at pixel centres without anti-aliasing and
  composed back to front, so ``part_map`` holds exactly the visible pixels of each element;
* interventions (removing parts or background objects) re-drawn from the same per-image
  parameters, so everything that is not removed stays bit-identical.

All per-image randomness comes from ``numpy.random.default_rng((seed, split_id, index))``.
Shapes are defined in a canonical bird frame whose units are pixels at
:data:`RESOLUTION` and scale 1; a per-image similarity transform (flip, rotation, scale,
translation) maps pixel centres back into that frame, where the shapes are tested.
Parts of different slots are disjoint in the canonical frame, hence never overlap in an
image, and every part lies on top of the body, so its visible area is its whole area.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "BACKGROUND_LABEL_BASE",
    "CLASS_SEARCH_SEED",
    "NUM_CLASSES",
    "PATCH",
    "RESOLUTION",
    "SLOTS",
    "PartsDataset",
    "collate_parts",
]

SLOTS: tuple[str, ...] = ("beak", "eye", "wing", "tail", "foot")
RESOLUTION: int = 96
PATCH: int = 8
BACKGROUND_LABEL_BASE: int = 100
NUM_CLASSES: int = 50
# The class table is part of the data set's definition, not of an image stream: train and
# test sets built with different seeds must share it, so its search has its own fixed seed.
CLASS_SEARCH_SEED: int = 2025

_SPLIT_IDS = {"train": 0, "test": 1}
_DEFAULT_LENGTHS = {"train": 20000, "test": 1000}
_MIN_RESOLUTION = 32

# Pose jitter of the bird. The scale range keeps the smallest part above PATCH * PATCH
# visible pixels at RESOLUTION; the rotation range keeps the whole bird inside the image.
_SCALE_RANGE = (0.92, 1.06)
_MAX_ROTATION_DEG = 12.0
_BORDER_PX = 1.0
# Colour jitter and pixel noise. Element colours are kept inside _COLOUR_RANGE and the
# noise amplitude is below its distance to 0 and 1, so no pixel is ever clipped: removing
# an element changes every one of its pixels, which keeps masks and interventions exact.
_PART_COLOUR_JITTER = 0.06
_BODY_COLOUR_JITTER = 0.05
_COLOUR_RANGE = (0.08, 0.92)
_NOISE_AMPLITUDE = 0.06
_MAX_BACKGROUND_OBJECTS = 4
_BACKGROUND_OBJECT_RADIUS = (4.5, 10.0)
_DROP_PROBABILITY = 0.5


# --------------------------------------------------------------------------------------
# Shapes: point-membership tests on arrays of canonical coordinates.
# --------------------------------------------------------------------------------------


class _Ellipse:
    """Filled ellipse with centre ``(cx, cy)``, semi-axes ``rx, ry``, rotated by ``angle_deg``."""

    def __init__(self, cx: float, cy: float, rx: float, ry: float, angle_deg: float = 0.0) -> None:
        if rx <= 0 or ry <= 0:
            raise ValueError(f"ellipse semi-axes must be positive, got {rx}, {ry}")
        self.cx, self.cy = float(cx), float(cy)
        self.inv_rx2, self.inv_ry2 = 1.0 / (rx * rx), 1.0 / (ry * ry)
        theta = math.radians(angle_deg)
        self.cos, self.sin = math.cos(theta), math.sin(theta)
        self.rotated = angle_deg % 180.0 != 0.0
        half_w = math.hypot(rx * self.cos, ry * self.sin)
        half_h = math.hypot(rx * self.sin, ry * self.cos)
        self.bounds = (self.cx - half_w, self.cy - half_h, self.cx + half_w, self.cy + half_h)
        self.area = math.pi * rx * ry

    def contains(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Boolean mask of the points ``(u, v)`` inside the ellipse (boundary included)."""
        du = u - self.cx
        dv = v - self.cy
        if self.rotated:
            du, dv = du * self.cos + dv * self.sin, dv * self.cos - du * self.sin
        return du * du * self.inv_rx2 + dv * dv * self.inv_ry2 <= 1.0


class _ConvexPolygon:
    """Filled convex polygon given by its vertices in either winding order."""

    def __init__(self, vertices: Sequence[tuple[float, float]]) -> None:
        pts = np.asarray(vertices, dtype=np.float64)
        if pts.ndim != 2 or pts.shape[0] < 3 or pts.shape[1] != 2:
            raise ValueError(f"a polygon needs at least 3 (x, y) vertices, got shape {pts.shape}")
        nxt = np.roll(pts, -1, axis=0)
        signed_area = 0.5 * float(np.sum(pts[:, 0] * nxt[:, 1] - nxt[:, 0] * pts[:, 1]))
        if signed_area == 0.0:
            raise ValueError("degenerate polygon with zero area")
        if signed_area < 0:
            pts = pts[::-1]
            nxt = np.roll(pts, -1, axis=0)
        edges = nxt - pts
        turns = edges[:, 0] * np.roll(edges[:, 1], -1) - edges[:, 1] * np.roll(edges[:, 0], -1)
        if np.any(turns <= 0):
            raise ValueError("polygon is not strictly convex")
        # Point p is inside iff it lies left of every edge: a*u + b*v + c >= 0.
        self.half_planes = tuple(
            (float(-ey), float(ex), float(ey * x0 - ex * y0))
            for (x0, y0), (ex, ey) in zip(pts, edges, strict=True)
        )
        self.bounds = (float(pts[:, 0].min()), float(pts[:, 1].min()),
                       float(pts[:, 0].max()), float(pts[:, 1].max()))
        self.area = abs(signed_area)

    def contains(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Boolean mask of the points ``(u, v)`` inside the polygon (boundary included)."""
        (a, b, c), *rest = self.half_planes
        mask = a * u + b * v + c >= 0.0
        for a, b, c in rest:
            mask &= a * u + b * v + c >= 0.0
        return mask


_Primitive = _Ellipse | _ConvexPolygon


class _Shape:
    """Union of components; each component is a primitive minus optional primitives."""

    def __init__(self, *components: _Primitive | tuple[_Primitive, tuple[_Primitive, ...]]) -> None:
        if not components:
            raise ValueError("a shape needs at least one component")
        self.components = tuple(
            c if isinstance(c, tuple) else (c, ()) for c in components
        )
        boxes = np.array([positive.bounds for positive, _ in self.components])
        self.bounds = (float(boxes[:, 0].min()), float(boxes[:, 1].min()),
                       float(boxes[:, 2].max()), float(boxes[:, 3].max()))

    def contains(self, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Boolean mask of the points ``(u, v)`` inside the shape."""
        mask = None
        for positive, negatives in self.components:
            part = positive.contains(u, v)
            for negative in negatives:
                part &= ~negative.contains(u, v)
            mask = part if mask is None else mask | part
        return mask


def _rect(x0: float, y0: float, x1: float, y1: float) -> _ConvexPolygon:
    return _ConvexPolygon([(x0, y0), (x1, y0), (x1, y1), (x0, y1)])


# --------------------------------------------------------------------------------------
# The bird: body, head and the part variants, in canonical coordinates (x right, y down,
# bird facing right). Slot regions are kept apart by >= 2.5 units so parts never touch.
# --------------------------------------------------------------------------------------

_RED = (0.86, 0.16, 0.14)
_ORANGE = (0.95, 0.55, 0.10)
_YELLOW = (0.92, 0.85, 0.16)
_GREEN = (0.20, 0.68, 0.24)
_BLUE = (0.16, 0.34, 0.86)
_PURPLE = (0.56, 0.22, 0.76)
_PINK = (0.95, 0.48, 0.72)
_CYAN = (0.16, 0.80, 0.86)
_DARK = (0.12, 0.12, 0.16)
_WHITE = (0.92, 0.92, 0.90)
_PUPIL = (0.08, 0.08, 0.10)

_BODY_SHAPES = (_Shape(_Ellipse(-4.0, 4.0, 19.0, 13.0)), _Shape(_Ellipse(15.0, -10.0, 11.0, 11.0)))
# Body colours: a mix of a tan and a grey, away from the saturated part colours.
_BODY_TAN = (0.66, 0.54, 0.40)
_BODY_GREY = (0.56, 0.56, 0.58)


@dataclass(frozen=True)
class _PartVariant:
    """One variant of a slot: layers of (shape, base colour), drawn in order."""

    name: str
    layers: tuple[tuple[_Shape, tuple[float, float, float]], ...]


def _variant(name: str, colour: tuple[float, float, float], shape: _Shape,
             *details: tuple[_Shape, tuple[float, float, float]]) -> _PartVariant:
    return _PartVariant(name, ((shape, colour), *details))


def _eye(name: str, colour: tuple[float, float, float], shape: _Primitive,
         pupil_xy: tuple[float, float] = (13.0, -12.0)) -> _PartVariant:
    pupil = _Shape(_Ellipse(pupil_xy[0], pupil_xy[1], 2.2, 2.2))
    return _variant(name, colour, _Shape(shape), (pupil, _PUPIL))


def _foot_pair(make_one: Callable[[float], tuple[_Primitive, ...]]) -> _Shape:
    """Both feet, from the primitives of one foot centred at x = c."""
    return _Shape(*make_one(-9.0), *make_one(2.0))


_VARIANTS: dict[str, tuple[_PartVariant, ...]] = {
    # Beak region: x in [23, 38], y in [-20, -2], in front of the head.
    "beak": (
        _variant("cone", _ORANGE, _Shape(_ConvexPolygon([(23, -18), (23, -4), (38, -11)]))),
        _variant("hook", _YELLOW, _Shape(
            _ConvexPolygon([(23, -18), (33, -18), (33, -7), (23, -5)]),
            _ConvexPolygon([(33, -18), (36, -16.5), (38, -13), (35, -9), (33, -11)]))),
        _variant("bill", _RED, _Shape(_rect(23, -15.5, 34, -6.5), _Ellipse(34, -11, 3.5, 4.5))),
        _variant("wedge", _DARK, _Shape(
            _ConvexPolygon([(23, -18), (23, -4), (37, -9), (37, -13)]))),
        _variant("open", _PINK, _Shape(
            _ConvexPolygon([(23, -20), (23, -12), (38, -18)]),
            _ConvexPolygon([(23, -10), (23, -2), (36, -4)]))),
    ),
    # Eye region: within radius 7.5 of (13, -12), on the head; each eye has a dark pupil.
    "eye": (
        _eye("round", _WHITE, _Ellipse(13, -12, 7.0, 7.0)),
        _eye("square", _YELLOW, _rect(7.5, -17.5, 18.5, -6.5)),
        _eye("diamond", _RED, _ConvexPolygon([(13, -19.5), (20.5, -12), (13, -4.5), (5.5, -12)])),
        _eye("almond", _CYAN, _Ellipse(13, -12, 7.5, 4.6)),
        _eye("triangle", _GREEN, _ConvexPolygon([(13, -20), (20.5, -6), (5.5, -6)]), (13.0, -10.5)),
    ),
    # Wing region: x in [-17, 4], y in [-5, 11], on the body.
    "wing": (
        _variant("oval", _BLUE, _Shape(_Ellipse(-6.5, 3.0, 10.5, 6.0, -12.0))),
        _variant("pointed", _GREEN, _Shape(_ConvexPolygon([(3, -4), (3, 10), (-17, 7)]))),
        _variant("feathers", _PURPLE, _Shape(
            _Ellipse(-7.0, -1.5, 10.0, 2.3), _Ellipse(-6.0, 3.5, 10.0, 2.3),
            _Ellipse(-5.0, 8.5, 9.0, 2.3))),
        _variant("block", _ORANGE, _Shape(_rect(-14, -3, 1, 9))),
        _variant("crescent", _DARK, _Shape(
            (_Ellipse(-6.0, 3.0, 9.0, 8.0), (_Ellipse(-1.0, -1.0, 8.0, 7.0),)))),
    ),
    # Tail region: x in [-38, -20], y in [-14, 12], behind the body.
    "tail": (
        _variant("fan", _RED, _Shape(_ConvexPolygon([(-20, 1), (-38, -12), (-38, 9)]))),
        _variant("streamer", _BLUE, _Shape(
            _ConvexPolygon([(-20, -3), (-20, 4), (-38, -4), (-38, -11)]))),
        _variant("fork", _YELLOW, _Shape(
            _ConvexPolygon([(-20, -1), (-38, -14), (-33, 0)]),
            _ConvexPolygon([(-20, 2), (-33, 1.5), (-38, 9)]))),
        _variant("round", _PINK, _Shape(_Ellipse(-29.5, -2.0, 8.5, 7.5))),
        _variant("spikes", _DARK, _Shape(
            _ConvexPolygon([(-20, -5), (-20, -1), (-37, -13)]),
            _ConvexPolygon([(-20, 0.5), (-20, 4.5), (-38, 1.5)]),
            _ConvexPolygon([(-20, 6), (-20, 10), (-37, 12)]))),
    ),
    # Foot region: two feet at x = -9 and x = 2, y in [14, 28], below the body.
    "foot": (
        _variant("sticks", _ORANGE, _foot_pair(lambda c: (
            _rect(c - 1.6, 14, c + 1.6, 24), _rect(c - 4.5, 23, c + 4.5, 26.5)))),
        _variant("webbed", _RED, _foot_pair(lambda c: (
            _rect(c - 1.3, 14, c + 1.3, 21), _ConvexPolygon([(c, 19), (c + 6, 27), (c - 6, 27)])))),
        _variant("boots", _DARK, _foot_pair(lambda c: (
            _rect(c - 2.5, 14, c + 2.5, 23), _Ellipse(c + 1.5, 24.0, 4.5, 2.6)))),
        _variant("balls", _BLUE, _foot_pair(lambda c: (
            _rect(c - 1.2, 14, c + 1.2, 21), _Ellipse(c, 24.2, 3.8, 3.8)))),
    ),
}

def _union_bounds(shapes: Iterable[_Shape]) -> tuple[float, float, float, float]:
    boxes = np.array([shape.bounds for shape in shapes])
    return (float(boxes[:, 0].min()), float(boxes[:, 1].min()),
            float(boxes[:, 2].max()), float(boxes[:, 3].max()))


# Box around every shape any bird can have; the pose keeps it inside the image.
_BIRD_BOUNDS = _union_bounds(
    (*_BODY_SHAPES, *(shape for vs in _VARIANTS.values() for v in vs for shape, _ in v.layers)))
_BIRD_CENTRE = ((_BIRD_BOUNDS[0] + _BIRD_BOUNDS[2]) / 2, (_BIRD_BOUNDS[1] + _BIRD_BOUNDS[3]) / 2)

# Background distractors, in a unit frame (radius about 1) scaled and rotated per object.
_BACKGROUND_SHAPES: tuple[_Shape, ...] = (
    _Shape(_Ellipse(0, 0, 1.0, 1.0)),
    _Shape(_rect(-0.85, -0.85, 0.85, 0.85)),
    _Shape(_ConvexPolygon([(0, -1), (0.95, 0.7), (-0.95, 0.7)])),
    _Shape(_ConvexPolygon([(0, -1), (0.75, 0), (0, 1), (-0.75, 0)])),
    _Shape((_Ellipse(0, 0, 1.0, 1.0), (_Ellipse(0, 0, 0.55, 0.55),))),
    _Shape(_rect(-1, -0.3, 1, 0.3), _rect(-0.3, -1, 0.3, 1)),
    _Shape(_Ellipse(0, 0, 1.0, 0.45)),
)
# Distractors take a part colour half of the time, so colour alone never marks a part.
_PART_PALETTE = tuple(sorted({layer[1] for v in _VARIANTS.values() for p in v for layer in p.layers
                              if layer[1] != _PUPIL}))

_DROP_SUBSETS: tuple[frozenset[str], ...] = tuple(
    frozenset(c) for k in range(1, len(SLOTS)) for c in itertools.combinations(SLOTS, k)
)


# --------------------------------------------------------------------------------------
# Classes
# --------------------------------------------------------------------------------------


def _shared(a: tuple[int, ...], b: tuple[int, ...]) -> frozenset[int]:
    return frozenset(i for i in range(len(SLOTS)) if a[i] == b[i])


def _minimal_sufficient_sets(table: tuple[tuple[int, ...], ...],
                             label: int) -> list[frozenset[int]]:
    """Minimal slot-index sets on which no other class agrees with ``label``."""
    own = table[label]
    others = [c for j, c in enumerate(table) if j != label]

    def sufficient(subset: tuple[int, ...]) -> bool:
        return not any(all(c[i] == own[i] for i in subset) for c in others)

    found: list[frozenset[int]] = []
    # Sufficiency is monotone (a superset of a sufficient set is sufficient), so in order of
    # size a sufficient set is minimal iff it contains no smaller one found before.
    for size in range(1, len(SLOTS) + 1):
        for subset in itertools.combinations(range(len(SLOTS)), size):
            if sufficient(subset) and not any(f <= set(subset) for f in found):
                found.append(frozenset(subset))
    return found


def _ts_pairs(table: tuple[tuple[int, ...], ...], label: int) -> list[tuple[int, int]]:
    """Class pairs sharing exactly two slots each with ``label``, on disjoint slot sets."""
    near = [j for j, c in enumerate(table) if j != label and len(_shared(table[label], c)) == 2]
    return [(b, c) for b, c in itertools.combinations(near, 2)
            if not _shared(table[label], table[b]) & _shared(table[label], table[c])]


def _class_table_is_valid(table: tuple[tuple[int, ...], ...]) -> bool:
    return all(
        all(len(s) > 1 for s in _minimal_sufficient_sets(table, label)) and _ts_pairs(table, label)
        for label in range(len(table))
    )


@lru_cache(maxsize=1)
def _class_table() -> tuple[tuple[int, ...], ...]:
    """The 50 classes: a seeded random search over unique variant combinations.

    Candidate tables of distinct combinations are drawn until one satisfies, for every
    class, (a) no single slot variant is unique to it and (b) a target-sensitivity pair
    exists. The search is deterministic, so the table is the same in every process.
    """
    counts = [len(_VARIANTS[s]) for s in SLOTS]
    combos = list(itertools.product(*(range(n) for n in counts)))
    rng = np.random.default_rng(CLASS_SEARCH_SEED)
    for _ in range(1000):
        picked = rng.choice(len(combos), size=NUM_CLASSES, replace=False)
        table = tuple(sorted(combos[i] for i in picked))
        if _class_table_is_valid(table):
            return table
    raise RuntimeError("no valid class table found; the part variants allow too few combinations")


# --------------------------------------------------------------------------------------
# Per-image parameters and drawing
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BackgroundObject:
    shape: _Shape
    colour: np.ndarray
    inverse: tuple[float, float, float, float, float, float]   # pixel -> unit frame
    box: tuple[int, int, int, int]                              # y0, y1, x0, x1 (clipped)


@dataclass(frozen=True)
class _ImageParams:
    label: int
    parts: tuple[str, ...]                                      # parts drawn before removal
    inverse: tuple[float, float, float, float, float, float]   # pixel -> canonical bird frame
    forward: tuple[float, float, float, float, float, float]   # canonical bird frame -> pixel
    body_colour: np.ndarray
    part_colours: dict[str, tuple[np.ndarray, ...]]
    background: np.ndarray                                      # (3, H, W) float32
    objects: tuple[_BackgroundObject, ...]
    noise: np.ndarray                                           # (3, H, W) float32


def _clip_colour(colour: np.ndarray) -> np.ndarray:
    return np.clip(colour, *_COLOUR_RANGE).astype(np.float32)


def _pixel_box(bounds: tuple[float, float, float, float],
               forward: tuple[float, float, float, float, float, float],
               resolution: int) -> tuple[int, int, int, int]:
    """Clipped pixel rows/cols (y0, y1, x0, x1) covering a canonical box after ``forward``."""
    a, b, c, d, e, f = forward
    xs, ys = [], []
    for u in (bounds[0], bounds[2]):
        for v in (bounds[1], bounds[3]):
            xs.append(a * u + b * v + c)
            ys.append(d * u + e * v + f)
    x0 = max(int(math.floor(min(xs))) - 1, 0)
    x1 = min(int(math.ceil(max(xs))) + 1, resolution)
    y0 = max(int(math.floor(min(ys))) - 1, 0)
    y1 = min(int(math.ceil(max(ys))) + 1, resolution)
    return y0, y1, x0, x1


class PartsDataset(Dataset):
    """FunnyBirds-style synthetic parts data set, drawn on the fly, deterministic by seed.

    Args:
        split: ``"train"`` or ``"test"``; the two splits are different image streams.
        length: number of images; defaults to 20000 for train and 1000 for test.
        resolution: image side in pixels (at least 32); the geometry scales with it.
        seed: non-negative seed of the image stream (the classes do not depend on it).
        drop_parts: whether half of the images drop a random non-empty, non-full subset of
            parts (the label is unchanged); defaults to True for train, False for test.

    Labels are balanced: image ``index`` shows class ``index % num_classes``.
    """

    def __init__(self, split: str, length: int | None = None, *, resolution: int = RESOLUTION,
                 seed: int = 0, drop_parts: bool | None = None) -> None:
        if split not in _SPLIT_IDS:
            raise ValueError(f"split must be one of {sorted(_SPLIT_IDS)}, got {split!r}")
        if length is None:
            length = _DEFAULT_LENGTHS[split]
        if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
            raise ValueError(f"length must be a positive int, got {length!r}")
        if (not isinstance(resolution, int) or isinstance(resolution, bool)
                or resolution < _MIN_RESOLUTION):
            raise ValueError(f"resolution must be an int >= {_MIN_RESOLUTION}, got {resolution!r}")
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if drop_parts is None:
            drop_parts = split == "train"
        if not isinstance(drop_parts, bool):
            raise ValueError(f"drop_parts must be a bool or None, got {drop_parts!r}")
        self.split = split
        self.length = length
        self.resolution = resolution
        self.seed = seed
        self.drop_parts = drop_parts
        self._table = _class_table()
        self.num_classes: int = len(self._table)
        self.classes: tuple[dict[str, int], ...] = tuple(
            dict(zip(SLOTS, combo, strict=True)) for combo in self._table
        )
        self.variants: dict[str, int] = {slot: len(_VARIANTS[slot]) for slot in SLOTS}
        self._unit = resolution / RESOLUTION
        centres = (np.arange(resolution, dtype=np.float64) + 0.5)
        self._xs = centres[None, :]
        self._ys = centres[:, None]

    # ---------------------------------------------------------------- Dataset protocol

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict:
        return self.render(index)

    # ---------------------------------------------------------------- rendering

    def render(self, index: int, *, remove_parts: Iterable[str] = (),
               remove_background: Iterable[int] = ()) -> dict:
        """Draw image ``index``, optionally without some parts and background objects.

        Everything not removed (pose, colours, noise, other objects) is identical to
        ``self[index]``; pixels a removed element covered show what lies beneath it.

        Args:
            index: image index in ``[0, len(self))``.
            remove_parts: slot names to leave out (parts already dropped are ignored).
            remove_background: indices ``0..n-1`` of background objects to leave out.

        Returns:
            ``{"image": float32 (3, H, W) in [0, 1], "label": int, "part_map": int64 (H, W),
            "present_parts": tuple[str, ...], "background_objects": int, "index": int}``;
            ``part_map`` is 0 on the body and plain background, ``i`` on the visible pixels
            of ``SLOTS[i - 1]`` and ``BACKGROUND_LABEL_BASE + k`` on background object k.

        Raises:
            IndexError: ``index`` out of range.
            ValueError: unknown slot name or out-of-range background object index.
            TypeError: a non-integer index or a bare string for ``remove_parts``.
        """
        index = self._check_index(index)
        removed_parts = self._check_parts(remove_parts)
        params = self._sample(index)
        removed_objects = self._check_objects(remove_background, len(params.objects))
        image, part_map, present = self._draw(params, removed_parts, removed_objects)
        return {
            "image": torch.from_numpy(image),
            "label": params.label,
            "part_map": torch.from_numpy(part_map),
            "present_parts": present,
            "background_objects": len(params.objects),
            "index": index,
        }

    def _check_index(self, index: int) -> int:
        try:
            index = operator.index(index)
        except TypeError:
            raise TypeError(f"index must be an int, got {type(index).__name__}") from None
        if not 0 <= index < self.length:
            raise IndexError(f"index {index} out of range for a data set of length {self.length}")
        return index

    @staticmethod
    def _check_parts(remove_parts: Iterable[str]) -> frozenset[str]:
        if isinstance(remove_parts, str):
            raise TypeError("remove_parts must be a collection of slot names, "
                            f"got the string {remove_parts!r}")
        names = frozenset(remove_parts)
        unknown = sorted(map(repr, names - set(SLOTS)))
        if unknown:
            raise ValueError(f"unknown slot name(s) {', '.join(unknown)}; slots are {SLOTS}")
        return names

    @staticmethod
    def _check_objects(remove_background: Iterable[int], count: int) -> frozenset[int]:
        indices = set()
        for k in remove_background:
            if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
                raise ValueError(f"background object indices must be ints, got {k!r}")
            if not 0 <= k < count:
                raise ValueError(f"background object index {k} out of range: "
                                 f"this image has {count} objects")
            indices.add(int(k))
        return frozenset(indices)

    def _sample(self, index: int) -> _ImageParams:
        """All random parameters of image ``index``, drawn in a fixed order."""
        res, unit = self.resolution, self._unit
        rng = np.random.default_rng((self.seed, _SPLIT_IDS[self.split], index))
        label = index % self.num_classes

        drop_draw, drop_choice = rng.random(), int(rng.integers(len(_DROP_SUBSETS)))
        drops = self.drop_parts and drop_draw < _DROP_PROBABILITY
        dropped = _DROP_SUBSETS[drop_choice] if drops else frozenset()
        parts = tuple(s for s in SLOTS if s not in dropped)

        # Bird pose: pixel = s * R * F * (canonical - centre) + t.
        flip = -1.0 if rng.random() < 0.5 else 1.0
        scale = rng.uniform(*_SCALE_RANGE) * unit
        theta = math.radians(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG))
        cos, sin = math.cos(theta), math.sin(theta)
        a, b, d, e = scale * cos * flip, -scale * sin, scale * sin * flip, scale * cos
        cu, cv = _BIRD_CENTRE
        corners = [(u - cu, v - cv) for u in (_BIRD_BOUNDS[0], _BIRD_BOUNDS[2])
                   for v in (_BIRD_BOUNDS[1], _BIRD_BOUNDS[3])]
        xs = [a * u + b * v for u, v in corners]
        ys = [d * u + e * v for u, v in corners]
        frac_x, frac_y = rng.random(), rng.random()
        border = _BORDER_PX * unit
        lo_x, hi_x = border - min(xs), res - border - max(xs)
        lo_y, hi_y = border - min(ys), res - border - max(ys)
        tx = lo_x + frac_x * (hi_x - lo_x) if hi_x >= lo_x else res / 2
        ty = lo_y + frac_y * (hi_y - lo_y) if hi_y >= lo_y else res / 2
        forward = (a, b, tx - a * cu - b * cv, d, e, ty - d * cu - e * cv)
        # Inverse of the similarity: canonical = M^-1 (pixel - t) + centre, det = flip * s^2.
        det = a * e - b * d
        ia, ib, id_, ie = e / det, -b / det, -d / det, a / det
        inverse = (ia, ib, cu - ia * tx - ib * ty, id_, ie, cv - id_ * tx - ie * ty)

        mix = rng.random()
        body_colour = _clip_colour(
            mix * np.asarray(_BODY_TAN) + (1 - mix) * np.asarray(_BODY_GREY)
            + rng.uniform(-_BODY_COLOUR_JITTER, _BODY_COLOUR_JITTER, 3))
        jitter = rng.uniform(-_PART_COLOUR_JITTER, _PART_COLOUR_JITTER, (len(SLOTS), 3))
        table_row = self._table[label]
        part_colours = {
            slot: tuple(_clip_colour(np.asarray(colour) + jitter[i])
                        for _, colour in _VARIANTS[slot][table_row[i]].layers)
            for i, slot in enumerate(SLOTS)
        }

        ends = rng.uniform(0.2, 0.9, (2, 3))
        direction = rng.uniform(0.0, 2 * math.pi)
        ramp = ((self._xs - res / 2) * math.cos(direction)
                + (self._ys - res / 2) * math.sin(direction))
        ramp = ramp / (res * math.sqrt(0.5)) + 0.5          # in [0, 1] over the image
        background = (ends[0][:, None, None]
                      + (ends[1] - ends[0])[:, None, None] * ramp[None]).astype(np.float32)

        count = int(rng.integers(1, _MAX_BACKGROUND_OBJECTS + 1))
        objects = []
        for _ in range(count):
            kind = int(rng.integers(len(_BACKGROUND_SHAPES)))
            use_palette = rng.random() < 0.5
            palette_colour = np.asarray(_PART_PALETTE[int(rng.integers(len(_PART_PALETTE)))])
            colour = (palette_colour + rng.uniform(-_PART_COLOUR_JITTER, _PART_COLOUR_JITTER, 3)
                      if use_palette else rng.uniform(*_COLOUR_RANGE, 3))
            ox, oy = rng.uniform(0, res, 2)
            radius = rng.uniform(*_BACKGROUND_OBJECT_RADIUS) * unit
            phi = rng.uniform(0.0, 2 * math.pi)
            oc, os_ = math.cos(phi) * radius, math.sin(phi) * radius
            obj_forward = (oc, -os_, ox, os_, oc, oy)
            r2 = radius * radius
            obj_inverse = (oc / r2, os_ / r2, -(oc * ox + os_ * oy) / r2,
                           -os_ / r2, oc / r2, (os_ * ox - oc * oy) / r2)
            shape = _BACKGROUND_SHAPES[kind]
            objects.append(_BackgroundObject(shape, _clip_colour(colour), obj_inverse,
                                             _pixel_box(shape.bounds, obj_forward, res)))

        noise = rng.random((3, res, res), dtype=np.float32)
        noise = noise * np.float32(2 * _NOISE_AMPLITUDE) - np.float32(_NOISE_AMPLITUDE)
        return _ImageParams(label, parts, inverse, forward, body_colour, part_colours,
                            background, tuple(objects), noise)

    def _paint(self, image: np.ndarray, part_map: np.ndarray, shape: _Shape,
               inverse: tuple[float, ...], box: tuple[int, int, int, int],
               colour: np.ndarray, label: int) -> None:
        """Paint ``shape`` (tested at pixel centres through ``inverse``) over ``box``."""
        y0, y1, x0, x1 = box
        if y0 >= y1 or x0 >= x1:
            return
        xs, ys = self._xs[:, x0:x1], self._ys[y0:y1]
        a, b, c, d, e, f = inverse
        u = a * xs + (b * ys + c)
        v = d * xs + (e * ys + f)
        mask = shape.contains(u, v)
        image[:, y0:y1, x0:x1][:, mask] = colour[:, None]
        part_map[y0:y1, x0:x1][mask] = label

    def _draw(self, params: _ImageParams, removed_parts: frozenset[str],
              removed_objects: frozenset[int]) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
        res = self.resolution
        image = params.background.copy()
        part_map = np.zeros((res, res), dtype=np.int64)
        for k, obj in enumerate(params.objects):
            if k not in removed_objects:
                self._paint(image, part_map, obj.shape, obj.inverse, obj.box, obj.colour,
                            BACKGROUND_LABEL_BASE + k)
        for shape in _BODY_SHAPES:
            self._paint(image, part_map, shape, params.inverse,
                        _pixel_box(shape.bounds, params.forward, res), params.body_colour, 0)
        present = tuple(s for s in params.parts if s not in removed_parts)
        table_row = self._table[params.label]
        for slot in present:
            i = SLOTS.index(slot)
            layers = _VARIANTS[slot][table_row[i]].layers
            for (shape, _), colour in zip(layers, params.part_colours[slot], strict=True):
                self._paint(image, part_map, shape, params.inverse,
                            _pixel_box(shape.bounds, params.forward, res), colour, i + 1)
        image += params.noise
        np.clip(image, 0.0, 1.0, out=image)
        return image, part_map, present

    # ---------------------------------------------------------------- class structure

    def _check_label(self, label: int, name: str = "label") -> int:
        if isinstance(label, bool) or not isinstance(label, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(label).__name__}")
        if not 0 <= label < self.num_classes:
            raise ValueError(f"{name} {label} out of range [0, {self.num_classes})")
        return int(label)

    def minimal_sufficient_part_sets(self, label: int) -> list[frozenset[str]]:
        """Minimal slot sets S such that no other class has ``label``'s variants on all of S.

        These are FunnyBirds' CSDC ground truth; here every such set has more than one slot.
        """
        label = self._check_label(label)
        sets = _minimal_sufficient_sets(self._table, label)
        return [frozenset(SLOTS[i] for i in s) for s in sets]

    def classes_at_distance(self, label: int, distance: int) -> list[int]:
        """Classes (ascending) that differ from ``label`` in exactly ``distance`` slots."""
        label = self._check_label(label)
        if (isinstance(distance, bool) or not isinstance(distance, int)
                or not 0 <= distance <= len(SLOTS)):
            raise ValueError(f"distance must be an int in [0, {len(SLOTS)}], got {distance!r}")
        own = self._table[label]
        return [j for j, c in enumerate(self._table)
                if len(SLOTS) - len(_shared(own, c)) == distance]

    def target_sensitivity_pair(self, label: int) -> tuple[int, int]:
        """Two classes (b < c), each sharing exactly 2 slots with ``label``, on disjoint slots.

        The pair is the first in lexicographic order, so the choice is deterministic.
        """
        label = self._check_label(label)
        return _ts_pairs(self._table, label)[0]

    def shared_slots(self, label_a: int, label_b: int) -> tuple[str, ...]:
        """Slots (in :data:`SLOTS` order) on which the two classes have the same variant."""
        label_a = self._check_label(label_a, "label_a")
        label_b = self._check_label(label_b, "label_b")
        shared = _shared(self._table[label_a], self._table[label_b])
        return tuple(SLOTS[i] for i in sorted(shared))


def collate_parts(batch: Sequence[dict]) -> dict:
    """Collate samples of :class:`PartsDataset` for a ``DataLoader``.

    The default collate function fails on ``present_parts`` (tuples of different lengths
    once parts are dropped), so this one stacks the tensors and keeps the part names as a
    list: ``image`` (B, 3, H, W), ``part_map`` (B, H, W), ``label``, ``background_objects``
    and ``index`` as int64 tensors of shape (B,), ``present_parts`` a list of tuples.
    """
    if not batch:
        raise ValueError("cannot collate an empty batch")
    return {
        "image": torch.stack([sample["image"] for sample in batch]),
        "label": torch.tensor([sample["label"] for sample in batch], dtype=torch.int64),
        "part_map": torch.stack([sample["part_map"] for sample in batch]),
        "present_parts": [sample["present_parts"] for sample in batch],
        "background_objects": torch.tensor([sample["background_objects"] for sample in batch],
                                           dtype=torch.int64),
        "index": torch.tensor([sample["index"] for sample in batch], dtype=torch.int64),
    }
