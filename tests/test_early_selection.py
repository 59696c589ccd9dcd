"""Capture-time selection first (omenn_kernels/early_selection.py).

A program captured with the selection of the explained positions moved ahead of the
position-wise operations must give the explanation of the program captured without it —
weight, bias and logit — on the reference and fused backends, and compute the moved
operations on the selected positions only. Models in float64 with every bias and norm
affine randomized; tolerance 1e-10 relative (moving a selection changes at most the rounding
of a reduction over features).
"""

from __future__ import annotations

import pytest
import timm
import torch
import torch.nn as nn
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from omenn_kernels.backends import fused, reference
from omenn_kernels.capture import capture
from omenn_kernels.early_selection import select_early
from omenn_kernels.linearize import linearize
from omenn_kernels.readout import Readout
from omenn_kernels.testing import randomize_, relative_distance

TOLERANCE = 1e-10
aten = torch.ops.aten


class _LastTokens(nn.Module):
    """A causal LM on its input embeddings (B, T, D), the logits of its last ``kept`` positions flattened."""

    def __init__(self, model: nn.Module, kept: int) -> None:
        super().__init__()
        self.model, self.kept = model, kept

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        return self.model(inputs_embeds=embeddings, use_cache=False, logits_to_keep=self.kept).logits.flatten(1)


def _gpt2() -> nn.Module:
    """GPT-2: ``Conv1D`` layers written as view–addmm–view, GELU-tanh written out."""
    config = GPT2Config(vocab_size=30, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return _LastTokens(GPT2LMHeadModel(config), kept=2)


def _llama() -> nn.Module:
    """Llama: ``linear`` layers, RMSNorm as a mean over the features, a gated SiLU MLP."""
    config = LlamaConfig(vocab_size=30, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16)
    return _LastTokens(LlamaForCausalLM(config), kept=1)


def _vit() -> nn.Module:
    """A ViT classifying its class token (``x[:, 0]``, a ``select``)."""
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, num_classes=5, depth=2)


MODELS = {"gpt2": (_gpt2, (2, 9, 32)), "llama": (_llama, (2, 9, 32)), "vit": (_vit, (2, 3, 32, 32))}


def _programs(name: str):
    build, shape = MODELS[name]
    model = randomize_(build().double().eval(), seed=5)
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    feature_dim = -1 if name != "vit" else 1
    programs = linearize(capture(model, x)), linearize(capture(model, x, select_first=False))
    for program in programs:
        program.feature_dim = feature_dim % x.dim()
    return model, x, programs


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("backend", [reference, fused], ids=["reference", "fused"])
def test_selecting_first_explains_as_selecting_last(name: str, backend) -> None:
    model, x, (selected_first, selected_last) = _programs(name)
    target = torch.tensor([1, 3])
    early = backend.explain_batch(selected_first, model, x, Readout(target))
    late = backend.explain_batch(selected_last, model, x, Readout(target))
    for part, what in ((0, "weight"), (1, "bias"), (2, "logit")):
        assert relative_distance(early[part], late[part]) < TOLERANCE, what
    assert relative_distance(early[2], model(x).gather(1, target[:, None])[:, 0]) < TOLERANCE


def _products(program) -> list[tuple[int, ...]]:
    """The output shapes of the matrix products (linear layers) of a program, in order."""
    return [tuple(step.node.meta["val"].shape) for step in program.steps
            if step.node.target in (aten.addmm.default, aten.mm.default, aten.linear.default)]


@pytest.mark.parametrize("name, rows", [("gpt2", 2 * 2), ("llama", 2 * 1)])
def test_the_last_block_after_its_attention_runs_on_the_kept_positions(name: str, rows: int) -> None:
    """The selection stops at the last attention (R6 gives each output the ones of its own
    value position); the projections after it, the MLP and the head run on the kept rows."""
    _, x, (selected_first, selected_last) = _programs(name)
    early, late = _products(selected_first), _products(selected_last)
    assert len(early) == len(late)
    changed = [i for i, (a, b) in enumerate(zip(early, late)) if a != b]
    per_block = 4 if name == "gpt2" else 7  # GPT-2: c_attn, c_proj, c_fc, c_proj; Llama: q, k, v, o, gate, up, down
    first_after_attention = len(late) - 1 - per_block + (1 if name == "gpt2" else 3)
    assert changed == list(range(first_after_attention, len(late) - 1))
    for index in changed:
        assert early[index][:-1] in ((rows,), (2, rows // 2))
    attention = [s.node for s in selected_first.steps if s.node.target is aten.scaled_dot_product_attention.default]
    assert all(node.meta["val"].shape[-2] == x.shape[1] for node in attention)


def test_a_selection_moves_only_past_operations_whose_every_user_selects_alike() -> None:
    """``y = f(x)`` read whole by one user and in part by another is computed whole once."""

    class TwoReaders(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(6, 6), nn.Linear(6, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = torch.tanh(self.inner(x))
            return self.outer(y[:, -2:]).flatten(1) + y.sum((1, 2), keepdim=True).flatten(1)

    model = randomize_(TwoReaders().double().eval(), seed=2)
    x = torch.randn(2, 5, 6, dtype=torch.float64)
    program = capture(model, x)
    tanh = [n for n in program.graph.nodes if n.target is aten.tanh.default]
    assert [tuple(n.meta["val"].shape) for n in tanh] == [(2, 5, 6)]
    assert select_early(program.graph) == 0


def test_a_selected_output_and_a_strided_slice_stay_where_they_are() -> None:
    class Strided(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)[:, ::2]

    class Selected(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(x)[:, 1]

    x = torch.randn(2, 4, 3, dtype=torch.float64)
    for model in (Strided(), Selected()):
        graph = capture(model, x, select_first=False).graph
        assert select_early(graph) == 0


def test_slices_of_two_axes_move_once_each() -> None:
    """Swin's ``x[:, :H, :W]`` after window padding: the two slices do not swap past each other
    forever; each moves past the operations before them, and the explanation is unchanged."""

    class Cropped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner, self.outer = nn.Linear(3, 3), nn.Linear(3, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.outer(torch.tanh(self.inner(x))[:, :4, :3]).sum((1, 2))

    model = randomize_(Cropped().double().eval(), seed=3)
    x = torch.randn(2, 5, 6, 3, dtype=torch.float64)
    kept, whole = capture(model, x), capture(model, x, select_first=False)
    tanh = [n for n in kept.graph.nodes if n.target is aten.tanh.default]
    assert [tuple(n.meta["val"].shape) for n in tanh] == [(2, 4, 3, 3)]
    explanations = []
    for program in (linearize(kept), linearize(whole)):
        program.feature_dim = 3
        explanations.append(reference.explain_batch(program, model, x, Readout(torch.tensor([0, 1]))))
    for got, want in zip(*explanations):
        assert relative_distance(got, want) < TOLERANCE
