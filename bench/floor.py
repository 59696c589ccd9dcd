"""The arithmetic floor of an explanation: FLOPs and least bytes of a forward pass, input × gradient and OMENN.

    python bench/floor.py --measure-cpu --measured bench/results/*.json --out bench/results/floor.json

Counted on the meta device (no memory, no time) for vit_base_patch16_224, resnet50,
convnext_base and vgg16 (timm, 224×224) at batch 8 in float32 and batch 64 in bfloat16,
parameters frozen (every method differentiates the input alone).

FLOPs: the matrix products and convolutions, by ``torch.utils.flop_counter`` over the
forward (elementwise work is far below them and left out). With ``L``, ``C`` and ``A``
the forward FLOPs of the linear layers, the convolutions and the attention products
(``q·kᵀ`` and ``P·v``), and ``Q`` those of the ``qkv`` projections:

- forward ``F``;
- input × gradient ``F + L + C + 2A``: each linear layer's and convolution's input
  gradient costs its forward product; attention's backward four products (``dV``,
  ``dP``, ``dQ``, ``dK``), twice its forward;
- OMENN ``F + L − 2Q/3 + C + A/2``: the same, but a ``qkv`` projection's input gradient
  runs over its value third only (its query and key thirds feed only the held attention
  weights) and attention's backward is ``dV = Pᵀ·dY`` alone. The ones channel adds one
  value per position, nothing at this scale.

Bytes, the least any method moves through memory: the forward reads the parameters and
the input once; a backward reads the parameters again, writes and reads back what the
forward saves for it (what autograd saves for input × gradient, counted with
``saved_tensors_hooks``; OMENN's backward needs the same: each held multiplier's input,
the normalizations' statistics, and attention's ``q``, ``k`` and ``v``, since ``dV`` needs
``P``), and writes the gradient (OMENN: ``C_w``, and ``C_b`` with one value per pixel).

The floor time is ``max(FLOPs / rate, bytes / bandwidth)``: on an H200 (bf16 rows) the
rates measured on one such machine of this workplace (``/work/.library/device/KINDS.md``:
788 TFLOP/s for a bf16 8192³ product on random data, 4.3 TB/s for a device-to-device copy
counting reads and writes); on the CPU (float32 rows) the rates ``--measure-cpu`` measures
here (float32 products of 1024³ to 3072³ and a 1 GiB copy, the best calls, at torch's
thread count). ``--measured``
reads the times of ``bench/gpu_compiled.py`` and ``bench/test_end_to_end.py`` results and
prints each over its floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

import timm

MODELS = ["vit_base_patch16_224", "resnet50", "convnext_base", "vgg16"]
SETTINGS = [(8, torch.float32), (64, torch.bfloat16)]
H200 = {"name": "NVIDIA H200", "flops_per_s": 788e12, "bytes_per_s": 4.3e12}  # KINDS.md, measured here
CONV_OPS = ("aten.convolution",)
LINEAR_OPS = ("aten.mm", "aten.addmm")


def counts(model_name: str, batch: int, dtype: torch.dtype) -> dict:
    """FLOPs and bytes of forward, input × gradient and OMENN (see the module docstring)."""
    with torch.device("meta"):
        model = timm.create_model(model_name, pretrained=False).to(dtype).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    x = torch.empty(batch, 3, 224, 224, device="meta", dtype=dtype, requires_grad=True)
    parameters = {id(p) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        if id(tensor) not in parameters and tensor.device.type == "meta":
            saved.setdefault(id(tensor), tensor.numel() * tensor.element_size())
        return tensor

    with FlopCounterMode(display=False, depth=None) as counter, \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(x)
    by_module = counter.get_flop_counts()
    total = by_module["Global"]
    forward = sum(total.values())
    conv = sum(v for op, v in total.items() if str(op) in CONV_OPS)
    linear = sum(v for op, v in total.items() if str(op) in LINEAR_OPS)
    attention = forward - conv - linear  # bmm / scaled-dot-product products
    qkv = sum(sum(ops.values()) for name, ops in by_module.items() if name.endswith(".qkv"))
    size = dtype.itemsize
    parameter_bytes = sum(p.numel() for p in model.parameters()) * size
    input_bytes = x.numel() * size
    saved_bytes = sum(saved.values())
    forward_bytes = parameter_bytes + input_bytes + logits.numel() * size
    gradient_bytes = 2 * parameter_bytes + 2 * input_bytes + 2 * saved_bytes
    omenn_bytes = gradient_bytes + batch * 224 * 224 * size  # C_b: one value per pixel
    return {
        "model": model_name, "batch": batch, "dtype": str(dtype).removeprefix("torch."),
        "flops": {"forward": forward, "input_x_gradient": forward + linear + conv + 2 * attention,
                  "omenn": forward + linear - 2 * qkv / 3 + conv + attention / 2},
        "bytes": {"forward": forward_bytes, "input_x_gradient": gradient_bytes, "omenn": omenn_bytes},
        "parts": {"linear": linear, "conv": conv, "attention": attention, "qkv": qkv,
                  "parameter_bytes": parameter_bytes, "saved_bytes": saved_bytes},
    }


def measure_cpu() -> dict:
    """This CPU's float32 matrix-product rate and copy bandwidth, at torch's thread count: the best
    of five calls at each of three sizes (a ceiling, so the best, not the median)."""
    rate = 0.0
    for n in (1024, 2048, 3072):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)
        rate = max(rate, 2 * n ** 3 / min(_seconds(lambda: torch.mm(a, b)) for _ in range(5)))
    source = torch.randn(2 ** 28)  # 1 GiB
    target = torch.empty_like(source)
    target.copy_(source)
    bandwidth = 2 * source.numel() * 4 / min(_seconds(lambda: target.copy_(source)) for _ in range(3))
    return {"name": f"CPU, {torch.get_num_threads()} thread(s)", "flops_per_s": rate, "bytes_per_s": bandwidth}


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def floor_seconds(row: dict, method: str, device: dict) -> float:
    return max(row["flops"][method] / device["flops_per_s"], row["bytes"][method] / device["bytes_per_s"])


_METHODS = {"forward": "forward", "input_x_gradient": "input_x_gradient", "omenn_compiled": "omenn",
            "omenn_fused": "omenn", "omenn_reference": "omenn", "input_x_gradient_compiled": "input_x_gradient"}


def measured_times(paths: list[Path]) -> list[dict]:
    """(model, batch, dtype, method, seconds, source) from gpu_compiled.py and pytest-benchmark JSONs."""
    found = []
    for path in paths:
        data = json.loads(path.read_text())
        if "rows" in data:  # bench/gpu_compiled.py
            for row in data["rows"]:
                if "seconds" in row and row["method"] in _METHODS:
                    found.append({**{k: row[k] for k in ("model", "batch", "dtype", "method", "seconds")},
                                  "source": path.name})
        for bench in data.get("benchmarks", []):  # bench/test_end_to_end.py
            name = bench["name"]
            if not name.startswith("test_end_to_end[") or bench.get("group") is None:
                continue
            model, method = name[len("test_end_to_end["):-1].rsplit("-", 1)
            group = bench["group"].split()  # "<model> <device> <dtype> batch <B>"
            if method in _METHODS and len(group) == 5:
                found.append({"model": model, "batch": int(group[4]), "dtype": group[2], "method": method,
                              "seconds": bench["stats"]["median"], "source": path.name})
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="the JSON written")
    parser.add_argument("--measure-cpu", action="store_true", help="measure this CPU's rates for the float32 rows")
    parser.add_argument("--measured", type=Path, nargs="*", default=[],
                        help="JSON results whose times are set over their floor")
    args = parser.parse_args(argv)
    for path in args.measured:
        if not path.is_file():
            parser.error(f"--measured {path}: no such file")
    cpu = measure_cpu() if args.measure_cpu else None
    rows = [counts(model, batch, dtype) for model in MODELS for batch, dtype in SETTINGS]
    print("| model | batch, dtype | GFLOP forward / input × gradient / OMENN | OMENN ÷ input × gradient, FLOPs "
          "| GB forward / input × gradient / OMENN | floor ms forward / input × gradient / OMENN (device) |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        device = H200 if row["dtype"] == "bfloat16" else cpu
        methods = ("forward", "input_x_gradient", "omenn")
        if device is not None:
            row["floor_s"] = {m: floor_seconds(row, m, device) for m in methods}
            row["floor_device"] = device
        floors = " / ".join(f"{row['floor_s'][m] * 1e3:.1f}" for m in methods) + f" ({device['name']})" \
            if device else "(no rates: --measure-cpu)"
        print(f"| {row['model']} | {row['batch']}, {row['dtype']} | "
              + " / ".join(f"{row['flops'][m] / 1e9:.0f}" for m in methods)
              + f" | {row['flops']['omenn'] / row['flops']['input_x_gradient']:.3f} | "
              + " / ".join(f"{row['bytes'][m] / 1e9:.2f}" for m in methods) + f" | {floors} |")
    over = []
    for time_row in measured_times(args.measured):
        match = next((r for r in rows if (r["model"], r["batch"], r["dtype"]) ==
                      (time_row["model"], time_row["batch"], time_row["dtype"]) and "floor_s" in r), None)
        if match is not None:
            floor = match["floor_s"][_METHODS[time_row["method"]]]
            over.append({**time_row, "floor_s": floor, "over_floor": time_row["seconds"] / floor})
    if over:
        print("\n| model | batch, dtype | method | measured ms | floor ms | measured ÷ floor | source |")
        print("|---|---|---|---|---|---|---|")
        for r in over:
            print(f"| {r['model']} | {r['batch']}, {r['dtype']} | {r['method']} | {r['seconds'] * 1e3:.1f} | "
                  f"{r['floor_s'] * 1e3:.1f} | {r['over_floor']:.1f} | {r['source']} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"cpu": cpu, "h200": H200, "rows": rows, "measured_over_floor": over},
                                       indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
