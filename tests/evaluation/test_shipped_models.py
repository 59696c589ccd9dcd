"""The shipped parts classifiers: files, recorded results, live accuracy, OMENN completeness.

* Checkpoints exist, are at most 10 MB, load with ``load_pretrained`` and record a test
  accuracy >= 0.95 (on the 1000 test images) and a training time <= 20 minutes.
* Live: each model classifies the first 200 images of ``PartsDataset("test", seed=0)``
  with accuracy >= 0.95.
* Both architectures, untrained with randomized biases, norm statistics and tokens
  (``randomize_``), and the trained models, are explained in float64 with a relative
  completeness error below 1e-9.
* Unknown names, missing files and bad hyper-parameters raise clear exceptions.
"""

from __future__ import annotations

import json

import pytest
import torch

from omenn_kernels import explain
from omenn_kernels.evaluation.parts_dataset import PartsDataset
from omenn_kernels.models import (CHECKPOINT_DIR, available, build, checkpoint_config, load_checkpoint,
                                  load_pretrained)
from omenn_kernels.models.train import evaluate, save_checkpoint
from omenn_kernels.testing import randomize_

NAMES = ("parts_cnn", "parts_vit")
REQUIRED_ACCURACY = 0.95
MAX_BYTES = 10 * 1024 * 1024
MAX_TRAIN_SECONDS = 20 * 60
FIXED_SUBSET = range(200)  # the first 200 test images
COMPLETENESS_TOLERANCE = 1e-9  # relative, float64


@pytest.fixture(scope="module")
def test_set() -> PartsDataset:
    return PartsDataset("test", seed=0)


@pytest.mark.parametrize("name", NAMES)
def test_checkpoint_files_exist_and_are_small(name):
    weights = CHECKPOINT_DIR / f"{name}.safetensors"
    assert weights.is_file() and (CHECKPOINT_DIR / f"{name}.json").is_file()
    assert weights.stat().st_size <= MAX_BYTES
    assert name in available()


@pytest.mark.parametrize("name", NAMES)
def test_recorded_configuration_and_results(name):
    config = checkpoint_config(name)
    assert config["arch"] == name.removeprefix("parts_")
    assert config["num_classes"] == 50
    assert config["data"]["seed"] == 0 and config["data"]["test_length"] == 1000
    results = config["results"]
    assert results["test_images"] == 1000
    assert results["test_accuracy"] >= REQUIRED_ACCURACY
    assert 0 < results["train_seconds"] <= MAX_TRAIN_SECONDS
    assert results["threads"] == 2
    assert len(results["history"]) == config["training"]["epochs"]


@pytest.mark.parametrize("name", NAMES)
def test_shipped_model_reaches_the_stated_accuracy_on_a_fixed_test_subset(name, test_set):
    model = load_pretrained(name)
    assert not model.training
    assert sum(p.numel() for p in model.parameters()) == checkpoint_config(name)["parameters"]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    accuracy = evaluate(model, test_set, FIXED_SUBSET)
    assert accuracy >= REQUIRED_ACCURACY, f"{name}: {accuracy:.3f} on the first 200 test images"


@pytest.mark.parametrize("name", NAMES)
def test_shipped_model_explanations_are_complete(name, test_set):
    model = load_pretrained(name).double()
    samples = [test_set[i] for i in range(2)]
    x = torch.stack([s["image"] for s in samples]).double()
    labels = torch.tensor([s["label"] for s in samples])
    explanation = explain(model, x, labels)
    assert explanation.completeness_error().max().item() < COMPLETENESS_TOLERANCE


@pytest.mark.parametrize("arch", ["cnn", "vit"])
def test_randomized_architecture_explanations_are_complete(arch):
    torch.manual_seed(0)
    model = randomize_(build(arch), seed=3).eval().double()
    x = torch.rand(2, 3, 96, 96, dtype=torch.float64)
    explanation = explain(model, x, torch.tensor([4, 31]))
    with torch.no_grad():
        expected = model(x)[[0, 1], [4, 31]]
    torch.testing.assert_close(explanation.logit, expected, rtol=1e-12, atol=0)
    assert explanation.completeness_error().max().item() < COMPLETENESS_TOLERANCE


def test_saved_checkpoint_loads_back_identically(tmp_path):
    torch.manual_seed(0)
    model = randomize_(build("cnn", 7, widths=(4, 8, 8)), seed=1).eval()
    config = {"arch": "cnn", "num_classes": 7, "arch_params": {"widths": [4, 8, 8]}}
    weights, config_path = save_checkpoint(model, config, tmp_path, "tiny")
    assert json.loads(config_path.read_text()) == config
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.json", "tiny.safetensors"]  # no temp files
    loaded = load_checkpoint(weights)
    x = torch.rand(3, 3, 96, 96)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


def test_bad_names_and_paths_raise(tmp_path):
    with pytest.raises(ValueError, match="unknown checkpoint 'resnet50'"):
        load_pretrained("resnet50")
    with pytest.raises(ValueError, match="unknown checkpoint"):
        checkpoint_config("parts_mlp")
    with pytest.raises(TypeError, match="must be a str"):
        load_pretrained(3)
    with pytest.raises(FileNotFoundError, match="weights not found"):
        load_checkpoint(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="expected a .safetensors file"):
        load_checkpoint(tmp_path / "model.pt")
    lonely = tmp_path / "lonely.safetensors"
    lonely.write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="configuration not found"):
        load_checkpoint(lonely)
    with pytest.raises(ValueError, match="unknown architecture 'mlp'"):
        build("mlp")
    with pytest.raises(ValueError, match=r"unknown hyper-parameters for 'vit': \['patch_size'\]"):
        build("vit", patch_size=16)
