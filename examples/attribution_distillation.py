"""Attribution distillation: a small ViT student learns to explain as the shipped ViT does.

Trains two students of the same small ViT from the same initialization, on the same
seeded sequence of batches of the synthetic parts data set, and compares them on
held-out test images:

* ``logits``: logit distillation, ``T² · KL(teacher softmax_T ‖ student softmax_T)``
  plus cross-entropy on the labels;
* ``logits+attributions``: the same loss plus ``λ ·`` :func:`omenn_kernels.losses.
  attribution_distillation` (``1 − cos`` of the student's and the teacher's OMENN
  contribution maps of the true class). The logit losses use the logits returned by the
  explanations' own forwards, so each model runs one forward per step, not two.

Run from the repository root:

    python examples/attribution_distillation.py [--steps 1000] [--attribution-weight 1]
        [--out bench/results/attribution_distillation.json]

It reports, for the untrained student and for each run: test accuracy, top-1 agreement
with the teacher, and attribution agreement with the teacher, i.e. the mean per-image
cosine similarity and Spearman rank correlation of the student's and the teacher's
contribution maps of the true class (first-order explanations); plus each run's
training wall time and seconds per step. It prints a table and writes a JSON file
(configuration, machine, results, loss history). An interrupted run (Ctrl-C) writes
nothing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import omenn_kernels
from omenn_kernels import Explainer
from omenn_kernels.evaluation.parts_dataset import PartsDataset, collate_parts
from omenn_kernels.losses import attribution_distillation
from omenn_kernels.models import build, load_pretrained
from omenn_kernels.models.train import cpu_model

LOG = logging.getLogger("attribution_distillation")

TEACHER = "parts_vit"
STUDENT_ARCH = "vit"
STUDENT_HYPER_PARAMETERS: dict[str, object] = {"embed_dim": 32, "depth": 2, "num_heads": 2}
LOGIT_RUN = "logits"
ATTRIBUTION_RUN = "logits+attributions"
# Fixed, so that every test image's explanation reuses one captured program per model.
EVAL_BATCH_SIZE = 50
EXIT_INTERRUPTED = 130


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per run (default: 1000)")
    parser.add_argument("--batch-size", type=int, default=32, help="training images per step (default: 32)")
    parser.add_argument("--attribution-weight", type=float, default=1.0,
                        help="λ, the weight of the attribution loss in the second run (default: 1)")
    parser.add_argument("--temperature", type=float, default=2.0,
                        help="softmax temperature T of the logit distillation (default: 2)")
    parser.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate (default: 2e-3)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the student's initialization and of the batch order (default: 0)")
    parser.add_argument("--test-images", type=int, default=1000,
                        help="held-out images evaluated, the first ones of the test split (default: 1000)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--log-every", type=int, default=50, help="steps between loss logs (default: 50)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/attribution_distillation.json"),
                        help="the JSON file written (default: bench/results/attribution_distillation.json)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "test_images", "threads", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("attribution_weight", "temperature", "lr"):
        if not getattr(args, name) > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def images_and_labels(dataset: PartsDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = collate_parts([dataset[i] for i in indices])
    return batch["image"], batch["label"]


def batch_order(images: int, batch_size: int, seed: int) -> list[list[int]]:
    """A seeded shuffle of ``range(images)`` cut into batches: both runs see the same sequence."""
    order = torch.randperm(images, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[start:start + batch_size] for start in range(0, images, batch_size)]


def logit_distillation(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                       temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T² · KL(teacher_T ‖ student_T), cross-entropy)``; T² keeps the KL gradient's scale at any T."""
    kl = F.kl_div(F.log_softmax(student_logits / temperature, dim=1),
                  F.log_softmax(teacher_logits / temperature, dim=1),
                  reduction="batchmean", log_target=True) * temperature ** 2
    return kl, F.cross_entropy(student_logits, labels)


