"""Exceptions raised by omenn_kernels.

Every error names what is wrong and, where it comes from the model, where in the
model it happens, so that a user can fix the model or the call.
"""

from __future__ import annotations


class OmennError(Exception):
    """Base class of every error raised by omenn_kernels."""


class CaptureError(OmennError, RuntimeError):
    """The model's forward could not be captured as a graph by ``torch.export``."""


class UnsupportedOpError(OmennError, NotImplementedError):
    """An operation of the model has no OMENN rule, or is used in a way no rule covers.

    Attributes:
        op: the aten operation, e.g. ``"aten.mul.Tensor"``.
        module_path: dotted path of the submodule where it occurs (``""`` for the root).
        rule_kind: the kind of rule it would need, in the words of the rule book.
    """

    def __init__(self, message: str, *, op: str, module_path: str, rule_kind: str) -> None:
        super().__init__(message)
        self.op = op
        self.module_path = module_path
        self.rule_kind = rule_kind


class InputError(OmennError, ValueError):
    """The input (images, other features, or token ids with their attention mask) cannot be explained as given."""


class TargetError(OmennError, ValueError):
    """The target (class index, indices or read-out weights) does not fit the model's output."""


class OutputError(CaptureError):
    """The model's output holds no tensor that the output selector picks as the explained logits."""


class InputTypeError(OmennError, TypeError):
    """The input is not a floating-point tensor of the model's dtype."""


class StoreError(OmennError, ValueError):
    """An attribution store cannot be created, opened, replaced or written as asked."""


class StoreLockedError(StoreError):
    """Another process is writing the attribution store."""


class ModelLoadError(OmennError, ValueError):
    """A model name, or a weights file, that cannot be loaded as the model asked for."""


class ImageSourceError(OmennError, ValueError):
    """An image folder that cannot be explained as given (missing, empty, mixed, bad class folders)."""


class ImageDecodeError(OmennError, ValueError):
    """An image whose mode or values cannot be decoded into an RGB image with values in [0, 1]."""


class OptionError(OmennError, ValueError):
    """A run option (device, dtype, batch size, ...) that is not valid."""


def first_line(error: BaseException) -> str:
    """``error`` as one line for a message: its type and the first line of its text."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else repr(error)}"
