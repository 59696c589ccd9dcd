"""Test-wide set-up.

* Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. The variable
  must be set before anything imports Triton (torchvision does, while test modules are
  collected), hence here, in the root conftest.
* The shared helper modules of this directory (``kernel_references``) are importable
  from the test files of every sub-directory.
"""

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
