"""OMENN's attention (forward with log-sum-exp, ``dV``-only backward) against SDPA, on one GPU.

    python bench/gpu_attention.py --out bench/results/attention_gpu.json

For each shape (default: B 64, H 12, T 197, d 64 — ViT-B/16 at batch 64 — and B 8, H 12,
T 1024, d 64), bfloat16, it times each variant as one CUDA graph (captured after warm-up,
then replayed: the median over ``--rounds`` rounds of ``--replays`` replays between CUDA
events), so that launch overhead does not count:

- ``omenn_forward``: the Triton forward of ``omenn::attention`` (output and ``lse``);
- ``omenn_forward_backward_dv``: that forward and the ``dV``-only Triton backward;
- ``sdpa_forward``: ``F.scaled_dot_product_attention`` (PyTorch's choice of kernel);
- ``sdpa_forward_full_backward``: SDPA's forward and its backward to ``q``, ``k`` and ``v``
  (what autograd runs for input × gradient);
- ``flash_forward_lse`` / ``efficient_forward_lse`` / ``cudnn_forward_lse``: PyTorch's
  flash, memory-efficient and cuDNN kernels asked for the log-sum-exp, the forwards that
  could replace the Triton one;
- ``<kernel>_forward_backward_dv``: each of those forwards with the Triton ``dV`` backward
  fed its log-sum-exp.

Accuracy against the float32 written-out reference (relative Frobenius norm) is recorded
for every output and ``dV``, so that a log-sum-exp of another convention (base 2, padded)
shows as a wrong ``dV`` rather than a fast one. A variant that PyTorch refuses (no kernel
for the shape or the card) is recorded with its error. The JSON is rewritten after every
variant.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omenn_kernels.ops import attention as attention_op  # noqa: E402
from omenn_kernels.testing import relative_distance  # noqa: E402

SHAPES = ["64,12,197,64", "8,12,1024,64"]


def _graph_ms(call: Callable, replays: int, rounds: int) -> float:
    """Median milliseconds of one ``call`` replayed as a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / replays)
    return statistics.median(times)


def _lse_forwards(q, k, v, scale) -> dict[str, Callable]:
    """PyTorch's attention kernels that return the natural-log log-sum-exp, ``(out, lse)``."""
    tq = q.shape[2]
    aten = torch.ops.aten

    def out_lse(result) -> tuple[torch.Tensor, torch.Tensor]:
        # (B, H, Tq), also where a kernel pads the query axis or keeps a trailing 1
        return result[0], result[1].flatten(2)[..., :tq]

    return {
        "flash": lambda: out_lse(aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)),
        "efficient": lambda: out_lse(aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, False, scale=scale)),
        "cudnn": lambda: out_lse(aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, False, False, scale=scale)),
    }


