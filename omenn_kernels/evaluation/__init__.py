"""Explanation quality without downloads: a FunnyBirds-style data set, its protocol, the compared methods.

- :mod:`.parts_dataset` draws the synthetic parts data set (FunnyBirds' design in 2-D:
  5 part slots, 50 classes, background distractors, exact part masks, interventions);
- :mod:`.funnybirds` scores attribution methods with the FunnyBirds protocol;
- :mod:`.quantus_metrics` adds Quantus' faithfulness correlation and part-mask localisation;
- :mod:`.methods` wraps OMENN and the established methods it is compared with;
- :mod:`.benchmark` runs everything on the shipped models
  (``python -m omenn_kernels.evaluation.benchmark``).
"""

from .funnybirds import FunnyBirdsScores, evaluate
from .parts_dataset import SLOTS, PartsDataset, collate_parts

__all__ = ["SLOTS", "FunnyBirdsScores", "PartsDataset", "collate_parts", "evaluate"]
