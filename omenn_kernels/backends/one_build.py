"""Inductor's CPU kernels of one compilation built as one C++ source per compile thread.

Inductor's Python wrapper builds each CPU kernel of a graph as a shared library of its own
(``AsyncCompile.cpp_pybinding``): one compiler run per kernel, most of it the same for every
kernel — starting the compiler, reading the precompiled header and ``Python.h``, linking —
and little of it the kernel's own code. An explanation's graph has tens of kernels, so the
C++ compiler is most of its compilation. While :func:`building_as_one` is active on a
thread, the kernels that the wrapper being loaded asks for are collected instead, and built
when it waits for them (``AsyncCompile.wait``, before its first run) as one source per
compile thread (Inductor's ``compile_threads``), built side by side: each kernel in a
namespace of its own, all called through one Python module whose functions take the
arguments Inductor's bindings take.

Inductor's code cache keys a source by its text and compile command, so a later process
loading the same graph from Inductor's cache with as many compile threads finds the
libraries built, and loads them without preparing Inductor's precompiled header
(:func:`_built`). A kernel source with preprocessor lines other than ``#include`` and
``#pragma`` is built by Inductor as usual, and so is every kernel of a thread where the
context is not active (another thread's ``torch.compile``, say).
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import first_line

log = logging.getLogger("omenn_kernels.compiled")
# .pending: the kernels collected and not yet built, on this thread; .looking_up: see _built
_active = threading.local()
_install_lock = threading.Lock()
_originals: dict[str, Callable] = {}

_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\s*\(')
# What a library looked up by _built names as its precompiled header: never built with it.
_UNPREPARED_HEADER = "omenn-kernels-unprepared-header.h"


@contextlib.contextmanager
def building_as_one() -> Iterator[None]:
    """Within the block, this thread's Inductor CPU kernels are built together (module docstring)."""
    _install()
    outer = getattr(_active, "pending", None)
    _active.pending = []
    try:
        yield
    finally:
        _active.pending = outer


class _Kernel:
    """One collected kernel; once its build has run, the function that calls it."""

    def __init__(self, argtypes: list[str], source: str, batch: list[_Kernel]) -> None:
        self.argtypes = argtypes
        self.source = source
        self.batch = batch  # the kernels built with this one
        self.function: Callable | None = None

    def built(self) -> Callable:
        if self.function is None:
            _build([kernel for kernel in self.batch if kernel.function is None])
        return self.function

    def __call__(self, *args: Any) -> None:  # called before the wrapper's wait: built then
        return self.built()(*args)


def _install() -> None:
    from torch._inductor import codecache
    from torch._inductor.async_compile import AsyncCompile

    with _install_lock:
        if _originals:
            return
        _originals["cpp_pybinding"] = AsyncCompile.cpp_pybinding
        _originals["wait"] = AsyncCompile.wait
        _originals["precompile_header"] = codecache._precompile_header

        def cpp_pybinding(self, argtypes: list[str], source_code: str):
            pending = getattr(_active, "pending", None)
            if pending is None or not _mergeable(source_code):
                return _originals["cpp_pybinding"](self, argtypes, source_code)
            kernel = _Kernel(list(argtypes), source_code, pending)
            pending.append(kernel)
            return kernel

        def wait(self, scope: dict[str, Any]) -> None:
            for name, value in list(scope.items()):
                if isinstance(value, _Kernel):
                    scope[name] = value.built()
            return _originals["wait"](self, scope)

        def precompile_header(*args, **kwargs) -> str:
            if getattr(_active, "looking_up", False):  # see _built: no build follows
                return _UNPREPARED_HEADER
            return _originals["precompile_header"](*args, **kwargs)

        AsyncCompile.cpp_pybinding = cpp_pybinding
        AsyncCompile.wait = wait
        codecache._precompile_header = precompile_header


def _mergeable(source: str) -> bool:
    """Whether ``source`` is one ``kernel`` whose only preprocessor lines are includes and pragmas."""
    directives = (line.strip() for line in source.splitlines() if line.lstrip().startswith("#"))
    return len(_ENTRY.findall(source)) == 1 and \
        all(line.startswith(("#include", "#pragma")) for line in directives)


def _build(kernels: list[_Kernel]) -> None:
    """Build ``kernels`` as one source per compile thread, side by side, and bind their functions."""
    from torch._inductor.async_compile import get_compile_threads
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    if not kernels:
        return
    started = time.perf_counter()
    threads = max(1, min(get_compile_threads(), len(kernels)))
    parts = [kernels[start::threads] for start in range(threads)]
    try:
        with ThreadPoolExecutor(threads) as pool:
            sources = [_source(part) for part in parts]
            loads = [_built(source) or CppPythonBindingsCodeCache.load_async(
                source, "cpu", submit_fn=pool.submit if threads > 1 else None) for source in sources]
            modules = [load() for load in loads]
    except Exception as error:  # noqa: BLE001 — building together only saves time: each is built alone
        log.info("Inductor's kernels did not build as one source (%s); building them one by one",
                 first_line(error))
        for kernel in kernels:
            kernel.function = CppPythonBindingsCodeCache.load_pybinding(kernel.argtypes, kernel.source)
        return
    for part, module in zip(parts, modules):
        for index, kernel in enumerate(part):
            kernel.function = getattr(module, f"kernel_{index}")
    log.info("built %d of Inductor's kernels as %d C++ sources in %.1f s", len(kernels), threads,
             time.perf_counter() - started)


