"""Offline end-to-end demo: train a small CNN on drawn shapes, explain it, write overlays.

    python -m omenn_kernels.demo --out omenn_demo

Draws a synthetic data set (a disc, a square or a cross at a random place on a noisy
background), trains a small residual-free CNN with BatchNorm, biases and max
pooling for a few seconds on the CPU, explains a few test images with OMENN and
writes, per image, an overlay PNG and a completeness report. Needs no download.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from . import Explainer
from .visualize import overlay_grid, postprocess

CLASSES = ("disc", "square", "cross")


def draw_shapes(count: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` images (count, 3, size, size) of a coloured shape on noise, and their labels."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(CLASSES), (count,), generator=generator)
    images = 0.3 * torch.rand(count, 3, size, size, generator=generator)
    rows, cols = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i, label in enumerate(labels.tolist()):
        radius = int(torch.randint(size // 8, size // 4, (1,), generator=generator))
        cy, cx = (int(v) for v in torch.randint(radius, size - radius, (2,), generator=generator))
        dy, dx = (rows - cy).abs(), (cols - cx).abs()
        if label == 0:
            mask = dy.pow(2) + dx.pow(2) <= radius ** 2
        elif label == 1:
            mask = (dy <= radius) & (dx <= radius)
        else:
            mask = ((dy <= radius) & (dx <= radius // 3)) | ((dx <= radius) & (dy <= radius // 3))
        colour = 0.5 + 0.5 * torch.rand(3, 1, generator=generator)
        images[i][:, mask] = colour.expand(3, int(mask.sum()))
    return images, labels


def small_cnn() -> nn.Module:
    """The demo's classifier: conv/BatchNorm/ReLU/max-pool blocks and a linear head."""
    def block(cin: int, cout: int) -> list[nn.Module]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2)]
    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 32),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, len(CLASSES)))


def train(model: nn.Module, steps: int, seed: int = 0) -> float:
    """Train on freshly drawn batches; returns the accuracy on 512 held-out images."""
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for step in range(steps):
        images, labels = draw_shapes(64, seed=seed + 1 + step)
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 50 == 0:
            print(f"  step {step + 1}/{steps}  loss {loss.item():.3f}", flush=True)
    model.eval()
    images, labels = draw_shapes(512, seed=10_000)
    with torch.no_grad():
        return (model(images).argmax(1) == labels).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="OMENN offline demo")
    parser.add_argument("--out", type=Path, default=Path("omenn_demo"), help="output folder")
    parser.add_argument("--steps", type=int, default=150, help="training steps")
    parser.add_argument("--images", type=int, default=4, help="images to explain")
    args = parser.parse_args(argv)

    print(f"training a small CNN on drawn shapes ({args.steps} steps)...", flush=True)
    start = time.perf_counter()
    model = small_cnn()
    accuracy = train(model, args.steps)
    print(f"  accuracy {accuracy:.1%} on 512 test images ({time.perf_counter() - start:.0f} s)")

    images, labels = draw_shapes(args.images, seed=20_000)
    explanation = Explainer(model)(images, target=labels)
    errors = explanation.completeness_error()

    args.out.mkdir(parents=True, exist_ok=True)
    report = []
    for i in range(args.images):
        total = explanation.contribution[i].sum().item()
        report.append({"image": i, "label": CLASSES[labels[i]], "logit": explanation.logit[i].item(),
                       "sum_of_contributions": total, "relative_error": errors[i].item()})
    titles = [f"{r['label']}: logit {r['logit']:.2f}, sum C {r['sum_of_contributions']:.2f}" for r in report]
    overlay_grid(images, explanation.contribution, path=args.out / "raw.png", titles=titles)
    overlay_grid(images, postprocess(explanation.contribution), path=args.out / "postprocessed.png",
                 titles=titles, postprocessed=True)
    (args.out / "completeness.json").write_text(json.dumps(report, indent=2))

    print("\ncompleteness (sum of contributions vs the explained logit):")
    print(f"  {'image':>5} {'label':>7} {'logit':>10} {'sum C':>10} {'rel. error':>10}")
    for r in report:
        print(f"  {r['image']:>5} {r['label']:>7} {r['logit']:>10.4f} {r['sum_of_contributions']:>10.4f} "
              f"{r['relative_error']:>10.1e}")
    print(f"\nwrote {args.out / 'raw.png'}, {args.out / 'postprocessed.png'}, {args.out / 'completeness.json'}")
    worst = max(r["relative_error"] for r in report)
    if not math.isfinite(worst) or worst > 1e-4:
        print(f"completeness check failed: worst relative error {worst:.1e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
