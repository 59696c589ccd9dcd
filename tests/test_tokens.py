"""Models explained from their token ids: one contribution per token, at the embedding layer.

Small random configurations with every bias and norm affine randomized, float64, random ids,
padding on the left and on the right. Tolerances: completeness ``|Σ C − ŷ| / |ŷ| ≤ 1e-10``
against the model's own logits on the same ids and mask; padding tokens exactly 0;
backends against the reference ``rtol=1e-9, atol=1e-12·max|C|``; a generation explained in
one pass against N single explanations ``rtol=1e-10, atol=1e-12·max|C|``. The compiled
backend runs its traced graph uncompiled (``COMPILER`` is the identity).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, GPT2Config,
                          GPT2ForSequenceClassification, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Phi3Config,
                          Phi3ForCausalLM)
from transformers.pytorch_utils import Conv1D

from omenn_kernels import Explainer, InputError, InputTypeError, TokenExplainer, api, explain
from omenn_kernels.backends import compiled
from omenn_kernels.testing import randomize_
from omenn_kernels.tokens import bucket
from test_dispatch_counts import _Counted  # aten ops dispatched, by op

DT = torch.float64
BACKENDS = ("reference", "fused", "compiled")
VOCABULARY = 40
PAD = 0


@pytest.fixture(autouse=True)
def _traced_graph_runs_uncompiled(monkeypatch):
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: graph)


def _gpt2(kind=GPT2LMHeadModel, **extra):
    config = GPT2Config(vocab_size=VOCABULARY, n_embd=32, n_layer=2, n_head=4, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0, bos_token_id=1,
                        eos_token_id=1, pad_token_id=PAD, **extra)
    return randomize_(kind(config), seed=11).to(DT).eval()


def _bert(kind):
    config = BertConfig(vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, pad_token_id=PAD)
    return randomize_(kind(config), seed=12).to(DT).eval()


def _padded(left: bool, seed: int = 13, length: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """(3, length) ids with no padding id among the tokens, and a mask padding samples 1 and 2."""
    ids = torch.randint(2, VOCABULARY, (3, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    padding = [(1, 3), (2, 1)]  # (sample, padding tokens)
    for sample, count in padding:
        if left:
            mask[sample, :count] = 0
        else:
            mask[sample, length - count:] = 0
    ids[mask == 0] = PAD
    return ids, mask


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want).abs() / want.abs()).max())


def _check(explanations: dict, logit: torch.Tensor, mask: torch.Tensor) -> None:
    """Complete, padding exactly 0 (C, C_b and every feature of C_w), backends equal."""
    reference = explanations["reference"]
    padding = int((mask == 0).sum())
    for backend, e in explanations.items():
        assert e.contribution.shape == mask.shape, backend
        assert _relative(e.contribution.sum(1), logit) <= 1e-10, backend
        assert torch.equal(e.contribution[mask == 0], torch.zeros(padding, dtype=DT)), backend
        assert torch.equal(e.bias[mask == 0], torch.zeros(padding, dtype=DT)), backend
        assert torch.equal(e.weight[mask == 0], torch.zeros(padding, e.weight.shape[-1], dtype=DT)), backend
        torch.testing.assert_close(e.contribution, reference.contribution, rtol=1e-9,
                                   atol=1e-12 * float(reference.contribution.abs().max()))


@pytest.mark.parametrize("left", [True, False], ids=["left padding", "right padding"])
def test_a_causal_lm_explains_the_next_token_of_each_last_real_token(left):
    model = _gpt2()
    ids, mask = _padded(left)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    last = torch.tensor([6, 6, 6]) if left else torch.tensor([6, 3, 5])
    at_last = logits[torch.arange(3), last]
    explanations = {backend: explain(model, ids, attention_mask=mask, backend=backend) for backend in BACKENDS}
    e = explanations["reference"]
    assert torch.equal(e.target, at_last.argmax(1))  # the predicted next token by default
    torch.testing.assert_close(e.logits, at_last, rtol=1e-12, atol=1e-12)
    _check(explanations, at_last.gather(1, e.target[:, None])[:, 0], mask)


@pytest.mark.parametrize("left", [True, False], ids=["left padding", "right padding"])
def test_a_sequence_classifier_pooling_its_last_token_by_pad_ids(left):
    """GPT-2's classifier finds the pooled token from the ids (``!= pad_token_id``): the ids are
    held as they are, so it pools the same token as on its own."""
    model = _gpt2(GPT2ForSequenceClassification, num_labels=3)
    ids, mask = _padded(left, seed=14)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
    explainer = {backend: TokenExplainer(model, backend=backend) for backend in BACKENDS}
    explanations = {backend: explainer[backend](ids, 2, attention_mask=mask) for backend in BACKENDS}
    _check(explanations, logits[:, 2], mask)


def test_an_encoder_explains_the_logits_at_a_chosen_position():
    model = _bert(BertForMaskedLM)
    for left, position in ((True, torch.tensor([4, 5, 3])), (False, 2)):
        ids, mask = _padded(left, seed=15)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        at = logits[torch.arange(3), torch.as_tensor(position).expand(3)]
        explanations = {backend: explain(model, ids, 7, attention_mask=mask, position=position, backend=backend)
                        for backend in BACKENDS}
        _check(explanations, at[:, 7], mask)


def test_a_bert_classifier_with_token_type_ids_held_as_given():
    model = _bert(BertForSequenceClassification)
    ids, mask = _padded(left=False, seed=16)
    token_types = torch.zeros_like(ids)
    token_types[:, 3:] = 1
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, token_type_ids=token_types).logits
    e = explain(model, ids, 1, attention_mask=mask, token_type_ids=token_types, backend="fused")
    _check({"reference": e}, logits[:, 1], mask)
    plain = explain(model, ids, 1, attention_mask=mask, backend="fused")
    assert not torch.allclose(plain.logit, e.logit)  # the token types were used
    # At a layer that is not a lookup (word, position and token type embeddings, LayerNorm):
    # its output in the model's own forward is the explained input.
    whole = explain(model, ids, 1, attention_mask=mask, token_type_ids=token_types, layer="bert.embeddings",
                    backend="fused")
    _check({"reference": whole}, logits[:, 1], mask)
    assert whole.weight.shape == (3, 7, 32)


def test_a_generation_is_explained_in_one_pass_as_each_token_on_its_own():
    model = _gpt2()
    ids, mask = _padded(left=True, seed=17, length=9)
    generated = 4
    for backend in ("reference", "fused"):
        explainer = TokenExplainer(model, backend=backend)
        e = explainer.explain_generation(ids, generated, attention_mask=mask)
        assert e.contribution.shape == (3, generated, 9)
        torch.testing.assert_close(e.target, ids[:, -generated:], rtol=0, atol=0)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits
        for n in range(generated):
            position = 9 - generated - 1 + n
            single = explainer(ids, ids[:, position + 1], attention_mask=mask, position=position)
            assert _relative(e.logit[:, n], logits[:, position].gather(1, ids[:, position + 1, None])[:, 0]) <= 1e-10
            torch.testing.assert_close(e.contribution[:, n], single.contribution, rtol=1e-10,
                                       atol=1e-12 * float(single.contribution.abs().max()))
            torch.testing.assert_close(e.logit[:, n], single.logit, rtol=1e-10, atol=0)


def test_a_new_sequence_length_and_batch_need_no_action():
    model = _gpt2()
    explainer = TokenExplainer(model, backend="fused")
    for length, batch in ((5, 2), (9, 2), (5, 3), (5, 2)):
        ids = torch.randint(2, VOCABULARY, (batch, length), generator=torch.Generator().manual_seed(length + batch))
        with torch.no_grad():
            logits = model(ids).logits[:, -1]
        e = explainer(ids, 3)
        assert e.contribution.shape == (batch, length)
        assert _relative(e.contribution.sum(1), logits[:, 3]) <= 1e-10


def test_one_capture_and_compilation_serve_batch_sizes_2_to_9_and_lengths_9_to_12(monkeypatch):
    """Batches padded to the bucket of 12 tokens and run in chunks of the first batch's size:
    one capture and one compiled graph for all; each batch complete (1e-10) with padding
    exactly 0, and equal to its explanation on its own (rtol 1e-10) where that is computed."""
    assert [bucket(n)[0] for n in (1, 8, 9, 12, 13, 17, 25, 100)] == [8, 8, 12, 12, 16, 24, 32, 128]
    assert bucket(13, longest=14) == (14, 12) and bucket(15, longest=14) == (15, 12)
    captures, compilations = [], []
    counted_capture = api.capture
    monkeypatch.setattr(api, "capture", lambda *args, **kwargs: captures.append(1) or counted_capture(*args, **kwargs))
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: compilations.append(graph) or graph)
    model = _gpt2()
    explainer = TokenExplainer(model, backend="compiled")
    on_its_own = TokenExplainer(model, backend="fused", pad_to_buckets=False)
    for batch, length in ((4, 9), (2, 12), (9, 10), (3, 9), (7, 12), (5, 10), (8, 11), (6, 9)):
        generator = torch.Generator().manual_seed(batch * 100 + length)
        ids = torch.randint(2, VOCABULARY, (batch, length), generator=generator)
        mask = torch.ones_like(ids)
        mask[0, :2] = 0  # left padding in the first sequence
        ids[mask == 0] = PAD
        target = torch.randint(0, VOCABULARY, (batch,), generator=generator)
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits[:, -1]
        e = explainer(ids, target, attention_mask=mask)
        _check({"reference": e}, logits.gather(1, target[:, None])[:, 0], mask)
        if (batch, length) in ((2, 12), (9, 10)):  # run in 1 and in 3 chunks of 4
            own = on_its_own(ids, target, attention_mask=mask)
            torch.testing.assert_close(e.contribution, own.contribution, rtol=1e-10,
                                       atol=1e-12 * float(own.contribution.abs().max()))
            torch.testing.assert_close(e.weight, own.weight, rtol=1e-10, atol=1e-12 * float(own.weight.abs().max()))
    assert len(compilations) == 1
    assert len(captures) == 1 + 2  # the two batches explained on their own
    # Differentiable explanations run a batch whole (a chunk's graph holds the model's inputs).
    fused = TokenExplainer(model, backend="fused")
    fused(ids[:2], attention_mask=mask[:2])  # later batches would run in chunks of 2
    gradients = []
    for tokens in (fused, on_its_own):
        model.zero_grad()
        e = tokens(ids, target, attention_mask=mask, create_graph=True)
        (e.contribution ** 2).sum().backward()
        gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(gradients[0], gradients[1], rtol=1e-9, atol=1e-12 * float(gradients[1].abs().max()))


class _Pooled(nn.Module):
    """An encoder of one's own whose logits pool its tokens: the first token, the mean of all
    (padding included), the mean of the real ones, or the last real one."""

    def __init__(self, pooling: str) -> None:
        super().__init__()
        self.pooling = pooling
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.mix = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, ids, attention_mask):
        hidden = self.mix(self.embed(ids), src_key_padding_mask=attention_mask == 0)
        if self.pooling == "first":
            pooled = hidden[:, 0]
        elif self.pooling == "mean":
            pooled = hidden.mean(1)
        elif self.pooling == "masked mean":
            pooled = (hidden * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True)
        else:
            last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)
            pooled = hidden[torch.arange(hidden.shape[0]), last]
        return self.head(pooled)


@pytest.mark.parametrize("pooling", ["first", "mean", "masked mean", "last"])
def test_padding_contributes_exactly_zero_under_every_pooling(pooling):
    """Padding is not a position (R8'): with the attention mask given, padding tokens get C, C_w
    and C_b exactly 0, and the biases after them (the head's after a mean over every token
    included) go to the real tokens."""
    model = randomize_(_Pooled(pooling), seed=21).to(DT).eval()
    ids, mask = _padded(left=pooling != "first", seed=22)
    with torch.no_grad():
        logits = model(ids, mask)
    # A mean over every position changes when the batch is padded to 8: it is explained as given.
    padding_changes_logits = pytest.warns(RuntimeWarning, match="_Pooled is explained at each sequence length .* "
                                          "padded to 8 tokens under the attention mask differ") \
        if pooling == "mean" else contextlib.nullcontext()
    with padding_changes_logits:
        explanations = {backend: explain(model, ids, 3, attention_mask=mask, layer="embed", backend=backend)
                        for backend in BACKENDS}
    _check(explanations, logits[:, 3], mask)


class _Conv1DMean(nn.Module):
    """GPT-2's ``Conv1D`` layers (``addmm`` of a bias and a product) over every token, padding
    included, then a mean over all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.mix = Conv1D(24, 16)
        self.head = Conv1D(4, 24)

    def forward(self, ids, attention_mask):
        return self.head(F.gelu(self.mix(self.embed(ids))).mean(1))


def test_conv1d_layers_carry_their_bias_over_padding_through_the_fused_linear():
    """``addmm(b, x, W)`` is R1 as ``F.linear``: a bias at a padding position (no ones, R8') goes
    to the sample's real tokens (R11'), in every backend; the fused backend runs it as
    ``omenn::linear_ones``, whose backward multiplies only the features that receive."""
    model = randomize_(_Conv1DMean(), seed=25).to(DT).eval()
    ids, mask = _padded(left=True, seed=26)
    with torch.no_grad():
        logits = model(ids, mask)
    explainers = {backend: TokenExplainer(model, backend=backend, layer="embed", pad_to_buckets=False)
                  for backend in BACKENDS}
    explanations = {backend: explainer(ids, 3, attention_mask=mask) for backend, explainer in explainers.items()}
    _check(explanations, logits[:, 3], mask)
    explainer = explainers["fused"]
    explainer(ids, 3, attention_mask=mask)
    with _Counted() as calls:
        explainer(ids, 3, attention_mask=mask)
    assert calls.ops[torch.ops.omenn.linear_ones.default] == 2
    assert calls.ops[torch.ops.aten.addmm.default] == 0


class _MaskedMean(nn.Module):
    """A masked mean over token embeddings with the mask an integer buffer, used as it is or
    cast to the embeddings' dtype: R8' inside the model."""

    def __init__(self, mask: torch.Tensor, cast: str) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.cast = cast
        self.lift = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, embeddings):
        if self.cast == "integer":
            weights = self.mask.unsqueeze(-1)
        elif self.cast == "cast, then viewed":  # sentence-transformers' mean pooling
            weights = self.mask.to(embeddings.dtype).unsqueeze(-1).expand(embeddings.shape)
        else:
            weights = self.mask.unsqueeze(-1).float().to(embeddings.dtype)
        return self.head((self.lift(embeddings) * weights).sum(1) / self.mask.sum(1, keepdim=True))


