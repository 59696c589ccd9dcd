"""The compiled backend on one GPU against forward and input × gradient, in one process.

    python bench/gpu_compiled.py --out bench/results/compiled_gpu.json

For each model (default vit_base_patch16_224 and resnet50; randomly initialized timm
models, biases and norm statistics randomized, parameters frozen; batch 64, bfloat16,
224×224) it measures, one method after the other on the same input:

- ``forward``; ``input_x_gradient`` (eager); ``input_x_gradient_compiled``
  (``torch.compile``, default mode); ``omenn_reference``, ``omenn_fused`` and
  ``omenn_compiled`` (``Explainer(model, backend=...)``, the predicted class);
- time per call: the median of ``--iterations`` calls, each between CUDA events after
  warm-up (the first calls, which capture and compile, are timed apart as ``setup_s``);
- memory: what the allocator holds after the set-up and one call (``memory_reserved``,
  the cache emptied before the method's set-up), the number compared across methods,
  since a CUDA graph's pool is reserved but not allocated between replays; and the peak
  allocated during one call (``max_memory_allocated`` after a reset), which for a CUDA
  graph counts only what lies outside its pool;
- one ``torch.profiler`` pass of one call: GPU kernels launched, their summed time and
  the twenty names that take most of it, GPU-busy fraction (the
  union of kernel and copy intervals over the span from the call's first CPU op to its
  last GPU activity), CUDA graph launches and host synchronizations (the pass ends with one
  of its own, and each host read counts its read and its wait);
- for ``omenn_compiled``: the compile seconds of the signature and whether the compiled
  graph (not the fused fallback) ran;
- correctness of each OMENN backend in the benchmark's dtype: ``Σ C − logit`` relative to
  the logit, and ``C_w`` and ``C_b`` against the reference backend in float32 on the same
  input (relative Frobenius norm).

The JSON is rewritten after every method, so a run cut off keeps what it finished. The
last lines printed are a table of every row. ``--device cpu`` runs the same script on the
CPU (timings by the wall clock, no profiler pass) to check it before a GPU run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

import torch

import timm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from omenn_kernels import Explainer  # noqa: E402
from omenn_kernels.backends import compiled as compiled_backend  # noqa: E402
from omenn_kernels.testing import randomize_, relative_distance  # noqa: E402

# In order of priority: a run cut off by its time budget keeps the first ones.
METHODS = ["forward", "input_x_gradient", "omenn_compiled", "omenn_fused", "omenn_reference",
           "input_x_gradient_compiled"]
# Tracebacks of the compiled backend's tracing and compilation failures (its warning keeps the first line only).
FAILURES: list[str] = []
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _input_x_gradient(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    inputs = x.clone().requires_grad_(True)
    logits = model(inputs)
    selected = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    (gradient,) = torch.autograd.grad(selected, inputs)
    return gradient * inputs


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _median_seconds(call: Callable, device: str, iterations: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(iterations):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
    return statistics.median(times), times


def _profile(call: Callable) -> dict:
    """Kernels, GPU-busy fraction, graph launches and host syncs of one call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.events()
    gpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    kernels = [e for e in gpu if not e.name.startswith(("Memcpy", "Memset"))]
    intervals = sorted((e.time_range.start, e.time_range.end) for e in gpu)
    busy, reach = 0.0, float("-inf")
    for start, end in intervals:  # union of the intervals
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    first = min([e.time_range.start for e in cpu] or [0])
    last = max([e.time_range.end for e in gpu] or [first])
    names = [e.name for e in cpu]
    by_name: dict[str, list] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:160], [0, 0.0])
        entry[0] += 1
        entry[1] += (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:20]
    return {
        "kernels": len(kernels),
        "gpu_busy_fraction": busy / (last - first) if last > first else None,
        "profiled_span_ms": (last - first) / 1e3,
        "cuda_graph_launches": sum(n.startswith("cudaGraphLaunch") for n in names),
        "host_syncs": sum(n in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "aten::_local_scalar_dense",
                                "cudaEventSynchronize") for n in names),
        "device_to_host_copies": sum(e.name.startswith("Memcpy DtoH") for e in gpu),
        "kernel_ms": sum(entry[1] for entry in by_name.values()),
        "top_kernels": [{"name": name, "count": count, "ms": ms} for name, (count, ms) in top],
    }


def _check(explanation, reference) -> dict:
    logit = explanation.logit.double()
    sums = explanation.contribution.double().flatten(1).sum(1)
    return {
        "completeness_relative_max": float(((sums - logit).abs() / logit.abs().clamp_min(1e-12)).max()),
        "weight_vs_reference_float32": relative_distance(explanation.weight, reference.weight),
        "bias_vs_reference_float32": relative_distance(explanation.bias, reference.bias),
        "same_targets_as_reference": bool(torch.equal(explanation.target.cpu(), reference.target.cpu())),
    }


