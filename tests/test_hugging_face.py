"""Hugging Face models as they come: image classifiers returning a ``ModelOutput`` of several
tensors, a BERT-style encoder explained on its input embeddings with its attention mask, and a
Llama-style causal language model explained for its next-token logit.

Small configurations, random initialization with every bias and norm affine randomized,
float64, random inputs. Tolerances: completeness ``|Σ C − ŷ| / |ŷ| ≤ 1e-10``, except for the
Llama-style model, whose RMSNorm computes in float32 whatever the model's dtype (so its
own logits carry float32 rounding, ~6e-8 relative): ``≤ 1e-6`` there. Backends against
the reference: ``rtol=1e-9``, ``atol=1e-12·max|C|`` (``1e-6·max|C|`` for the Llama-style model).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import (BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM, ViTConfig,
                          ViTForImageClassification)

from omenn_kernels import Explainer, explain
from omenn_kernels.linearize.rules import attention as attention_rules
from omenn_kernels.ops import attention as attention_op
from omenn_kernels.testing import randomize_

DT = torch.float64


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs()).max())


def _assert_backends_agree(explanations: dict, atol: float = 1e-12) -> None:
    reference = explanations["reference"]
    for e in explanations.values():
        torch.testing.assert_close(e.contribution, reference.contribution, rtol=1e-9,
                                   atol=atol * float(reference.contribution.abs().max()))


def _through_the_attention_op(monkeypatch, explanation):
    """``explanation()`` on the fused backend with every SDPA through ``omenn::attention`` (on the
    CPU only attention weights larger than one chunk take it; here every size does)."""
    calls = []
    real = attention_op.attention

    def counted(*args):
        calls.append(args)
        return real(*args)

    with monkeypatch.context() as patch:
        patch.setattr(attention_rules, "_CHUNK_BYTES", 0)
        patch.setattr(attention_op, "attention", counted)
        result = explanation()
    assert calls
    return result


def test_a_vit_returning_its_hidden_states_is_explained_on_its_logits():
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, num_labels=5, output_hidden_states=True)
    model = randomize_(ViTForImageClassification(config), seed=1).to(DT).eval()
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2), dtype=DT)
    with torch.no_grad():
        output = model(x)
    assert len(output) == 2  # logits and hidden states
    explanations = {backend: explain(model, x, 2, backend=backend) for backend in ("reference", "fused")}
    assert _relative(explanations["reference"].contribution.sum((1, 2)), output.logits[:, 2]) <= 1e-10
    _assert_backends_agree(explanations)


class OnEmbeddings(nn.Module):
    """A sequence classifier explained on its token embeddings (B, T, D). The attention mask is a
    buffer: set it per batch in place (``mask.copy_(...)``); the explainer reads buffers at every call."""

    def __init__(self, model: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mask", mask)

    def forward(self, embeddings):
        return self.model(inputs_embeds=embeddings, attention_mask=self.mask)


def _bert():
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return randomize_(BertForSequenceClassification(config), seed=3).to(DT).eval()


def _embedded(model, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50, (3, 8), generator=generator)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[1, 5:] = 0  # padding
    mask[2, 3:] = 0
    with torch.no_grad():
        return model.get_input_embeddings()(ids), mask


def test_a_bert_encoder_gives_each_token_its_contribution_and_padding_exactly_zero(monkeypatch):
    bert = _bert()
    embeddings, mask = _embedded(bert, seed=4)
    model = OnEmbeddings(bert, mask)
    with torch.no_grad():
        logit = model(embeddings).logits[:, 1]
    explanations = {backend: explain(model, embeddings, 1, backend=backend, feature_dim=-1)
                    for backend in ("reference", "fused")}
    explanations["attention op"] = _through_the_attention_op(
        monkeypatch, lambda: explain(model, embeddings, 1, backend="fused", feature_dim=-1))
    e = explanations["reference"]
    assert e.contribution.shape == (3, 8)  # one contribution per token
    assert _relative(e.contribution.sum(1), logit) <= 1e-10
    torch.testing.assert_close(e.contribution, (e.weight * embeddings).sum(-1) + e.bias, rtol=1e-12, atol=1e-14)
    for explanation in explanations.values():
        assert torch.equal(explanation.contribution[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=DT))
    _assert_backends_agree(explanations)


def test_a_mask_set_in_place_is_read_at_the_next_call():
    bert = _bert()
    embeddings, mask = _embedded(bert, seed=5)
    model = OnEmbeddings(bert, mask.clone())
    explainer = Explainer(model, feature_dim=-1)
    explainer(embeddings, 0)
    other = torch.ones_like(mask)
    other[0, 6:] = 0
    model.mask.copy_(other)
    again = explainer(embeddings, 0)
    fresh = explain(OnEmbeddings(bert, other), embeddings, 0, feature_dim=-1)
    torch.testing.assert_close(again.contribution, fresh.contribution, rtol=1e-12, atol=1e-14)
    assert torch.equal(again.contribution[0, 6:], torch.zeros(2, dtype=DT))


class NextToken(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, embeddings):
        return self.model(inputs_embeds=embeddings, use_cache=False)


def test_a_llama_style_model_explains_its_next_token_logit(monkeypatch):
    config = LlamaConfig(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=32,
                         tie_word_embeddings=False)
    llama = randomize_(LlamaForCausalLM(config), seed=6).to(DT).eval()
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        embeddings = llama.get_input_embeddings()(ids)
        logits = llama(inputs_embeds=embeddings, use_cache=False).logits[:, -1]  # (B, V) at the last position
    next_token = logits.argmax(1)
    model = NextToken(llama)
    explanations = {backend: explain(model, embeddings, next_token, backend=backend, feature_dim=-1,
                                     output=lambda out: out.logits[:, -1])
                    for backend in ("reference", "fused")}
    explanations["attention op"] = _through_the_attention_op(monkeypatch, lambda: explain(
        model, embeddings, next_token, backend="fused", feature_dim=-1, output=lambda out: out.logits[:, -1]))
    e = explanations["reference"]
    assert e.contribution.shape == (2, 7)
    assert _relative(e.contribution.sum(1), logits.gather(1, next_token[:, None])[:, 0]) <= 1e-6
    _assert_backends_agree(explanations, atol=1e-6)


class LastTokenWithMask(nn.Module):
    """A causal LM on its token embeddings with a (left-)padding mask held as a buffer."""

    def __init__(self, model: nn.Module, mask: torch.Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("mask", mask)

    def forward(self, embeddings):
        return self.model(inputs_embeds=embeddings, attention_mask=self.mask, use_cache=False).logits[:, -1]


def test_a_left_padded_gpt2_batch_is_explained_without_nan(monkeypatch):
    """Left padding under a causal mask leaves the padding queries no key to attend to: SDPA gives
    them weights 0; every backend must too (softmax of a row of -inf is NaN, and NaN weights make
    the padded sample's whole explanation NaN). The compiled graph runs as traced."""
    from omenn_kernels.backends import compiled
    from transformers import GPT2Config, GPT2LMHeadModel

    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)
    config = GPT2Config(vocab_size=40, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    gpt2 = randomize_(GPT2LMHeadModel(config), seed=8).to(DT).eval()
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(9))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        embeddings = gpt2.get_input_embeddings()(ids)
    model = LastTokenWithMask(gpt2, mask)
    with torch.no_grad():
        logits = model(embeddings)
    assert torch.isfinite(logits).all()
    target = logits.argmax(1)
    explanations = {backend: Explainer(model, backend=backend, feature_dim=-1)(embeddings, target)
                    for backend in ("reference", "fused", "compiled")}
    for backend, e in explanations.items():
        assert torch.isfinite(e.contribution).all(), backend
        assert _relative(e.contribution.sum(1), logits.gather(1, target[:, None])[:, 0]) <= 1e-10, backend
    _assert_backends_agree(explanations)