@pytest.mark.parametrize("cast", ["integer", "cast, then viewed", "viewed, then cast twice"])
def test_a_masked_mean_in_the_model_removes_the_padding_positions(cast):
    """Also when the mask changes in place after the first call (the compiled graph, traced on
    the first mask, reads no ones: its zeros move with the mask)."""
    masks = [torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 1, 1, 1, 1]]),
             torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])]
    model = randomize_(_MaskedMean(masks[0].clone(), cast), seed=23).to(DT).eval()
    embeddings = torch.randn(3, 5, 16, dtype=DT, generator=torch.Generator().manual_seed(24))
    explainers = {backend: Explainer(model, backend=backend, feature_dim=-1) for backend in BACKENDS}
    for mask in masks:
        model.mask.copy_(mask)
        with torch.no_grad():
            logits = model(embeddings)
        for backend, explainer in explainers.items():
            e = explainer(embeddings, 1)
            assert _relative(e.contribution.sum(1), logits[:, 1]) <= 1e-10, backend
            assert torch.equal(e.bias[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=DT)), backend
            # The head's and the lift's biases are spread over the real tokens alone, evenly.
            real = mask.sum(1, keepdim=True).to(DT)
            lift_bias = (model.head.weight[1] @ model.lift.bias).detach()
            torch.testing.assert_close(e.bias, mask * (model.head.bias[1].detach() + lift_bias) / real,
                                       rtol=1e-10, atol=1e-12)


