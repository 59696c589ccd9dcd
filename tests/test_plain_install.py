"""The README's first command needs no extras: ``omenn demo`` runs without the test and eval packages.

CI runs the command itself in a fresh virtual environment; this test catches an import
of an extra on the demo's path without installing anything, by making those packages
unimportable in a child process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed only by `pip install -e ".[test]"` or `".[eval]"` (setup.py's extras).
EXTRAS = ("scipy", "captum", "zennit", "quantus", "hypothesis", "pytest", "pytest_benchmark")

_CHILD = """
import sys
for name in {extras!r}:
    sys.modules[name] = None  # `import name` now raises ImportError
from omenn_kernels.cli import main
sys.exit(main(["demo", "--out", sys.argv[1], "--images", "2", "-q"]))
"""


def test_demo_runs_without_extras(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([sys.executable, "-c", _CHILD.format(extras=EXTRAS), str(out)],
                            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "completeness check passed" in result.stdout
    report = json.loads((out / "completeness.json").read_text())
    assert len(report) == 2 * 4


def test_the_triton_kernels_install_inside_the_library_only(tmp_path):
    """The top-level folder ``triton_kernels/`` is installed as ``omenn_kernels.triton_kernels``:
    from outside the checkout, ``import triton_kernels`` finds another project's package or none."""
    child = ("import importlib.util, sys\n"
             "ours = importlib.util.find_spec('omenn_kernels.triton_kernels')\n"
             "other = importlib.util.find_spec('triton_kernels')\n"
             "print(ours.origin if ours else None)\n"
             "print(other.origin if other else None)\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, other = result.stdout.splitlines()
    assert Path(ours).read_bytes() == (ROOT / "triton_kernels" / "__init__.py").read_bytes(), ours
    assert other == "None" or not Path(other).resolve().is_relative_to(ROOT), other
