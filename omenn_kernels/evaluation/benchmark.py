"""Explanation-quality benchmark: every compared method on the shipped CNN and ViT.

    python -m omenn_kernels.evaluation.benchmark --out bench/results

Runs, for ``parts_cnn`` and ``parts_vit`` on the synthetic parts data set's test split:
the FunnyBirds protocol (:mod:`.funnybirds`), Quantus' FaithfulnessCorrelation (baseline
0, as in the OMENN paper) and part-mask localisation (RelevanceMassAccuracy,
PointingGame), for OMENN (raw and post-processed), Saliency, InputXGradient,
IntegratedGradients, Grad-CAM, Zennit LRP (CNN) and random attributions. Writes
``explanation_quality.json`` (every score, the configuration, the machine, timings) and
``explanation_quality.md`` (the tables, next to the paper's own FunnyBirds rows).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from .. import __version__
from ..models import checkpoint_config, load_pretrained
from ..models.train import cpu_model
from . import funnybirds, methods, quantus_metrics
from .parts_dataset import PATCH, PartsDataset, collate_parts

MODELS = ("parts_cnn", "parts_vit")
SCORE_COLUMNS = (("accuracy", "Acc."), ("background_independence", "B.I."), ("csdc", "CSDC"),
                 ("preservation_check", "PC"), ("deletion_check", "DC"), ("distractibility", "D"),
                 ("single_deletion", "SD"), ("target_sensitivity", "TS"), ("completeness", "Com."),
                 ("correctness", "Cor."), ("contrastivity", "Con."), ("mx", "mX"))
QUANTUS_COLUMNS = (("faithfulness_correlation", "FC"), ("relevance_mass_accuracy", "RMA"),
                   ("pointing_game", "PG"))

# The OMENN paper's FunnyBirds results (Table "Results on FunnyBirds framework", supplementary),
# on the FunnyBirds authors' ViT-B/16 and VGG-16 and the real FunnyBirds renders: quoted, not ours.
PAPER_ROWS: dict[str, dict[str, tuple[float, ...]]] = {
    "ViT-B/16": {
        "OMENN": (0.98, 1.00, 0.89, 0.85, 0.85, 0.92, 0.74, 0.97, 0.89, 0.74, 0.97, 0.87),
        "Chefer LRP": (0.98, 1.00, 0.91, 0.92, 0.89, 0.90, 0.74, 0.95, 0.90, 0.74, 0.95, 0.86),
        "Rollout": (0.98, 1.00, 0.86, 0.80, 0.82, 0.80, 0.76, 0.00, 0.81, 0.76, 0.00, 0.52),
        "IxG": (0.98, 1.00, 0.74, 0.59, 0.60, 0.43, 0.51, 0.67, 0.54, 0.51, 0.67, 0.57),
        "IG": (0.98, 1.00, 0.89, 0.86, 0.85, 0.90, 0.65, 0.91, 0.88, 0.65, 0.91, 0.82),
        "GradCAM": (0.98, 1.00, 0.75, 0.67, 0.68, 0.91, 0.70, 0.48, 0.81, 0.70, 0.48, 0.66),
    },
    "VGG-16": {
        "OMENN": (0.99, 0.99, 0.93, 0.95, 0.91, 0.93, 0.71, 0.97, 0.93, 0.71, 0.97, 0.89),
        "IxG": (0.99, 0.99, 0.79, 0.71, 0.69, 0.94, 0.55, 0.69, 0.84, 0.55, 0.69, 0.69),
        "IG": (0.99, 0.99, 0.92, 0.92, 0.92, 0.97, 0.67, 0.92, 0.92, 0.67, 0.92, 0.85),
        "GradCAM": (0.99, 0.99, 0.94, 0.97, 0.93, 0.87, 0.75, 0.93, 0.91, 0.75, 0.93, 0.86),
    },
}


def methods_for(name: str, model: nn.Module) -> dict[str, methods.AttributionMethod]:
    """The compared attribution methods for the shipped model ``name``."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    compared = {
        "OMENN": methods.omenn(model),
        "OMENN (post-processed)": methods.omenn_postprocessed(model),
        "Saliency": methods.saliency(model),
        "InputXGradient": methods.input_x_gradient(model),
        "IntegratedGradients": methods.integrated_gradients(model),
    }
    if name == "parts_cnn":
        compared["GradCAM"] = methods.grad_cam(model, model.stage3)
        compared["LRP (Zennit ε+♭)"] = methods.lrp_epsilon_plus_flat(model)
    else:
        compared["GradCAM"] = methods.token_grad_cam(model, model.blocks[-1].norm1,
                                                     tuple(model.patch_embed.grid_size),
                                                     model.num_prefix_tokens)
    compared["Random"] = methods.random_attribution(seed=0)
    return compared


