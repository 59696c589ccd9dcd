"""Explanation quality without downloads: a FunnyBirds-style data set, its protocol, the compared methods.

- :mod:`.parts_dataset` draws the synthetic parts data set (FunnyBirds' design in 2-D:
  5 part slots, 50 classes, background distractors, exact part masks, interventions);
- :mod:`.funnybirds` scores attribution methods with the FunnyBirds protocol;
- :mod:`.quantus_metrics` adds Quantus' faithfulness correlation and part-mask localisation;
- :mod:`.methods` wraps OMENN and the established methods it is compared with;
- :mod:`.benchmark` runs everything on the shipped models
  (``python -m omenn_kernels.evaluation.benchmark``).

The scoring modules need the ``eval`` extras (scipy, captum, zennit, quantus); the data
set does not. Names are therefore imported on first use, so that ``omenn demo`` and
training on the parts data set run on a plain install.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"SLOTS": ".parts_dataset", "PartsDataset": ".parts_dataset", "collate_parts": ".parts_dataset",
            "FunnyBirdsScores": ".funnybirds", "evaluate": ".funnybirds"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
