"""Train a shipped classifier from scratch on the synthetic parts data set, on the CPU.

    python -m omenn_kernels.models.train cnn --out omenn_kernels/models/checkpoints
    python -m omenn_kernels.models.train vit --out omenn_kernels/models/checkpoints

Trains on ``PartsDataset("train", seed=0)`` with AdamW and a linear-warm-up cosine
schedule, evaluates on the 1000 images of ``PartsDataset("test", seed=0)`` and writes
``<out>/parts_<arch>.safetensors`` (the float32 state_dict) and ``<out>/parts_<arch>.json``
(the full training configuration and the measured results). Both files are written to
temporary names first and renamed, so an interrupted run leaves earlier files intact.
Runs are deterministic for a given seed and thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Iterable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from ..atomic_file import write_atomically
from . import CHECKPOINT_DIR
from .architectures import DEFAULTS, INPUT_NORMALIZATION, build

# Per architecture, the recipe of the shipped checkpoint; every field can be overridden.
# The ViT learns more slowly and overfits 20000 images, so it sees a longer stream of the
# same seeded train split (its first 20000 images are the default train set).
RECIPES: dict[str, dict[str, object]] = {
    "cnn": {"epochs": 3, "batch_size": 64, "lr": 3e-3, "weight_decay": 0.05, "warmup_epochs": 0.25,
            "label_smoothing": 0.0, "train_length": 20000},
    "vit": {"epochs": 5, "batch_size": 32, "lr": 2e-3, "weight_decay": 0.05, "warmup_epochs": 0.1,
            "label_smoothing": 0.0, "train_length": 60000},
}


def _images_and_labels(samples: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate only what training needs (the samples also hold variable-length part tuples)."""
    images = torch.stack([sample["image"] for sample in samples])
    labels = torch.tensor([sample["label"] for sample in samples], dtype=torch.int64)
    return images, labels