class _Positioned(nn.Module):
    """Learned positions for 7 tokens and no config: a batch padded to 8 fails (index out of range)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.positions = nn.Embedding(7, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids, attention_mask):
        hidden = self.embed(ids) + self.positions(torch.arange(ids.shape[1]))
        return self.head((hidden * attention_mask.unsqueeze(-1)).sum(1) / attention_mask.sum(1, keepdim=True))


def test_a_model_that_fails_on_the_padded_batch_is_explained_as_given():
    model = randomize_(_Positioned(), seed=27).to(DT).eval()
    ids, mask = _padded(left=False, seed=28)
    with torch.no_grad():
        logits = model(ids, mask)
    explainer = TokenExplainer(model, backend="fused", layer="embed")
    with pytest.warns(RuntimeWarning, match=r"_Positioned is explained at each sequence length .* fails on the "
                                            r"padded batch \(IndexError"):
        e = explainer(ids, 2, attention_mask=mask)
    assert not explainer.pad_to_buckets
    _check({"reference": e}, logits[:, 2], mask)


def test_a_llama_computing_its_norms_in_float32_runs_compiled_on_padded_batches(monkeypatch):
    """A float64 Llama computes its RMSNorms and rotary embedding in float32: its compiled graph
    (here scaled by 1 + 1e-7, as float32 kernels that round otherwise give) and its logits on the
    padded batch are held to float32's tolerance, so the graph runs and the batch stays padded."""
    config = LlamaConfig(vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16, pad_token_id=PAD)
    model = randomize_(LlamaForCausalLM(config), seed=29).to(DT).eval()
    monkeypatch.setattr(compiled, "COMPILER", lambda graph, example: lambda *inputs: tuple(
        t * (1 + 1e-7) if t.is_floating_point() else t for t in graph(*inputs)))
    ids, mask = _padded(left=True, seed=30)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits[:, -1]
    explainer = TokenExplainer(model, backend="compiled")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        e = explainer(ids, attention_mask=mask)
    assert explainer.pad_to_buckets
    assert _relative(e.logit, logits.gather(1, e.target[:, None])[:, 0] * (1 + 1e-7)) <= 1e-10
    fused = TokenExplainer(model, backend="fused")(ids, attention_mask=mask)
    torch.testing.assert_close(e.weight, fused.weight * (1 + 1e-7), rtol=1e-10,
                               atol=1e-12 * float(fused.weight.abs().max()))


