"""Completeness of OMENN on every supported model family, in float64 and float32.

For each family (randomly initialized, biases and norm statistics randomized), explains
the predicted class of a random batch and reports ``max |Σ C − logit| / |logit|``
against the model's own forward. Writes ``bench/results/completeness.{json,md}``.

    python bench/completeness.py [--full-size] [--batch 2]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time
from pathlib import Path

import torch

from omenn_kernels import Explainer, __version__
from omenn_kernels.testing import FAMILIES, FULL_SIZE, randomize_, relative_completeness_error

RESULTS = Path(__file__).parent / "results"


def measure(name: str, family, batch: int, dtype: torch.dtype) -> dict:
    torch.manual_seed(0)
    model = randomize_(family.build()).to(dtype).eval()
    x = torch.randn(batch, 3, family.size, family.size, dtype=dtype)
    start = time.perf_counter()
    explanation = Explainer(model)(x)
    seconds = time.perf_counter() - start
    return {"family": name, "model": family.description, "input": f"{batch}x3x{family.size}x{family.size}",
            "dtype": str(dtype).replace("torch.", ""),
            "relative_error": relative_completeness_error(model, x, explanation),
            "seconds_with_capture": round(seconds, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full-size", action="store_true", help="also the full-size 224x224 models")
    parser.add_argument("--batch", type=int, default=2)
    args = parser.parse_args()
    families = dict(FAMILIES, **(FULL_SIZE if args.full_size else {}))
    rows = []
    for name, family in families.items():
        for dtype in (torch.float64, torch.float32):
            rows.append(measure(name, family, 1 if name in FULL_SIZE else args.batch, dtype))
            print(f"{name:24s} {rows[-1]['dtype']:8s} {rows[-1]['relative_error']:.2e}", flush=True)
    machine = {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "omenn_kernels": __version__,
               "date": datetime.date.today().isoformat()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "completeness.json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    by_family: dict[str, dict] = {}
    for row in rows:
        by_family.setdefault(row["family"], {"model": row["model"], "input": row["input"]})[row["dtype"]] = row["relative_error"]
    lines = ["| family | model | input | float64 | float32 |", "|---|---|---|---|---|"]
    lines += [f"| {f} | {r['model']} | {r['input']} | {r['float64']:.1e} | {r['float32']:.1e} |"
              for f, r in by_family.items()]
    (RESULTS / "completeness.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
