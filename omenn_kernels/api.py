"""The public API: ``explain``, ``Explainer`` and ``Explanation``."""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from .backends import Backend
from .backends.executor import PARAMETER_GRADIENTS, ParameterGradient
from .capture import ModelStructure, OutputSelector, capture, checked_selector, reference_parameter
from .errors import InputError, InputTypeError, TargetError
from .gc_paused import gc_paused
from .linearize import LinearizedProgram, linearize
from .readout import Readout, Readouts, Target, as_tensor, checked_readout, shown

log = logging.getLogger("omenn_kernels.api")

# Linearized programs an Explainer keeps (one per input signature), the least recently used dropped first.
MAX_PROGRAMS = 8


@dataclass
class Explanation:
    """The OMENN explanation of one read-out of the logits (or T of them), for a batch of inputs.

    Shapes are given for images (B, C, H, W), whose feature axis is C; an input of any
    other layout gives ``weight`` its own shape and ``contribution`` and ``bias`` its shape
    without the feature axis (all of it where there is none: ``feature_dim=None``). With T
    read-outs (:meth:`Explainer.explain_targets`) every field but ``logits`` gains a
    dimension T after the batch: ``contribution`` (B, T, H, W), ``weight`` (B, T, C, H, W), ...

    Attributes:
        contribution: ``C`` (B, H, W) = ``Σ_c C_w ⊙ X + C_b``; sums to ``logit`` per image.
        weight: ``C_w`` (B, C, H, W), the weight representation (``∂ŷ/∂X`` of the
            linearized network).
        bias: ``C_b`` (B, H, W), the bias representation (what the biases contribute,
            routed through the ones channel to each pixel).
        logit: (B,) the explained read-out ``ŷ`` of the model's output, computed in the
            explanation's forward pass by the model's own operations in eval semantics
            (equal to ``model.eval()(x)`` up to floating-point rounding).
        target: (B,) class indices, or (B, K) read-out weights, that were explained.
        logits: (B, K) all the model's logits from the same forward pass.

    Computed with ``create_graph=True`` the fields keep their autograd graph and are
    differentiable with respect to the model's parameters (see :meth:`Explainer.__call__`);
    otherwise every field is detached.
    """

    contribution: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor
    logit: torch.Tensor
    target: torch.Tensor
    logits: torch.Tensor | None = None

    def completeness_error(self) -> torch.Tensor:
        """Per explained read-out, ``|Σ C − ŷ| / |ŷ|``: how far the explanation is from summing to it."""
        total = self.contribution.reshape(*self.logit.shape, -1).sum(-1)
        return (total - self.logit).abs() / self.logit.abs().clamp_min(torch.finfo(self.logit.dtype).tiny)


def feature_axis(feature_dim: int | None, x: torch.Tensor) -> int | None:
    """``feature_dim`` as a non-negative axis of ``x`` (None stays None); InputError if it is not
    an axis after the batch."""
    if feature_dim is None:
        return None
    if not -x.dim() <= feature_dim < x.dim() or feature_dim % x.dim() == 0:
        raise InputError(f"feature_dim={feature_dim} is not an axis after the batch of an input of shape "
                         f"{tuple(x.shape)}")
    return feature_dim % x.dim()


