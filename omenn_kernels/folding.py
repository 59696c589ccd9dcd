"""Capture-time folding: eval-mode BatchNorm merged into the convolution that feeds it.

An eval-mode BatchNorm is the per-channel affine map ``y·s + t`` with
``s = γ/√(var+ε)`` and ``t = β − mean·s``. Applied to a convolution ``y = conv(x, W) + b``
it is the convolution ``conv(x, W·s) + (b·s + t)``. The explanation does not change
either (beyond rounding): R3 carries ``t`` by the ones at each output position, which R2
made the renormalized window sums of the convolution, the same ones that carry the
folded bias; the input gradient ``convᵀ(dy·s, W)`` is ``convᵀ(dy, W·s)``. One
convolution with its bias replaces a convolution, a BatchNorm and their ones work.

``W·s`` and ``b·s + t`` are computed in the graph from the parameters and running
statistics, as the rest of the graph reads them, so optimizer steps and
``load_state_dict`` are seen, and a parameter gradient flows to ``W``, ``b``, ``γ`` and ``β``
as through the unfolded pair. A first-order compiled explanation keeps them as constants
of its graph, computed again when a parameter changes
(:mod:`~omenn_kernels.backends.parameter_only`). Where the graph computes them from
trained parameters (a differentiable explanation), :func:`scale_gradients_not_kernels`
has each folded convolution's input gradient read ``W`` rather than ``W·s``, so that the
folded kernels do not outlive the forward.
"""

from __future__ import annotations

import operator

import torch
from torch._guards import detect_fake_mode

aten = torch.ops.aten

# Convolutions as the captured graph holds them: (input, weight, bias, stride, padding, dilation, groups).
_CONVOLUTIONS = (aten.conv1d.default, aten.conv2d.default, aten.conv3d.default)
_BATCH_NORM = aten._native_batch_norm_legit_no_training.default  # (input, γ, β, mean, var, momentum, ε)


def fold_batch_norms(graph: torch.fx.Graph, input_name: str) -> int:
    """Fold each eval-mode BatchNorm whose input is a convolution used by nothing else; returns the count.

    The convolution's weight and bias and the BatchNorm's affine parameters and statistics
    must not depend on ``input_name`` (the graph's image input): a layer whose kernel is
    computed from the input keeps its BatchNorm.
    """
    dependent = _input_dependent(graph, input_name)
    folded = 0
    for norm in list(graph.nodes):
        convolution = norm.args[0] if norm.op == "call_function" and norm.target is _BATCH_NORM else None
        if not _foldable(convolution, norm, dependent):
            continue
        _fold(graph, convolution, norm)
        folded += 1
    if folded:
        graph.lint()
    return folded


def _input_dependent(graph: torch.fx.Graph, input_name: str) -> set[torch.fx.Node]:
    dependent: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.name == input_name or any(n in dependent for n in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _foldable(convolution, norm: torch.fx.Node, dependent: set[torch.fx.Node]) -> bool:
    if not isinstance(convolution, torch.fx.Node) or convolution.target not in _CONVOLUTIONS:
        return False
    if len(convolution.users) != 1 or len(norm.args) != 7 or norm.kwargs:
        return False
    # Only the normalized value is used (the saved statistics of the eval op are empty), and not
    # as the graph's output, which the export's signature names.
    if any(user.target is not operator.getitem or user.args[1] != 0 or
           any(u.op == "output" for u in user.users) for user in norm.users):
        return False
    constants = [*_arguments(convolution)[1:3], *norm.args[1:5]]
    return all(c is None or isinstance(c, torch.fx.Node) and c not in dependent for c in constants)


def _arguments(node: torch.fx.Node) -> list:
    """``node``'s arguments in schema order, keyword and defaulted ones included."""
    return [node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
            for i, a in enumerate(node.target._schema.arguments)]


def _fold(graph: torch.fx.Graph, convolution: torch.fx.Node, norm: torch.fx.Node) -> None:
    """Replace ``norm(convolution(x, W, b))`` by ``convolution(x, W·s, b·s + t)`` in ``graph``."""
    x, weight, bias, *geometry = _arguments(convolution)
    _, gamma, beta, mean, variance, _momentum, eps = norm.args
    meta = {key: value for key, value in convolution.meta.items() if key != "val"}

    def call(op, *args) -> torch.fx.Node:
        node = graph.call_function(op, args)
        node.meta.update(meta)
        values = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in args]
        fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
        if fake_mode is not None and all(v is not None for v in values):
            with fake_mode:
                node.meta["val"] = op(*values)
        return node

    with graph.inserting_before(convolution):
        scale = call(aten.rsqrt.default, call(aten.add.Tensor, variance, eps))
        if gamma is not None:
            scale = call(aten.mul.Tensor, scale, gamma)
        kernel_shape = [-1] + [1] * (len(weight.meta["val"].shape) - 1)
        folded_weight = call(aten.mul.Tensor, weight, call(aten.view.default, scale, kernel_shape))
        centred = mean if bias is None else call(aten.sub.Tensor, mean, bias)
        folded_bias = call(aten.neg.default, call(aten.mul.Tensor, centred, scale))  # (b − mean)·s
        if beta is not None:
            folded_bias = call(aten.add.Tensor, folded_bias, beta)
        folded = call(convolution.target, x, folded_weight, folded_bias, *geometry)
    for user in list(norm.users):
        user.replace_all_uses_with(folded)
        graph.erase_node(user)
    graph.erase_node(norm)
    graph.erase_node(convolution)


# The ops of a convolution's input gradient ``(grad, input, kernel, *rest)`` by name, and
# whether ``rest`` asks for that alone (not transposed, no kernel or bias gradient).
_INPUT_GRADIENTS = {
    "aten.convolution_backward.default": lambda rest: not rest[4] and list(rest[-1]) == [True, False, False],
    "omenn.conv2d_input_grad.default": lambda rest: True,
}


def scale_gradients_not_kernels(graph: torch.fx.Graph) -> int:
    """In a traced explanation, take the input gradient of each convolution whose kernel is scaled
    per output channel (``W·s``: a BatchNorm folded in) as ``convᵀ(dy·s, W)`` instead of
    ``convᵀ(dy, W·s)``; returns the count.

    The two are equal, ``s`` scaling the output channels. The second keeps the folded kernel
    ``W·s`` from the forward until the backward, a second copy of every folded kernel at the
    memory peak; the first frees it after the forward convolution, and the scaling of ``dy``
    joins the elementwise kernel that produces ``dy``.
    """
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or str(node.target) not in _INPUT_GRADIENTS:
            continue
        grad, x, kernel, *rest = node.args
        split = _kernel_times_scale(kernel)
        if split is None or not isinstance(grad, torch.fx.Node) or not _INPUT_GRADIENTS[str(node.target)](rest):
            continue
        weight, scale = split
        if len({n.meta["val"].dtype if "val" in n.meta else None for n in (grad, weight, scale)}) != 1:
            continue
        # Without fake values: the trace's values come from several fake modes, and the
        # compiler traces the graph again.
        with graph.inserting_before(node):
            channels = graph.call_function(aten.view.default, (scale, [1, -1] + [1] * (weight.meta["val"].dim() - 2)))
            node.args = (graph.call_function(aten.mul.Tensor, (grad, channels)), x, weight, *rest)
        rewritten += 1
    if rewritten:
        graph.eliminate_dead_code()
        graph.lint()
    return rewritten


def _kernel_times_scale(kernel) -> tuple[torch.fx.Node, torch.fx.Node] | None:
    """``(W, s)`` where ``kernel`` is the folded ``W·s.view(-1, 1, …)`` with ``s`` one value per output channel."""
    if not isinstance(kernel, torch.fx.Node) or kernel.target is not aten.mul.Tensor or len(kernel.args) != 2:
        return None
    weight, scaled = kernel.args
    if not all(isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor) for n in (weight, scaled)):
        return None
    if scaled.target is not aten.view.default or not isinstance(scaled.args[0], torch.fx.Node):
        return None
    scale = scaled.args[0]
    value = scale.meta.get("val")
    kernel_shape = weight.meta["val"].shape
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.shape[0] != kernel_shape[0] \
            or list(scaled.meta["val"].shape) != [kernel_shape[0]] + [1] * (len(kernel_shape) - 1):
        return None
    return weight, scale
