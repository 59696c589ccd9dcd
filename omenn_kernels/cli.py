"""The ``omenn`` command: ``build`` (the C++ CPU kernels), ``demo``, ``explain`` (a folder into a
store) and ``show`` (overlays).

Exit codes: 0 done; 1 a defect, an error that is not about the input (traceback
logged); 2 a usage or input error: a bad option, or any :class:`~omenn_kernels.errors.OmennError`
(a one-line reason on stderr that names the value, file or folder); 3 done, but some
images could not be read (recorded as failed in the store); 4 the C++ CPU kernels could not
be built (the reason on stderr; the library works without them); 130 interrupted by Ctrl-C or
SIGTERM (finished batches are kept: run the same command again to resume).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Iterator

from .cpu_memory import keep_freed_memory
from .errors import OmennError
from .bulk.store import STORE_DTYPES, check_components

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_FAILED_IMAGES, EXIT_NO_KERNELS, EXIT_INTERRUPTED = 0, 1, 2, 3, 4, 130

log = logging.getLogger("omenn_kernels.cli")

_EPILOG = """exit codes: 0 done; 1 unexpected error (a defect: please report it); 2 usage or input error;
3 done with unreadable images (recorded as failed); 4 the C++ kernels could not be built; 130 interrupted
by Ctrl-C or SIGTERM (run again to resume)"""


def _components(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    try:
        check_components(names)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return names


def _indices(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"image indices must be comma-separated integers, got {text!r}") from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be ≥ 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omenn", description="Exact OMENN explanations of image "
                                     "classifiers, for whole data sets.", epilog=_EPILOG)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    common.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no progress bar")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    commands.add_parser("build", parents=[common], epilog=_EPILOG,
                        help="build the C++ CPU kernels now (once per machine and torch version; else the "
                        "fused backend's first call builds them)")

    demo = commands.add_parser("demo", parents=[common], help="offline demo: the shipped model on drawn images "
                               "→ overlays and a completeness report", epilog=_EPILOG)
    demo.add_argument("--out", type=Path, default=Path("omenn_demo"), help="output folder (default: omenn_demo)")
    demo.add_argument("--model", default="parts_vit", choices=["parts_vit", "parts_cnn"])
    demo.add_argument("--images", type=_positive, default=8, help="images to draw and explain (default: 8)")
    demo.add_argument("--backend", default="reference", choices=["reference", "fused", "auto"],
                      help="'fused' compiles the C++ kernels on first use (needs g++)")

    explain = commands.add_parser("explain", parents=[common], epilog=_EPILOG,
                                  help="explain every image of a folder into an attribution store")
    explain.add_argument("source", type=Path, help="a folder of images, or one sub-folder per class "
                         "(integer folder names are used as class indices)")
    explain.add_argument("--out", type=Path, required=True, help="the attribution store (a zarr folder); "
                         "an existing store of the same run is resumed")
    explain.add_argument("--model", required=True, help="parts_vit, parts_cnn, or a timm model name")
    weights = explain.add_mutually_exclusive_group()
    weights.add_argument("--checkpoint", type=Path, help="weights file (timm: .pth/.safetensors state_dict)")
    weights.add_argument("--pretrained", action="store_true", help="timm's pretrained weights (downloads)")
    explain.add_argument("--num-classes", type=_positive, help="timm: number of classes of the checkpoint's head")
    explain.add_argument("--targets", default="predicted", help="comma-separated: predicted, label, a class "
                         "index, topK, or a contrast a-b (a, b: index, predicted or label); default predicted")
    explain.add_argument("--batch-size", type=_positive, default=32, help="images per batch and per store chunk")
    explain.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                         help="compute dtype (bf16/fp16 through autocast)")
    explain.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu, cuda or cuda:N")
    explain.add_argument("--backend", default="auto", choices=["auto", "fused", "reference", "compiled"],
                         help="auto (default): compiled where the run is long enough to pay for compiling, "
                         "else fused on the CPU and reference on CUDA; one backend for the whole run, a "
                         "resumed run keeps its store's; compiled: the explanation compiled once (tens of "
                         "seconds) and then run as one graph")
    explain.add_argument("--store-dtype", default="float16", choices=list(STORE_DTYPES))
    explain.add_argument("--components", type=_components, default=("contribution",),
                         help="what to store besides logits and targets: contribution[,weighted_input][,bias]")
    explain.add_argument("--workers", type=int, default=_default_workers(),
                         help="image-loading processes; 0: a thread of this process reads ahead (the "
                              "default on machines of up to 2 cores, where worker processes take the "
                              "model's cores)")
    explain.add_argument("--overwrite", action="store_true", help="replace an existing store instead of resuming")
    explain.add_argument("--allow-mixed", action="store_true",
                         help="resume a store whose explained images come from another backend (a compiled run's "
                         "fallback to fused included) or another omenn_kernels or torch version; refused by "
                         "default, as it mixes their numbers")
    explain.add_argument("--no-verify", dest="verify", action="store_false",
                         help="resume without first reading back the batches marked done (by default a resumed run "
                         "reads the finished part of the store once and explains damaged batches again)")

    show = commands.add_parser("show", parents=[common], help="draw overlays from an attribution store", epilog=_EPILOG)
    show.add_argument("store", type=Path)
    show.add_argument("--out", type=Path, required=True, help="folder for target<t>.png")
    show.add_argument("--images", type=_indices, help="comma-separated image indices (default: the first explained)")
    show.add_argument("--limit", type=_positive, default=16, help="images per overlay (default: 16)")
    show.add_argument("--source", type=Path, help="the image folder, if it moved since the run")
    show.add_argument("--postprocess", action="store_true", help="the paper's display post-processing")
    return parser


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _default_workers() -> int:
    """0 (reading on a thread) on up to 2 cores, else one loader process per spare core, at most 4.

    Measured on 2 cores (bench/test_pipeline.py): a reading thread kept the batch loop at
    94 % of OMENN on preloaded tensors, 1 and 2 worker processes at 76 % and 72 %.
    """
    cores = os.cpu_count() or 1
    return 0 if cores <= 2 else min(4, cores - 1)


def _setup_logging(verbose: bool, quiet: bool) -> None:
    rank = os.environ.get("RANK")
    prefix = f"[rank {rank}] " if rank is not None and os.environ.get("WORLD_SIZE", "1") != "1" else ""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO,
                        format=f"%(asctime)s %(levelname)s {prefix}%(message)s", datefmt="%H:%M:%S")


def _explain(args: argparse.Namespace) -> int:
    from .bulk.run import RunConfig, explain_folder

    summary = explain_folder(RunConfig(
        source=args.source, out=args.out, model=args.model, checkpoint=args.checkpoint,
        pretrained=args.pretrained, num_classes=args.num_classes, targets=args.targets,
        batch_size=args.batch_size, dtype=args.dtype, device=args.device, backend=args.backend,
        store_dtype=args.store_dtype, components=args.components, workers=args.workers,
        overwrite=args.overwrite, progress=not args.quiet, allow_mixed=args.allow_mixed, verify=args.verify))
    return EXIT_FAILED_IMAGES if summary.totals.get("failed") else EXIT_OK


def _build() -> int:
    """Build and load the C++ CPU kernels, saying how long it took and where torch caches them."""
    import time

    from .native import NAME, load_cpu_kernels

    from torch.utils.cpp_extension import get_default_build_root

    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    log.info("building the C++ CPU kernels (%s; a minute or more the first time)", NAME)
    start = time.perf_counter()
    try:
        load_cpu_kernels()
    except RuntimeError as error:
        print(f"omenn build: error: {_one_line(str(error))}. omenn_kernels works without them: the fused "
              "backend then runs its ops' PyTorch math on the CPU, more slowly", file=sys.stderr)
        return EXIT_NO_KERNELS
    print(f"omenn build: the C++ CPU kernels {NAME} are built and loaded ({time.perf_counter() - start:.0f} s; "
          f"torch keeps them in {cache} for later processes)")
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    from .bulk.overlays import write_overlays
    from .bulk.store import AttributionStore

    written = write_overlays(AttributionStore.open(args.store), args.out, indices=args.images, limit=args.limit,
                             source=args.source, postprocessed=args.postprocess)
    for path in written:
        print(path)
    return EXIT_OK


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``, a batch scheduler stopping the job) ends the command as Ctrl-C does: the
    batch in progress is dropped, the store's lock released, exit 130. Python runs signal
    handlers in the main thread only; elsewhere (the command called from a thread) SIGTERM keeps
    its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: list[str] | None = None) -> int:
    """Run the ``omenn`` command; returns its exit code."""
    args = _parser().parse_args(argv)
    _setup_logging(args.verbose, args.quiet)
    if args.command == "demo" or (args.command == "explain" and args.device == "cpu"):
        # The command owns the process: freed tensors stay mapped for the next batch.
        log.debug("glibc keeps freed memory: %s", keep_freed_memory())
    try:
        with _terminate_as_interrupt():
            if args.command == "build":
                return _build()
            if args.command == "demo":
                from .demo import run_demo

                return run_demo(args.out, model=args.model, images=args.images, backend=args.backend,
                                progress=not args.quiet)
            return _explain(args) if args.command == "explain" else _show(args)
    except KeyboardInterrupt:
        log.error("interrupted; %s", {
            "explain": "finished batches are in the store: run the same command again to resume",
            "demo": f"{args.out} may hold part of the demo: remove it, or pass another --out",
        }.get(args.command, "run the same command again"))
        return EXIT_INTERRUPTED
    except OmennError as error:
        print(f"omenn {args.command}: error: {_one_line(str(error))}", file=sys.stderr)
        return EXIT_USAGE
    except Exception:  # not an input error: a defect, reported with its traceback
        log.exception("omenn %s failed with an unexpected error (a defect, not an input error)", args.command)
        return EXIT_ERROR


def _one_line(message: str) -> str:
    """``message`` with its line breaks (and the indentation after them) collapsed to single spaces."""
    return re.sub(r"\s*\n\s*", " ", message).strip()


def entry_point() -> None:
    """The console script."""
    sys.exit(main())


if __name__ == "__main__":
    entry_point()
