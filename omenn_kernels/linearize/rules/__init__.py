"""One module per op family; importing this package registers every rule."""

from . import (activation, arithmetic, attention, conv, linear, multiplier, norm, pooling, refused, selection,
               structure)

__all__ = ["activation", "arithmetic", "attention", "conv", "linear", "multiplier", "norm", "pooling", "refused",
           "selection", "structure"]
