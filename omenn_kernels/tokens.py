"""Text and sequence models from their token ids: one exact contribution per token.

A model that takes token ids is explained at the output of its input embedding layer
(``get_input_embeddings()`` for Hugging Face models, or any named submodule, as Captum's
layer attributions do): the embeddings ``E`` (B, T, D) are the explained input, and each
token's contribution ``C = Σ_d C_w ⊙ E + C_b`` (B, T) sums over the tokens to the logit.

The model runs as it does on its ids: a forward hook puts the explained embeddings in
place of the layer's output, and the ids, the attention mask and any other keyword input
are held constant (buffers of a module that wraps the model, one per input shape). A
batch is padded to one of a few lengths and run in chunks of one size (see
:class:`TokenExplainer`), so that one capture and compilation serves many lengths and
batch sizes; a new length or batch size needs no action of the caller.
"""

from __future__ import annotations

import inspect
import threading
import warnings
from collections import OrderedDict
from typing import Any

import torch

from .api import MAX_PROGRAMS, Explainer, Explanation, Target
from .backends.compiled import (HALF_LOGITS_TOLERANCE, REORDERED_TOLERANCE, batch_rows, computing_dtype,
                                relative_distance)
from .backends.executor import ParameterGradient
from .capture import OutputSelector, checked_selector, selected_output
from .errors import InputError, InputTypeError, OmennError, OutputError
from .readout import Readout, checked_readout


def embedding_layer(model: torch.nn.Module, layer: str | torch.nn.Module | None) -> torch.nn.Module:
    """The submodule whose output is explained: ``layer`` (a module of ``model`` or its dotted
    name), else ``model.get_input_embeddings()``.

    Raises:
        InputError: no such submodule, or ``layer`` is None and the model has no
            ``get_input_embeddings()``; the message says what to pass.
    """
    if isinstance(layer, torch.nn.Module):
        if not any(layer is module for module in model.modules()):
            raise InputError(f"layer={type(layer).__name__} is not a submodule of {type(model).__name__}")
        return layer
    if isinstance(layer, str):
        try:
            return model.get_submodule(layer)
        except AttributeError:
            raise InputError(f"layer={layer!r} is not a submodule of {type(model).__name__}; name the "
                             "embedding layer by its dotted path, as in model.named_modules()") from None
    if layer is not None:
        raise TypeError(f"layer must be a submodule, its dotted name or None, got {type(layer).__name__}")
    embeddings = getattr(model, "get_input_embeddings", None)
    found = embeddings() if callable(embeddings) else None
    if not isinstance(found, torch.nn.Module):
        raise InputError(f"integer inputs are token ids, explained at the model's embedding layer, but "
                         f"{type(model).__name__} has no get_input_embeddings(): name the layer to explain at "
                         "(layer='embed' for model.embed), or pass floating-point inputs (embeddings with "
                         "feature_dim=-1)")
    return found


def _checked_ids(input_ids: object, layer: torch.nn.Module) -> torch.Tensor:
    if not isinstance(input_ids, torch.Tensor):
        raise InputTypeError(f"input_ids must be a torch.Tensor, got {type(input_ids).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise InputTypeError(f"input_ids must be integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2 or 0 in input_ids.shape:
        raise InputError(f"input_ids must be a batch of sequences (B, T), got shape {tuple(input_ids.shape)}")
    vocabulary = getattr(layer, "num_embeddings", None)
    if vocabulary is not None:
        outside = (input_ids < 0) | (input_ids >= vocabulary)
        if bool(outside.any()):
            sample, position = (int(i) for i in outside.nonzero()[0])
            raise InputError(f"token id {int(input_ids[sample, position])} (sample {sample}, position "
                             f"{position}) is outside the vocabulary of {type(layer).__name__} "
                             f"(ids 0..{vocabulary - 1})")
    return input_ids


def _checked_mask(attention_mask: object, input_ids: torch.Tensor) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor):
        raise InputTypeError(f"attention_mask must be a torch.Tensor, got {type(attention_mask).__name__}")
    if tuple(attention_mask.shape) != tuple(input_ids.shape):
        raise InputError(f"attention_mask has shape {tuple(attention_mask.shape)}, but input_ids "
                         f"{tuple(input_ids.shape)}: one 1 (token) or 0 (padding) per id")
    if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
        raise InputError("attention_mask must hold 1 for tokens and 0 for padding; got the values "
                         f"{torch.unique(attention_mask).tolist()[:8]}")
    empty = (attention_mask == 0).all(1)
    if bool(empty.any()):
        raise InputError(f"sample {int(empty.nonzero()[0])} of attention_mask has no token (all 0)")
    return attention_mask.to(input_ids.device)


