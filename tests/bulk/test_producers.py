"""What explained each batch is recorded (``produced_by``), and a resume does not mix backends or versions.

One store of 4 images (2 batches) is shared; each test copies it, marks its second batch pending
and resumes. It is explained by the fused backend and its records then say ``compiled``, as a
compiled run's would (compiling is slow; ``tests/bulk/test_run.py`` checks a compiled run's
records). A compilation that fails is a ``make_fx`` that raises: the compiled backend then runs
the fused one, with a warning, as where Inductor's cache cannot be written.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from omenn_kernels import __version__
from omenn_kernels.backends import compiled
from omenn_kernels.bulk import AttributionStore, RunConfig, StoreMismatchError, explain_folder
from omenn_kernels.bulk.store import PENDING, PRODUCED_BY
from omenn_kernels.cli import EXIT_OK, EXIT_USAGE, main
from omenn_kernels.demo import draw_images

VERSIONS = f"omenn_kernels={__version__} torch={torch.__version__}"


def _config(source: Path, out: Path, **overrides) -> RunConfig:
    options = dict(model="parts_vit", targets="predicted", batch_size=2, backend="compiled", store_dtype="float32",
                   device="cpu", workers=0, progress=False)
    options.update(overrides)
    return RunConfig(source=source, out=out, **options)


def _command(source: Path, out: Path, backend: str) -> list[str]:
    return ["explain", str(source), "--out", str(out), "--model", "parts_vit", "--targets", "predicted",
            "--batch-size", "2", "--backend", backend, "--store-dtype", "float32", "--device", "cpu",
            "--workers", "0", "-q"]


def _cannot_compile(*args, **kwargs):
    raise RuntimeError("the Inductor cache folder is read-only")


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("producers") / "images"
    draw_images(folder, 4)
    return folder


@pytest.fixture(scope="module")
def compiled_store(images, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compiled") / "store.zarr"
    explain_folder(_config(images, out, backend="fused"))
    store = AttributionStore.open(out, writable=True)
    assert store.read(PRODUCED_BY).tolist() == [f"backend=fused {VERSIONS}"] * 4
    store.group[PRODUCED_BY][:] = np.full(4, f"backend=compiled {VERSIONS}", dtype=object)
    return out


def _interrupted_copy(store: Path, folder: Path) -> Path:
    """A copy of ``store`` whose second batch is pending again, as a killed run leaves it."""
    out = folder / "resumed.zarr"
    shutil.copytree(store, out)
    AttributionStore.open(out, writable=True).group["status"][2:4] = PENDING
    return out


def test_a_resume_that_falls_back_to_fused_is_refused_unless_allowed(compiled_store, images, tmp_path, monkeypatch):
    out = _interrupted_copy(compiled_store, tmp_path)
    monkeypatch.setattr(compiled, "make_fx", _cannot_compile)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(StoreMismatchError, match=r"backend: store has 'compiled', this run 'fused'") as refused:
            explain_folder(_config(images, out))
        assert "could not compile this run's explanation" in str(refused.value)
        assert "--allow-mixed" in str(refused.value)
        assert AttributionStore.open(out).summary()["pending"] == 2  # nothing written
        summary = explain_folder(_config(images, out, allow_mixed=True))
    assert summary.explained == 2
    store = AttributionStore.open(out)
    assert store.producers() == {f"backend=compiled {VERSIONS}": 2, f"backend=fused {VERSIONS}": 2}
    assert store.attrs["produced_by"] == [f"backend=compiled {VERSIONS}", f"backend=fused {VERSIONS}"]


def test_another_backend_or_version_is_refused_before_explaining(compiled_store, images, tmp_path, monkeypatch,
                                                                   capsys):
    out = _interrupted_copy(compiled_store, tmp_path)
    explained = []
    monkeypatch.setattr("omenn_kernels.bulk.run._BatchExplainer.__call__",
                        lambda *args: explained.append(1) or pytest.fail("explained a batch"))
    assert main(_command(images, out, "reference")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "backend: store has 'compiled', this run 'reference'" in err
    store = AttributionStore.open(out, writable=True)
    store.group[PRODUCED_BY][0:2] = np.full(2, "backend=compiled omenn_kernels=0.0.9 torch=2.1.0", dtype=object)
    assert main(_command(images, out, "compiled")) == EXIT_USAGE
    err = capsys.readouterr().err
    assert (f"omenn_kernels: store has '0.0.9', this run '{__version__}'; torch: store has '2.1.0', this run "
            f"'{torch.__version__}'") in err
    assert not explained


def test_a_store_without_records_resumes_only_when_allowed(compiled_store, images, tmp_path, capsys):
    out = _interrupted_copy(compiled_store, tmp_path)
    shutil.rmtree(out / PRODUCED_BY)
    assert main(_command(images, out, "reference")) == EXIT_USAGE
    assert "the backend and versions of images explained before omenn_kernels recorded them are not known" in \
        capsys.readouterr().err
    assert main(_command(images, out, "reference") + ["--allow-mixed"]) == EXIT_OK
    store = AttributionStore.open(out)
    assert store.read(PRODUCED_BY).tolist() == ["", "", f"backend=reference {VERSIONS}",
                                                f"backend=reference {VERSIONS}"]
