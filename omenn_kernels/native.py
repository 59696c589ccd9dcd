"""Loader of the C++ CPU kernels in ``csrc/`` (the ``omenn_cpu`` library).

The library is built just in time with ``torch.utils.cpp_extension.load`` and ninja (no
CUDA; ``-O3 -fopenmp -fno-trapping-math``), cached by torch (``$TORCH_EXTENSIONS_DIR``,
default ``~/.cache/torch_extensions``) in a folder of its own per checkout of ``csrc/``
(:func:`build_directory`), and loaded as a plain shared library, not a Python
module: loading it registers its kernels with the dispatcher (``csrc/bindings.cpp``).

``-fno-trapping-math`` changes no result (it only stops GCC from assuming that
floating-point exceptions are observed, clang's default) and lets GCC if-convert and
vectorize loops with comparisons and selects (relu, leaky_relu, hardswish, the ``S == 0``
guard). Where ATen dispatches to AVX2 or AVX-512 kernels
(``torch.backends.cpu.get_cpu_capability()``), the build targets the same instruction set,
so that the float32 GELU, tanh-GELU and SiLU loops run on ATen's SIMD vectors, as PyTorch's
own kernels do; their float64, float16 and bfloat16 loops, and the float32 loops' last
partial vector, call libm (erfc, exp) per element. Not used: ``-march=native``, which would
tie the build to one CPU, and ``-ffast-math``, which changes rounding.

``load_cpu_kernels()`` builds and loads the library at most once per process (RuntimeError
if it cannot); ``available()`` says whether it can. ``define_cpu_op`` defines an op of the
``omenn`` namespace whose CPU kernel is in the library, so that the op traces before the
build and a first call builds it; later calls, from eager code or from a compiled graph,
reach C++ without a Python frame. The library itself defines the ops that manage the packed
convolutions' reordered weights, available once it is loaded:

- ``torch.ops.omenn.packed_weight_reorders()``: how many weights the packed convolutions
  reordered so far;
- ``torch.ops.omenn.clear_packed_weights()``: drop the reordered weights they keep (returns
  how many);
- ``torch.ops.omenn.forget_packed_weight(weight)``: drop the reordered copies of one weight
  (returns how many).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import sys
import warnings
from pathlib import Path
from typing import Callable

import torch

NAME = "omenn_cpu"
CSRC = Path(__file__).resolve().parents[1] / "csrc"
SOURCES = ("activation.cpp", "attention.cpp", "conv_bias.cpp", "conv_packed.cpp", "linear_ones.cpp",
           "max_pool.cpp", "bindings.cpp")


def _simd_flags(capability: str | None = None) -> list[str]:
    """The compiler flags for the SIMD level that ATen dispatches to here (``capability``:
    ``torch.backends.cpu.get_cpu_capability()``), AVX-512 or AVX2; none for any other."""
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    if capability == "AVX512":
        return ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c",
                "-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512"]
    if capability == "AVX2":
        return ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"]
    return []


CFLAGS = ["-O3", "-fopenmp", "-fno-trapping-math", *_simd_flags()]
LDFLAGS = ["-fopenmp"]


def _find_ninja() -> str | None:
    """ninja: on PATH, beside this Python (an unactivated venv), or from pip's ``ninja``."""
    found = shutil.which("ninja")
    if found:
        return found
    beside = Path(sys.executable).parent / "ninja"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    try:
        import ninja  # the PyPI package ships the binary

        candidate = Path(ninja.BIN_DIR) / "ninja"
        if candidate.is_file():
            return str(candidate)
    except (ImportError, AttributeError):
        pass
    return None


def _preflight() -> str:
    """Check the sources and tools a build needs; return ninja's path or raise RuntimeError."""
    missing = [s for s in SOURCES if not (CSRC / s).is_file()]
    if missing:
        raise RuntimeError(
            f"the C++ sources of {NAME} are missing from {CSRC} ({', '.join(missing)}); "
            "the kernels build from a source checkout (pip install -e .)")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise RuntimeError(
            f"cannot build {NAME}: no C++ compiler, {compiler!r} is not on PATH "
            "(install g++ or clang, or set CXX)")
    ninja = _find_ninja()
    if ninja is None:
        raise RuntimeError(f"cannot build {NAME}: ninja is not installed (pip install ninja)")
    return ninja