def _recording(function: Callable, failures: list) -> Callable:
    """``function``, keeping the traceback of any exception it raises (then re-raised) in ``failures``."""
    def recorded(*args, **kwargs):
        try:
            result = function(*args, **kwargs)
        except Exception:
            failures.append(traceback.format_exc()[-4000:])
            raise
        if callable(result) and not isinstance(result, torch.nn.Module):
            return _recording(result, failures)  # make_fx returns the tracer
        return result
    return recorded


def _method(name: str, model: torch.nn.Module, x: torch.Tensor, shared: dict) -> tuple[Callable, Callable, dict]:
    """``(setup, call, info)``: ``setup()`` does what is timed apart (capture, compile, warm-up)."""
    info: dict = {}
    if name == "forward":
        def call():
            with torch.no_grad():
                return model(x)
        return lambda: (call(), call()), call, info
    if name == "input_x_gradient":
        call = lambda: _input_x_gradient(model, x)  # noqa: E731
        return lambda: (call(), call()), call, info
    if name == "input_x_gradient_compiled":
        compiled = torch.compile(_input_x_gradient)
        call = lambda: compiled(model, x)  # noqa: E731
        return lambda: (call(), call(), call()), call, info
    explainer = Explainer(model, backend=name.removeprefix("omenn_"))
    if shared:  # captured once per model: every backend runs the same linearized program
        explainer._programs, explainer._structure = shared["programs"], shared["structure"]

    def setup():
        explainer.program(x)
        shared.update(programs=explainer._programs, structure=explainer._structure)
        # compiled: the first call runs eagerly and compiles; then CUDA graph warm-up and recording
        for _ in range(3 if name == "omenn_compiled" else 2):
            explainer(x)
        if name == "omenn_compiled":
            program, _ = explainer.program(x)
            kept = list(compiled_backend.explanations(program).values())
            info["compiled_graph_ran"] = any(isinstance(k, compiled_backend.CompiledExplanation) for k in kept)
            info["compile_s"] = next((k.seconds for k in kept if hasattr(k, "seconds")), None)
            info["aten_nodes"] = next((sum(n.op == "call_function" for n in k.graph.graph.nodes)
                                       for k in kept if hasattr(k, "graph")), None)

    info["explainer"] = explainer
    return setup, lambda: explainer(x), info


def run_model(model_name: str, args, device: str, dtype: torch.dtype, write: Callable, rows: list) -> None:
    torch.manual_seed(0)
    model = randomize_(timm.create_model(model_name, pretrained=False), seed=0).to(device).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    x32 = torch.randn(args.batch, 3, 224, 224, device=device)
    reference = Explainer(model, backend="reference")(x32)  # float32 oracle of every OMENN row
    model = model.to(dtype)
    x = x32.to(dtype)
    shared: dict = {}
    for name in args.methods:
        if time.perf_counter() > args.deadline:
            print(f"{model_name} {name}: skipped, the time budget is spent", flush=True)
            continue
        gc.collect()  # the previous method's explainer, compiled graphs and CUDA graph pools
        if device == "cuda":
            torch.cuda.empty_cache()
        row = {"model": model_name, "method": name, "device": device, "dtype": str(dtype).removeprefix("torch."),
               "batch": args.batch}
        failures_before = len(FAILURES)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                setup, call, info = _method(name, model, x, shared)
                _synchronize(device)
                start = time.perf_counter()
                setup()
                _synchronize(device)
                row["setup_s"] = time.perf_counter() - start
                explainer = info.pop("explainer", None)
                row.update(info)
                if device == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                    call()
                    torch.cuda.synchronize()
                    row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
                    row["reserved_bytes"] = torch.cuda.memory_reserved()
                row["seconds"], row["all_seconds"] = _median_seconds(call, device, args.iterations)
                if device == "cuda":
                    row.update(_profile(call))
                if explainer is not None:
                    row.update(_check(call(), reference))
                from torch._dynamo.utils import counters
                row["inductor_counters"] = {k: dict(v) for k, v in counters.items() if k in ("inductor",)}
            row["warnings"] = [str(w.message)[:400] for w in caught]
            row["failure_tracebacks"] = FAILURES[failures_before:]
            del setup, call, info, explainer
        except Exception as error:  # one failing method must not cost the others' numbers
            row["error"] = f"{type(error).__name__}: {str(error)[:2000]}"
        rows.append(row)
        write()
        print(_line(row), flush=True)
    del model, reference