def _check_input(x: object, model: torch.nn.Module) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise InputTypeError(f"the input must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise InputError(f"the input must be a batch (B, ...) with at least one dimension after the batch; "
                         f"got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        hint = ""
        if not x.is_complex() and x.dtype != torch.bool:
            hint = (": token ids are explained at the model's embedding layer by explain(model, input_ids, ...) "
                    "or TokenExplainer(model)")
        raise InputTypeError(f"the input must be a floating-point tensor; got dtype {x.dtype}{hint}")
    if x.shape[0] == 0:
        raise InputError("the input batch is empty")
    reference = reference_parameter(model)
    if reference is not None and reference.device != x.device:
        raise InputError(f"the input is on device '{x.device}' but the model's parameters are on "
                         f"'{reference.device}'; move one of them")
    if reference is not None and reference.dtype != x.dtype:
        raise InputTypeError(f"the input has dtype {x.dtype} but the model's parameters are "
                             f"{reference.dtype}; convert one of them")
    return x


class _Finiteness:
    """Whether every value of an input is finite: computed on its device at once, read by the
    host (a device sync) when first required."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        # aminmax propagates NaN and is ~15x faster than an elementwise isfinite on CPU.
        self.finite: torch.Tensor | None = torch.isfinite(torch.stack(torch.aminmax(x))).all()

    def require(self) -> None:
        """Raise :class:`InputError` if the input holds NaN or Inf (reads the verdict once)."""
        if self.finite is None:
            return
        finite, self.finite = bool(self.finite), None
        if not finite:
            bad = int((~torch.isfinite(self.x)).sum())
            raise InputError(f"the input contains {bad} NaN or Inf values; OMENN explains finite inputs only")


def _parameter_gradient(create_graph: bool, parameter_gradient: str) -> ParameterGradient | None:
    """What the backends need to know: None for detached explanations, else the gradient's kind."""
    if not isinstance(create_graph, bool):
        raise TypeError(f"create_graph must be a bool, got {type(create_graph).__name__}")
    if parameter_gradient not in PARAMETER_GRADIENTS:
        raise ValueError(f"unknown parameter_gradient {parameter_gradient!r}; expected one of "
                         f"{', '.join(repr(p) for p in PARAMETER_GRADIENTS)}")
    return parameter_gradient if create_graph else None


class Explainer:
    """Explains a model with OMENN, capturing and linearizing it once per input signature.

    The model is captured in eval semantics (BatchNorm running statistics, no dropout)
    whatever its ``training`` flag, and is left unchanged: parameters, flags, hooks and
    buffers are as before. Parameters are read at every call, so the explanations
    follow training. A change of the model's structure that a capture bakes in (forward
    hooks and pre-hooks, global module hooks, replaced submodules, parameters or buffers
    re-bound to other tensors, a forward set on an instance, a plain attribute such as
    ``self.scale`` or timm's ``global_pool``; see
    :class:`~omenn_kernels.capture.ModelStructure`) is noticed at the next call, which
    captures the model again (logged at INFO).

    One program is kept per input signature (shape, dtype, device; a program captured
    from a batch of two or more serves other batch sizes), at most :data:`MAX_PROGRAMS`,
    the least recently used dropped first; the compiled backend keeps at most
    :data:`~omenn_kernels.backends.compiled.MAX_COMPILED` compiled graphs per program.

    Thread-safe: threads may share an ``Explainer``, and several ``Explainer`` objects
    may run at once; captures run one at a time, and so do explanations on the fused and
    compiled backends, which must not run their custom ops while another thread exports
    (:data:`~omenn_kernels.capture.CAPTURE_LOCK`). The model's own forward must not run in
    another thread while it is being captured, since ``torch.export`` replaces its
    parameters by fake tensors meanwhile; nor should the backward of an explanation made
    with ``create_graph`` (it runs the custom ops outside the lock).

    Args:
        model: any ``nn.Module`` whose forward maps one tensor (B, ...) to (B, K) logits,
            alone or inside a tuple, list, dict or Hugging Face ``ModelOutput``.
        backend: ``"reference"`` (plain PyTorch autograd, the oracle), ``"fused"`` (one ones
            value per pixel, fused ops), ``"compiled"`` (the fused explanation traced once per
            input and target signature into one graph and compiled with Inductor; the
            first call of a signature runs eagerly and compiles, with ``create_graph`` too;
            one graph serves every batch size; read-outs given as functions run on
            ``"fused"``) or ``"auto"``, the default: the device's fastest eager backend
            (``"fused"`` on the CPU, ``"reference"`` on CUDA) until a signature's calls have
            taken a minute, then ``"compiled"`` for first-order explanations
            (:mod:`omenn_kernels.backends.tiered`).
        output: which tensor of the model's output holds the logits: None (default) for
            the output itself, the first element of a tuple or list, or the ``"logits"``
            entry of a dict or ``ModelOutput``; an index or a key (``output=1``,
            ``output="aux_logits"``); or a function of the output that returns (B, K)
            logits, traced with the model (``output=lambda out: out.logits[:, -1]``).
        feature_dim: the input's feature axis: each position (pixel, time step, token)
            has one ones value shared by its features, and ``contribution`` and ``bias``
            sum over this axis. 1 (default) for images (B, C, H, W), audio (B, C, T),
            video (B, C, T, H, W) and tables (B, F) (one position per row); -1 for
            token embeddings (B, T, D); None for no feature axis: every element is a
            position of its own (a table's features, each with its share of the biases).

    Example:
        >>> explainer = Explainer(model)
        >>> e = explainer(images, target=3)
        >>> e.contribution.sum((1, 2))  # == e.logit
    """

    def __init__(self, model: torch.nn.Module, *, backend: str = "auto", output: OutputSelector = None,
                 feature_dim: int | None = 1) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.backend = backend  # checked by the setter
        self.output = checked_selector(output)
        if feature_dim is not None and (isinstance(feature_dim, bool) or not isinstance(feature_dim, int)):
            raise TypeError(f"feature_dim must be an int or None, got {type(feature_dim).__name__}")
        self.feature_dim = feature_dim
        # Per (input shape, dtype, device), the most recently used last; a program that serves
        # a range of batch sizes has the shape (None, C, H, W) and the range after the device.
        self._programs: dict[tuple, tuple[LinearizedProgram, int]] = {}
        self._structure: ModelStructure | None = None  # the model's structure the programs were captured with
        self._lock = threading.RLock()  # so that two threads do not capture the same signature

    @property
    def backend(self) -> str:
        """The backend's name, as given; may be set to another backend between calls."""
        return self._backend.name

    @backend.setter
    def backend(self, name: str) -> None:
        self._backend = Backend(name)

    def program(self, x: torch.Tensor) -> tuple[LinearizedProgram, int]:
        """The linearized program for ``x``'s signature and the model's number of classes.

        A program captured from a batch of two or more serves every batch size of at least
        2 where the model's forward allows it (see :func:`~omenn_kernels.capture.capture`);
        a batch of one has a program of its own.

        Captures the model if no program for the signature is cached, or if the model's
        structure changed since the cached ones were captured (they are then dropped).
        """
        with self._lock:
            cached = self._cached_program(x)
            if cached is not None:
                return cached
            self._backend.before_capture(x.device)
            with gc_paused():
                captured = capture(self.model, x, self.output)
                program = linearize(captured)
            program.feature_dim = feature_axis(self.feature_dim, x)
            output = next(n for n in captured.graph.nodes if n.name == captured.output_name)
            shape = (x.shape[0], *output.meta["val"].shape[1:]) if output.meta["val"].dim() else ()
            if len(shape) != 2:
                raise InputError(f"the model's output has shape {shape}; explain needs (batch, "
                                 "num_classes) logits (output= selects them from another output)")
            # A program that serves a range of batch sizes is kept under the shape (None, C, H, W).
            key = (tuple(x.shape), x.dtype, x.device) if captured.batch_range is None else \
                ((None, *x.shape[1:]), x.dtype, x.device, captured.batch_range)
            self._programs[key] = entry = (program, int(shape[1]))
            while len(self._programs) > MAX_PROGRAMS:  # the least recently used first
                self._programs.pop(next(iter(self._programs)))
            return entry

    def _cached_program(self, x: torch.Tensor) -> tuple[LinearizedProgram, int] | None:
        """The cached program for ``x``'s signature, or None (the cache dropped first if the
        model's structure changed since its programs were captured)."""
        any_batch = (None, *x.shape[1:])  # the key's shape of a program that serves a range of batch sizes
        with self._lock:
            if self._structure is None or not self._structure.matches(self.model):
                if self._programs:
                    log.info("capturing %s again, its structure changed: %s", type(self.model).__name__,
                             self._structure.changes(self.model))
                self._programs = {}
                self._structure = ModelStructure.record(self.model)
            for key, entry in self._programs.items():
                shape, dtype, device = key[:3]
                if (shape, dtype, device) == (tuple(x.shape), x.dtype, x.device) or \
                        (shape, dtype, device) == (any_batch, x.dtype, x.device) and \
                        entry[0].captured.serves_batch(x.shape[0]):
                    self._programs[key] = self._programs.pop(key)  # now the most recently used
                    return entry
            return None

    def __call__(self, x: torch.Tensor, target: Target = None, *, create_graph: bool = False,
                 parameter_gradient: ParameterGradient = "total") -> Explanation:
        """Explain ``target`` for the batch ``x``.

        Args:
            x: (B, C, H, W) floating-point images, or a batch of another layout (see
                ``feature_dim``), on the model's device and dtype.
            target: an int class, (B,) integer classes, (K,) or (B, K) read-out weights
                (e.g. ``e_a − e_b`` for a contrastive explanation), or None for each
                image's predicted class.
            create_graph: keep the autograd graph, so that ``contribution``, ``weight`` and
                ``bias`` are differentiable with respect to the model's parameters (for
                attribution losses in training). Their values do not change.
            parameter_gradient: with ``create_graph``, what the gradient with respect to
                the parameters θ is. ``"total"``: the total derivative of ``C(θ)``: the
                multipliers (``ξ``, ``1/σ``, attention weights) are held constant with
                respect to the input, as always, but follow θ; it equals finite
                differences of ``C``. It runs the model's own forward on held values
                (whose products attention and the fused linear layers reuse), and ``logits``
                is then the model's own (differentiable) output.
                ``"fixed_multipliers"``: a surrogate that also holds the multipliers
                fixed with respect to θ (only the weights and biases inside the linear
                map are differentiated); ``logit`` and ``logits`` are detached.
                The fused backend differentiates its ops twice, except CUDA's attention,
                which runs its reference rule then, with a warning.
        """
        return self._explained(x, target, False, create_graph, parameter_gradient)

    def explain_targets(self, x: torch.Tensor, readouts: Readouts | Readout, *, create_graph: bool = False,
                        parameter_gradient: ParameterGradient = "total") -> Explanation:
        """Explain T read-outs per image with one forward pass (and one backward per read-out).

        Args:
            x: (B, C, H, W) floating-point images, or a batch of another layout (see
                ``feature_dim``), on the model's device and dtype.
            readouts: (B, T, K) read-out weights (a one-hot row explains one class,
                ``e_a − e_b`` the contrast of two), or a function that maps the detached
                logits (B, K) of the shared forward to such weights, for targets that
                depend on the prediction (predicted class, top-k): a
                :class:`ReadoutFunction` (which the compiled backend compiles with the
                explanation) or any callable (run on the fused backend); or a
                :class:`~omenn_kernels.readout.Readout` built before.
            create_graph, parameter_gradient: as in :meth:`__call__`.

        Returns:
            An :class:`Explanation` whose fields have a dimension T after the batch:
            ``contribution`` (B, T, H, W) sums to ``logit`` (B, T); ``logits`` (B, K).
        """
        return self._explained(x, readouts, True, create_graph, parameter_gradient)

    def _explained(self, x: torch.Tensor, given: Target | Readouts | Readout, several: bool, create_graph: bool,
                   parameter_gradient: str) -> Explanation:
        """The explanation of the ``given`` target, one read-out per image or ``several`` (see
        :func:`~omenn_kernels.readout.checked_readout`).

        One or T read-outs per image: ``C_w`` is (B, C, H, W) or (B, T, C, H, W), and ``C``
        sums it with ``X`` over the feature axis either way.
        """
        parameter_gradient = _parameter_gradient(create_graph, parameter_gradient)
        x = _check_input(x, self.model)
        feature = feature_axis(self.feature_dim, x)
        finite = _Finiteness(x)
        # Explaining needs autograd, also when called under inference_mode.
        with torch.inference_mode(False):
            if x.is_inference():
                x = x.clone()
            # A compiled graph that only replays reads the verdict once it is launched, so that
            # the device runs it while the host waits; nothing is captured, run or compiled
            # for a bad input.
            cached = self._cached_program(x)
            if cached is None:
                finite.require()
            program, classes = cached or self.program(x)
            readout = checked_readout(given, x.shape[0], classes, x.device, several)
            if self._backend.runs_on(program, self.model, x, readout, parameter_gradient) != "compiled":
                finite.require()
            weight, bias, logit, target, logits = self._backend.explain(program, self.model, x, readout,
                                                                        parameter_gradient)
            finite.require()
            if not create_graph:  # every field detached, also from an input that requires a gradient
                x, weight, bias, logit, logits = x.detach(), weight.detach(), bias.detach(), logit.detach(), \
                    logits.detach()
            readouts = weight.dim() - x.dim()  # 1 with T read-outs
            weighted = weight * x.reshape(x.shape[0], *([1] * readouts), *x.shape[1:])
            contribution = (weighted if feature is None else weighted.sum(feature + readouts)) + bias
        return Explanation(contribution, weight, bias, logit, target, logits)

    def attribute(self, inputs: torch.Tensor, target: Target = None) -> torch.Tensor:
        """Captum-style attributions of the input's shape: ``C_w ⊙ X + C_b / C`` per channel.

        The bias part is spread evenly over the feature axis (the channels of an image), so
        the attributions of an input still sum to its explained logit.
        """
        e = self(inputs, target)
        feature = feature_axis(self.feature_dim, inputs)
        if feature is None:
            return e.weight * inputs + e.bias
        return e.weight * inputs + e.bias.unsqueeze(feature) / inputs.shape[feature]


def explain(model: torch.nn.Module, x: torch.Tensor, target: Target = None, *,
            backend: str = "auto", create_graph: bool = False,
            parameter_gradient: ParameterGradient = "total", output: OutputSelector = None,
            feature_dim: int | None = 1, attention_mask: torch.Tensor | None = None,
            position: int | torch.Tensor | None = None, layer: str | torch.nn.Module | None = None,
            **inputs) -> Explanation:
    """Explain ``model`` on ``x`` for ``target`` with OMENN (one capture, one forward, one backward).

    Args:
        model: any ``nn.Module`` mapping a (B, C, H, W) tensor (or a batch of another
            layout, see ``feature_dim``) to (B, K) logits, or a model that takes token ids.
        x: the batch, floating-point, on the model's device and dtype; or (B, T) integer
            token ids, explained at the model's embedding layer, one contribution per
            token (see :class:`~omenn_kernels.tokens.TokenExplainer`, which takes
            ``attention_mask``, ``position``, ``layer`` and other keyword ``inputs``).
        target: an int class, (B,) integer classes, (K,) or (B, K) read-out weights, or
            None for each image's predicted class.
        backend: ``"reference"``, ``"fused"``, ``"compiled"`` or ``"auto"`` (see :class:`Explainer`).
        output: which tensor of the model's output holds the logits (see :class:`Explainer`).
        feature_dim: the input's feature axis (see :class:`Explainer`).
        create_graph, parameter_gradient: an explanation differentiable with respect to
            the model's parameters (see :meth:`Explainer.__call__`). Training loops
            should keep one :class:`Explainer` (or use :func:`explainer_for`), which
            captures the model once.

    Returns:
        The :class:`Explanation`; ``contribution.sum((1, 2)) == logit`` up to rounding.

    Raises:
        InputError, InputTypeError: a malformed input, or one the model's own forward
        fails on. TargetError: a target that does not fit the model's output.
        UnsupportedOpError: an operation with no rule. CaptureError: a forward
        torch.export cannot capture. OutputError: ``output`` picks no tensor of the
        model's output.
    """
    token_inputs = dict(inputs, attention_mask=attention_mask, position=position, layer=layer)
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
        from .tokens import TokenExplainer  # it builds on this module
        layer = token_inputs.pop("layer")
        return TokenExplainer(model, layer=layer, backend=backend, output=output)(
            x, target, create_graph=create_graph, parameter_gradient=parameter_gradient, **token_inputs)
    given = sorted(name for name, value in token_inputs.items() if value is not None)
    if given:
        raise InputError(f"{', '.join(given)} are inputs of a model explained from token ids, but the input "
                         f"is {x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return Explainer(model, backend=backend, output=output, feature_dim=feature_dim)(
        x, target, create_graph=create_graph, parameter_gradient=parameter_gradient)


_EXPLAINERS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Explainer]]" = \
    weakref.WeakKeyDictionary()
