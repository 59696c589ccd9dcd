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

from ..errors import ModelLoadError
from .architectures import build, parts_cnn, parts_vit
from .weights import CheckpointNotFoundError, ModelNameTypeError, load_weights, read_state_dict

CHECKPOINT_DIR = Path(__file__).resolve().parent / "checkpoints"
_SHIPPED = ("parts_cnn", "parts_vit")

__all__ = ["CHECKPOINT_DIR", "CheckpointNotFoundError", "ModelNameTypeError", "available", "build",
           "checkpoint_config", "load_checkpoint", "load_pretrained", "load_weights", "parts_cnn", "parts_vit",
           "read_state_dict"]


def available() -> tuple[str, ...]:
    """Names of the shipped checkpoints whose weights and configuration are both present."""
    return tuple(name for name in _SHIPPED
                 if (CHECKPOINT_DIR / f"{name}.safetensors").is_file()
                 and (CHECKPOINT_DIR / f"{name}.json").is_file())


def _shipped_path(name: str) -> Path:
    if not isinstance(name, str):
        raise ModelNameTypeError(f"the checkpoint name must be a str, got {type(name).__name__}")
    if name not in _SHIPPED:
        raise ModelLoadError(f"unknown checkpoint {name!r}; the shipped ones are {list(_SHIPPED)}")
    return CHECKPOINT_DIR / f"{name}.safetensors"


def _read_config(weights: Path) -> dict:
    config_path = weights.with_suffix(".json")
    if not weights.is_file():
        raise CheckpointNotFoundError(f"checkpoint weights not found: no file at {weights}")
    if not config_path.is_file():
        raise CheckpointNotFoundError(f"checkpoint configuration not found: {config_path} "
                                      f"(it must lie beside {weights.name})")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{config_path} is not a JSON file: {error}") from error
    if not isinstance(config, dict):
        raise ModelLoadError(f"{config_path} holds a JSON {type(config).__name__}, not an object of the "
                             "training configuration")
    for key in ("arch", "num_classes", "arch_params"):
        if key not in config:
            raise ModelLoadError(f"{config_path} lacks the key {key!r}")
    return config


def checkpoint_config(name: str) -> dict:
    """The training configuration and measured results recorded with a shipped checkpoint."""
    return _read_config(_shipped_path(name))


def load_checkpoint(path: str | Path) -> nn.Module:
    """Load a checkpoint written by ``omenn_kernels.models.train`` from ``path`` (a .safetensors file).

    The architecture is rebuilt from the JSON file of the same stem beside it; the model
    is returned in eval mode (float32, CPU).

    Raises:
        CheckpointNotFoundError: the weights, or the JSON file beside them, do not exist.
        ModelLoadError: not a .safetensors path, a JSON file that does not describe an
            architecture, or weights that cannot be read or do not fit it (missing or
            unexpected names, other shapes); the message names the file.
    """
    weights = Path(path)
    if weights.suffix != ".safetensors":
        raise ModelLoadError(f"expected a .safetensors file, got {weights}")
    config = _read_config(weights)
    config_path = weights.with_suffix(".json")
    if not isinstance(config["arch_params"], dict):
        raise ModelLoadError(f"{config_path}: 'arch_params' must be an object of hyper-parameters, got "
                             f"{config['arch_params']!r}")
    try:
        model = build(config["arch"], config["num_classes"], **config["arch_params"])
    except (ValueError, TypeError) as error:  # the configuration's values, named with the file
        raise ModelLoadError(f"{config_path} does not describe a model: {error}") from error
    load_weights(model, weights, model_name=f"the {config['arch']!r} model that {config_path.name} describes")
    return model.eval()


def load_pretrained(name: str) -> nn.Module:
    """The shipped model ``name`` ("parts_cnn" or "parts_vit"), trained, in eval mode."""
    return load_checkpoint(_shipped_path(name))
