"""Compile time of a compiled explanation: from an empty Inductor cache, and in a new process on a warm one.

    OMP_NUM_THREADS=1 python -m pytest bench/test_compile_time.py --benchmark-json bench/results/compile_time_cpu.json

vit_small_patch16_224 with random weights, batch 4, 224×224, float32, one thread. Two fresh
processes share one new ``TORCHINDUCTOR_CACHE_DIR``: the first compiles from the empty
cache, the second (another seed: other weights, the same architecture) reads Inductor's
graph back. Each records its first call (capture, the eager call, trace, passes, checks,
Inductor), its fastest of three later calls, and the compilation's stages
(``CompiledExplanation.stages``); ``extra_info`` holds both processes' numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MODEL, BATCH = "vit_small_patch16_224", 4


def _process(seed: int) -> dict:
    """One process's numbers (run as ``python bench/test_compile_time.py SEED``)."""
    import timm
    import torch

    from omenn_kernels import Explainer
    from omenn_kernels.backends import compiled
    from omenn_kernels.testing import randomize_

    torch.manual_seed(seed)
    model = randomize_(timm.create_model(MODEL), seed=seed).eval()
    x = torch.rand(BATCH, 3, 224, 224)
    explainer = Explainer(model, backend="compiled")
    start = time.perf_counter()
    explainer(x, 3)
    first = time.perf_counter() - start
    warm = []
    for _ in range(3):
        start = time.perf_counter()
        explainer(x, 3)
        warm.append(time.perf_counter() - start)
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    return {"first_call_seconds": first, "warm_call_seconds": min(warm), "compile_seconds": kept.seconds,
            "stages_seconds": kept.stages}


def test_compile_time_cold_and_in_a_new_process(benchmark):
    benchmark.group = f"compile-time {MODEL} cpu float32 batch {BATCH}"
    results = {}

    def both():
        with tempfile.TemporaryDirectory() as cache:
            environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
            for name, seed in (("empty_cache", 0), ("new_process_warm_cache", 1)):
                done = subprocess.run([sys.executable, __file__, str(seed)], env=environment, check=True,
                                      capture_output=True, text=True)
                results[name] = json.loads(done.stdout.strip().splitlines()[-1])

    benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(results)
    for numbers in results.values():
        assert numbers["compile_seconds"] >= sum(numbers["stages_seconds"].values())


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(_process(int(sys.argv[1]))))
