"""The rules are the paper's maths: no rule module imports a kernel.

The fused ops (:mod:`omenn_kernels.ops`) attach their forms of the rules and import the
rules' maths; a rule importing an op, the C++ loader or the Triton kernels would make
the two depend on each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RULES = Path(__file__).resolve().parents[2] / "omenn_kernels" / "linearize" / "rules"
KERNELS = ("omenn_kernels.ops", "omenn_kernels.native", "omenn_kernels.triton_kernels", "triton_kernels", "triton")


def _imported(path: Path) -> set[str]:
    """The absolute names of the modules that ``path`` (a module of the rules package) imports."""
    package = ["omenn_kernels", "linearize", "rules"]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.update([module] + [f"{module}.{alias.name}" for alias in node.names])
    return names


@pytest.mark.parametrize("path", sorted(RULES.glob("*.py")), ids=lambda path: path.name)
def test_no_rule_module_imports_a_kernel(path):
    imported = _imported(path)
    assert imported, "the module imports nothing: the parse found no imports"
    kernels = sorted(name for name in imported if name.startswith(KERNELS))
    assert not kernels, f"{path.name} imports {kernels}"


def test_the_check_sees_relative_imports_of_the_ops(tmp_path):
    rule = tmp_path / "rule.py"
    rule.write_text("from ...ops.activation import activation\nfrom ..values import Live\n", encoding="utf-8")
    assert "omenn_kernels.ops.activation.activation" in _imported(rule)
    assert "omenn_kernels.linearize.values.Live" in _imported(rule)
