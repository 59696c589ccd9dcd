"""Explaining whole data sets: image folders, target specifications, the attribution store.

``explain_folder(RunConfig(...))`` is what ``omenn explain`` runs; ``AttributionStore``
reads its output; ``StoreLock`` is the one-writer-per-store lock a run holds.
"""

from .images import ImageList, list_images
from .lock import LockFileError, StoreLock
from .model_source import LoadedModel, load_model
from .run import RunConfig, RunSummary, explain_folder
from .store import AttributionStore, StoreMismatchError
from .targets import TargetSpec, parse_targets, readout_weights

__all__ = ["AttributionStore", "ImageList", "LoadedModel", "LockFileError", "RunConfig", "RunSummary", "StoreLock",
           "StoreMismatchError", "TargetSpec", "explain_folder", "list_images", "load_model", "parse_targets",
           "readout_weights"]