def last_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B,) the position of each sequence's last real token, with left or right padding."""
    length = input_ids.shape[1]
    if attention_mask is None:
        return torch.full((input_ids.shape[0],), length - 1, dtype=torch.long, device=input_ids.device)
    return length - 1 - attention_mask.flip(1).long().argmax(1)


def _checked_positions(position: object, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``position`` (an int, or (B,) ints, negative counting from the end) as (B,) positions,
    or each sequence's last real token for None."""
    batch, length = input_ids.shape
    if position is None:
        return last_tokens(input_ids, attention_mask)
    if isinstance(position, bool) or not isinstance(position, (int, torch.Tensor)):
        raise TypeError(f"position must be an int, a (B,) integer tensor or None, got {type(position).__name__}")
    positions = torch.as_tensor(position, device=input_ids.device)
    if positions.is_floating_point() or positions.dtype == torch.bool or positions.dim() > 1 or \
            positions.dim() == 1 and positions.numel() != batch:
        raise InputError(f"position must be an int or {batch} integer positions, got {position!r}")
    positions = positions.long().expand(batch)
    if bool(((positions < -length) | (positions >= length)).any()):
        raise InputError(f"position {positions.tolist() if positions.numel() <= 8 else position} is past "
                         f"sequences of {length} tokens (valid: {-length}..{length - 1})")
    positions = positions % length
    if attention_mask is not None:
        padded = attention_mask.gather(1, positions[:, None])[:, 0] == 0
        if bool(padded.any()):
            sample = int(padded.nonzero()[0])
            raise InputError(f"position {int(positions[sample])} of sample {sample} is padding "
                             "(attention_mask 0): its logit explains no token")
    return positions


class _OnEmbeddings(torch.nn.Module):
    """``model`` as a function of its embedding layer's output (B, T, D), with the ids and
    every other input held in buffers that are updated in place per call, returning
    the explained logits: the model's own (B, K), or for (B, T, V) outputs the logits at
    ``positions`` (B, V), or ``logits[b, positions[b, n], tokens[b, n]]`` (B, N) where
    ``tokens`` is set (a generation)."""

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Module, selector: OutputSelector,
                 tensors: dict[str, torch.Tensor], settings: dict[str, Any], positions: torch.Tensor,
                 tokens: torch.Tensor | None) -> None:
        super().__init__()
        self.model = model
        self._layer = [layer]  # not a child: its parameters are the model's
        self.selector = selector
        self.names = list(tensors)
        for name, value in tensors.items():
            self.register_buffer(f"input_{name}", value.clone())
        self.settings = settings
        self.register_buffer("positions", positions.clone())
        self.register_buffer("tokens", None if tokens is None else tokens.clone())
        # The embeddings of the padding tokens, held: padding is not a position (R8').
        self.register_buffer("padding_values", None)

    def update(self, tensors: dict[str, torch.Tensor], positions: torch.Tensor, tokens: torch.Tensor | None) -> None:
        with torch.no_grad():
            for name, value in tensors.items():
                getattr(self, f"input_{name}").copy_(value)
            self.positions.copy_(positions)
            if tokens is not None:
                self.tokens.copy_(tokens)

    def layer_output(self) -> torch.Tensor:
        """The embedding layer's output in the model's own forward on the held inputs, detached;
        with an attention mask, its padding positions are kept as ``padding_values``."""
        embeddings = self._recorded_output()
        if "attention_mask" in self.names:
            with torch.no_grad():
                padding = embeddings * (self.input_attention_mask == 0).unsqueeze(-1)
            if self.padding_values is None or self.padding_values.shape != padding.shape:
                self.padding_values = padding
            else:
                self.padding_values.copy_(padding)
        return embeddings

    def _recorded_output(self) -> torch.Tensor:
        if isinstance(self._layer[0], torch.nn.Embedding):  # a lookup: no need to run the model
            with torch.no_grad():
                return self._layer[0](self.input_input_ids)
        outputs = []
        handle = self._layer[0].register_forward_hook(lambda module, args, output: outputs.append(output))
        try:
            with torch.no_grad():
                inputs = {name: getattr(self, f"input_{name}") for name in self.names}
                self.model(inputs.pop("input_ids"), **inputs, **self.settings)
        finally:
            handle.remove()
        if len(outputs) != 1 or not isinstance(outputs[0], torch.Tensor) or not outputs[0].is_floating_point():
            raise InputError(f"the layer {type(self._layer[0]).__name__} must run once per forward and return one "
                             f"floating-point tensor; it ran {len(outputs)} times")
        return outputs[0]

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        if self.padding_values is not None:
            # The same values; multiplied by the (integer) mask, padding positions have no
            # ones from here on (R8'), and their embeddings are held constant.
            embeddings = embeddings * (self.input_attention_mask != 0).unsqueeze(-1) + self.padding_values
        calls = []

        def explained(module, args, output):
            calls.append(module)
            return embeddings

        handle = self._layer[0].register_forward_hook(explained)
        try:
            inputs = {name: getattr(self, f"input_{name}") for name in self.names}
            output = self.model(inputs.pop("input_ids"), **inputs, **self.settings)
        finally:
            handle.remove()
        if len(calls) != 1:
            raise InputError(f"the embedding layer {type(self._layer[0]).__name__} ran {len(calls)} times in one "
                             "forward; explain at a layer that runs once")
        logits = selected_output(output, self.selector)
        if logits.dim() == 2:
            return logits
        if logits.dim() != 3:
            raise OutputError(f"the model's logits have shape {tuple(logits.shape)}; expected (B, K), or "
                              "(B, T, V) per position")
        batch, _, vocabulary = logits.shape
        if self.tokens is None:
            index = self.positions.reshape(batch, 1, 1).expand(batch, 1, vocabulary)
            return logits.gather(1, index).squeeze(1)
        steps = self.tokens.shape[1]
        at_positions = logits.gather(1, self.positions.reshape(batch, steps, 1).expand(batch, steps, vocabulary))
        return at_positions.gather(2, self.tokens.reshape(batch, steps, 1)).squeeze(2)


