"""torchvision's classification zoo, randomly initialized, explained exactly at a small input size.

Every model of ``torchvision.models.list_models(module=torchvision.models)`` with 10
classes, every bias and norm statistic randomized (``randomize_``), float64, a batch of
two at the smallest size each accepts (``SIZE``), on the default backend. The explanation
must sum to the model's own logit: ``|Σ C − ŷ| ≤ 1e-10 · (|Σ C_w ⊙ X| + |Σ C_b| + |ŷ|)``,
relative to the terms rather than to ``|ŷ|`` alone, which can be 0 (SqueezeNet ends in a
ReLU before its pooling). float64, because in float32 the model's own forward rounds: deep
models at random initialization (RegNetY-32GF, ViT-B/32) give logits near 0 whose float32
rounding is about 5e-5 of them.

CI runs six quick architectures (``IN_CI``; Swin V2 for R11'), within its 30-minute budget;
the whole zoo takes 10 minutes on a 2-core machine, most of it in ``torch.export``.
``OMENN_ZOO=all`` runs every model; the README lists the whole zoo's result.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from omenn_kernels import explain
from omenn_kernels.testing import randomize_

torchvision = pytest.importorskip("torchvision")

IN_CI = ["alexnet", "resnet18", "shufflenet_v2_x0_5", "squeezenet1_0", "swin_v2_t", "vgg11_bn"]
ALL = torchvision.models.list_models(module=torchvision.models)
# The smallest input each accepts where 32×32 is too small (MaxViT: a multiple of 32·7); ViTs
# take theirs as an argument.
SIZE = {"alexnet": 64, "inception_v3": 75, "maxvit_t": 224}
ARGUMENTS = {name: {"image_size": 28 if "_14" in name else 32} for name in ALL if name.startswith("vit_")}


@pytest.mark.parametrize("name", ALL if os.environ.get("OMENN_ZOO") == "all" else IN_CI)
def test_the_model_explains_exactly(name):
    torch.manual_seed(0)  # the weights' initialization
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # GoogLeNet's and Inception's note on their init
        model = torchvision.models.get_model(name, weights=None, num_classes=10, **ARGUMENTS.get(name, {}))
    randomize_(model, seed=0).to(torch.float64).eval()
    size = ARGUMENTS.get(name, {}).get("image_size", SIZE.get(name, 32))
    x = torch.rand(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    e = explain(model, x, 3)
    with torch.no_grad():
        logit = model(x)[:, 3]
    weighted, biased = (e.weight * x).sum((1, 2, 3)), e.bias.sum((1, 2))
    scale = weighted.abs() + biased.abs() + logit.abs()
    assert bool(((weighted + biased - logit).abs() <= 1e-10 * scale).all())