_EXPLAINERS_LOCK = threading.Lock()


def explainer_for(model: torch.nn.Module, backend: str = "auto", output: OutputSelector = None,
                  feature_dim: int | None = 1) -> Explainer:
    """The :class:`Explainer` of ``model``, ``backend``, ``output`` and ``feature_dim`` kept for
    repeated calls (held weakly).

    Code that explains the same model many times (Quantus metrics, attribution losses at
    every training step) captures it once per input signature this way. A function given
    as ``output`` is told apart by identity: pass the same function object at every call.
    """
    key = (backend, checked_selector(output), feature_dim)
    with _EXPLAINERS_LOCK:  # one Explainer per model and setting, also when threads ask at once
        per_setting = _EXPLAINERS.setdefault(model, {})
        if key not in per_setting:
            per_setting[key] = Explainer(model, backend=backend, output=output, feature_dim=feature_dim)
        return per_setting[key]


def _class_labels(targets: object) -> torch.Tensor:
    """Quantus's labels as class indices: integers, or floats with integral values (0-d or (B,))."""
    labels = targets if isinstance(targets, torch.Tensor) else as_tensor(targets)
    if labels.dtype == torch.bool or labels.is_complex():
        raise TargetError(f"the labels {shown(labels)} have dtype {labels.dtype}; quantus_explain needs "
                          "integer class indices")
    if labels.is_floating_point():
        wide = labels.double()
        # .long() would truncate 2.7 to class 2, and turn NaN or values beyond 64 bits into arbitrary ones
        if not bool((torch.isfinite(wide) & (wide == wide.round()) & (wide.abs() < 2.0 ** 63)).all()):
            raise TargetError(f"the labels {shown(labels)} are not all whole numbers; quantus_explain needs "
                              "integer class indices")
        labels = wide.long()
    return labels.reshape(-1) if labels.dim() > 1 else labels


