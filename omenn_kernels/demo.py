"""The offline demo behind ``omenn demo``: the shipped model on drawn images.

Draws test images of the synthetic parts data set (no download), writes them as an
ImageFolder-style tree of PNGs, explains them with ``omenn explain``'s pipeline for
the folder label and the three largest logits (four targets per image, one forward
pass), draws the overlays as ``omenn show`` does, and checks and reports
completeness: per image and target, the contributions must sum to the explained logit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
from PIL import Image

from .bulk.overlays import completeness, write_overlays
from .bulk.run import RunConfig, explain_folder
from .bulk.store import AttributionStore
from .errors import StoreError
from .evaluation.parts_dataset import PartsDataset

log = logging.getLogger("omenn_kernels.demo")

DEMO_TARGETS = "label,top3"
# float32 store: |ΣC − ŷ| ≤ TOLERANCE·max(1, |ŷ|) for every image and target.
TOLERANCE = 1e-4


def draw_images(folder: Path, count: int) -> None:
    """Write ``count`` test images of the parts data set as ``folder/<class>/<index>.png``."""
    dataset = PartsDataset("test", count)
    for i in range(count):
        sample = dataset[i]
        pixels = (sample["image"].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        target = folder / f"{sample['label']:02d}"
        target.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(target / f"{i:04d}.png")


def run_demo(out: Path, *, model: str = "parts_vit", images: int = 8, backend: str = "reference",
             progress: bool = True) -> int:
    """Run the demo into ``out``; returns 0 if every explanation is complete, else 1."""
    out = Path(out)
    folder, store_path = out / "images", out / "attributions.zarr"
    if (out / "images").exists() or store_path.exists():
        raise StoreError(f"{out} holds an earlier demo; remove it or pass another --out")
    draw_images(folder, images)
    log.info("drew %d test images of the parts data set into %s", images, folder)
    explain_folder(RunConfig(source=folder, out=store_path, model=model, targets=DEMO_TARGETS,
                             batch_size=min(images, 8), backend=backend, store_dtype="float32",
                             components=("contribution", "weighted_input", "bias"), workers=0,
                             progress=progress))
    store = AttributionStore.open(store_path)
    overlays = write_overlays(store, out / "overlays", limit=images)
    report = completeness(store)
    (out / "completeness.json").write_text(json.dumps(report, indent=2))

    print(f"\n{model}: targets {DEMO_TARGETS!r} (folder label, then the three largest logits)")
    print(f"{'image':<16} {'target':>6} {'logit':>9} {'sum C':>9} {'abs. error':>10}")
    for row in report:
        print(f"{row['path']:<16} {row['target']:>6} {row['explained']:>9.4f} "
              f"{row['sum_of_contributions']:>9.4f} {row['absolute_error']:>10.1e}")
    worst = max(row["absolute_error"] / max(1.0, abs(row["explained"])) for row in report)
    print(f"\nstore {store_path}; overlays {', '.join(str(p) for p in overlays)}; report {out / 'completeness.json'}")
    if not np.isfinite(worst) or worst > TOLERANCE:
        print(f"completeness check FAILED: worst error {worst:.1e} > {TOLERANCE:.0e}")
        return 1
    print(f"completeness check passed: worst error {worst:.1e} ≤ {TOLERANCE:.0e} (relative to max(1, |logit|))")
    return 0
