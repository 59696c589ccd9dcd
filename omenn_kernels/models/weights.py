"""Reading a weights file into a model, with errors that say what is wrong with the file.

:func:`read_state_dict` reads a safetensors file or a ``torch.save`` file (weights only,
possibly wrapped as timm's training checkpoints are); :func:`load_weights` checks that
its names and shapes are the model's before loading it, so that a file of another
model, or of another head size, is named as such instead of failing inside
``load_state_dict``.
"""

from __future__ import annotations

import argparse
import pickle
from pathlib import Path

import torch
from torch import nn

from ..errors import ModelLoadError, first_line

# How many names an error lists before it says how many more there are.
_NAMES_SHOWN = 4
# The keys under which timm's training checkpoints wrap the state_dict, in timm's order of preference.
_WRAPPING_KEYS = ("state_dict_ema", "model_ema", "state_dict", "model")
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOL_OPCODE = 0x80


class CheckpointNotFoundError(ModelLoadError, FileNotFoundError):
    """A weights file, or the configuration file beside it, that does not exist."""


class ModelNameTypeError(ModelLoadError, TypeError):
    """A model name that is not a string."""


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    return shown if len(names) <= _NAMES_SHOWN else f"{shown}, … ({len(names) - _NAMES_SHOWN} more)"


def _looks_like_safetensors(leading: bytes, size: int) -> bool:
    """A safetensors file starts with its JSON header's length (8 bytes, little-endian) and then ``{``."""
    return len(leading) >= 9 and 0 < int.from_bytes(leading[:8], "little") <= size - 8 and leading[8:9] == b"{"


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except SafetensorError as error:
        raise ModelLoadError(f"{path} is not a readable safetensors file (truncated or corrupt?): "
                             f"{first_line(error)}") from error


def _read_torch_file(path: Path) -> object:
    try:
        # timm's training checkpoints record their arguments as an argparse.Namespace.
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        try:
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception:  # the archive cannot be listed either: the load error below says why
            refused = []
        if any(name.startswith("torch.nn.modules.") for name in refused):
            raise ModelLoadError(f"{path} holds a pickled model (torch.save(model)), not a state_dict; save "
                                 "torch.save(model.state_dict(), path) and pass that file") from error
        if refused:
            raise ModelLoadError(f"{path} holds pickled objects that a weights-only load refuses "
                                 f"({_listing(refused)}); save a state_dict of tensors instead") from error
        raise ModelLoadError(f"{path} is not a weights file torch.load can read: {first_line(error)}") from error
    except Exception as error:  # torch.load reports a damaged archive with many exception types
        raise ModelLoadError(f"{path} is a damaged torch.save file (truncated or corrupt?): "
                             f"{first_line(error)}") from error


def _unwrapped(checkpoint: object, path: Path) -> dict[str, torch.Tensor]:
    """The state_dict in ``checkpoint``, unwrapped and with DDP/compile prefixes removed as timm does."""
    from timm.models import clean_state_dict

    if isinstance(checkpoint, dict):
        for key in _WRAPPING_KEYS:
            if isinstance(checkpoint.get(key), dict):
                checkpoint = checkpoint[key]
                break
    if not isinstance(checkpoint, dict):
        raise ModelLoadError(f"{path} holds a {type(checkpoint).__name__}, not a state_dict (a dict of tensors "
                             "by parameter name); save torch.save(model.state_dict(), path)")
    # load_state_dict takes any object for a module's extra state; every other entry must be a tensor.
    not_tensors = [str(k) for k, v in checkpoint.items()
                   if not isinstance(v, torch.Tensor) and not str(k).endswith("_extra_state")]
    if not_tensors or not checkpoint:
        what = f"entries that are not tensors ({_listing(not_tensors)})" if not_tensors else "no entries"
        raise ModelLoadError(f"{path} is not a state_dict: it holds {what}; save "
                             "torch.save(model.state_dict(), path)")
    return clean_state_dict(checkpoint)


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict in the weights file ``path``, on the CPU.

    ``.safetensors`` files are read with safetensors; other files by their content: a
    ``torch.save`` file (weights only: tensors, no pickled objects) or a safetensors
    file under another name. A dict that wraps the state_dict under ``state_dict_ema``,
    ``model_ema``, ``state_dict`` or ``model`` (timm's training checkpoints) is unwrapped,
    and ``module.`` / ``_orig_mod.`` prefixes are removed, as timm's ``load_checkpoint`` does.

    Raises:
        CheckpointNotFoundError: ``path`` is not a file.
        ModelLoadError: the file is not a weights file, is damaged, holds a pickled model
            or other objects, or holds no state_dict; the message says which.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"checkpoint not found: no file at {path}")
    if path.suffix == ".safetensors":
        return _unwrapped(_read_safetensors(path), path)
    with path.open("rb") as file:
        leading = file.read(9)
    if leading.startswith(_ZIP_MAGIC) or leading[:1] == bytes([_PICKLE_PROTOCOL_OPCODE]):
        return _unwrapped(_read_torch_file(path), path)
    if _looks_like_safetensors(leading, path.stat().st_size):
        return _unwrapped(_read_safetensors(path), path)
    raise ModelLoadError(f"{path} is not a weights file torch.load or safetensors can read: it is neither a "
                         "torch.save archive nor a safetensors file")


