"""Compile time of a compiled explanation: from an empty Inductor cache, and in a new process on a warm one.

    OMP_NUM_THREADS=1 python -m pytest bench/test_compile_time.py --benchmark-json bench/results/compile_time_cpu.json

vit_small_patch16_224 with random weights, batch 4, 224×224, float32, one thread. Two fresh
processes share one new ``TORCHINDUCTOR_CACHE_DIR``: the first compiles from the empty
cache and saves its traced graph, the second (another seed: other weights, the same
architecture) loads that graph with its own weights and reads Inductor's code back. Each
records its first call (the capture and the compilation: the first's eager call, trace,
passes, checks, Inductor; the second's ``load``), its fastest of three later calls, and the
compilation's stages (``CompiledExplanation.stages``); ``extra_info`` holds both processes'
numbers. The first
process then explains batches of 2, 3 and 6 images, which run the batch-4 graph in chunks:
each size's first call (with its check against the fused backend) must take at most 3× its
fastest of two later calls.

A third process, on an empty cache of its own, explains the 4-layer Llama-style causal LM of
``test_text_models.py`` from its token ids (float32, one thread): a batch of 2 × 100 tokens
(padded to the bucket of 128) compiles; batches of other lengths of that bucket and other
sizes (``TOKEN_SHAPES``) must run the same graph, each one's first call (with its check
against the model's own logits) at most 3× its fastest of two later calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

MODEL, BATCH = "vit_small_patch16_224", 4
OTHER_BATCHES = (2, 3, 6)
NEW_BATCH_FIRST_CALL_LIMIT = 3.0  # a new batch size's (or length's) first call, in warm calls of that shape
TOKEN_BATCH = (2, 100)  # sequences, tokens
TOKEN_SHAPES = ((2, 110), (2, 128), (3, 100), (5, 120))


def _seconds(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _process(seed: int) -> dict:
    """One process's numbers (run as ``python bench/test_compile_time.py SEED``); the first
    (seed 0) also times batches of other sizes."""
    import timm
    import torch

    from omenn_kernels import Explainer
    from omenn_kernels.backends import compiled
    from omenn_kernels.testing import randomize_

    torch.manual_seed(seed)
    model = randomize_(timm.create_model(MODEL), seed=seed).eval()
    x = torch.rand(BATCH, 3, 224, 224)
    explainer = Explainer(model, backend="compiled")
    first = _seconds(lambda: explainer(x, 3))
    warm = min(_seconds(lambda: explainer(x, 3)) for _ in range(3))
    other_batches = {}
    for size in OTHER_BATCHES if seed == 0 else ():
        images = torch.rand(size, 3, 224, 224)
        first_of_size = _seconds(lambda: explainer(images, 3))
        warm_of_size = min(_seconds(lambda: explainer(images, 3)) for _ in range(2))
        other_batches[size] = {"first_call_seconds": first_of_size, "warm_call_seconds": warm_of_size,
                               "ratio": first_of_size / warm_of_size}
    (kept,) = compiled.explanations(explainer.program(x)[0]).values()
    assert all(kept.batches.values()), kept.batches  # every size ran the batch-4 graph
    return {"first_call_seconds": first, "warm_call_seconds": warm, "compile_seconds": kept.seconds,
            "stages_seconds": kept.stages, "other_batches": other_batches}


def _token_process() -> dict:
    """The token model's numbers (run as ``python bench/test_compile_time.py tokens``)."""
    import torch

    from omenn_kernels import TokenExplainer
    from omenn_kernels.backends import compiled
    from omenn_kernels.testing import randomize_
    from test_text_models import _llama

    compilations = []
    compiler = compiled.COMPILER
    # Counted, and still Inductor as far as the backend can tell (it starts Inductor's probe of
    # the CPU only for Inductor, and saves only Inductor's graphs).
    compiled.COMPILER = compiled.inductor = lambda graph, example: compilations.append(1) or compiler(graph, example)
    torch.manual_seed(0)
    model = randomize_(_llama()).eval()
    explainer = TokenExplainer(model, backend="compiled")

    def batch(size: int, length: int) -> torch.Tensor:
        return torch.randint(0, 1000, (size, length), generator=torch.Generator().manual_seed(size * 1000 + length))

    ids = batch(*TOKEN_BATCH)
    first = _seconds(lambda: explainer(ids))
    warm = min(_seconds(lambda: explainer(ids)) for _ in range(3))
    shapes = {}
    for size, length in TOKEN_SHAPES:
        other = batch(size, length)
        first_of_shape = _seconds(lambda: explainer(other))
        warm_of_shape = min(_seconds(lambda: explainer(other)) for _ in range(2))
        shapes[f"{size}x{length}"] = {"first_call_seconds": first_of_shape, "warm_call_seconds": warm_of_shape,
                                      "ratio": first_of_shape / warm_of_shape}
    return {"first_call_seconds": first, "warm_call_seconds": warm, "compilations": len(compilations),
            "other_shapes": shapes}


def _in_a_new_process(argument: str, cache: str) -> dict:
    """The numbers of ``python bench/test_compile_time.py ARGUMENT`` on the Inductor cache folder ``cache``."""
    environment = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    done = subprocess.run([sys.executable, __file__, argument], env=environment, check=True, capture_output=True,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_token_model_lengths_and_batch_sizes_of_one_compilation(benchmark):
    benchmark.group = f"compile-time llama cpu float32 tokens {TOKEN_BATCH[0]}x{TOKEN_BATCH[1]}"
    results = {}

    def one():
        with tempfile.TemporaryDirectory() as cache:
            results.update(_in_a_new_process("tokens", cache))

    benchmark.pedantic(one, rounds=1, iterations=1)
    benchmark.extra_info.update(results)
    assert results["compilations"] == 1, results
    for shape, numbers in results["other_shapes"].items():
        assert numbers["ratio"] <= NEW_BATCH_FIRST_CALL_LIMIT, (shape, numbers)


def test_compile_time_cold_and_in_a_new_process(benchmark):
    benchmark.group = f"compile-time {MODEL} cpu float32 batch {BATCH}"
    results = {}

    def both():
        with tempfile.TemporaryDirectory() as cache:
            for name, seed in (("empty_cache", 0), ("new_process_warm_cache", 1)):
                results[name] = _in_a_new_process(str(seed), cache)

    benchmark.pedantic(both, rounds=1, iterations=1)
    benchmark.extra_info.update(results)
    for numbers in results.values():
        assert numbers["compile_seconds"] >= sum(numbers["stages_seconds"].values())
    for size, numbers in results["empty_cache"]["other_batches"].items():
        assert numbers["ratio"] <= NEW_BATCH_FIRST_CALL_LIMIT, (size, numbers)


if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    print(json.dumps(_token_process() if sys.argv[1] == "tokens" else _process(int(sys.argv[1]))))