def quantus_explain(model: torch.nn.Module, inputs, targets, **kwargs) -> np.ndarray:
    """A Quantus ``explain_func``: OMENN attributions as a numpy array (B, C, H, W).

    Accepts numpy arrays or tensors: floating-point images, which are converted to the
    model's dtype, and integer class labels (floats with whole values, such as 3.0, are
    taken as those classes). Extra Quantus keyword arguments are ignored except
    ``backend`` and ``reduce_channels=True``, which returns the contribution map as
    (B, 1, H, W). Quantus calls this many times with the same model: the captured
    program is kept (weakly) per model.

    Raises:
        InputTypeError: integer (e.g. uint8) or otherwise non-floating-point images.
        TargetError: labels that are not whole numbers, or out of the model's range.
    """
    x = torch.as_tensor(inputs)
    if not x.is_floating_point():
        # uint8 images converted as they are would be explained on 0-255 values
        raise InputTypeError(f"the inputs have dtype {x.dtype}; the model needs floating-point images in its "
                             "normalized input range, so convert and normalize them first")
    reference = reference_parameter(model)
    if reference is not None:
        x = x.to(dtype=reference.dtype, device=reference.device)
    else:
        x = x.to(device=kwargs.get("device") or "cpu")
    target = _class_labels(targets).to(x.device)
    explainer = explainer_for(model, kwargs.get("backend", "auto"))
    if kwargs.get("reduce_channels", False):
        return explainer(x, target).contribution.unsqueeze(1).cpu().numpy()
    return explainer.attribute(x, target).detach().cpu().numpy()
