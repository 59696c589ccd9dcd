"""Inductor's CPU kernels of one compilation built as one C++ source per compile thread."""

from __future__ import annotations

import logging

import pytest
import torch
from torch._inductor import config as inductor_config
from torch._inductor.codecache import CppPythonBindingsCodeCache
from torch._inductor.compile_fx import compile_fx
from torch.fx.experimental.proxy_tensor import make_fx

from omenn_kernels.backends import one_build


def _several_kernels(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # The matrix products are ATen calls, which split the elementwise ops and reductions
    # around them into kernels of their own.
    a = torch.nn.functional.gelu(x) * 2 + 1
    b = a @ w
    c = torch.softmax(torch.tanh(b), dim=-1)
    d = (c @ w.t()).sigmoid()
    return d * x, b.sum(0), c.amax(1)


@pytest.fixture
def sources(monkeypatch):
    """Every C++ source that Inductor's Python-binding cache is asked to build, in order, once each."""
    seen: list[str] = []
    load_async = CppPythonBindingsCodeCache.load_async

    def spy(main_code, *args, **kwargs):
        if main_code not in seen:  # a source is looked up (see one_build._built), then built
            seen.append(main_code)
        return load_async(main_code, *args, **kwargs)

    monkeypatch.setattr(CppPythonBindingsCodeCache, "load_async", staticmethod(spy))
    with inductor_config.patch(compile_threads=2):
        yield seen


def _compiled(seed: int):
    generator = torch.Generator().manual_seed(seed)
    example = [torch.randn(7, 12, dtype=torch.float64, generator=generator),
               torch.randn(12, 12, dtype=torch.float64, generator=generator)]
    graph = make_fx(_several_kernels)(*example)
    with one_build.building_as_one():
        compiled = compile_fx(graph, example, config_patches={"cpp_wrapper": False, "fx_graph_cache": False})
    return compiled, example


def _kernels(source: str) -> int:
    return source.count("namespace kernel_")


def test_the_kernels_of_one_compilation_are_built_as_one_source_per_compile_thread(sources):
    compiled, example = _compiled(seed=1)
    merged = [source for source in sources if _kernels(source)]
    assert len(merged) == 2, "one source per compile thread"
    assert sum(_kernels(source) for source in merged) == 3
    assert len(sources) == 2, "no kernel built on its own"
    for got, want in zip(compiled(*example), _several_kernels(*example)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_a_library_built_by_an_earlier_process_is_loaded_without_preparing_the_header(sources, monkeypatch,
                                                                                         tmp_path):
    """Built from an empty cache with Inductor's precompiled header; in a process that finds the
    libraries (Inductor's in-memory cache emptied), the header is not prepared."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(CppPythonBindingsCodeCache, "cache", {})  # what this process loaded: not seen
    one_build._install()
    prepared = []
    prepare = one_build._originals["precompile_header"]
    monkeypatch.setitem(one_build._originals, "precompile_header",
                        lambda *args, **kwargs: prepared.append(args[0]) or prepare(*args, **kwargs))
    _compiled(seed=4)
    assert prepared, "built with the header"
    prepared.clear()
    monkeypatch.setattr(CppPythonBindingsCodeCache, "cache", {})  # as in a new process
    compiled, example = _compiled(seed=4)
    assert prepared == []
    assert len([source for source in sources if _kernels(source)]) == 2
    for got, want in zip(compiled(*example), _several_kernels(*example)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_kernels_that_do_not_build_together_are_built_one_by_one(sources, monkeypatch, caplog):
    monkeypatch.setattr(one_build, "_source", lambda kernels: "#error not one source\n")
    with caplog.at_level(logging.INFO, logger="omenn_kernels.compiled"):
        compiled, example = _compiled(seed=2)
    assert "did not build as one source" in caplog.text
    alone = [source for source in sources if "#error" not in source]
    assert len(alone) == 3 and not any(_kernels(source) for source in alone)
    for got, want in zip(compiled(*example), _several_kernels(*example)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_outside_the_context_inductor_builds_each_kernel(sources):
    generator = torch.Generator().manual_seed(3)
    example = [torch.randn(5, 12, dtype=torch.float64, generator=generator),
               torch.randn(12, 12, dtype=torch.float64, generator=generator)]
    compiled = compile_fx(make_fx(_several_kernels)(*example), example,
                          config_patches={"cpp_wrapper": False, "fx_graph_cache": False, "compile_threads": 1})
    assert len(sources) == 3 and not any(_kernels(source) for source in sources)
    for got, want in zip(compiled(*example), _several_kernels(*example)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("source, mergeable", [
    ('#include <x.h>\nextern "C"  void  kernel(const float* in_ptr0)\n{\n    #pragma omp simd\n}\n', True),
    ('#include <x.h>\n#define N 4\nextern "C" void kernel(float* out_ptr0)\n{\n}\n', False),
    ('#include <x.h>\nextern "C" void kernel(float* a)\n{\n}\nextern "C" void kernel(float* b)\n{\n}\n', False),
    ('#include <x.h>\nvoid helper(float* a)\n{\n}\n', False),
])
def test_only_single_kernels_with_includes_and_pragmas_are_built_together(source, mergeable):
    assert one_build._mergeable(source) is mergeable
