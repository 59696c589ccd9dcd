"""Smoke tests of the example scripts in ``examples/``: they run end to end on tiny settings."""

import importlib.util
import json
import math
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def load_example(name: str) -> ModuleType:
    """Import ``examples/<name>.py`` as a module (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look the module up by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def distillation() -> ModuleType:
    return load_example("attribution_distillation")


def test_attribution_distillation_writes_both_runs(distillation, tmp_path):
    out = tmp_path / "result.json"
    status = distillation.main(["--steps", "3", "--batch-size", "4", "--test-images", "8",
                                "--log-every", "1", "--out", str(out)])
    assert status == 0
    report = json.loads(out.read_text(encoding="utf-8"))
    assert report["config"]["steps"] == 3 and report["config"]["test_images"] == 8
    assert {"cpu", "torch", "date"} <= set(report["machine"])
    results = report["results"]
    assert {"initialization", distillation.LOGIT_RUN, distillation.ATTRIBUTION_RUN} <= set(results)
    for name, row in results.items():
        for key in ("accuracy", "teacher_top1_agreement"):
            assert 0.0 <= row[key] <= 1.0, (name, key, row[key])
        for key in ("attribution_cosine", "attribution_spearman"):
            assert math.isfinite(row[key]) and -1.0 <= row[key] <= 1.0, (name, key, row[key])
    for name in (distillation.LOGIT_RUN, distillation.ATTRIBUTION_RUN):
        row = results[name]
        assert row["seconds_per_step"] > 0 and row["wall_seconds"] >= row["train_seconds"] > 0
        assert [entry["step"] for entry in row["loss_history"]] == [1, 2, 3]
    for run, terms in ((distillation.LOGIT_RUN, {"kl", "cross_entropy", "total"}),
                       (distillation.ATTRIBUTION_RUN, {"kl", "cross_entropy", "attribution", "total"})):
        for entry in results[run]["loss_history"]:
            assert set(entry) == terms | {"step"}
            assert all(math.isfinite(entry[term]) for term in terms)
    # Same initialization and first batch: the first step's logit losses agree across the runs.
    first = [results[run]["loss_history"][0] for run in (distillation.LOGIT_RUN, distillation.ATTRIBUTION_RUN)]
    for term in ("kl", "cross_entropy"):
        assert first[0][term] == pytest.approx(first[1][term], rel=1e-5)


def test_attribution_distillation_interrupted_writes_nothing(distillation, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(distillation, "train_student", interrupted)
    out = tmp_path / "result.json"
    status = distillation.main(["--steps", "1", "--batch-size", "2", "--test-images", "2", "--out", str(out)])
    assert status == distillation.EXIT_INTERRUPTED
    assert list(tmp_path.iterdir()) == []


def test_explain_text_explains_a_prompt_and_its_generation(tmp_path, capsys):
    text = load_example("explain_text")
    out, png = tmp_path / "map.html", tmp_path / "map.png"
    assert text.main(["--new-tokens", "2", "--backend", "fused", "--out", str(out), "--png", str(png)]) == 0
    printed = capsys.readouterr().out
    error = float(re.search(r"largest \|Σ C − logit\| / \|logit\|: (\S+)", printed).group(1))
    assert error <= 1e-5  # float32
    assert printed.count("explained: ") == 4  # two prompts, two generated tokens
    assert out.read_text(encoding="utf-8").count('class="caption"') == 4
    assert png.read_bytes()[:4] == b"\x89PNG"
