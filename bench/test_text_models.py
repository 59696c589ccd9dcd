"""Text models from their token ids: OMENN's eager and compiled explanations against input × gradient.

    OMP_NUM_THREADS=1 python -m pytest bench/test_text_models.py --benchmark-json bench/results/text_cpu.json

A Llama-style and a GPT-2 causal LM with random weights (hidden 256, 4 layers, 4 heads,
vocabulary 1,000), float32, batch 2, 128 tokens with the second sequence left-padded by
16, one thread. Each method explains (or differentiates) the next-token logit of the
predicted token at the last position:

* ``input_x_gradient``: the model on its input embeddings, one backward of the logit, the
  gradient times the embeddings; ``input_x_gradient_last_logits`` the same with the LM head
  run on the last position only (``logits_to_keep=1``), as the explanations run it;
* ``omenn_fused`` and ``omenn_compiled``: :class:`~omenn_kernels.TokenExplainer` from the
  token ids and the attention mask (capture, and for ``compiled`` the compilation, happen
  in the warm-up calls, outside the timed rounds).

The four are called in turn, one of each per round, so that a host whose speed drifts
moves all four alike; ``extra_info`` records each one's median and the ratios to input ×
gradient (the benchmark's own time is the round's).
"""

from __future__ import annotations

import statistics
import time

import pytest
import torch

from omenn_kernels import TokenExplainer
from omenn_kernels.testing import randomize_

BATCH, LENGTH, PADDING, ROUNDS = 2, 128, 16, 15


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, intermediate_size=688, max_position_embeddings=256)
    return LlamaForCausalLM(config)


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_embd=256, n_layer=4, n_head=4, n_positions=256, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def setup(request):
    torch.manual_seed(0)
    model = randomize_({"llama": _llama, "gpt2": _gpt2}[request.param]()).eval()
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    ids = torch.randint(0, 1000, (BATCH, LENGTH))
    mask = torch.ones_like(ids)
    mask[1, :PADDING] = 0
    return request.param, model, ids, mask


def _input_x_gradient(model, ids, mask, **kept):
    embeddings = model.get_input_embeddings()(ids).requires_grad_(True)
    logits = model(inputs_embeds=embeddings, attention_mask=mask, use_cache=False, **kept).logits[:, -1]
    selected = logits.gather(1, logits.detach().argmax(1, keepdim=True)).sum()
    (gradient,) = torch.autograd.grad(selected, embeddings)
    return gradient * embeddings


def test_text_model_in_turn(benchmark, setup):
    name, model, ids, mask = setup
    benchmark.group = f"text-in-turn-{name} cpu float32 batch {BATCH} tokens {LENGTH}"
    explainers = {backend: TokenExplainer(model, backend=backend) for backend in ("fused", "compiled")}
    calls = {"input_x_gradient": lambda: _input_x_gradient(model, ids, mask),
             "input_x_gradient_last_logits": lambda: _input_x_gradient(model, ids, mask, logits_to_keep=1),
             **{f"omenn_{backend}": (lambda e=e: e(ids, attention_mask=mask)) for backend, e in explainers.items()}}
    started = time.perf_counter()
    for call in calls.values():  # capture; the compiled one runs eagerly and compiles, then runs compiled
        call()
        call()
    benchmark.extra_info["warm_up_seconds"] = time.perf_counter() - started
    times = {method: [] for method in calls}

    def round_of_each():
        for method, call in calls.items():
            start = time.perf_counter()
            call()
            times[method].append(time.perf_counter() - start)

    benchmark.pedantic(round_of_each, rounds=ROUNDS, warmup_rounds=1)
    medians = {method: statistics.median(values[1:]) for method, values in times.items()}  # the warm-up round dropped
    benchmark.extra_info["median_seconds"] = medians
    benchmark.extra_info["ratio_to_input_x_gradient"] = {
        method: medians[method] / medians["input_x_gradient"] for method in medians}
