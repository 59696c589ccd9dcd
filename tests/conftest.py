"""Test-wide set-up.

* Without CUDA, Triton kernels run in Triton's interpreter on CPU tensors. The variable
  must be set before anything imports Triton (torchvision does, while test modules are
  collected), hence here, in the root conftest.
* Image folders drawn from the parts data set, for the bulk-explanation and CLI tests.
* The shared helper modules of this directory (``kernel_references``) are importable
  from the test files of every sub-directory.
* Under pytest-xdist (``-n N``) each worker process gets its share of the cores, instead
  of every worker starting as many threads as there are cores.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, _CORES // _WORKERS))

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


@pytest.fixture(scope="session")
def parts_folder(tmp_path_factory) -> Path:
    """An ImageFolder tree of 20 drawn test images (class folders named by class index)."""
    from omenn_kernels.demo import draw_images

    folder = tmp_path_factory.mktemp("parts") / "images"
    draw_images(folder, 20)
    return folder


@pytest.fixture(scope="session")
def folder_with_corrupt_file(tmp_path_factory) -> Path:
    """Six drawn images and, in the middle of the sorted list, a truncated PNG."""
    from omenn_kernels.demo import draw_images

    folder = tmp_path_factory.mktemp("corrupt") / "images"
    draw_images(folder, 6)
    good = next(iter(sorted(folder.rglob("*.png"))))
    (good.parent / "0000b.png").write_bytes(good.read_bytes()[:60])
    return folder


@pytest.fixture
def full_float32_on_cuda():
    """cuDNN and cuBLAS in full float32 (no TF32), so that differences are the kernels', not rounding's."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved
