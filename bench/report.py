"""Markdown tables from the pytest-benchmark JSON results in ``bench/results/``.

    python bench/report.py bench/results/end_to_end_cpu.json bench/results/kernels_cpu.json

End-to-end groups get each method's median time and peak memory, each also as a
ratio to input × gradient; kernel groups the median of each variant.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict


def _variant(name: str, group: str) -> str:
    """The parameter id of a benchmark without the parts its group already names."""
    if "[" not in name:
        return name
    parts = name.split("[", 1)[1].rstrip("]").split("-")
    return "-".join(p for p in parts if p not in group) or parts[-1]


def table(path: str) -> str:
    data = json.load(open(path))
    machine = data["machine_info"]
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("device", "?"))
    groups: dict[str, dict[str, tuple[float, int | None]]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        groups[bench["group"]][_variant(bench["name"], bench["group"])] = (
            bench["stats"]["median"], bench.get("extra_info", {}).get("peak_memory_bytes"))
    lines = [f"Machine: {cpu}, {machine.get('torch_threads', '?')} threads, torch {machine.get('torch')}, "
             f"triton {machine.get('triton', '?')}, {machine.get('date', '?')} (`{path}`)", ""]
    for group, results in groups.items():
        base_time, base_memory = results.get("input_x_gradient", (None, None))
        if base_time is None:
            lines += [f"| {group} | median |", "|---|---|"]
            lines += [f"| {variant} | {median * 1e3:.1f} ms |" for variant, (median, _) in results.items()]
        else:
            lines += [f"| {group} | median | ÷ input×gradient | peak memory | ÷ input×gradient |",
                      "|---|---|---|---|---|"]
            for variant, (median, memory) in results.items():
                memory_cells = (f"{memory / 2**20:.0f} MiB | {memory / base_memory:.2f}"
                                if memory is not None and base_memory else "not measured | ")
                lines.append(f"| {variant} | {median * 1e3:.1f} ms | {median / base_time:.2f} | {memory_cells} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n".join(table(p) for p in sys.argv[1:]))
