"""Input errors of the ``omenn`` command exit 2 with one line that names the value or file; defects exit 1.

Weights files that cannot be loaded (damaged, not weights, a pickled model, another
model's names, another head size) are refused by ``load_model`` with a
:class:`~omenn_kernels.errors.ModelLoadError` that names the file and what is wrong,
and by the command with exit 2. Small timm models without pretrained weights (no
network) and tiny parts models are written to ``tmp_path``.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Callable

import pytest
import timm
import torch
from safetensors.torch import save_file

from omenn_kernels.bulk import AttributionStore
from omenn_kernels.bulk.model_source import load_model
from omenn_kernels.cli import EXIT_ERROR, EXIT_USAGE, main
from omenn_kernels.errors import ModelLoadError
from omenn_kernels.models import CHECKPOINT_DIR, load_checkpoint
from omenn_kernels.testing import randomize_

TIMM_MODEL = "resnet10t"


def _timm_state_dict(num_classes: int) -> dict[str, torch.Tensor]:
    return randomize_(timm.create_model(TIMM_MODEL, num_classes=num_classes), seed=num_classes).state_dict()


def _truncated_safetensors(folder: Path) -> Path:
    whole = folder / "whole.safetensors"
    save_file(_timm_state_dict(10), str(whole))
    bad = folder / "bad.safetensors"
    bad.write_bytes(whole.read_bytes()[:4096])
    return bad


def _shipped_vit_truncated(folder: Path) -> Path:
    """A damaged .safetensors beside a valid parts_vit configuration."""
    bad = folder / "bad.safetensors"
    bad.write_bytes((CHECKPOINT_DIR / "parts_vit.safetensors").read_bytes()[:3000])
    shutil.copy(CHECKPOINT_DIR / "parts_vit.json", folder / "bad.json")
    return bad


def _shipped_vit_garbage(folder: Path) -> Path:
    bad = folder / "noise.safetensors"
    bad.write_bytes(torch.randint(0, 256, (5000,), generator=torch.Generator().manual_seed(4),
                                  dtype=torch.uint8).numpy().tobytes())
    shutil.copy(CHECKPOINT_DIR / "parts_vit.json", folder / "noise.json")
    return bad


def _shipped_vit_of_other_config(folder: Path) -> Path:
    """parts_vit weights beside a configuration that asks for another embedding width."""
    weights = folder / "narrow.safetensors"
    shutil.copy(CHECKPOINT_DIR / "parts_vit.safetensors", weights)
    (folder / "narrow.json").write_text(json.dumps({"arch": "vit", "num_classes": 50,
                                                    "arch_params": {"embed_dim": 32}}))
    return weights


def _text_file(folder: Path) -> Path:
    path = folder / "notes.pth"
    path.write_text("these are my training notes, not weights\n" * 20)
    return path


def _pickled_model(folder: Path) -> Path:
    path = folder / "model.pth"
    torch.save(randomize_(timm.create_model(TIMM_MODEL, num_classes=10)), path)
    return path


def _ten_class_head(folder: Path) -> Path:
    path = folder / "ten.pth"
    torch.save(_timm_state_dict(10), path)
    return path


def _other_names(folder: Path) -> Path:
    state = _timm_state_dict(10)
    state["extra.scale"] = state.pop("fc.bias")
    path = folder / "renamed.pth"
    torch.save(state, path)
    return path


def _truncated_pth(folder: Path) -> Path:
    whole = folder / "whole.pth"
    torch.save(_timm_state_dict(10), whole)
    path = folder / "cut.pth"
    path.write_bytes(whole.read_bytes()[:20000])
    return path


def _no_state_dict(folder: Path) -> Path:
    path = folder / "epoch.pth"
    torch.save({"epoch": 7, "lr": 0.25}, path)
    return path


# (model, weights file writer, --num-classes, what the error says after the file's path)
CASES: dict[str, tuple[str, Callable[[Path], Path], int | None, str]] = {
    "shipped_truncated": ("parts_vit", _shipped_vit_truncated, None, "is not a readable safetensors file"),
    "shipped_garbage": ("parts_vit", _shipped_vit_garbage, None, "is not a readable safetensors file"),
    "shipped_other_config": ("parts_vit", _shipped_vit_of_other_config, None,
                             r"does not fit the 'vit' model that narrow.json describes: cls_token is \(1, 1, 64\) "
                             r"in the checkpoint but \(1, 1, 32\) in the model"),
    "timm_truncated_safetensors": (TIMM_MODEL, _truncated_safetensors, 10, "is not a readable safetensors file"),
    "timm_truncated_pth": (TIMM_MODEL, _truncated_pth, 10, "is a damaged torch.save file"),
    "text_file": (TIMM_MODEL, _text_file, 10, "is not a weights file torch.load or safetensors can read"),
    "pickled_model": (TIMM_MODEL, _pickled_model, 10,
                      r"holds a pickled model .*save torch.save\(model.state_dict\(\), path\)"),
    "not_a_state_dict": (TIMM_MODEL, _no_state_dict, 10, r"is not a state_dict: .*not tensors \(epoch, lr\)"),
    "head_without_num_classes": (TIMM_MODEL, _ten_class_head, None,
                                 r"does not fit the timm model 'resnet10t': fc.weight is \(10, 512\) in the "
                                 r"checkpoint but \(1000, 512\) in the model, fc.bias .*the checkpoint's head "
                                 r"has 10 classes: pass --num-classes 10$"),
    "head_of_other_size": (TIMM_MODEL, _ten_class_head, 5,
                           r"does not fit the timm model 'resnet10t': fc.weight is \(10, 512\) in the checkpoint but "
                           r"\(5, 512\) .*pass --num-classes 10$"),
    "missing_and_unexpected_names": (TIMM_MODEL, _other_names, 10,
                                     r"does not fit the timm model 'resnet10t' \(the model's weights missing from "
                                     r"it: fc.bias; its entries the model does not have: extra.scale\); is it a "
                                     r"checkpoint of another model\?"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_unloadable_weights_are_a_model_load_error_and_exit_2(case, parts_folder, tmp_path, capsys):
    model, write, num_classes, message = CASES[case]
    weights = write(tmp_path)
    expected = re.escape(str(weights)) + " " + message
    with pytest.raises(ModelLoadError, match=expected):
        load_model(model, checkpoint=weights, num_classes=num_classes)

    out = tmp_path / "store.zarr"
    classes = [] if num_classes is None else ["--num-classes", str(num_classes)]
    assert main(["explain", str(parts_folder), "--out", str(out), "--model", model, "--checkpoint", str(weights),
                 *classes, "--workers", "0", "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("omenn explain: error: ")
    assert re.search(expected, err.rstrip("\n")), err
    assert not out.exists()


def test_weights_files_as_timm_trains_and_safetensors_under_any_name_load_exactly(tmp_path):
    state = _timm_state_dict(10)
    wrapped = tmp_path / "train_checkpoint.pth.tar"
    torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in state.items()}}, wrapped)
    renamed = tmp_path / "weights.pt"
    save_file(state, str(renamed))
    for path in (wrapped, renamed):
        loaded = load_model(TIMM_MODEL, checkpoint=path, num_classes=10).model.state_dict()
        assert loaded.keys() == state.keys()
        assert all(torch.equal(loaded[k], state[k]) for k in state), path


def test_shipped_checkpoint_configuration_errors_name_the_file(tmp_path):
    weights = tmp_path / "tiny.safetensors"
    shutil.copy(CHECKPOINT_DIR / "parts_cnn.safetensors", weights)
    config = tmp_path / "tiny.json"
    for text, message in [("{not json", "is not a JSON file"),
                          (json.dumps([1, 2]), "holds a JSON list"),
                          (json.dumps({"arch": "mlp", "num_classes": 5, "arch_params": {}}),
                           "does not describe a model: unknown architecture 'mlp'"),
                          (json.dumps({"arch": "cnn", "num_classes": 5, "arch_params": {"depth": 3}}),
                           r"does not describe a model: unknown hyper-parameters for 'cnn': \['depth'\]"),
                          (json.dumps({"arch": "cnn", "num_classes": 5, "arch_params": [32]}),
                           "'arch_params' must be an object")]:
        config.write_text(text)
        with pytest.raises(ModelLoadError, match=re.escape(str(config)) + ".*" + message):
            load_checkpoint(weights)


def test_num_classes_that_a_shipped_model_does_not_have_is_refused(parts_folder, tmp_path, capsys):
    with pytest.raises(ModelLoadError, match="parts_cnn from the shipped weights has 50 classes, not --num-classes 7"):
        load_model("parts_cnn", num_classes=7)
    assert main(["explain", str(parts_folder), "--out", str(tmp_path / "s.zarr"), "--model", "parts_cnn",
                 "--num-classes", "7", "-q"]) == EXIT_USAGE
    assert "has 50 classes, not --num-classes 7" in capsys.readouterr().err


@pytest.mark.parametrize("raised, code", [(ModelLoadError("the first line\n   and the second"), EXIT_USAGE),
                                          (KeyError("status"), EXIT_ERROR),
                                          (ValueError("a defect that happens to be a ValueError"), EXIT_ERROR)],
                         ids=["input_error", "key_error", "value_error"])
def test_only_library_errors_are_usage_errors(raised, code, monkeypatch, tmp_path, capsys, caplog):
    def explain_folder(config):
        raise raised

    monkeypatch.setattr("omenn_kernels.bulk.run.explain_folder", explain_folder)
    with caplog.at_level(logging.ERROR, logger="omenn_kernels.cli"):
        assert main(["explain", str(tmp_path), "--out", str(tmp_path / "s.zarr"), "--model", "parts_cnn",
                     "--device", "cpu", "-q"]) == code
    err = capsys.readouterr().err
    if code == EXIT_USAGE:
        assert err == "omenn explain: error: the first line and the second\n"
    else:
        # a defect: logged with its traceback, not reported as the user's mistake
        assert "error:" not in err
        assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [type(raised)]


@pytest.mark.parametrize("option", ["--batch-size", "--num-classes"])
def test_a_count_that_is_not_an_integer_is_named(option, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["explain", str(tmp_path), "--out", str(tmp_path / "s.zarr"), "--model", "parts_cnn", option, "ten"])
    assert exit_.value.code == EXIT_USAGE
    assert f"argument {option}: must be an integer ≥ 1, got 'ten'" in capsys.readouterr().err


@pytest.mark.parametrize("device", ["meta", "mps"])
def test_a_device_that_cannot_explain_is_named(device, parts_folder, tmp_path, capsys):
    out = tmp_path / "s.zarr"
    assert main(["explain", str(parts_folder), "--out", str(out), "--model", "parts_cnn", "--device", device,
                 "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"omenn explain: error: device '{device}' cannot run omenn explain: it explains on cpu, cuda or " \
                  "cuda:N\n"
    assert not out.exists()


def test_pretrained_weights_that_cannot_be_fetched_are_named(parts_folder, tmp_path, monkeypatch, capsys):
    """Without a network: the hub in offline mode (no waiting for connection time-outs), its cache empty."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    expected = f"the pretrained weights of the timm model '{TIMM_MODEL}' could not be fetched"
    with pytest.raises(ModelLoadError, match=expected):
        load_model(TIMM_MODEL, pretrained=True)
    out = tmp_path / "s.zarr"
    assert main(["explain", str(parts_folder), "--out", str(out), "--model", TIMM_MODEL, "--pretrained",
                 "--workers", "0", "-q"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "--checkpoint" in err
    assert not out.exists()


def test_show_into_a_file_is_named(tmp_path, capsys):
    store = tmp_path / "s.zarr"
    AttributionStore.create(store, paths=["a.png", "b.png"], labels=[0, 1], target_count=1, classes=3,
                            image_shape=(3, 4, 4), batch_size=2, store_dtype="float32", components=("contribution",),
                            attributes={})
    a_file = tmp_path / "overlays.png"
    a_file.write_bytes(b"an image of mine")
    for out in (a_file, a_file / "sub"):
        assert main(["show", str(store), "--out", str(out), "-q"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(out) in err, err
    assert a_file.read_bytes() == b"an image of mine"