def _quantus_scores(model: nn.Module, dataset: PartsDataset, compared: dict, count: int,
                    subset_size: int, nr_runs: int, progress: bool) -> dict[str, dict[str, float]]:
    batch = collate_parts([dataset[i] for i in range(count)])
    images, part_maps = batch["image"], batch["part_map"]
    targets = torch.as_tensor(batch["label"])
    scores = {}
    for name, explain in tqdm(compared.items(), desc="quantus", disable=not progress):
        attributions = torch.cat([explain(images[i:i + 32], targets[i:i + 32])
                                  for i in range(0, count, 32)]).float()
        per_image = {
            "faithfulness_correlation": quantus_metrics.faithfulness_correlation(
                model, images, targets, attributions, nr_runs=nr_runs, subset_size=subset_size),
            "relevance_mass_accuracy": quantus_metrics.relevance_mass_accuracy(
                images, targets, attributions, part_maps),
            "pointing_game": quantus_metrics.pointing_game(images, targets, attributions, part_maps),
        }
        scores[name] = {}
        for key, values in per_image.items():
            scores[name][key] = float(np.nanmean(values))
            scores[name][f"{key}_std"] = float(np.nanstd(values))
    return scores


def run(models: tuple[str, ...] = MODELS, *, images: int = 250, quantus_images: int = 100,
        nr_runs: int = 100, seed: int = 0, progress: bool = True) -> dict:
    """Run the benchmark; returns the JSON-ready results (see the module docstring)."""
    if images < 1 or quantus_images < 1:
        raise ValueError(f"images and quantus_images must be positive, got {images} and {quantus_images}")
    dataset = PartsDataset("test", seed=seed)
    if images > len(dataset) or quantus_images > len(dataset):
        raise ValueError(f"the test split has {len(dataset)} images; asked for {max(images, quantus_images)}")
    # Quantus' default is 224 features of a 224×224 image; keep the same fraction of the image.
    subset_size = round(224 * (dataset.resolution / 224) ** 2)
    results: dict = {
        "command": " ".join(["python -m omenn_kernels.evaluation.benchmark", *sys.argv[1:]]),
        "date": datetime.date.today().isoformat(),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "omenn_kernels": __version__},
        "config": {"split": "test", "seed": seed, "images": images, "quantus_images": quantus_images,
                   "resolution": dataset.resolution, "patch": PATCH,
                   "thresholds": "numpy.linspace(0.01, 0.5, 80)",
                   "dilation": funnybirds.dilation_size(dataset.resolution),
                   "faithfulness": {"nr_runs": nr_runs, "subset_size": subset_size, "baseline": 0.0}},
        "models": {},
    }
    for name in models:
        model = load_pretrained(name)
        compared = methods_for(name, model)
        started = time.perf_counter()
        funny = funnybirds.evaluate(model, dataset, compared, range(images), progress=progress)
        quantus = _quantus_scores(model, dataset, compared, quantus_images, subset_size, nr_runs, progress)
        config = checkpoint_config(name)
        results["models"][name] = {
            "checkpoint": {"arch": config["arch"], "arch_params": config["arch_params"],
                           "test_accuracy": config["results"]["test_accuracy"]},
            "seconds": round(time.perf_counter() - started, 1),
            "methods": {m: {**funny[m].to_dict(), **quantus[m]} for m in compared},
        }
    return results


def _cell(value: float) -> str:
    return "n/a" if value is None or np.isnan(value) else f"{value:.2f}"


def markdown(results: dict) -> str:
    """The results as Markdown tables, followed by the paper's FunnyBirds rows."""
    machine, config = results["machine"], results["config"]
    lines = [f"Synthetic parts data set, test split, {config['images']} images (Quantus: first "
             f"{config['quantus_images']}), {config['resolution']} px. {machine['cpu']}, "
             f"{machine['threads']} threads, torch {machine['torch']}, {results['date']}. "
             f"Command: `{results['command']}`.", ""]
    header = [label for _, label in SCORE_COLUMNS + QUANTUS_COLUMNS]
    for name, model in results["models"].items():
        lines += [f"**{name}** ({model['seconds']:.0f} s)", "",
                  "| method | " + " | ".join(header) + " |", "|---" * (len(header) + 1) + "|"]
        for method, scores in model["methods"].items():
            cells = [_cell(scores[key]) for key, _ in SCORE_COLUMNS + QUANTUS_COLUMNS]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["The OMENN paper's own FunnyBirds rows (real FunnyBirds renders, the FunnyBirds authors' "
              "models; quoted from the paper, not measured here):", "",
              "| model | method | " + " | ".join(label for _, label in SCORE_COLUMNS) + " |",
              "|---" * (len(SCORE_COLUMNS) + 2) + "|"]
    for model, rows in PAPER_ROWS.items():
        for method, values in rows.items():
            lines.append(f"| {model} | {method} | " + " | ".join(f"{v:.2f}" for v in values) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="folder for the JSON and Markdown")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--images", type=int, default=250, help="test images for the FunnyBirds protocol")
    parser.add_argument("--quantus-images", type=int, default=100, help="test images for the Quantus metrics")
    parser.add_argument("--nr-runs", type=int, default=100, help="FaithfulnessCorrelation's random subsets")
    parser.add_argument("--seed", type=int, default=0, help="the test split's seed")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    results = run(tuple(args.models), images=args.images, quantus_images=args.quantus_images,
                  nr_runs=args.nr_runs, seed=args.seed, progress=not args.no_progress)
    args.out.mkdir(parents=True, exist_ok=True)
    for suffix, text in (("json", json.dumps(results, indent=1)), ("md", markdown(results))):
        target = args.out / f"explanation_quality.{suffix}"
        partial = target.with_suffix(f".{suffix}.partial")
        partial.write_text(text, encoding="utf-8")
        partial.replace(target)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
