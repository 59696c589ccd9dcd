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
