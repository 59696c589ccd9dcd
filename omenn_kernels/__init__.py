"""omenn_kernels: exact OMENN explanations (CVPR 2025, "One Matrix to Explain Neural Networks").

Every layer is rewritten as an input-dependent linear map of the input augmented with
a channel of ones; one forward pass with detached multipliers and one backward pass
give, per pixel, contributions that sum to the explained logit.
"""

from .api import Explainer, Explanation, explain, explainer_for, quantus_explain
from .readout import ReadoutFunction
from .tokens import TokenExplainer
from .errors import (CaptureError, InputError, InputTypeError, OmennError, OutputError, TargetError,
                     UnsupportedOpError)

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "Explainer", "Explanation", "InputError", "InputTypeError", "OmennError",
    "OutputError", "ReadoutFunction", "TargetError", "TokenExplainer", "UnsupportedOpError", "explain",
    "explainer_for", "quantus_explain", "__version__",
]
