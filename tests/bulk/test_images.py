"""Image sources: flat folders, class trees, unreadable files."""

import re

import numpy as np
import pytest
import torch
from PIL import Image

from omenn_kernels.bulk.images import ImageFiles, collate_images, list_images
from omenn_kernels.errors import ImageSourceError


def _png(path, value=0):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((5, 7, 3), value, np.uint8)).save(path)


def test_flat_folder(tmp_path):
    _png(tmp_path / "b.png")
    _png(tmp_path / "a.JPG")
    (tmp_path / "c.txt").write_text("not an image")
    images = list_images(tmp_path)
    assert images.paths == ("a.JPG", "b.png") and images.labels == (-1, -1) and not images.has_labels


def test_class_tree_named_and_numbered(tmp_path):
    for path in ["cat/1.png", "cat/deep/2.png", "ant/3.png", ".hidden/4.png"]:
        _png(tmp_path / "named" / path)
    (tmp_path / "named" / "empty").mkdir()
    (tmp_path / "named" / "empty" / "readme.txt").write_text("no images here")
    named = list_images(tmp_path / "named")
    assert named.classes == ("ant", "cat")
    assert named.paths == ("ant/3.png", "cat/1.png", "cat/deep/2.png") and named.labels == (0, 1, 1)
    for path in ["7/a.png", "12/b.png"]:
        _png(tmp_path / "numbered" / path)
    numbered = list_images(tmp_path / "numbered")
    assert numbered.paths == ("12/b.png", "7/a.png") and numbered.labels == (12, 7)


def test_bad_sources(tmp_path):
    with pytest.raises(ImageSourceError, match=f"not found: {re.escape(str(tmp_path / 'missing'))}"):
        list_images(tmp_path / "missing")
    with pytest.raises(ImageSourceError, match=f"no images found in {re.escape(str(tmp_path))}"):
        list_images(tmp_path)
    _png(tmp_path / "loose.png")
    _png(tmp_path / "class" / "x.png")
    with pytest.raises(ImageSourceError, match=f"{re.escape(str(tmp_path))} holds both images and class folders"):
        list_images(tmp_path)


def test_unreadable_file_is_returned_as_failure(tmp_path):
    _png(tmp_path / "a.png", 255)
    (tmp_path / "b.png").write_bytes(b"\x89PNG broken")
    dataset = ImageFiles(list_images(tmp_path), lambda image: torch.from_numpy(np.array(image)).float())
    batch = collate_images([dataset[0], dataset[1]])
    assert batch["indices"] == [0, 1] and batch["readable"] == [0]
    assert batch["images"].shape == (1, 5, 7, 3) and bool((batch["images"] == 255).all())
    assert set(batch["errors"]) == {1} and "UnidentifiedImageError" in batch["errors"][1]
    assert collate_images([dataset[1]])["images"] is None