class _NotBuilt(Exception):
    """Raised where Inductor would start building a source (see :func:`_built`)."""


def _not_built(build: Callable) -> None:
    raise _NotBuilt


def _built(source: str) -> Callable | None:
    """The loader of ``source``'s library where it is in Inductor's cache already (built by an
    earlier process), else None (nothing started).

    Before it looks for a library, Inductor prepares its precompiled header, which runs the
    preprocessor over the header and its includes (once per process, to key the header by
    them), though the header only serves a build. So the library is looked for with the
    header left unprepared on this thread (:func:`_install`; the library's key does not hold
    the header): Inductor hands a source to ``submit_fn`` only where its library is missing,
    and raising there leaves nothing behind.
    """
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    _active.looking_up = True
    try:
        return CppPythonBindingsCodeCache.load_async(source, "cpu", submit_fn=_not_built)
    except _NotBuilt:
        return None
    finally:
        _active.looking_up = False


def _source(kernels: list[_Kernel]) -> str:
    """The kernels' code, each in namespace ``kernel_<i>``, and a module ``kernel`` calling them."""
    includes: dict[str, None] = {}
    bodies = []
    for index, kernel in enumerate(kernels):
        lines = kernel.source.splitlines()
        includes.update((line.strip(), None) for line in lines if line.lstrip().startswith("#include"))
        body = "\n".join(line for line in lines if not line.lstrip().startswith("#include"))
        bodies.append(f"namespace kernel_{index} {{\n{_ENTRY.sub('void kernel(', body)}\n}}\n")
    calls = []
    for index, kernel in enumerate(kernels):
        arguments = ", ".join(f"parse_arg<{argtype.replace('const ', '')}>(args, {position})"
                              for position, argtype in enumerate(kernel.argtypes))
        calls.append(_CALL.format(index=index, count=len(kernel.argtypes), arguments=arguments))
    methods = "".join(f'    {{"kernel_{index}", call_{index}, METH_VARARGS, ""}},\n' for index in range(len(kernels)))
    return "\n".join(includes) + "\n" + "".join(bodies) + _BINDINGS_HEAD + "".join(calls) + \
        _BINDINGS_TAIL.replace("METHODS", methods)


# The bindings: Inductor's argument conversions (a tensor's data pointer through the function
# whose address Inductor passes in an environment variable; integers, floats), one function
# per kernel, and the module ``kernel`` that Inductor's loader imports (``PyInit_kernel``).
_BINDINGS_HEAD = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

static void* (*tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T parse_arg(PyObject* args, Py_ssize_t n) {
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or scalar");
    return static_cast<T>(tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}
template <> inline int64_t parse_arg<int64_t>(PyObject* args, Py_ssize_t n) {
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (result == -1 && PyErr_Occurred()) throw std::runtime_error("expected int arg");
    return result;
}
template <> inline uintptr_t parse_arg<uintptr_t>(PyObject* args, Py_ssize_t n) {
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (result == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected int arg");
    return reinterpret_cast<uintptr_t>(result);
}
template <> inline float parse_arg<float>(PyObject* args, Py_ssize_t n) {
    auto result = PyFloat_AsDouble(PyTuple_GET_ITEM(args, n));
    if (result == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected float arg");
    return static_cast<float>(result);
}
"""

_CALL = r"""
static PyObject* call_{index}(PyObject* self, PyObject* args) {{
    try {{
        if (PyTuple_GET_SIZE(args) != {count}) throw std::runtime_error("requires {count} args");
        kernel_{index}::kernel({arguments});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }}
}}
"""

_BINDINGS_TAIL = r"""
static PyMethodDef methods[] = {
METHODS    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, "kernel", NULL, -1, methods};

PyMODINIT_FUNC PyInit_kernel(void) {
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }
    char* end = nullptr;
    errno = 0;
    uintptr_t value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not an address");
        return nullptr;
    }
    tensor_data_ptr = reinterpret_cast<decltype(tensor_data_ptr)>(value);
    PyObject* module = PyModule_Create(&module_definition);
#ifdef Py_GIL_DISABLED
    if (module != NULL) PyUnstable_Module_SetGIL(module, Py_MOD_GIL_NOT_USED);
#endif
    return module;
}
"""