def train_student(student: nn.Module, teacher: nn.Module, train_set: PartsDataset, batches: list[list[int]], *,
                  name: str, attribution_weight: float | None, temperature: float, lr: float,
                  log_every: int) -> dict:
    """Train ``student`` in place; ``attribution_weight`` None trains on the logit loss alone.

    Returns the timings and the loss history (means over each logging window).
    """
    optimizer = torch.optim.Adam(student.parameters(), lr=lr)
    student.train()
    history: list[dict] = []
    window: dict[str, float] = {}
    step_seconds: list[float] = []
    for step, indices in enumerate(batches, start=1):
        start = time.perf_counter()
        images, labels = images_and_labels(train_set, indices)
        if attribution_weight is None:
            matched = None
            with torch.no_grad():
                teacher_logits = teacher(images)
            logits = student(images)
        else:
            # One forward per model: both explanations' forwards give the logits too.
            matched = attribution_distillation(student, teacher, images, target=labels)
            teacher_logits, logits = matched.reference.logits, matched.logits
        kl, cross_entropy = logit_distillation(logits, teacher_logits, labels, temperature)
        terms = {"kl": kl, "cross_entropy": cross_entropy}
        total = kl + cross_entropy
        if matched is not None:
            terms["attribution"] = matched.loss
            total = total + attribution_weight * matched.loss
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        step_seconds.append(time.perf_counter() - start)

        for key, value in {**terms, "total": total}.items():
            window[key] = window.get(key, 0.0) + value.item()
        window_steps = (step - 1) % log_every + 1
        if window_steps == log_every or step == len(batches):
            means = {key: value / window_steps for key, value in window.items()}
            history.append({"step": step, **means})
            LOG.info("%s step %d/%d: %s (%.2f s/step)", name, step, len(batches),
                     ", ".join(f"{key} {value:.4f}" for key, value in means.items()),
                     sum(step_seconds[-window_steps:]) / window_steps)
            window = {}
    student.eval()
    # The first step also captures and linearizes the models for OMENN; it is kept apart.
    steady = step_seconds[1:] or step_seconds
    return {"train_seconds": sum(step_seconds), "first_step_seconds": step_seconds[0],
            "seconds_per_step": sum(steady) / len(steady), "loss_history": history}


def explain_test_set(model: nn.Module, test_set: PartsDataset) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(contribution maps (N, H, W), logits (N, K), labels (N,))`` of the true classes."""
    explainer = Explainer(model)
    maps, logits, labels = [], [], []
    for start in range(0, len(test_set), EVAL_BATCH_SIZE):
        images, batch_labels = images_and_labels(test_set, list(range(start, min(start + EVAL_BATCH_SIZE,
                                                                                   len(test_set)))))
        explanation = explainer(images, batch_labels)
        maps.append(explanation.contribution)
        logits.append(explanation.logits)
        labels.append(batch_labels)
    return torch.cat(maps), torch.cat(logits), torch.cat(labels)


def ranks(values: torch.Tensor) -> torch.Tensor:
    """Per row, the ranks 0..n-1 of the values (ties broken by order; the maps are continuous)."""
    return values.argsort(dim=1).argsort(dim=1).to(values.dtype)


def agreement(student: nn.Module, test_set: PartsDataset, teacher_maps: torch.Tensor,
              teacher_logits: torch.Tensor) -> dict[str, float]:
    """Accuracy, top-1 agreement and attribution agreement of ``student`` with the teacher."""
    maps, logits, labels = explain_test_set(student, test_set)
    student_flat, teacher_flat = maps.flatten(1), teacher_maps.flatten(1)
    predictions = logits.argmax(1)
    return {
        "accuracy": (predictions == labels).double().mean().item(),
        "teacher_top1_agreement": (predictions == teacher_logits.argmax(1)).double().mean().item(),
        "attribution_cosine": F.cosine_similarity(student_flat, teacher_flat, dim=1).mean().item(),
        # Spearman's rho is the Pearson correlation of the ranks.
        "attribution_spearman": F.cosine_similarity(
            *(r - r.mean(1, keepdim=True) for r in (ranks(student_flat), ranks(teacher_flat))), dim=1
        ).mean().item(),
    }


def write_json_atomically(path: Path, content: dict) -> None:
    """Write to a temporary file beside ``path`` and rename it, so no partial file is ever left."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(json.dumps(content, indent=2) + "\n")
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def print_table(teacher_accuracy: float, results: dict[str, dict]) -> None:
    header = (f"{'student':22s} {'accuracy':>8s} {'top-1 agr.':>10s} {'attr. cos':>9s} {'spearman':>8s} "
              f"{'s/step':>7s} {'wall s':>7s}")
    print(header)
    print("-" * len(header))
    print(f"{'(teacher ' + TEACHER + ')':22s} {teacher_accuracy:8.3f}")
    for name, row in results.items():
        timing = (f" {row['seconds_per_step']:7.3f} {row['wall_seconds']:7.1f}"
                  if "seconds_per_step" in row else "")
        print(f"{name:22s} {row['accuracy']:8.3f} {row['teacher_top1_agreement']:10.3f} "
              f"{row['attribution_cosine']:9.3f} {row['attribution_spearman']:8.3f}{timing}")