def run_shape(shape: tuple[int, int, int, int], args, record: Callable) -> None:
    B, H, T, D = shape
    dtype = torch.bfloat16
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, T, D, device="cuda", dtype=dtype, generator=generator) for _ in range(4))
    scale = D ** -0.5
    with torch.no_grad():
        out_ref, lse_ref = attention_op.reference(q.float(), k.float(), v.float(), None, scale)
        dv_ref = attention_op.reference_backward_dv(q.float(), k.float(), grad.float(), lse_ref, None, scale)

    from omenn_kernels.triton_kernels.attention import attention_backward_dv, attention_forward

    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    variants: dict[str, tuple[Callable, Callable | None]] = {
        "omenn_forward": (lambda: attention_forward(q, k, v, scale), lambda r: {"out": relative_distance(r[0], out_ref)}),
        "omenn_forward_backward_dv": (
            lambda: attention_backward_dv(q, k, grad, attention_forward(q, k, v, scale)[1], scale),
            lambda r: {"dv": relative_distance(r, dv_ref)}),
        "sdpa_forward": (lambda: F.scaled_dot_product_attention(q, k, v, scale=scale),
                         lambda r: {"out": relative_distance(r, out_ref)}),
        "sdpa_forward_full_backward": (
            lambda: torch.autograd.grad(F.scaled_dot_product_attention(qg, kg, vg, scale=scale), (qg, kg, vg), grad),
            lambda r: {"dv": relative_distance(r[2], dv_ref)}),
    }
    for kernel, forward in _lse_forwards(q, k, v, scale).items():
        variants[f"{kernel}_forward_lse"] = (
            forward, lambda r: {"out": relative_distance(r[0], out_ref), "lse": relative_distance(r[1], lse_ref)})
        variants[f"{kernel}_forward_backward_dv"] = (
            lambda forward=forward: attention_backward_dv(q, k, grad, forward()[1].float(), scale),
            lambda r: {"dv": relative_distance(r, dv_ref)})

    for name, (call, check) in variants.items():
        row = {"shape": list(shape), "dtype": "bfloat16", "variant": name}
        try:
            with torch.no_grad() if "full_backward" not in name else torch.enable_grad():
                row["accuracy"] = check(call())
                row["ms"] = _graph_ms(call, args.replays, args.rounds)
        except Exception as error:  # a kernel PyTorch does not offer for this shape or card
            row["error"] = f"{type(error).__name__}: {error}"[:500]
            row["traceback"] = traceback.format_exc()[-2000:]
            torch.cuda.synchronize()
        record(row)
        print(_line(row), flush=True)


def _line(row: dict) -> str:
    shape = "×".join(map(str, row["shape"]))
    if "error" in row:
        return f"{shape:16} {row['variant']:32} error: {row['error'][:120]}"
    accuracy = " ".join(f"{k} {v:.1e}" for k, v in row["accuracy"].items())
    return f"{shape:16} {row['variant']:32} {row['ms']:8.3f} ms | {accuracy}"


def _print_table(rows: list[dict]) -> None:
    print("\n| B×H×T×d | variant | ms | ÷ SDPA forward + full backward | accuracy |\n|---|---|---|---|---|")
    for row in rows:
        if "error" in row:
            continue
        base = next((r.get("ms") for r in rows if r["shape"] == row["shape"]
                     and r["variant"] == "sdpa_forward_full_backward"), None)
        ratio = f"{row['ms'] / base:.2f}" if base else "–"
        accuracy = ", ".join(f"{k} {v:.1e}" for k, v in row["accuracy"].items())
        print(f"| {'×'.join(map(str, row['shape']))} | {row['variant']} | {row['ms']:.3f} | {ratio} | {accuracy} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="JSON file to write (rewritten after every variant)")
    parser.add_argument("--shapes", nargs="+", default=SHAPES, help="B,H,T,d per shape")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--report", type=Path, help="print the table of a JSON written earlier, and exit")
    args = parser.parse_args(argv)
    if args.report:
        _print_table(json.loads(args.report.read_text())["rows"])
        return 0
    if not torch.cuda.is_available():
        print("gpu_attention.py needs a CUDA device", file=sys.stderr)
        return 2
    try:
        shapes = [tuple(int(n) for n in s.split(",")) for s in args.shapes]
        if any(len(s) != 4 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        print(f"--shapes takes B,H,T,d with four positive integers; got {args.shapes}", file=sys.stderr)
        return 2
    import triton

    result = {"machine": {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                          "triton": triton.__version__, "cuda": torch.version.cuda,
                          "python": platform.python_version(),
                          "command": " ".join([Path(sys.argv[0]).as_posix()] + sys.argv[1:])},
              "rows": []}

    def record(row: dict) -> None:
        result["rows"].append(row)
        if args.out:  # atomically: a run killed while writing keeps the previous JSON
            args.out.parent.mkdir(parents=True, exist_ok=True)
            partial = args.out.with_suffix(".partial")
            partial.write_text(json.dumps(result, indent=1))
            os.replace(partial, args.out)

    for shape in shapes:
        run_shape(shape, args, record)
    _print_table(result["rows"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
