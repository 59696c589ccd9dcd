"""Loading the model to explain: a shipped parts model or any timm model, and its input pipeline."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from PIL import Image
from torch import nn

from .. import models
from ..errors import ModelLoadError, first_line

# The shipped models see the drawn images as they are: 96×96, values in [0, 1].
_SHIPPED_DATA_CONFIG = {"input_size": (3, 96, 96), "interpolation": "bilinear", "mean": (0.0, 0.0, 0.0),
                        "std": (1.0, 1.0, 1.0), "crop_pct": 1.0, "crop_mode": "center"}


@dataclass
class LoadedModel:
    """A model in eval mode with what the store records about it.

    Attributes:
        model: the module, in eval mode.
        name: the model's name (shipped name or timm name).
        weights: where the weights came from (``shipped``, ``pretrained``, a checkpoint path).
        weights_sha256: hash of the state_dict (names, dtypes, shapes and values).
        data_config: timm's data configuration (input size, interpolation, crop, mean, std).
    """

    model: nn.Module
    name: str
    weights: str
    weights_sha256: str
    data_config: dict

    def transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """PIL image → the normalized tensor the model expects."""
        return image_transform(self.data_config, normalize=True)


def weights_digest(model: nn.Module) -> str:
    """sha256 over the state_dict in order: each entry's name, dtype, shape and bytes."""
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def image_transform(data_config: dict, *, normalize: bool) -> Callable[[Image.Image], torch.Tensor]:
    """timm's evaluation transform (resize, centre crop, to tensor, normalize).

    ``normalize=False`` gives the same crop with values in [0, 1], for display.
    """
    from timm.data import create_transform

    config = dict(data_config)
    if not normalize:
        config["mean"], config["std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return create_transform(**{k: config[k] for k in ("input_size", "interpolation", "mean", "std",
                                                       "crop_pct", "crop_mode") if k in config},
                            is_training=False)


def load_model(name: str, *, checkpoint: str | Path | None = None, pretrained: bool = False,
               num_classes: int | None = None) -> LoadedModel:
    """Load ``name``: a shipped parts model (``parts_cnn``, ``parts_vit``) or a timm model.

    A shipped model loads its shipped weights, or ``checkpoint`` (a .safetensors file
    written by ``omenn_kernels.models.train``, with its JSON file beside it). A timm model
    needs its weights: either ``pretrained=True`` (timm's download, cached by the Hugging
    Face hub) or ``checkpoint`` (a state_dict file: .pth, .pt, .safetensors, possibly
    wrapped in ``{"state_dict": ...}``; see :func:`omenn_kernels.models.read_state_dict`).
    ``num_classes`` sets a timm model's head size; a shipped model's comes from its
    configuration, and a different ``num_classes`` is refused.

    Raises:
        ModelLoadError: an unknown model name, a timm model without weights, a
            ``num_classes`` below 1 or that a shipped model does not have, or a checkpoint
            that does not exist, cannot be read or does not fit the model (the message
            names the file, what is wrong, and for a head of another size the
            ``--num-classes`` that fits), or pretrained weights that cannot be fetched (no
            network, and not in the Hugging Face cache).
    """
    if num_classes is not None and num_classes < 1:
        raise ModelLoadError(f"num_classes must be at least 1, got {num_classes}")
    if checkpoint is not None and not Path(checkpoint).is_file():
        raise models.CheckpointNotFoundError(f"checkpoint not found: no file at {checkpoint}")
    if name in ("parts_cnn", "parts_vit"):
        if pretrained:
            raise ModelLoadError(f"{name} is a shipped model: its weights come with the package "
                                 "(drop --pretrained)")
        model = models.load_checkpoint(checkpoint) if checkpoint else models.load_pretrained(name)
        classes = model.head.out_features
        if num_classes is not None and num_classes != classes:
            raise ModelLoadError(f"{name} from {checkpoint or 'the shipped weights'} has {classes} classes, not "
                                 f"--num-classes {num_classes}; drop --num-classes (it is for timm models)")
        return LoadedModel(model.eval(), name, str(checkpoint) if checkpoint else "shipped",
                           weights_digest(model), dict(_SHIPPED_DATA_CONFIG))
    import timm

    if not timm.is_model(name):
        raise ModelLoadError(f"unknown model {name!r}: not a shipped model (parts_cnn, parts_vit) nor a "
                             "timm model name (see timm.list_models())")
    if not pretrained and checkpoint is None:
        raise ModelLoadError(f"the timm model {name!r} needs weights: pass --pretrained (timm downloads them) "
                             "or --checkpoint PATH; random weights explain nothing")
    if pretrained and checkpoint is not None:
        raise ModelLoadError("give either --pretrained or --checkpoint, not both")
    options = {} if num_classes is None else {"num_classes": num_classes}
    try:
        model = timm.create_model(name, pretrained=pretrained, **options)
    except OSError as error:  # the hub's and urllib's errors, offline mode's included
        if not pretrained:
            raise
        raise ModelLoadError(f"the pretrained weights of the timm model {name!r} could not be fetched "
                             f"({first_line(error)}); connect to the network, or download the weights where "
                             "there is one and pass --checkpoint PATH") from error
    if checkpoint is not None:
        heads = model.pretrained_cfg.get("classifier") or ()
        models.load_weights(model, checkpoint, model_name=f"the timm model {name!r}",
                            heads=(heads,) if isinstance(heads, str) else tuple(heads))
    data_config = timm.data.resolve_model_data_config(model)
    return LoadedModel(model.eval(), name, str(checkpoint) if checkpoint else "pretrained",
                       weights_digest(model), data_config)