def main(argv: list[str] | None = None) -> int:
    """Train and evaluate both students, print the table and write the JSON; returns the exit status."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(args.threads)
    try:
        started = time.perf_counter()
        teacher = load_pretrained(TEACHER)
        for parameter in teacher.parameters():
            parameter.requires_grad_(False)
        train_set = PartsDataset("train", args.steps * args.batch_size)
        test_set = PartsDataset("test", args.test_images)
        batches = batch_order(len(train_set), args.batch_size, args.seed)

        teacher_maps, teacher_logits, test_labels = explain_test_set(teacher, test_set)
        teacher_accuracy = (teacher_logits.argmax(1) == test_labels).double().mean().item()
        torch.manual_seed(args.seed)
        initial_student = build(STUDENT_ARCH, test_set.num_classes, **STUDENT_HYPER_PARAMETERS)
        results = {"initialization": agreement(initial_student, test_set, teacher_maps, teacher_logits)}
        LOG.info("teacher test accuracy %.3f; untrained student: %s", teacher_accuracy, results["initialization"])

        for name, weight in ((LOGIT_RUN, None), (ATTRIBUTION_RUN, args.attribution_weight)):
            run_started = time.perf_counter()
            student = build(STUDENT_ARCH, test_set.num_classes, **STUDENT_HYPER_PARAMETERS)
            student.load_state_dict(initial_student.state_dict())
            training = train_student(student, teacher, train_set, batches, name=name, attribution_weight=weight,
                                     temperature=args.temperature, lr=args.lr, log_every=args.log_every)
            metrics = agreement(student, test_set, teacher_maps, teacher_logits)
            results[name] = {**metrics, "wall_seconds": time.perf_counter() - run_started, **training}
            LOG.info("%s: %s", name, metrics)
    except KeyboardInterrupt:
        LOG.warning("interrupted: nothing written")
        return EXIT_INTERRUPTED

    print_table(teacher_accuracy, results)
    report = {
        "description": "attribution distillation from the shipped parts ViT to a small ViT, "
                       "against plain logit distillation (examples/attribution_distillation.py)",
        "command": "python examples/attribution_distillation.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
        "config": {
            **{key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()},
            "teacher": TEACHER,
            "student": {"arch": STUDENT_ARCH, **STUDENT_HYPER_PARAMETERS,
                        "parameters": sum(p.numel() for p in initial_student.parameters())},
            "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
            "optimizer": "Adam, constant learning rate",
            "logit_loss": "T^2 * KL(teacher softmax_T || student softmax_T) + cross-entropy on the labels",
            "attribution_loss": "1 - cos of the contribution maps of the true class (attribution_distillation "
                                "defaults: the student on the fused backend, auto, with the total parameter "
                                "gradient; the teacher first-order on the fused backend)",
            "train_data": f"PartsDataset('train', {len(train_set)}, seed=0), each image once, "
                          f"in a shuffle seeded by --seed",
            "test_data": f"the first {len(test_set)} images of PartsDataset('test', seed=0)",
            "evaluation": "first-order OMENN explanations of the true class; cosine and Spearman "
                          "correlation per image, averaged",
        },
        "machine": {"cpu": cpu_model(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__, "omenn_kernels": omenn_kernels.__version__,
                    "python": platform.python_version(), "date": datetime.date.today().isoformat()},
        "teacher_test_accuracy": teacher_accuracy,
        "results": results,
        "total_seconds": time.perf_counter() - started,
    }
    write_json_atomically(args.out, report)
    LOG.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
