"""Bad targets and inputs given to the API raise the library's own exceptions, naming the value.

Targets beyond 64 bits, complex targets, numpy scalars, float class indices, Quantus
labels that are not whole numbers, integer images given to ``quantus_explain``, and an
input the model's own forward rejects (wrong channel count), which is not a capture
failure. Where an input is accepted, the result is compared with the explanation of the
equivalent well-formed call: float64, ``rtol=1e-12, atol=1e-14`` (the same computation).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

from omenn_kernels import Explainer, InputError, InputTypeError, TargetError, explain, quantus_explain
from omenn_kernels.testing import randomize_

DT = torch.float64
K = 5


def make_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                          nn.Flatten(), nn.Linear(24, K))
    return randomize_(model.to(DT), seed=seed, scale=0.5).eval()


def make_input(batch: int = 2, channels: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, channels, 8, 8, generator=torch.Generator().manual_seed(50 + seed), dtype=DT)


@pytest.fixture(scope="module")
def case() -> tuple[nn.Module, torch.Tensor, Explainer]:
    model = make_cnn()
    return model, make_input(), Explainer(model)


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-14)


# --------------------------------------------------------------------------- targets


BAD_TARGETS = {
    "int_beyond_64_bits": (2 ** 70, r"out of range: got 1180591620717411303424, the model has 5 classes"),
    "negative_int_beyond_64_bits": (-(2 ** 70), r"out of range: got -1180591620717411303424"),
    "numpy_uint64_scalar": (np.uint64(2 ** 64 - 1), r"out of range: got 18446744073709551615"),
    "list_with_int_beyond_64_bits": ([2 ** 70, 1], r"target \[1180591620717411303424, 1\] is not class indices.*"
                                                     r"dtype is object"),
    "numpy_uint64_indices": (np.array([2 ** 63, 1], dtype=np.uint64),
                             r"out of range: got \[9223372036854775808, 1\]"),
    "complex_tensor": (torch.tensor([1 + 0j, 2 + 0j]), r"target \[\(1\+0j\), \(2\+0j\)\] is complex "
                                                       r"\(torch\.complex64\).*integers"),
    "complex_numpy_array": (np.array([3, 1], dtype=np.complex128), r"is complex \(torch\.complex128\)"),
    "complex_weights": (torch.ones(K, dtype=torch.complex128), r"is complex.*read-out weights real"),
    "numpy_float64_scalar": (np.float64(3.0), r"unsupported target type float64 \(3\.0\)"),
    "numpy_float32_scalar": (np.float32(2.0), r"unsupported target type float32 \(2\.0\)"),
    "float_class_indices": (torch.tensor([1.0, 3.0], dtype=DT), r"got \(2,\) \(\[1\.0, 3\.0\] looks like one "
                                                                r"class per image: class indices must be an "
                                                                r"integer tensor\)"),
    "strings": (["cat", "dog"], r"target \['cat', 'dog'\] is not class indices.*dtype is <U3"),
}


@pytest.mark.parametrize("name", list(BAD_TARGETS))
def test_bad_target_is_a_target_error_naming_it(name, case):
    target, message = BAD_TARGETS[name]
    model, x, explainer = case
    with pytest.raises(TargetError, match=message):
        explainer(x, target)
    with pytest.raises(TargetError, match=message):
        explain(model, x, target)


# --------------------------------------------------------------------------- quantus_explain


@pytest.mark.parametrize("labels, message", [
    (np.array([1.0, 2.7]), r"labels \[1\.0, 2\.7\] are not all whole numbers"),
    (np.array([np.nan, 1.0]), r"labels \[nan, 1\.0\] are not all whole numbers"),
    (np.array([1e30, 1.0]), r"are not all whole numbers"),
    (torch.tensor([0.5, 1.0]), r"labels \[0\.5, 1\.0\] are not all whole numbers"),
    (np.array([2 ** 70]), r"target \[1180591620717411303424\] is not class indices"),
    (np.array([1, 2], dtype=np.complex64), r"dtype torch\.complex64; quantus_explain needs integer class"),
], ids=["fraction", "nan", "beyond_64_bits", "tensor_fraction", "int_beyond_64_bits", "complex"])
def test_quantus_explain_refuses_labels_that_are_not_whole_numbers(labels, message, case):
    model, x, _ = case
    with pytest.raises(TargetError, match=message):
        quantus_explain(model=model, inputs=x.numpy(), targets=labels, device="cpu")


def test_quantus_explain_takes_whole_float_labels_as_classes(case):
    model, x, explainer = case
    for labels in (np.array([3.0, 1.0]), np.array([3.0, 1.0], dtype=np.float32), torch.tensor([3.0, 1.0])):
        result = quantus_explain(model=model, inputs=x.numpy(), targets=labels, device="cpu")
        assert_same(torch.as_tensor(result), explainer.attribute(x, torch.tensor([3, 1])))
    with pytest.raises(TargetError, match=r"2\.5"):
        quantus_explain(model=model, inputs=x.numpy(), targets=np.array([3.0, 2.5]), device="cpu")


@pytest.mark.parametrize("dtype", [np.uint8, np.int64, np.bool_])
def test_quantus_explain_refuses_integer_images(dtype, case):
    model, x, _ = case
    images = (np.random.default_rng(0).random(x.shape) * 255).astype(dtype)
    with pytest.raises(InputTypeError, match=r"inputs have dtype torch\.\w+; the model needs floating-point "
                                             r"images in its normalized input range"):
        quantus_explain(model=model, inputs=images, targets=np.array([1, 2]), device="cpu")


# --------------------------------------------------------------------------- inputs the model rejects


class CountsCalls(nn.Module):
    """A linear head on 48 features that counts its calls in a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(48, K)
        self.register_buffer("calls", torch.zeros((), dtype=DT))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc(x.flatten(1))


def test_wrong_channel_count_is_an_input_error_not_a_capture_failure():
    model = make_cnn()
    gray = make_input(channels=1)
    message = (r"model's own forward fails on an input of shape \(2, 1, 8, 8\) \(RuntimeError: .*"
               r"expected input\[2, 1, 8, 8\] to have 3 channels")
    with pytest.raises(InputError, match=message) as info:
        explain(model, gray, 0)
    assert isinstance(info.value.__cause__, RuntimeError)
    explainer = Explainer(model)
    with pytest.raises(InputError, match=message):
        explainer(gray, 0)
    x = make_input()
    assert_same(explainer(x, 0).contribution, explain(model, x, 0).contribution)  # still usable


def test_model_rejecting_the_input_shape_keeps_its_buffers():
    model = CountsCalls().to(DT)
    wrong = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(1), dtype=DT)  # 60 features, not 48
    with pytest.raises(InputError, match=r"model's own forward fails on an input of shape \(2, 3, 4, 5\)"):
        explain(model, wrong, 0)
    assert model.calls.item() == 0