def bucket(length: int, longest: int | None = None) -> tuple[int, int]:
    """The length a batch of ``length`` tokens is padded to, the smallest of 8, 12, 16, 24,
    32, 48, … (``2^k`` and ``3·2^(k−1)``) that holds it, at most ``longest`` (the model's
    positions) but never below ``length``; and the bucket below it (0 for the first), which
    every length of this one exceeds."""
    below, padded = 0, SHORTEST_BUCKET
    while padded < length:
        below, padded = padded, padded * 3 // 2 if padded & (padded - 1) == 0 else padded * 4 // 3
    if longest is not None and padded > longest:
        padded = max(length, longest)
    return padded, below


# The shortest bucket: shorter batches are padded to it.
SHORTEST_BUCKET = 8


class TokenExplainer:
    """Explains a model that takes token ids, one contribution per token.

    The explained input is the output of the model's embedding layer; the token ids, the
    attention mask and other keyword inputs are held constant. For a model whose logits
    are per position (B, T, V), such as a causal LM, the explained logit is the one at
    ``position``, by default each sequence's last real token (the next-token logit, with
    left or right padding); for a sequence classifier (B, K), the model's logits.

    Lengths and batch sizes: a model that takes an ``attention_mask`` is run on batches
    padded on the right, under the mask, to one of a few lengths (8, 12, 16, 24, 32, …,
    see :func:`bucket`), and in chunks of the first batch's size (the last chunk filled up
    with copies of its last sequence), so that one capture, and with ``backend="compiled"``
    one compilation, serves every length of a bucket and every batch size (differentiable
    explanations, ``create_graph=True``, run each batch size whole). The padding and
    the copies are dropped from the explanation; padding tokens contribute exactly 0
    (R8'), so nothing changes but rounding. The first batch of each new length and size
    is checked against the model's own logits on the batch as given; a model whose logits
    change under padding (a mean over every position, the padding included, say) is from
    then on explained at each length and batch size on its own, after one warning.

    Args:
        model: a Hugging Face model (``input_ids``, ``attention_mask``,
            ``get_input_embeddings()``) or any module whose forward takes the ids first.
        layer: the embedding layer to explain at: a submodule or its dotted name; None for
            ``model.get_input_embeddings()``.
        backend, output: as in :class:`~omenn_kernels.Explainer`.
        pad_to_buckets: False explains each length and batch size on its own (one capture,
            or compilation, each), with no padding.

    Example:
        >>> explainer = TokenExplainer(causal_lm)
        >>> e = explainer(input_ids, attention_mask=mask)  # the predicted next token
        >>> e.contribution.sum(1)  # (B,) == e.logit; padding tokens contribute 0
    """

    def __init__(self, model: torch.nn.Module, *, layer: str | torch.nn.Module | None = None,
                 backend: str = "auto", output: OutputSelector = None, pad_to_buckets: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.layer = embedding_layer(model, layer)
        self.backend = backend
        self.output = checked_selector(output)
        parameters = inspect.signature(model.forward).parameters
        # Padding needs a forward that takes the mask that hides it.
        self.pad_to_buckets = bool(pad_to_buckets) and "attention_mask" in parameters
        config = getattr(model, "config", None)
        padding_id = getattr(config, "pad_token_id", None)
        self._padding_id = padding_id if isinstance(padding_id, int) else 0
        longest = getattr(config, "max_position_embeddings", None)
        self._longest = longest if isinstance(longest, int) else None
        # use_cache=False: a key-value cache is an output the explanation has no use for.
        self._no_cache = {"use_cache": False} if "use_cache" in parameters else {}
        # A Hugging Face LM computes the logits of its last k positions only where asked to.
        self._keeps_logits = "logits_to_keep" in parameters
        # Per input signature, a wrapped model and its Explainer, the least recently used dropped first.
        self._explainers: OrderedDict[tuple, tuple[_OnEmbeddings, Explainer]] = OrderedDict()
        # Per padded signature without the batch size (and whether the batch is one sequence),
        # the batch size its chunks have; and the (signature, batch size, length) checked.
        self._chunk_sizes: dict[tuple, int] = {}
        self._checked: set[tuple] = set()
        self._lock = threading.RLock()

    def __call__(self, input_ids: torch.Tensor, target: Target = None, *, attention_mask: torch.Tensor | None = None,
                 position: int | torch.Tensor | None = None, create_graph: bool = False,
                 parameter_gradient: ParameterGradient = "total", **inputs: Any) -> Explanation:
        """Explain ``target`` for the token ids ``input_ids`` (B, T).

        Args:
            input_ids: (B, T) integer token ids.
            target: the explained class or vocabulary token: an int, (B,) ints, read-out
                weights, or None for the predicted one (see :meth:`Explainer.__call__`).
            attention_mask: (B, T), 1 for tokens and 0 for padding, passed to the model.
            position: for per-position logits (B, T, V): the position whose logits are
                explained, an int or (B,) ints (negative from the end); None for each
                sequence's last real token.
            create_graph, parameter_gradient: as in :meth:`Explainer.__call__`.
            **inputs: other keyword inputs of the model, held constant (tensors with the
                batch first, or plain values such as ``output_attentions=False``); a
                tensor (B, T, …) is padded with zeros as the ids are.

        Returns:
            An :class:`Explanation` with ``contribution`` and ``bias`` (B, T), ``weight``
            (B, T, D) with respect to the embeddings, ``logit`` (B,), and ``logits`` the
            model's logits (B, K), at the explained position for (B, T, V) outputs.
        """
        input_ids = _checked_ids(input_ids, self.layer)
        mask = _checked_mask(attention_mask, input_ids)
        positions = _checked_positions(position, input_ids, mask)
        with self._lock:
            return self._explained(input_ids, mask, inputs, positions, None, target, create_graph,
                                   parameter_gradient)

    def explain_generation(self, input_ids: torch.Tensor, generated: int, *,
                           attention_mask: torch.Tensor | None = None, create_graph: bool = False,
                           parameter_gradient: ParameterGradient = "total", **inputs: Any) -> Explanation:
        """Explain every generated token of a causal LM at once: one forward pass, and one
        backward pass per token.

        The last ``generated`` real tokens of each sequence (B, T) are a continuation: the
        logit of token ``t`` at the position before it is explained, for each of them.

        Returns:
            An :class:`Explanation` with a dimension N = ``generated`` after the batch:
            ``contribution`` and ``bias`` (B, N, T), ``weight`` (B, N, T, D), ``logit`` and
            ``logits`` (B, N) the generated tokens' logits, ``target`` (B, N) their ids.
            Row ``n`` equals the single explanation with ``position`` the one before the
            n-th generated token and ``target`` its id.
        """
        input_ids = _checked_ids(input_ids, self.layer)
        mask = _checked_mask(attention_mask, input_ids)
        if isinstance(generated, bool) or not isinstance(generated, int):
            raise TypeError(f"generated must be an int, got {type(generated).__name__}")
        last = last_tokens(input_ids, mask)
        real = input_ids.shape[1] if mask is None else mask.sum(1).min()
        if not 1 <= generated < int(real):
            raise InputError(f"generated={generated}: a continuation needs 1 to {int(real) - 1} tokens after a "
                             f"prompt of at least one token (the shortest sequence has {int(real)})")
        # Token k of the continuation is predicted at the position before it.
        at = last[:, None] - generated + torch.arange(1, generated + 1, device=input_ids.device)
        if mask is not None and bool((mask.gather(1, at) == 0).any() | (mask.gather(1, at - 1) == 0).any()):
            raise InputError(f"the last {generated} tokens of a sequence and the one before them must not be "
                             "padding (a continuation is contiguous)")
        tokens = input_ids.gather(1, at)
        with self._lock:
            e = self._explained(input_ids, mask, inputs, at - 1, tokens, None, create_graph, parameter_gradient)
        return Explanation(e.contribution, e.weight, e.bias, e.logit, tokens, e.logits)

    def _explained(self, input_ids: torch.Tensor, mask: torch.Tensor | None, inputs: dict[str, Any],
                   positions: torch.Tensor, tokens: torch.Tensor | None, target: Target,
                   create_graph: bool, parameter_gradient: ParameterGradient) -> Explanation:
        """The explanation of ``target`` at ``positions`` (or of ``tokens``, a generation),
        padded to a bucket where the model allows it, else on the batch as given."""
        tensors, settings = self._model_inputs(input_ids, mask, inputs)
        failure = None
        if self.pad_to_buckets:
            try:
                padded = self._padded(tensors, settings, positions, tokens, target, create_graph, parameter_gradient)
            except OmennError:
                raise
            except Exception as error:  # a forward that cannot take the padded batch (a table of positions)
                padded, failure = None, f"it fails on the padded batch ({type(error).__name__}: {error})"
            if padded is not None:
                return padded
        settings, positions = self._logits_kept(settings, positions, input_ids.shape[1], None)
        wrapped, explainer = self._prepared(tensors, settings, positions, tokens)
        explanation = self._run(explainer, wrapped.layer_output(), target, tokens, create_graph, parameter_gradient)
        if failure is not None:  # the model runs on the batch as given: its own failure is not the cause
            self._stop_padding(failure, stacklevel=3)
        return explanation

    def _padded(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any], positions: torch.Tensor,
                tokens: torch.Tensor | None, target: Target, create_graph: bool,
                parameter_gradient: ParameterGradient) -> Explanation | None:
        """The explanation of the batch padded to its bucket and run in chunks, or None (after
        one warning) where its logits are not the model's own on the batch as given."""
        batch, length = tensors["input_ids"].shape
        padded_length, below = bucket(length, self._longest)
        padded = {}
        for name, tensor in tensors.items():
            if tensor.dim() >= 2 and tensor.shape[1] == length:  # one value per token
                fill = self._padding_id if name == "input_ids" else 0
                padding = tensor.new_full((batch, padded_length - length, *tensor.shape[2:]), fill)
                tensor = torch.cat([tensor, padding], 1)
            padded[name] = tensor
        if "attention_mask" not in padded:
            padded["attention_mask"] = (torch.arange(padded_length, device=positions.device) < length).long() \
                .expand(batch, padded_length)
        kept, kept_positions = self._logits_kept(settings, positions, padded_length, below)
        family = self._signature(padded, kept, tokens, with_batch=False)
        # A differentiable explanation's graph holds the wrapped model's inputs until the caller's
        # backward, so its batch runs whole: a next chunk would overwrite them in place.
        size = batch if create_graph else self._chunk_sizes.setdefault((family, batch == 1), batch)
        readout = None
        parts = []
        for start in range(0, batch, size):
            wrapped, explainer = self._prepared({name: batch_rows(t, start, size) for name, t in padded.items()},
                                                kept, batch_rows(kept_positions, start, size),
                                                None if tokens is None else batch_rows(tokens, start, size))
            embeddings = wrapped.layer_output()
            rows = target
            if batch != size and tokens is None and target is not None:  # checked once, for the whole batch
                if readout is None:
                    readout = checked_readout(target, batch, explainer.program(embeddings)[1],
                                              embeddings.device)
                rows = Readout(batch_rows(readout.target, start, size))
            parts.append(self._run(explainer, embeddings, rows, tokens, create_graph, parameter_gradient))
        explanation = _joined(parts, batch, length)
        checked = (family, batch, length)
        if checked not in self._checked:
            own = self._own_logits(tensors, settings, positions, tokens)
            distance = relative_distance(explanation.logits, own)
            # Padding under the attention mask changes the logits by rounding only, as another order of
            # the same sums does, in the least precise type the model computes in.
            dtype = computing_dtype(explainer.program(embeddings)[0].captured.graph, embeddings)
            tolerance = REORDERED_TOLERANCE.get(dtype, HALF_LOGITS_TOLERANCE)
            if distance > tolerance:
                self._stop_padding(f"its logits on a batch padded to {padded_length} tokens under the attention "
                                   f"mask{f' and run in chunks of {size}' if size != batch else ''} differ from "
                                   f"those on the batch as given by {distance:.1e} (relative)", stacklevel=4)
                return None
            self._checked.add(checked)
        return explanation

    def _own_logits(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any], positions: torch.Tensor,
                    tokens: torch.Tensor | None) -> torch.Tensor:
        """The explained logits of the model's own forward on the batch as given."""
        settings, positions = self._logits_kept(settings, positions, tensors["input_ids"].shape[1], None)
        wrapped = _OnEmbeddings(self.model, self.layer, self.output, tensors, settings, positions, tokens)
        with torch.no_grad():
            return wrapped(wrapped.layer_output())

    def _stop_padding(self, reason: str, stacklevel: int) -> None:
        self.pad_to_buckets = False
        warnings.warn(f"omenn_kernels: {type(self.model).__name__} is explained at each sequence length and batch "
                      f"size on its own from now on (one capture each): {reason}", RuntimeWarning,
                      stacklevel=stacklevel + 1)

    def _run(self, explainer: Explainer, embeddings: torch.Tensor, target: Target | Readout,
             tokens: torch.Tensor | None, create_graph: bool, parameter_gradient: ParameterGradient) -> Explanation:
        """``explainer``'s explanation of ``target``, or of each of the ``tokens`` (a generation)."""
        if tokens is None:
            return explainer(embeddings, target, create_graph=create_graph, parameter_gradient=parameter_gradient)
        steps = tokens.shape[1]
        readouts = torch.eye(steps, dtype=embeddings.dtype, device=embeddings.device)
        return explainer.explain_targets(embeddings, readouts.expand(embeddings.shape[0], steps, steps),
                                         create_graph=create_graph, parameter_gradient=parameter_gradient)

    def _model_inputs(self, input_ids: torch.Tensor, mask: torch.Tensor | None,
                      inputs: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """The model's tensor inputs (ids first) and its other keyword inputs, checked."""
        tensors = {"input_ids": input_ids}
        if mask is not None:
            tensors["attention_mask"] = mask
        settings = dict(self._no_cache)
        for name, value in inputs.items():
            if name in ("input_ids", "inputs_embeds"):
                raise InputError(f"{name} is the explained input; pass the ids as the first argument")
            if isinstance(value, torch.Tensor):
                if value.dim() == 0 or value.shape[0] != input_ids.shape[0]:
                    raise InputError(f"the input {name} has shape {tuple(value.shape)}; tensors given to the "
                                     f"model must have the batch ({input_ids.shape[0]}) first")
                tensors[name] = value.to(input_ids.device)
            else:
                settings[name] = value
        return tensors, settings

    def _logits_kept(self, settings: dict[str, Any], positions: torch.Tensor, length: int,
                     below: int | None) -> tuple[dict[str, Any], torch.Tensor]:
        """``settings`` with the LM head run on the last positions of sequences of ``length`` only,
        from the first explained one, and ``positions`` counted from there; for a padded batch
        (``below``: the bucket below the one it was padded to), from ``below``, the same for every
        length of the bucket."""
        if not self._keeps_logits or "logits_to_keep" in settings:
            return settings, positions
        lowest = int(positions.min())
        if below is None and bool((positions == lowest).all()):  # no or left padding
            first = lowest
        elif below is not None and lowest >= below:
            first = below
        else:
            return settings, positions
        return dict(settings, logits_to_keep=length - first), positions - first

    def _signature(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any], tokens: torch.Tensor | None,
                   with_batch: bool = True) -> tuple:
        return (tuple((name, tuple(t.shape) if with_batch else tuple(t.shape[1:]), t.dtype, t.device)
                      for name, t in tensors.items()),
                repr(sorted(settings.items())), None if tokens is None else tokens.shape[1])

    def _prepared(self, tensors: dict[str, torch.Tensor], settings: dict[str, Any], positions: torch.Tensor,
                  tokens: torch.Tensor | None) -> tuple[_OnEmbeddings, Explainer]:
        """The wrapped model for this input signature, its buffers set to these inputs, and its Explainer."""
        key = self._signature(tensors, settings, tokens)
        if key in self._explainers:
            self._explainers.move_to_end(key)
            wrapped, explainer = self._explainers[key]
            wrapped.update(tensors, positions, tokens)
            return wrapped, explainer
        wrapped = _OnEmbeddings(self.model, self.layer, self.output, tensors, settings, positions, tokens)
        explainer = Explainer(wrapped, backend=self.backend, feature_dim=-1)
        self._explainers[key] = (wrapped, explainer)
        while len(self._explainers) > MAX_PROGRAMS:
            self._explainers.popitem(last=False)
        return wrapped, explainer


def _joined(parts: list[Explanation], batch: int, length: int) -> Explanation:
    """The explanations of a batch's chunks as one of its ``batch`` sequences of ``length`` tokens:
    the copies filling up the last chunk and the padding tokens (after ``length``) dropped."""
    def joined(field: str) -> torch.Tensor:
        values = [getattr(part, field) for part in parts]
        return (torch.cat(values) if len(values) > 1 else values[0])[:batch]
    return Explanation(joined("contribution")[..., :length].contiguous(),
                       joined("weight")[..., :length, :].contiguous(),
                       joined("bias")[..., :length].contiguous(),
                       joined("logit"), joined("target"), joined("logits"))