def _retraced_as_inductor_does(graph, example):
    """The graph traced again by AOTAutograd under Inductor's decompositions and run as traced:
    the strides Inductor's lowering sees, without its code generation."""
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor.decomposition import select_decomp_table
    return aot_module_simplified(graph, example, fw_compiler=lambda traced, _: traced,
                                 decompositions=select_decomp_table())


def test_a_phi3_whose_rotary_embedding_inductor_lays_out_otherwise_runs_compiled(monkeypatch):
    """Phi-3 concatenates its rotated queries, transposed, with their part without rotation, empty
    where the whole head rotates: the concatenation is contiguous in eager, where the trace records
    attention's reshape of it as a view, and keeps the transposed layout under Inductor's
    decompositions (which drop empty parts), where that view cannot be taken."""
    config = Phi3Config(vocab_size=VOCABULARY, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, intermediate_size=48, max_position_embeddings=16, pad_token_id=PAD)
    model = randomize_(Phi3ForCausalLM(config), seed=31).to(DT).eval()
    monkeypatch.setattr(compiled, "COMPILER", _retraced_as_inductor_does)
    ids, mask = _padded(left=True, seed=32)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="omenn_kernels")
        e = TokenExplainer(model, backend="compiled")(ids, attention_mask=mask)
    fused = TokenExplainer(model, backend="fused")(ids, attention_mask=mask)
    torch.testing.assert_close(e.weight, fused.weight, rtol=1e-10, atol=1e-12 * float(fused.weight.abs().max()))
    with torch.no_grad():
        logit = model(ids, attention_mask=mask).logits[:, -1].gather(1, e.target[:, None])[:, 0]
    # Complete to float32's rounding: Phi-3 computes its RMSNorms in float32, which rounds x.
    assert _relative(e.contribution.sum(1), logit) <= 1e-6
    assert torch.equal(e.contribution[mask == 0], torch.zeros(int((mask == 0).sum()), dtype=DT))


