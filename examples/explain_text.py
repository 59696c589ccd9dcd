"""Explain a causal language model end to end: token ids in, one contribution per token out.

With no ``--model``, a small GPT-2 with random weights and a word-level vocabulary built
from the prompts (no download); with ``--model NAME`` a Hugging Face causal LM and its
tokenizer (``AutoModelForCausalLM.from_pretrained``, which needs the weights locally or
a network). It

1. explains the predicted next token of each prompt of a left-padded batch, and prints
   the token heat map in the terminal (ANSI colours);
2. generates a continuation greedily and explains every generated token at once (one
   forward pass, one backward pass per token);
3. writes both heat maps as one self-contained HTML page (and a PNG with ``--png``).

Run from the repository root (needs ``transformers``: ``pip install -e ".[text]"``):

    python examples/explain_text.py [--model NAME] [--new-tokens 4] [--out text_map.html] [--png map.png]

Every explanation is checked: its contributions sum to the logit (printed), and padding
tokens contribute exactly 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

from omenn_kernels import TokenExplainer
from omenn_kernels.visualize_tokens import heatmap_ansi, heatmap_html, heatmap_png, save_html

PROMPTS = ["the cat sat on the mat because it was", "a small model explains"]


class WordTokenizer:
    """Whitespace words to ids, for the random model: id 0 is padding (left), one id per word."""

    def __init__(self, texts: list[str]) -> None:
        words = sorted({word for text in texts for word in text.split()})
        self.vocabulary = ["<pad>", *words, *(f"w{i}" for i in range(64 - len(words) - 1))]
        self.ids = {word: i for i, word in enumerate(self.vocabulary)}
        self.pad_token_id = 0

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        encoded = [[self.ids[word] for word in text.split()] for text in texts]
        length = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[0] * (length - len(ids)) + ids for ids in encoded])
        return {"input_ids": input_ids, "attention_mask": (input_ids != 0).long()}

    def tokens(self, ids: torch.Tensor) -> list[str]:
        return [" " + self.vocabulary[i] for i in ids.tolist()]


def random_model(vocabulary: int) -> torch.nn.Module:
    """A small GPT-2 with random weights and random biases and norm affines."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=vocabulary, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


class HubTokenizer:
    """A Hugging Face tokenizer with left padding."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.pad_token_id = self.tokenizer.pad_token_id

    def __call__(self, texts: list[str]) -> dict[str, torch.Tensor]:
        return dict(self.tokenizer(texts, return_tensors="pt", padding=True))

    def tokens(self, ids: torch.Tensor) -> list[str]:
        return [self.tokenizer.decode([i]) for i in ids.tolist()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="a Hugging Face causal LM (default: a small random GPT-2)")
    parser.add_argument("--new-tokens", type=int, default=4, help="tokens to generate and explain")
    parser.add_argument("--backend", default="auto", help="reference, fused, compiled or auto")
    parser.add_argument("--out", type=Path, default=Path("text_map.html"), help="the HTML page to write")
    parser.add_argument("--png", type=Path, help="also write the next-token heat map as a PNG")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error(f"--new-tokens must be at least 1, got {args.new_tokens}")
    if importlib.util.find_spec("transformers") is None:
        print("explain_text.py needs transformers: pip install -e \".[text]\"", file=sys.stderr)
        return 2

    if args.model is None:
        tokenizer = WordTokenizer(PROMPTS)
        model = random_model(len(tokenizer.vocabulary))
    else:
        from transformers import AutoModelForCausalLM

        tokenizer = HubTokenizer(args.model)
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    batch = tokenizer(PROMPTS)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    explainer = TokenExplainer(model, backend=args.backend)

    # 1. The predicted next token after each prompt.
    e = explainer(ids, attention_mask=mask)
    tokens = [tokenizer.tokens(row) for row in ids]
    labels = [f"next token {tokenizer.tokens(t[None])[0]!r}" for t in e.target]
    print(heatmap_ansi(tokens, e.contribution, e.logit, mask=mask, labels=labels))
    assert torch.equal(e.contribution[mask == 0], torch.zeros_like(e.contribution[mask == 0]))

    # 2. A greedy continuation, every generated token explained in one pass.
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
    full_mask = torch.cat([mask, torch.ones(len(ids), args.new_tokens, dtype=mask.dtype)], 1)
    g = explainer.explain_generation(generated, args.new_tokens, attention_mask=full_mask)
    sample = 0
    prompt = ids.shape[1]
    # Row n: the tokens before the n-th generated one (the later ones contribute 0, causally).
    steps = [tokenizer.tokens(generated[sample, :prompt + n]) for n in range(args.new_tokens)]
    step_rows = [g.contribution[sample, n, :prompt + n] for n in range(args.new_tokens)]
    step_masks = [full_mask[sample, :prompt + n] for n in range(args.new_tokens)]
    step_labels = [f"generated token {n + 1}: {tokenizer.tokens(g.target[sample, n:n + 1])[0]!r}"
                   for n in range(args.new_tokens)]
    print()
    print(heatmap_ansi(steps, step_rows, g.logit[sample], mask=step_masks, labels=step_labels))
    error = max(float(e.completeness_error().max()), float(g.completeness_error().max()))
    print(f"\nlargest |Σ C − logit| / |logit|: {error:.2e}")

    page = heatmap_html(tokens + steps, [*e.contribution, *step_rows], [*e.logit.tolist(), *g.logit[sample].tolist()],
                        mask=[*mask, *step_masks], labels=labels + step_labels)
    print(f"wrote {save_html(args.out, page)}")
    if args.png is not None:
        print(f"wrote {heatmap_png(args.png, tokens, e.contribution, e.logit, mask=mask, labels=labels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
