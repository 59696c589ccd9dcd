"""Markdown tables from the pytest-benchmark JSON results in ``bench/results/``.

    python bench/report.py bench/results/end_to_end_cpu.json bench/results/kernels_cpu.json

End-to-end groups get each method's median time and peak memory, each also as a
ratio to input × gradient; target groups (``targets-*``) the median of the shared and
the separate explanations and their ratio; training groups (``training-*``) each step's
median and its ratio to the plain step; pipeline groups (``pipeline-*``) each
variant's images/s as a percentage of the preloaded one; interleaved groups
(``interleaved-*``) the fused and the compiled explanation's medians, timed in turn, and
their ratio; training steps timed in turn (``training-in-turn-*``) each step's median, its
ratio to the plain step, its FLOPs' ratio to the plain step's (the least time ratio at the
plain step's FLOP rate) and the first ratio over the second; kernel groups the median of
each variant.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def _variant(name: str, group: str) -> str:
    """The parameter id of a benchmark without the parts its group already names."""
    if "[" not in name:
        return name
    parts = name.split("[", 1)[1].rstrip("]").split("-")
    return "-".join(p for p in parts if p not in group) or parts[-1]


def _pipeline_rows(group: str, results: dict[str, tuple[float, int | None]],
                   extra: dict[str, dict]) -> list[str]:
    """Images/s of each pipeline variant, whole call and batch loop, as % of the preloaded one."""
    preloaded = next((extra[v]["images_per_second"] for v in results if "preloaded" in v), None)
    rows = [f"| {group} | median | images/s | % of preloaded | batch-loop images/s | % of preloaded |",
            "|---|---|---|---|---|---|"]
    for variant, (median, _) in results.items():
        cells = []
        for key in ("images_per_second", "loop_images_per_second"):
            rate = extra[variant].get(key)
            cells += ["–", "–"] if rate is None else \
                [f"{rate:.1f}", f"{100 * rate / preloaded:.0f} %" if preloaded else "–"]
        rows.append(f"| {variant} | {median * 1e3:.1f} ms | " + " | ".join(cells) + " |")
    return rows


def _in_turn_rows(group: str, extra: dict[str, dict]) -> list[str]:
    """Training steps timed in turn: each step's median and ratios to the plain step's time and FLOPs."""
    rows = [f"| {group} | median | ÷ plain step | GFLOP | ÷ plain step's | time ÷ FLOP ratio |",
            "|---|---|---|---|---|---|"]
    for info in extra.values():
        for variant, median in info["median_s"].items():
            time_ratio, flop_ratio = info["over_plain"][variant], info["flops_over_plain"][variant]
            rows.append(f"| {variant} | {median * 1e3:.1f} ms | {time_ratio:.2f} | {info['flops'][variant] / 1e9:.1f} "
                        f"| {flop_ratio:.2f} | {time_ratio / flop_ratio:.2f} |")
    return rows


def table(path: str) -> str:
    data = json.load(open(path))
    machine = data["machine_info"]
    cpu = machine.get("cpu", {}).get("brand_raw", machine.get("device", "?"))
    groups: dict[str, dict[str, tuple[float, int | None]]] = defaultdict(dict)
    extra: dict[str, dict[str, dict]] = defaultdict(dict)
    for bench in data["benchmarks"]:
        variant = _variant(bench["name"], bench["group"])
        groups[bench["group"]][variant] = (
            bench["stats"]["median"], bench.get("extra_info", {}).get("peak_memory_bytes"))
        extra[bench["group"]][variant] = bench.get("extra_info", {})
    if machine.get("cuda"):  # the GPU the benchmarks ran on (CPU-only results record cuda: false)
        cpu = f"{machine.get('device', '?')} (host CPU {cpu})"
    lines = [f"Machine: {cpu}, {machine.get('torch_threads', '?')} threads, torch {machine.get('torch')}, "
             f"triton {machine.get('triton', '?')}, {machine.get('date', '?')} (`{path}`)", ""]
    for group, results in groups.items():
        base_time, base_memory = results.get("input_x_gradient", (None, None))
        if group.startswith("targets-") and "shared" in results:
            shared = results["shared"][0]
            lines += [f"| {group} | median | ÷ shared |", "|---|---|---|"]
            lines += [f"| {variant} | {median * 1e3:.1f} ms | {median / shared:.2f} |"
                      for variant, (median, _) in results.items()]
        elif group.startswith("training-in-turn-"):
            lines += _in_turn_rows(group, extra[group])
        elif group.startswith("training-") and "plain" in results:
            plain = results["plain"][0]
            lines += [f"| {group} | median | ÷ plain step |", "|---|---|---|"]
            lines += [f"| {variant} | {median * 1e3:.1f} ms | {median / plain:.2f} |"
                      for variant, (median, _) in results.items()]
        elif group.startswith("pipeline-"):
            lines += _pipeline_rows(group, results, extra[group])
        elif group.startswith("interleaved-"):
            lines += [f"| {group} | fused | compiled | fused ÷ compiled |", "|---|---|---|---|"]
            lines += [f"| {variant} | {info['fused_median_s'] * 1e3:.1f} ms | {info['compiled_median_s'] * 1e3:.1f} ms "
                      f"| {info['fused_over_compiled']:.2f} |" for variant, info in extra[group].items()]
        elif base_time is None:
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


def training_across(paths: list[str]) -> str:
    """Per training group and variant: the median ratio to the plain step over the runs, and its range."""
    ratios: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    plains: dict[str, list[float]] = defaultdict(list)
    for path in paths:
        medians: dict[str, dict[str, float]] = defaultdict(dict)
        for bench in json.load(open(path))["benchmarks"]:
            if bench["group"].startswith("training-in-turn-"):  # the steps' medians of one round-robin
                medians[bench["group"]].update(bench["extra_info"]["median_s"])
            elif bench["group"].startswith("training-"):
                medians[bench["group"]][_variant(bench["name"], bench["group"])] = bench["stats"]["median"]
        for group, results in medians.items():
            plains[group].append(results["plain"])
            for variant, median in results.items():
                ratios[group][variant].append(median / results["plain"])
    lines = [f"{len(paths)} runs: " + ", ".join(f"`{p}`" for p in paths), ""]
    for group, variants in ratios.items():
        plain = sorted(plains[group])
        plain_range = f"{plain[0] * 1e3:.1f}–{plain[-1] * 1e3:.1f} ms"
        lines += [f"| {group} | ÷ plain step, median of runs | range |", "|---|---|---|",
                  f"| plain | {statistics.median(plain) * 1e3:.1f} ms | {plain_range} |"]
        lines += [f"| {variant} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} |"
                  for variant, values in variants.items() if variant != "plain"]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--across"]:
        print(training_across(sys.argv[2:]))
    else:
        print("\n".join(table(p) for p in sys.argv[1:]))