class _Tagger(nn.Module):
    """A model of one's own: ids and a padding mask in, a mean over the real tokens out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, 16)
        self.mix = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, ids, padding):
        hidden = self.mix(self.embed(ids), src_key_padding_mask=padding)
        return self.head(hidden[:, 0])


def test_a_named_embedding_layer_of_a_model_of_ones_own():
    model = randomize_(_Tagger(), seed=18).to(DT).eval()
    ids, mask = _padded(left=False, seed=19)
    padding = mask == 0
    with torch.no_grad():
        logits = model(ids, padding)
    e = explain(model, ids, 2, layer="embed", padding=padding, backend="fused")
    _check({"reference": e}, logits[:, 2], mask)


def test_use_cache_is_not_needed_on_embeddings_either():
    """A causal LM's fresh key-value cache is an empty constant joined to the keys: it adds nothing."""
    model = _gpt2()
    ids = torch.randint(2, VOCABULARY, (2, 5), generator=torch.Generator().manual_seed(20))

    class OnEmbeddings(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, embeddings):
            return self.model(inputs_embeds=embeddings, use_cache=True).logits[:, -1]

    embeddings = model.get_input_embeddings()(ids).detach()
    with torch.no_grad():
        logits = model(ids).logits[:, -1]
    e = Explainer(OnEmbeddings(), backend="reference", feature_dim=-1)(embeddings, 5)
    assert _relative(e.contribution.sum(1), logits[:, 5]) <= 1e-10