def _line(row: dict) -> str:
    if "error" in row:
        return f"{row['model']:22s} {row['method']:26s} ERROR {row['error'][:300]}"
    parts = [f"{row['model']:22s} {row['method']:26s} {row['seconds'] * 1e3:9.2f} ms",
             f"setup {row['setup_s']:6.1f} s"]
    if "reserved_bytes" in row:
        parts.append(f"held {row['reserved_bytes'] / 2**30:6.2f} GiB, peak {row['peak_allocated_bytes'] / 2**30:6.2f}")
    if "kernels" in row:
        parts.append(f"kernels {row['kernels']:5d} busy {row['gpu_busy_fraction'] or 0:.2f} "
                     f"graphs {row['cuda_graph_launches']} syncs {row['host_syncs']}")
    if "completeness_relative_max" in row:
        parts.append(f"|ΣC−y|/|y| {row['completeness_relative_max']:.1e} C_w {row['weight_vs_reference_float32']:.1e} "
                     f"C_b {row['bias_vs_reference_float32']:.1e}")
    if "compile_s" in row:
        parts.append(f"compile {row['compile_s']} s, graph ran {row['compiled_graph_ran']}")
    if row.get("warnings"):
        parts.append(f"warnings {len(row['warnings'])}: {row['warnings'][0][:200]}")
    return " | ".join(parts)


def _ratios(rows: list) -> list[str]:
    lines = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["method"]: r for r in rows if r["model"] == model and "seconds" in r}
        ixg, forward = by.get("input_x_gradient"), by.get("forward")
        for name, row in by.items():
            ratio_ixg = row["seconds"] / ixg["seconds"] if ixg else float("nan")
            ratio_fwd = row["seconds"] / forward["seconds"] if forward else float("nan")
            memory = (row["reserved_bytes"] / ixg["reserved_bytes"]
                      if ixg and "reserved_bytes" in row else float("nan"))
            lines.append(f"| {model} | {name} | {row['seconds'] * 1e3:.2f} | {ratio_ixg:.2f} | {ratio_fwd:.2f} | "
                         f"{memory:.2f} |")
    return lines


def _print_tables(rows: list[dict]) -> None:
    print("\n".join(_line(row) for row in rows))
    print("\n| model | method | ms | ÷ input × gradient | ÷ forward | memory held ÷ input × gradient's |")
    print("|---|---|---|---|---|---|")
    print("\n".join(_ratios(rows)))
    for row in rows:  # where the GPU time of one call goes
        if row.get("top_kernels"):
            print(f"\n{row['model']} {row['method']}: {row['kernel_ms']:.2f} ms in {row['kernels']} kernels; "
                  "the most:")
            for kernel in row["top_kernels"][:10]:
                print(f"  {kernel['ms']:7.3f} ms {kernel['count']:4d}×  {kernel['name'][:110]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["vit_base_patch16_224", "resnet50"])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="no new method starts after this many seconds")
    parser.add_argument("--out", type=Path, help="the JSON written (rewritten after each method)")
    parser.add_argument("--report", type=Path, help="print the tables of a JSON this script wrote, and exit")
    args = parser.parse_args(argv)
    if args.report is not None:
        if not args.report.is_file():
            parser.error(f"--report {args.report}: no such file")
        rows = json.loads(args.report.read_text())["rows"]
        _print_tables(rows)
        return 0
    if args.out is None:
        parser.error("--out is required (the JSON to write)")
    unknown = [name for name in args.models if not timm.is_model(name)]
    if unknown:
        parser.error(f"--models: timm has no model named {', '.join(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    args.deadline = time.perf_counter() + args.budget_s
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    machine = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor(),
        "torch": torch.__version__, "triton": triton_version, "timm": timm.__version__,
        "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv),
    }
    if args.device == "cuda":
        import subprocess
        machine["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True).stdout.strip()
    compiled_backend.make_fx = _recording(compiled_backend.make_fx, FAILURES)
    compiled_backend.COMPILER = _recording(compiled_backend.COMPILER, FAILURES)
    if args.device == "cuda":
        torch._logging.set_logs(perf_hints=True)  # Inductor says why it skips CUDA graphs
    rows: list[dict] = []
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # atomically: a run killed while writing keeps the previous JSON
        partial = args.out.with_name(args.out.name + ".partial")
        partial.write_text(json.dumps({"machine": machine, "rows": rows}, indent=1))
        os.replace(partial, args.out)

    print(machine, flush=True)
    for model_name in args.models:
        run_model(model_name, args, args.device, DTYPES[args.dtype], write, rows)
    _print_tables(rows)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
