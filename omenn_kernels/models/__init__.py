"""Shipped classifiers of the synthetic parts data set and how to load them.

    from omenn_kernels.models import load_pretrained
    model = load_pretrained("parts_cnn")      # or "parts_vit"; eval mode, float32

Each checkpoint is a safetensors file of the model's state_dict next to a JSON file of
the same stem that holds the training configuration (architecture and its
hyper-parameters, data set, optimizer, schedule, seed) and the measured results (test
accuracy, training wall time, CPU). ``python -m omenn_kernels.models.train`` writes both.
"""

from __future__ import annotations

import json
from pathlib import Path

from torch import nn

from .architectures import build, parts_cnn, parts_vit

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
_SHIPPED = ("parts_cnn", "parts_vit")

__all__ = ["CHECKPOINT_DIR", "available", "build", "checkpoint_config", "load_checkpoint",
           "load_pretrained", "parts_cnn", "parts_vit"]


def available() -> tuple[str, ...]:
    """Names of the shipped checkpoints whose weights and configuration are both present."""
    return tuple(name for name in _SHIPPED
                 if (CHECKPOINT_DIR / f"{name}.safetensors").is_file()
                 and (CHECKPOINT_DIR / f"{name}.json").is_file())


def _shipped_path(name: str) -> Path:
    if not isinstance(name, str):
        raise TypeError(f"the checkpoint name must be a str, got {type(name).__name__}")
    if name not in _SHIPPED:
        raise ValueError(f"unknown checkpoint {name!r}; the shipped ones are {list(_SHIPPED)}")
    return CHECKPOINT_DIR / f"{name}.safetensors"


def _read_config(weights: Path) -> dict:
    config_path = weights.with_suffix(".json")
    if not weights.is_file():
        raise FileNotFoundError(f"checkpoint weights not found: {weights}")
    if not config_path.is_file():
        raise FileNotFoundError(f"checkpoint configuration not found: {config_path} "
                                f"(it must lie beside {weights.name})")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key in ("arch", "num_classes", "arch_params"):
        if key not in config:
            raise ValueError(f"{config_path} lacks the key {key!r}")
    return config


def checkpoint_config(name: str) -> dict:
    """The training configuration and measured results recorded with a shipped checkpoint."""
    return _read_config(_shipped_path(name))


def load_checkpoint(path: str | Path) -> nn.Module:
    """Load a checkpoint written by ``omenn_kernels.models.train`` from ``path`` (a .safetensors file).

    The architecture is rebuilt from the JSON file of the same stem beside it; the model
    is returned in eval mode (float32, CPU). Missing or unexpected weights raise.
    """
    from safetensors.torch import load_file

    weights = Path(path)
    if weights.suffix != ".safetensors":
        raise ValueError(f"expected a .safetensors file, got {weights}")
    config = _read_config(weights)
    model = build(config["arch"], config["num_classes"], **config["arch_params"])
    model.load_state_dict(load_file(weights), strict=True)
    return model.eval()


def load_pretrained(name: str) -> nn.Module:
    """The shipped model ``name`` ("parts_cnn" or "parts_vit"), trained, in eval mode."""
    return load_checkpoint(_shipped_path(name))
