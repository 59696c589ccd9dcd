"""Attribution losses for training: explanations matched to a reference model's.

Attribution distillation trains a student to explain as its teacher does; attribution
consistency (continual learning) keeps a model's explanations of old tasks close to
those of a frozen copy taken before the new task. Both compare OMENN maps: the
model's explanation is differentiable with respect to its parameters
(``create_graph=True``), the reference's is a constant.

    loss = attribution_distillation(student, teacher, images, labels)
    (task_loss(loss.logits, labels) + weight * loss.loss).backward()

A frozen reference model explains the same images the same way at every step, so
its maps can be computed once and passed instead of the model (a replay buffer that
stores explanations with its images, as in continual learning): the loss then costs
only the model's own explanation.

The returned ``logits`` come from the explanation's own forward pass (eval semantics).
With the default ``parameter_gradient="total"`` they are the student's output with its
full gradient, so the task loss needs no second forward where the student's training
forward equals its eval forward (no BatchNorm batch statistics, no active dropout or
stochastic depth). Otherwise run the training forward for the task loss as usual.
Explainers are kept per model (:func:`~omenn_kernels.api.explainer_for`), so a model
is captured once, not at every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from .api import Explanation, Target, explainer_for, feature_axis
from .capture import OutputSelector
from .backends.executor import ParameterGradient
from .errors import InputError, OptionError, TargetError

# How many batch rows an error lists before it says how many more there are.
_ROWS_SHOWN = 8

Distance = Literal["cosine", "mse"]
Component = Literal["contribution", "weighted_input", "bias"]
DISTANCES: tuple[str, ...] = ("cosine", "mse")
COMPONENTS: tuple[str, ...] = ("contribution", "weighted_input", "bias")


@dataclass
class AttributionLoss:
    """An attribution loss and what it was computed from.

    Attributes:
        loss: the scalar loss, differentiable with respect to the model's parameters.
        logits: (B, K) the model's logits from the explanation's forward (eval
            semantics); differentiable with ``parameter_gradient="total"``, detached
            with ``"fixed_multipliers"``.
        explanation: the model's explanation (differentiable).
        reference: the reference model's explanation (detached), or None when stored
            reference maps were passed.
    """

    loss: torch.Tensor
    logits: torch.Tensor
    explanation: Explanation
    reference: Explanation | None


def attribution_map(explanation: Explanation, x: torch.Tensor, component: Component,
                    feature_dim: int | None = 1) -> torch.Tensor:
    """The map of ``explanation`` that a loss compares: (B, H, W) for images (B, C, H, W), the
    input's shape without its feature axis for other layouts (see :class:`~omenn_kernels.api.Explainer`).

    ``"contribution"``: ``C``; ``"weighted_input"``: ``Σ_c C_w ⊙ X``; ``"bias"``: ``C_b``.
    """
    _check_choice(component, COMPONENTS, "component")
    if component == "contribution":
        return explanation.contribution
    if component == "weighted_input":
        axis = feature_axis(feature_dim, x)
        weighted = explanation.weight * x
        return weighted if axis is None else weighted.sum(axis)
    return explanation.bias


def map_distance(maps: torch.Tensor, reference: torch.Tensor, distance: Distance) -> torch.Tensor:
    """The batch mean of the per-image distance between two (B, H, W) maps.

    ``"cosine"``: ``1 − cos`` of the flattened maps, blind to their scale (a teacher's
    logits may be larger than its student's); ``"mse"``: the mean squared difference,
    which keeps the scale (and so how much of the logit each pixel carries).
    """
    _check_choice(distance, DISTANCES, "distance")
    if maps.shape != reference.shape:
        raise InputError(f"the explanation maps differ in shape: {tuple(maps.shape)} and "
                         f"{tuple(reference.shape)}")
    if distance == "cosine":
        return (1 - F.cosine_similarity(maps.flatten(1), reference.flatten(1), dim=1)).mean()
    return F.mse_loss(maps, reference)


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> None:
    if value not in choices:
        raise OptionError(f"unknown {what} {value!r}; expected one of {', '.join(repr(c) for c in choices)}")


def _checked_stored_maps(maps: torch.Tensor, x: torch.Tensor, feature_dim: int | None) -> torch.Tensor:
    """``maps`` if they are finite maps of the batch ``x``: (B, H, W) for images (B, C, H, W),
    ``x``'s shape without its feature axis otherwise.

    A store's failed rows hold NaN; compared with them, the loss would be NaN. An ``x`` or a
    ``feature_dim`` that does not make a batch is left to the explainer, which names what is wrong.
    """
    if not (isinstance(x, torch.Tensor) and x.dim() >= 2):
        return maps
    try:
        axis = feature_axis(feature_dim, x)
    except (InputError, TypeError):
        return maps
    expected = tuple(x.shape) if axis is None else tuple(size for dim, size in enumerate(x.shape) if dim != axis)
    if tuple(maps.shape) != expected:
        layout = "(B, H, W)" if x.dim() == 4 and axis == 1 else "without the feature axis"
        raise InputError(f"the stored reference maps have shape {tuple(maps.shape)}, but the maps of the "
                         f"batch {tuple(x.shape)} are {layout} = {expected}")
    non_finite = (~torch.isfinite(maps)).reshape(maps.shape[0], -1).any(1).nonzero().flatten().tolist()
    if non_finite:
        rows = ", ".join(str(row) for row in non_finite[:_ROWS_SHOWN])
        more = f", … ({len(non_finite) - _ROWS_SHOWN} more)" if len(non_finite) > _ROWS_SHOWN else ""
        raise InputError(f"the stored reference maps hold NaN or Inf in {len(non_finite)} of {expected[0]} rows "
                         f"(batch rows {rows}{more}); a store's failed rows hold NaN and a float16 store holds Inf "
                         "where a value overflowed: leave those images out of the batch")
    return maps


def _matched(model: torch.nn.Module, reference_model: torch.nn.Module | torch.Tensor, x: torch.Tensor,
             target: Target, distance: Distance, component: Component, backend: str,
             reference_backend: str, parameter_gradient: ParameterGradient,
             output: OutputSelector, feature_dim: int | None) -> AttributionLoss:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(reference_model, (torch.nn.Module, torch.Tensor)):
        raise TypeError("the reference must be a torch.nn.Module or a tensor of its stored maps, got "
                        f"{type(reference_model).__name__}")
    if model is reference_model:
        raise InputError("the model and the reference model are the same object; pass a frozen "
                         "copy (copy.deepcopy) as the reference")
    _check_choice(distance, DISTANCES, "distance")  # before the explanations are computed
    _check_choice(component, COMPONENTS, "component")
    if isinstance(reference_model, torch.Tensor):
        if target is None:
            raise TargetError("stored reference maps need the target they explain; pass target")
        reference, reference_maps = None, _checked_stored_maps(reference_model.detach(), x, feature_dim)
    else:
        reference = explainer_for(reference_model, reference_backend, output, feature_dim)(x, target)
        target, reference_maps = reference.target, attribution_map(reference, x, component, feature_dim)
    explanation = explainer_for(model, backend, output, feature_dim)(x, target, create_graph=True,
                                                                     parameter_gradient=parameter_gradient)
    loss = map_distance(attribution_map(explanation, x, component, feature_dim), reference_maps, distance)
    return AttributionLoss(loss, explanation.logits, explanation, reference)


def attribution_distillation(student: torch.nn.Module, teacher: torch.nn.Module | torch.Tensor, x: torch.Tensor,
                             target: Target = None, *, distance: Distance = "cosine",
                             component: Component = "contribution", backend: str = "auto",
                             teacher_backend: str = "auto",
                             parameter_gradient: ParameterGradient = "total",
                             output: OutputSelector = None, feature_dim: int | None = 1) -> AttributionLoss:
    """How far the student's OMENN explanations are from its teacher's, as a training loss.

    Args:
        student: the model being trained (any architecture OMENN supports).
        teacher: the model whose explanations are matched (it is not differentiated),
            or its maps of ``x`` stored earlier, (B, H, W): ``attribution_map(explain(
            teacher, x, target), x, component)``; ``target`` must then be given.
        x: (B, C, H, W) images, on both models' device and dtype.
        target: what both explain: an int class, (B,) classes, (K,) or (B, K) read-out
            weights, or None for the teacher's predicted class.
        distance: ``"cosine"`` (default; blind to the maps' scale) or ``"mse"``.
        component: which map is matched: ``"contribution"`` (C), ``"weighted_input"``
            or ``"bias"``.
        backend: the student's backend (``"auto"``: the fused ops where they differentiate
            twice, the reference rules elsewhere; see :mod:`omenn_kernels.backends.fused`).
        teacher_backend: the teacher's backend; its explanation is first-order, so the
            fused kernels (``"auto"``) apply.
        parameter_gradient: ``"total"`` or ``"fixed_multipliers"`` (see
            :meth:`~omenn_kernels.api.Explainer.__call__`).
        output: which tensor of both models' outputs holds the logits (see
            :class:`~omenn_kernels.api.Explainer`).
        feature_dim: the input's feature axis (see :class:`~omenn_kernels.api.Explainer`);
            the maps are the input's shape without it.

    Returns:
        An :class:`AttributionLoss`; its ``loss`` is differentiable with respect to the
        student's parameters and its ``logits`` can feed the task loss (module docstring).

    Raises:
        TypeError: a model that is not a module.
        InputError: the same module twice; stored maps of another shape than the maps of
            ``x``, (B, H, W), or with NaN or Inf in some rows (a store's failed rows; the
            message names them).
        OptionError: an unknown distance or component.
        TargetError: stored maps without a target.
        The errors of :func:`~omenn_kernels.explain` for inputs and targets.
    """
    return _matched(student, teacher, x, target, distance, component, backend, teacher_backend,
                    parameter_gradient, output, feature_dim)


def attribution_consistency(model: torch.nn.Module, reference_model: torch.nn.Module | torch.Tensor,
                            x: torch.Tensor,
                            target: Target = None, *, distance: Distance = "mse",
                            component: Component = "contribution", backend: str = "auto",
                            reference_backend: str = "auto",
                            parameter_gradient: ParameterGradient = "total",
                            output: OutputSelector = None, feature_dim: int | None = 1) -> AttributionLoss:
    """How far ``model``'s explanations have moved from a frozen copy's (continual learning).

    Take ``reference_model = copy.deepcopy(model)`` before training on a new task and add
    this loss on images of the old tasks, so that the model keeps explaining them as it
    did. ``distance="mse"`` (default) keeps the maps' scale: how much of each logit
    every pixel carries.

    Args:
        model: the model being trained.
        reference_model: the frozen copy (it is not differentiated), or its maps of ``x``
            stored earlier (see :func:`attribution_distillation`).
        x: (B, C, H, W) images of the old tasks.
        target: as in :func:`attribution_distillation`; None: the reference model's
            predicted class.
        distance, component, backend, parameter_gradient, output, feature_dim: as in
            :func:`attribution_distillation`.
        reference_backend: the reference model's backend (``"auto"``: the fused kernels).

    Returns:
        An :class:`AttributionLoss` (see :func:`attribution_distillation`).
    """
    return _matched(model, reference_model, x, target, distance, component, backend,
                    reference_backend, parameter_gradient, output, feature_dim)