def evaluate(model: nn.Module, dataset: Dataset, indices: Iterable[int] | None = None,
             batch_size: int = 100) -> float:
    """Top-1 accuracy of ``model`` (put in eval mode) on ``dataset`` (or the given indices of it)."""
    indices = list(range(len(dataset))) if indices is None else list(indices)
    if not indices:
        raise ValueError("nothing to evaluate: the index list is empty")
    model.eval()
    correct = 0
    with torch.no_grad():
        for start in range(0, len(indices), batch_size):
            images, labels = _images_and_labels([dataset[i] for i in indices[start:start + batch_size]])
            correct += int((model(images).argmax(1) == labels).sum())
    return correct / len(indices)


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``platform.processor()`` where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def save_checkpoint(model: nn.Module, config: dict, out: Path, name: str) -> tuple[Path, Path]:
    """Write ``<out>/<name>.safetensors`` (float32 state_dict) and ``<out>/<name>.json``; returns both paths."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {key: (value.float() if value.is_floating_point() else value).detach().cpu().contiguous()
             for key, value in model.state_dict().items()}
    weights, config_path = out / f"{name}.safetensors", out / f"{name}.json"
    write_atomically(weights, lambda p: save_file(state, str(p), metadata={"format": "pt"}))
    write_atomically(config_path, lambda p: p.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8"))
    return weights, config_path


def _cosine_with_warmup(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def _decays(name: str, parameter: torch.Tensor) -> bool:
    return parameter.dim() > 1 and "token" not in name and "pos_embed" not in name


def train(arch: str, *, epochs: int, batch_size: int, lr: float, weight_decay: float, warmup_epochs: float,
          label_smoothing: float, seed: int = 0, threads: int = 2, workers: int = 0,
          train_length: int | None = None, data_seed: int = 0, progress: bool = True) -> tuple[nn.Module, dict]:
    """Train ``arch`` from scratch; returns the model (eval mode) and its configuration with results."""
    from tqdm import tqdm

    from ..evaluation.parts_dataset import PartsDataset

    if epochs < 1 or batch_size < 1 or lr <= 0 or threads < 1 or workers not in (0, 1):
        raise ValueError(f"need epochs >= 1, batch_size >= 1, lr > 0, threads >= 1 and workers in (0, 1); "
                         f"got {epochs}, {batch_size}, {lr}, {threads}, {workers}")
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    train_set = PartsDataset("train", train_length, seed=data_seed)
    test_set = PartsDataset("test", seed=data_seed)
    model = build(arch, train_set.num_classes)
    loader = DataLoader(train_set, batch_size=batch_size, shuffle=True, drop_last=True, num_workers=workers,
                        collate_fn=_images_and_labels, generator=torch.Generator().manual_seed(seed))
    steps_per_epoch = len(loader)
    total_steps = epochs * steps_per_epoch
    # Biases, norm parameters, tokens and positional embeddings are not decayed.
    decayed = [p for name, p in model.named_parameters() if _decays(name, p)]
    others = [p for name, p in model.named_parameters() if not _decays(name, p)]
    optimizer = torch.optim.AdamW([{"params": decayed, "weight_decay": weight_decay},
                                   {"params": others, "weight_decay": 0.0}], lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _cosine_with_warmup(total_steps, max(1, round(warmup_epochs * steps_per_epoch))))
    criterion = nn.CrossEntropyLoss(label_smoothing=label_smoothing)

    history = []
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        seen, loss_sum, correct = 0, 0.0, 0
        epoch_start = time.perf_counter()
        bar = tqdm(loader, desc=f"{arch} epoch {epoch + 1}/{epochs}", disable=not progress, file=sys.stdout,
                   mininterval=5.0)
        for images, labels in bar:
            logits = model(images)
            loss = criterion(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            schedule.step()
            seen += len(labels)
            loss_sum += loss.item() * len(labels)
            correct += int((logits.argmax(1) == labels).sum())
            bar.set_postfix(loss=f"{loss_sum / seen:.3f}", acc=f"{correct / seen:.3f}",
                            img_s=f"{seen / (time.perf_counter() - epoch_start):.0f}", refresh=False)
        history.append({"epoch": epoch + 1, "train_loss": loss_sum / seen, "train_accuracy": correct / seen,
                        "seconds": time.perf_counter() - epoch_start})
        print(f"{arch} epoch {epoch + 1}/{epochs}: loss {loss_sum / seen:.4f}, train accuracy "
              f"{correct / seen:.4f}, {time.perf_counter() - epoch_start:.0f} s", flush=True)
    train_seconds = time.perf_counter() - start
    test_accuracy = evaluate(model, test_set)
    print(f"{arch}: test accuracy {test_accuracy:.4f} on {len(test_set)} images, "
          f"trained in {train_seconds:.0f} s", flush=True)

    config = {
        "arch": arch,
        "num_classes": train_set.num_classes,
        "arch_params": {key: (list(value) if isinstance(value, tuple) else value)
                        for key, value in DEFAULTS[arch].items()},
        "parameters": sum(p.numel() for p in model.parameters()),
        "input": {"shape": [3, 96, 96], "range": [0.0, 1.0], "normalization": INPUT_NORMALIZATION[arch]},
        "data": {"dataset": "omenn_kernels.evaluation.parts_dataset.PartsDataset", "seed": data_seed,
                 "train_split": "train", "train_length": len(train_set), "test_split": "test",
                 "test_length": len(test_set), "augmentation": "none (the train split drops parts itself)"},
        "training": {"epochs": epochs, "batch_size": batch_size, "optimizer": "AdamW", "lr": lr,
                     "weight_decay": weight_decay, "schedule": "linear warm-up, then cosine to 0, per step",
                     "warmup_epochs": warmup_epochs, "label_smoothing": label_smoothing, "seed": seed,
                     "threads": threads, "workers": workers, "drop_last": True},
        "results": {"test_accuracy": test_accuracy, "test_images": len(test_set),
                    "train_seconds": round(train_seconds, 1), "cpu": cpu_model(),
                    "cpu_count": os.cpu_count(), "threads": threads, "history": history},
        "versions": {"torch": torch.__version__, "python": platform.python_version(), **_other_versions()},
    }
    return model.eval(), config


def _other_versions() -> dict[str, str]:
    versions = {}
    for package in ("timm", "safetensors"):
        try:
            versions[package] = __import__(package).__version__
        except ImportError:
            pass
    return versions


def main(argv: list[str] | None = None) -> int:
    """Command line: train one architecture and write its checkpoint."""
    parser = argparse.ArgumentParser(description="Train a shipped parts classifier on the CPU")
    parser.add_argument("arch", choices=sorted(RECIPES), help="which architecture")
    parser.add_argument("--out", type=Path, default=CHECKPOINT_DIR,
                        help=f"output folder (default: the package's {CHECKPOINT_DIR})")
    parser.add_argument("--epochs", type=int, help="training epochs")
    parser.add_argument("--batch-size", type=int, help="images per step")
    parser.add_argument("--lr", type=float, help="peak learning rate")
    parser.add_argument("--weight-decay", type=float, help="AdamW weight decay of weight matrices")
    parser.add_argument("--warmup-epochs", type=float, help="linear warm-up length in epochs")
    parser.add_argument("--label-smoothing", type=float, help="cross-entropy label smoothing")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initialization and the shuffling")
    parser.add_argument("--data-seed", type=int, default=0, help="seed of the data set")
    parser.add_argument("--train-length", type=int,
                        help="training images per epoch (the first ones of the train split)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--workers", type=int, default=0, choices=(0, 1), help="DataLoader worker processes")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    recipe = dict(RECIPES[args.arch])
    for key in recipe:
        value = getattr(args, key)
        if value is not None:
            recipe[key] = value
    model, config = train(args.arch, seed=args.seed, threads=args.threads, workers=args.workers,
                          data_seed=args.data_seed,
                          progress=not args.no_progress, **recipe)
    config["command"] = "python -m omenn_kernels.models.train " + " ".join(
        sys.argv[1:] if argv is None else argv)
    weights, config_path = save_checkpoint(model, config, args.out, f"parts_{args.arch}")
    print(f"wrote {weights} ({weights.stat().st_size / 1e6:.2f} MB) and {config_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