def test_bad_token_inputs_are_named():
    model = _gpt2()
    ids, mask = _padded(left=True)
    outside = ids.clone()
    outside[1, 2] = VOCABULARY
    with pytest.raises(InputError, match=r"token id 40 \(sample 1, position 2\) is outside the vocabulary"):
        explain(model, outside)
    with pytest.raises(InputError, match=r"attention_mask has shape \(3, 6\), but input_ids \(3, 7\)"):
        explain(model, ids, attention_mask=mask[:, :6])
    with pytest.raises(InputError, match=r"position \[7, 7, 7\] is past sequences of 7 tokens"):
        explain(model, ids, attention_mask=mask, position=7)
    with pytest.raises(InputError, match="position 1 of sample 1 is padding"):
        explain(model, ids, attention_mask=mask, position=1)
    with pytest.raises(InputError, match="attention_mask must hold 1 for tokens and 0 for padding"):
        explain(model, ids, attention_mask=mask * 2)
    with pytest.raises(InputError, match="layer='wte' is not a submodule of GPT2LMHeadModel"):
        explain(model, ids, layer="wte")
    with pytest.raises(InputError, match="generated=7"):
        TokenExplainer(model).explain_generation(ids, 7)


def test_integer_inputs_without_an_embedding_layer_say_what_to_do():
    model = nn.Sequential(nn.Linear(4, 3)).to(DT)
    ids = torch.randint(0, 4, (2, 4))
    with pytest.raises(InputError, match="Sequential has no get_input_embeddings\\(\\): name the layer"):
        explain(model, ids)
    with pytest.raises(InputTypeError, match=r"token ids are explained .* explain\(model, input_ids"):
        Explainer(model)(ids)
    with pytest.raises(InputError, match="attention_mask are inputs of a model explained from token ids"):
        explain(model, torch.randn(2, 4, dtype=DT), attention_mask=torch.ones(2, 4))
