"""What to explain per image: a target specification and its resolution to read-outs.

A specification is a comma-separated list of items, each one or more targets:

- ``predicted``: the class with the largest logit;
- ``label``: the class of the image's folder (ImageFolder-style trees only);
- ``7``: class 7;
- ``top5``: the five largest logits, largest first (five targets);
- ``a-b``: the contrast ``logit_a − logit_b``, where ``a`` and ``b`` are each a class
  index, ``predicted`` or ``label`` (e.g. ``3-5``, ``label-predicted``).

Every target is stored as a pair ``(positive, negative)`` of class indices, the
negative ``-1`` when there is none, and explained as the read-out
``e_positive − e_negative`` of the logits, so that the contributions of an image sum
to ``logit_positive − logit_negative``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Union

import torch

from ..errors import TargetError

NO_CLASS = -1
_CLASS_REF = r"(predicted|label|\d+)"
_TOP = re.compile(r"top(\d+)")
_CONTRAST = re.compile(rf"{_CLASS_REF}-{_CLASS_REF}")

ClassRef = Union[int, str]


@dataclass(frozen=True)
class TargetSpec:
    """A parsed target specification: ``items`` of (kind, arguments), in order.

    Kinds: ``("class", ref)`` with ``ref`` an int, ``"predicted"`` or ``"label"``;
    ``("top", k)``; ``("contrast", ref_a, ref_b)``.
    """

    text: str
    items: tuple[tuple, ...]

    @property
    def count(self) -> int:
        """T: how many targets each image gets."""
        return sum(item[1] if item[0] == "top" else 1 for item in self.items)

    @property
    def needs_labels(self) -> bool:
        """Whether some item reads the folder label."""
        return any("label" in item[1:] for item in self.items)

    def check(self, classes: int, *, has_labels: bool) -> None:
        """Raise :class:`TargetError` if the specification cannot be resolved for a model
        with ``classes`` outputs, on images with (or without) folder labels."""
        for item in self.items:
            for ref in item[1:]:
                if item[0] != "top" and isinstance(ref, int) and not 0 <= ref < classes:
                    raise TargetError(f"target class {ref} in {self.text!r} is out of range: the model "
                                      f"has {classes} classes (valid: 0..{classes - 1})")
            if item[0] == "top" and item[1] > classes:
                raise TargetError(f"top{item[1]} in {self.text!r} asks for more classes than the "
                                  f"model's {classes}")
        if self.needs_labels and not has_labels:
            raise TargetError(f"{self.text!r} uses 'label', but the images carry no labels: give an "
                              "ImageFolder-style tree (one sub-folder per class)")

    def resolve(self, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The (B, T, 2) class pairs ``(positive, negative)`` for a batch.

        Args:
            logits: (B, K) logits of the batch.
            labels: (B,) folder labels, or None.

        Raises:
            TargetError: the specification reads labels that are missing or out of range.
        """
        if self.needs_labels:
            self.check_labels(labels, logits.shape[1])
        return self.pairs(logits, labels)

    def check_labels(self, labels: torch.Tensor | None, classes: int) -> None:
        """Raise :class:`TargetError` unless every image has a folder label below ``classes``."""
        if labels is None or bool((labels < 0).any()):
            raise TargetError("the target 'label' needs a folder label for every image")
        if bool((labels >= classes).any()):
            raise TargetError(f"a folder label is out of range for a model with {classes} classes")

    def pairs(self, logits: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """:meth:`resolve` for labels that passed :meth:`check_labels`: tensor operations only,
        no value read back, so that the compiled backend can trace it."""
        none = torch.full((logits.shape[0],), NO_CLASS, dtype=torch.long, device=logits.device)

        def lookup(ref: ClassRef) -> torch.Tensor:
            if ref == "predicted":
                return logits.argmax(-1)
            if ref == "label":
                return labels.to(device=logits.device, dtype=torch.long)
            return torch.full_like(none, ref)

        columns: list[torch.Tensor] = []
        for item in self.items:
            if item[0] == "class":
                columns.append(torch.stack([lookup(item[1]), none], -1))
            elif item[0] == "top":
                for column in logits.topk(item[1], -1).indices.unbind(-1):
                    columns.append(torch.stack([column, none], -1))
            else:
                columns.append(torch.stack([lookup(item[1]), lookup(item[2])], -1))
        return torch.stack(columns, 1)


def _class_ref(token: str) -> ClassRef:
    return int(token) if token.isdigit() else token


def parse_targets(text: str) -> TargetSpec:
    """Parse a target specification such as ``"predicted,label,top3,3-5"``.

    Raises:
        TargetError: an empty specification or an item that is none of the forms above.
    """
    if not isinstance(text, str) or not text.strip():
        raise TargetError("the target specification is empty; e.g. 'predicted', 'label', '7', "
                          "'top5', '3-5'")
    items: list[tuple] = []
    for raw in text.split(","):
        token = raw.strip().lower()
        top = _TOP.fullmatch(token)
        contrast = _CONTRAST.fullmatch(token)
        if token in ("predicted", "label") or token.isdigit():
            items.append(("class", _class_ref(token)))
        elif top:
            if int(top.group(1)) < 1:
                raise TargetError(f"'{raw.strip()}': top-k needs k ≥ 1")
            items.append(("top", int(top.group(1))))
        elif contrast:
            a, b = (_class_ref(g) for g in contrast.groups())
            if a == b:
                raise TargetError(f"'{raw.strip()}' contrasts a class with itself")
            items.append(("contrast", a, b))
        else:
            raise TargetError(f"unknown target {raw.strip()!r} in {text!r}; use 'predicted', "
                              "'label', a class index, 'topK' or a contrast 'a-b'")
    return TargetSpec(text, tuple(items))


def readout_weights(pairs: torch.Tensor, classes: int, dtype: torch.dtype) -> torch.Tensor:
    """(B, T, K) read-out weights ``e_positive − e_negative`` of (B, T, 2) class pairs."""
    weights = torch.zeros(*pairs.shape[:2], classes, dtype=dtype, device=pairs.device)
    weights.scatter_(2, pairs[..., :1], 1.0)
    negative = pairs[..., 1:]
    weights.scatter_add_(2, negative.clamp_min(0), -(negative >= 0).to(dtype))
    return weights
