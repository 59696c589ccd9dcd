"""The ``omenn`` command end to end: demo, explain, show, exit codes, SIGKILL and resume, torchrun."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import timm
import torch

from omenn_kernels.bulk import AttributionStore
from omenn_kernels.bulk.store import EXPLAINED, PENDING
from omenn_kernels.cli import EXIT_FAILED_IMAGES, EXIT_NO_KERNELS, EXIT_OK, EXIT_USAGE, main
from omenn_kernels.demo import draw_images
from omenn_kernels.testing import randomize_

ROOT = Path(__file__).resolve().parents[1]
ARRAYS = ("contribution", "explained", "logits", "targets", "status", "labels")


def _env() -> dict:
    # One thread per process: a 1-process and a 2-process run then round alike.
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _explain_command(source: Path, out: Path, *extra: str) -> list[str]:
    return ["explain", str(source), "--out", str(out), "--model", "parts_vit", "--targets", "predicted,top2,1-2",
            "--backend", "reference", "--store-dtype", "float32", "--workers", "0", "-q", *extra]


def _same_store(a: Path, b: Path, *, exact: bool) -> None:
    left, right = AttributionStore.open(a), AttributionStore.open(b)
    assert left.paths() == right.paths()
    for name in ARRAYS:
        x, y = left.read(name), right.read(name)
        if exact or not np.issubdtype(x.dtype, np.floating):
            assert np.array_equal(x, y, equal_nan=True), name
        else:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.fixture(scope="module")
def many_images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("many") / "images"
    draw_images(folder, 160)
    return folder


def test_build_loads_the_kernels_or_says_why_not(tmp_path, capsys):
    assert main(["build", "-q"]) == EXIT_OK
    assert "are built and loaded" in capsys.readouterr().out
    # A new process with no compiler and an empty extensions cache: exit 4 and the reason.
    environment = {**os.environ, "CXX": str(tmp_path / "no-compiler"), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "omenn_kernels.cli", "build", "-q"], env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == EXIT_NO_KERNELS, done.stderr
    assert "no C++ compiler" in done.stderr and "works without them" in done.stderr


def test_demo(tmp_path):
    assert main(["demo", "--out", str(tmp_path / "demo"), "--images", "4", "-q"]) == EXIT_OK
    report = json.loads((tmp_path / "demo" / "completeness.json").read_text())
    assert len(report) == 4 * 4 and max(r["absolute_error"] for r in report) < 1e-4
    assert sorted(p.name for p in (tmp_path / "demo" / "overlays").iterdir()) == \
        [f"target{t}.png" for t in range(4)]
    # a second demo into the same folder would mix two runs
    assert main(["demo", "--out", str(tmp_path / "demo"), "-q"]) == EXIT_USAGE


def test_explain_show_and_exit_codes(parts_folder, folder_with_corrupt_file, tmp_path, capsys):
    out = tmp_path / "s.zarr"
    assert main(_explain_command(parts_folder, out)) == EXIT_OK
    store = AttributionStore.open(out)
    assert (store.status() == EXPLAINED).all() and store.attrs["model"] == "parts_vit"
    np.testing.assert_allclose(store.read("contribution").astype(np.float64).sum((-2, -1)),
                               store.read("explained"), rtol=1e-5, atol=1e-4)
    assert main(["show", str(out), "--out", str(tmp_path / "png"), "--images", "0,3", "-q"]) == EXIT_OK
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == ["target0.png", "target1.png",
                                                                       "target2.png", "target3.png"]
    assert main(["show", str(out), "--out", str(tmp_path / "pp"), "--postprocess", "-q"]) == EXIT_OK
    capsys.readouterr()

    assert main(_explain_command(folder_with_corrupt_file, tmp_path / "c.zarr")) == EXIT_FAILED_IMAGES
    for arguments, message in [
        (_explain_command(parts_folder, out, "--targets", "top2"), "different run"),
        (_explain_command(parts_folder, tmp_path / "x", "--targets", "60"), "out of range"),
        (_explain_command(tmp_path / "missing", tmp_path / "y"), "not found"),
        (["explain", str(parts_folder), "--out", str(tmp_path / "z"), "--model", "resnet18", "-q"], "needs weights"),
        (["show", str(tmp_path / "missing.zarr"), "--out", str(tmp_path / "w")], "no attribution store"),
        (["show", str(out), "--out", str(tmp_path / "w"), "--images", "99"], "not explained"),
    ]:
        assert main(arguments) == EXIT_USAGE
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad_option:
        main(["explain", str(parts_folder), "--out", str(tmp_path / "v"), "--model", "parts_vit",
              "--components", "bias"])
    assert bad_option.value.code == EXIT_USAGE


def test_timm_model_from_checkpoint(parts_folder, tmp_path):
    model = randomize_(timm.create_model("resnet10t", num_classes=5)).eval()
    torch.save(model.state_dict(), tmp_path / "weights.pth")
    out = tmp_path / "s.zarr"
    assert main(["explain", str(parts_folder), "--out", str(out), "--model", "resnet10t", "--num-classes", "5",
                 "--checkpoint", str(tmp_path / "weights.pth"), "--targets", "top2,0-4", "--batch-size", "8",
                 "--store-dtype", "float32", "--workers", "0", "-q"]) == EXIT_OK
    store = AttributionStore.open(out)
    size = timm.data.resolve_model_data_config(model)["input_size"]
    assert store.read("contribution").shape == (20, 3, *size[1:])
    np.testing.assert_allclose(store.read("contribution").astype(np.float64).sum((-2, -1)),
                               store.read("explained"), rtol=1e-4, atol=1e-4)


def test_resume_after_sigkill_equals_an_uninterrupted_run(many_images, tmp_path):
    uninterrupted, killed = tmp_path / "whole.zarr", tmp_path / "killed.zarr"
    command = [sys.executable, "-m", "omenn_kernels.cli"]
    subprocess.run(command + _explain_command(many_images, uninterrupted, "--batch-size", "4"), env=_env(),
                   check=True, timeout=600)
    process = subprocess.Popen(command + _explain_command(many_images, killed, "--batch-size", "4"), env=_env())
    try:
        deadline = time.monotonic() + 300
        done = 0
        while done < 12 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            if (killed / "status" / "zarr.json").is_file():
                done = int((AttributionStore.open(killed).status() == EXPLAINED).sum())
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait()
    status = AttributionStore.open(killed).status()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert (status == PENDING).any() and (status == EXPLAINED).any()
    subprocess.run(command + _explain_command(many_images, killed, "--batch-size", "4"), env=_env(),
                   check=True, timeout=600)
    assert AttributionStore.open(killed).attrs["complete"]
    _same_store(uninterrupted, killed, exact=True)


def test_torchrun_two_processes_equal_one(parts_folder, tmp_path):
    """Both with ``--backend auto``, whose choice the processes of a torchrun make together."""
    single, sharded = tmp_path / "single.zarr", tmp_path / "sharded.zarr"
    command = [sys.executable, "-m", "omenn_kernels.cli"]
    subprocess.run(command + _explain_command(parts_folder, single, "--batch-size", "4", "--backend", "auto"),
                   env=_env(), check=True, timeout=600)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    "-m", "omenn_kernels.cli"] + _explain_command(parts_folder, sharded, "--batch-size", "4",
                                                                  "--device", "cpu", "--backend", "auto"),
                   env=_env(), check=True, timeout=600)
    store = AttributionStore.open(sharded)
    assert store.attrs["complete"] and (store.status() == EXPLAINED).all()
    _same_store(single, sharded, exact=False)
