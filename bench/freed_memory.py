"""``omenn explain`` on the CPU with glibc's defaults against ``keep_freed_memory()``.

Each run is a fresh process, as a command is (the allocator's state depends on the
process's history, which inside one pytest session is that of all earlier benchmarks):
``explain_folder`` on 512 drawn parts images, batch 32, targets ``predicted,top3``, the
``auto`` backend, 1 torch thread, no loader workers, runs alternating between the two
settings. Writes the batch-loop images/s and whole-call seconds of every run.

    python bench/freed_memory.py --rounds 3 --json bench/results/freed_memory_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MODELS = ("parts_vit", "parts_cnn")
SETTINGS = ("default", "kept")

_RUN = """
import json, sys, time, torch
torch.set_num_threads(1)
from omenn_kernels.cpu_memory import keep_freed_memory
from omenn_kernels.bulk.run import RunConfig, explain_folder
setting, model, images, store = sys.argv[1:]
if setting == "kept":
    keep_freed_memory()
start = time.perf_counter()
summary = explain_folder(RunConfig(images, store, model=model, targets="predicted,top3", batch_size=32,
                                   backend="auto", device="cpu", workers=0, progress=False))
print(json.dumps({"seconds": time.perf_counter() - start, "loop_images_per_second": summary.images_per_second}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    from omenn_kernels.demo import draw_images
    from omenn_kernels.models.train import cpu_model

    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        images = Path(scratch) / "images"
        draw_images(images, 512)
        for round_ in range(args.rounds):
            for model in MODELS:
                for setting in SETTINGS:
                    store = Path(scratch) / f"{model}-{setting}-{round_}.zarr"
                    done = subprocess.run([sys.executable, "-c", _RUN, setting, model, str(images), str(store)],
                                          capture_output=True, text=True, check=True)
                    runs.append({"model": model, "setting": setting, **json.loads(done.stdout)})
    print("| model | setting | batch-loop images/s (median) | whole call (median) |\n|---|---|---|---|")
    for model in MODELS:
        for setting in SETTINGS:
            mine = [r for r in runs if r["model"] == model and r["setting"] == setting]
            print(f"| {model} | {setting} | {statistics.median(r['loop_images_per_second'] for r in mine):.0f} "
                  f"| {statistics.median(r['seconds'] for r in mine):.2f} s |")
    args.json.write_text(json.dumps({"cpu": cpu_model(), "date": datetime.date.today().isoformat(),
                                     "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