def _head_classes(state_dict: dict[str, torch.Tensor], heads: tuple[str, ...], mismatched: list[str]) -> int | None:
    """The checkpoint's class count, when only the classifier ``heads``' tensors differ in shape."""
    weight = state_dict.get(f"{heads[0]}.weight") if heads else None
    if not isinstance(weight, torch.Tensor) or weight.dim() < 1:
        return None
    in_heads = all(any(name.startswith(f"{head}.") for head in heads) for name in mismatched)
    return int(weight.shape[0]) if in_heads else None


def load_weights(model: nn.Module, path: str | Path, *, model_name: str, heads: tuple[str, ...] = ()) -> None:
    """Load the weights file ``path`` into ``model`` (strictly: the same names and shapes).

    Args:
        model: the module to load into; it is changed only if the whole file fits.
        path: a weights file (see :func:`read_state_dict`).
        model_name: how errors name the model.
        heads: the classifiers' module names (timm's ``pretrained_cfg["classifier"]``); when
            only their tensors differ in shape, the error names the checkpoint's class count
            and the ``--num-classes`` that fits it.

    Raises:
        ModelLoadError: the file cannot be read (:func:`read_state_dict`), lacks some of
            the model's weights, holds names the model does not have, or holds tensors of
            other shapes; the message names them.
    """
    path = Path(path)
    state_dict = read_state_dict(path)
    expected = model.state_dict()
    missing = [name for name in expected if name not in state_dict]
    unexpected = [name for name in state_dict if name not in expected]
    mismatched = [name for name in expected if name in state_dict
                  and isinstance(state_dict[name], torch.Tensor) and state_dict[name].shape != expected[name].shape]
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the model's weights missing from it: {_listing(missing)}")
        if unexpected:
            parts.append(f"its entries the model does not have: {_listing(unexpected)}")
        raise ModelLoadError(f"{path} does not fit {model_name} ({'; '.join(parts)}); is it a checkpoint of "
                             "another model?")
    if mismatched:
        shapes = ", ".join(f"{name} is {tuple(state_dict[name].shape)} in the checkpoint but "
                           f"{tuple(expected[name].shape)} in the model" for name in mismatched[:_NAMES_SHOWN])
        more = f" ({len(mismatched) - _NAMES_SHOWN} more)" if len(mismatched) > _NAMES_SHOWN else ""
        classes = _head_classes(state_dict, heads, mismatched)
        hint = f"; the checkpoint's head has {classes} classes: pass --num-classes {classes}" if classes else ""
        raise ModelLoadError(f"{path} does not fit {model_name}: {shapes}{more}{hint}")
    try:
        model.load_state_dict(state_dict, strict=True)
    except RuntimeError as error:  # names and shapes fit: what is left is the file's own content
        raise ModelLoadError(f"{path} cannot be loaded into {model_name}: {first_line(error)}") from error
