"""The explanation-quality benchmark command end to end, on a few images of the shipped CNN."""

import json

import pytest

from omenn_kernels.evaluation import benchmark


def test_benchmark_writes_every_score_for_every_method(tmp_path):
    code = benchmark.main(["--out", str(tmp_path), "--models", "parts_cnn", "--images", "3",
                           "--quantus-images", "3", "--nr-runs", "4", "--no-progress"])
    assert code == 0
    results = json.loads((tmp_path / "explanation_quality.json").read_text())
    assert results["models"]["parts_cnn"]["checkpoint"]["test_accuracy"] >= 0.95
    methods = results["models"]["parts_cnn"]["methods"]
    assert set(methods) == {"OMENN", "OMENN (post-processed)", "Saliency", "InputXGradient",
                            "IntegratedGradients", "GradCAM", "LRP (Zennit ε+♭)", "Random"}
    for scores in methods.values():
        for key, _ in benchmark.SCORE_COLUMNS + benchmark.QUANTUS_COLUMNS:
            assert key in scores
        assert scores["num_images"] == 3
    table = (tmp_path / "explanation_quality.md").read_text()
    assert "| OMENN |" in table and "quoted from the paper" in table
    assert results["config"]["faithfulness"] == {"nr_runs": 4, "subset_size": 41, "baseline": 0.0}


def test_benchmark_rejects_more_images_than_the_split_has():
    with pytest.raises(ValueError, match="test split has 1000 images"):
        benchmark.run(("parts_cnn",), images=1001)


def test_methods_for_an_unknown_model():
    with pytest.raises(ValueError, match="unknown model"):
        benchmark.methods_for("resnet", None)