def build_directory(csrc: Path = CSRC) -> str:
    """Where the library from the sources in ``csrc`` is built and cached: torch's folder for an
    extension named after the library and ``csrc``'s path. torch rebuilds an extension whose
    sources' paths changed, so two checkouts (a clone beside a working copy, two venvs) sharing
    one folder would each rebuild it in the other's first call."""
    from torch.utils import cpp_extension

    checkout = hashlib.sha256(str(csrc.resolve()).encode()).hexdigest()[:12]
    return cpp_extension._get_build_directory(f"{NAME}_{checkout}", verbose=False)


@functools.cache
def _build() -> BaseException | None:
    """Build and load the library once per process; a failure is remembered, not retried."""
    try:
        ninja = _preflight()
    except RuntimeError as exc:
        return exc
    # Importing cpp_extension looks for CUDA and logs a warning when there is none; these
    # sources are CPU-only, so that warning is noise here.
    cpp_logger = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_logger.level
    cpp_logger.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_logger.setLevel(level)

    path = os.environ.get("PATH", "")
    ninja_dir = str(Path(ninja).parent)
    if shutil.which("ninja") is None:  # torch runs "ninja" from PATH
        os.environ["PATH"] = ninja_dir + os.pathsep + path
    try:
        cpp_extension.load(  # loads the library with torch.ops.load_library
            name=NAME,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=LDFLAGS,
            with_cuda=False,
            is_python_module=False,
            build_directory=build_directory(),
            verbose=False,
        )
    except Exception as exc:  # compiler errors, missing OpenMP, a broken cache, ...
        error = RuntimeError(f"building the C++ library {NAME} from {CSRC} failed: {exc}")
        error.__cause__ = exc
        return error
    finally:
        os.environ["PATH"] = path
    return None


def load_cpu_kernels() -> None:
    """Build (on first use) and load the ``omenn_cpu`` library, which registers its kernels
    with the dispatcher; RuntimeError if it cannot be built or loaded."""
    error = _build()
    if error is not None:
        raise RuntimeError(str(error)) from error


@functools.cache
def available() -> bool:
    """Whether the C++ CPU kernels build and load; the reason for a failure is warned once."""
    try:
        load_cpu_kernels()
    except RuntimeError as exc:
        warnings.warn(f"omenn_kernels: the C++ CPU kernels are unavailable: {exc}",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


_LIBRARY = torch.library.Library("omenn", "FRAGMENT")


def define_cpu_op(schema: str, fake: Callable) -> torch._ops.OpOverload:
    """The op ``omenn::<schema>``, whose CPU kernel ``csrc/bindings.cpp`` registers, with ``fake``
    as its shape function. The op takes at least one tensor (an op without one reaches no CPU
    kernel) and runs on CPU tensors only.

    Until the library is loaded, a call reaches a Python kernel that builds and loads it
    (which registers the C++ kernel) and calls the op again; later calls go to C++ directly.
    The op has no autograd: it is called below the autograd of the op it serves.
    """
    name = schema.split("(", 1)[0]
    _LIBRARY.define(schema)
    op = getattr(torch.ops.omenn, name).default

    def load_then_call(*args):
        devices = sorted({a.device.type for a in args if isinstance(a, torch.Tensor)})
        if devices != ["cpu"]:
            raise RuntimeError(f"omenn::{name} runs on CPU tensors only, got tensors on {devices}")
        load_cpu_kernels()
        if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
            raise RuntimeError(f"the C++ library {NAME} loaded without registering omenn::{name}")
        return op(*args)

    _LIBRARY.impl(name, load_then_call, "CompositeExplicitAutograd")
    torch.library.register_fake(op.name(), fake, lib=_LIBRARY)
    return op
