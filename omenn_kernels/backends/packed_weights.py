"""oneDNN convolutions with weights reordered once, for a compiled explanation's constant kernels (CPU).

ATen's CPU convolution either reorders its float32 kernel into oneDNN's blocked layout at
every call or, at small batches, runs an im2col product; its input gradient likewise.
A first-order explanation's graph holds its kernels as constants (``get_attr``: the
parameters themselves, or the folded kernels of
:mod:`~omenn_kernels.backends.parameter_only`), so the reordering can happen once:
:func:`pack_constant_convolutions` has each float32 2-D convolution of a constant kernel,
and each of their input gradients, call ``omenn::conv2d_packed_cpu`` and
``omenn::conv2d_input_grad_packed_cpu`` (:mod:`omenn_kernels.ops.conv_bias`,
``csrc/conv_packed.cpp``): ATen's oneDNN convolution and transposed convolution on a
reordered copy of the kernel, which the C++ side keeps until the kernel changes (its
version counter or storage), so that optimizer steps and refreshed folded kernels are seen;
a replay reorders nothing. A write through ``.data`` moves neither: the compiled backend
watches the values of the model's own kernels that the packed ops read
(:func:`constant_kernels`, :mod:`~omenn_kernels.backends.watched`) and has their
reordered copies dropped (:func:`forget_reordered_kernel`) when they changed.

The price is memory: one reordered copy of each such kernel per direction, kept until the
kernel's storage is freed (then dropped at the next packed call).
"""

from __future__ import annotations

import operator

import torch
from torch.fx import GraphModule, Node

from ..native import available as native_available, load_cpu_kernels
from ..ops.conv_bias import conv2d_input_grad_packed_cpu, conv2d_packed_cpu

aten = torch.ops.aten

# Views that share their base's storage and version counter, as the packed ops' cache keys them.
_ALIASES = {aten.detach.default, aten.alias.default}


def packing_available() -> bool:
    """Whether this PyTorch has ATen's oneDNN convolutions and the C++ kernels load."""
    ops = ("_convolution_pointwise", "_convolution_transpose_pointwise", "_reorder_convolution_weight",
           "_reorder_convolution_transpose_weight")
    return (torch.backends.mkldnn.is_available() and all(hasattr(torch.ops.mkldnn, op) for op in ops)
            and native_available())


def forget_reordered_kernels() -> None:
    """Drop every reordered kernel kept (a graph that will not run keeps none alive; the
    others are reordered again at their next call)."""
    load_cpu_kernels()  # which defines the op
    torch.ops.omenn.clear_packed_weights()


def forget_reordered_kernel(kernel: torch.Tensor) -> None:
    """Drop the reordered copies of ``kernel``: reordered again at their next call."""
    load_cpu_kernels()
    torch.ops.omenn.forget_packed_weight(kernel)


def constant_kernels(module: GraphModule) -> list[torch.Tensor]:
    """The constant kernels that ``module``'s packed convolutions read, each once."""
    kernels: dict[int, torch.Tensor] = {}
    for node in module.graph.nodes:
        if node.target in (conv2d_packed_cpu, conv2d_input_grad_packed_cpu):
            weight = node.args[1]
            while weight.target in _ALIASES:
                weight = weight.args[0]
            kernel = operator.attrgetter(weight.target)(module)
            kernels[id(kernel)] = kernel
    return list(kernels.values())


def pack_constant_convolutions(module: GraphModule) -> int:
    """Replace ``module``'s float32 2-D convolutions of a constant kernel, and their input
    gradients, by the packed ops, each returning the layout the traced op returned; returns how
    many were replaced. The graph is changed in place and recompiled."""
    graph = module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.convolution.default:
            x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = node.args
            layout = _channels_last(node.meta.get("val"))
            if transposed or any(output_padding) or layout is None or not _packable(module, x, weight):
                continue
            with graph.inserting_before(node):
                packed = graph.call_function(conv2d_packed_cpu,
                                             (x, weight, bias, stride, padding, dilation, groups, layout))
            packed.meta.update(node.meta)
            node.replace_all_uses_with(packed)
            graph.erase_node(node)
            replaced += 1
        elif node.target is aten.convolution_backward.default:
            grad, x, weight, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = \
                node.args
            outputs = list(node.users)
            if list(mask) != [True, False, False] or transposed or any(output_padding) \
                    or not _packable(module, grad, weight) \
                    or any(user.target is not operator.getitem or user.args[1] != 0 for user in outputs):
                continue
            layout = _channels_last(outputs[0].meta.get("val")) if outputs else None
            if layout is None:
                continue
            with graph.inserting_before(node):
                packed = graph.call_function(conv2d_input_grad_packed_cpu,
                                             (grad, weight, list(x.meta["val"].shape[2:]), stride, padding,
                                              dilation, groups, layout))
            for output in outputs:
                packed.meta.update(output.meta)
                output.replace_all_uses_with(packed)
                graph.erase_node(output)
            graph.erase_node(node)
            replaced += 1
    if replaced:
        graph.lint()
        module.recompile()
    return replaced


def _channels_last(value: object) -> bool | None:
    """Whether the traced result ``value`` is channels-last (False: contiguous; None: neither),
    the layout the packed op must return, as the graph after it was traced with it."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_contiguous():
        return False
    return True if value.is_contiguous(memory_format=torch.channels_last) else None


def _packable(module: GraphModule, activation: object, weight: object) -> bool:
    """Whether a convolution of ``activation`` with ``weight`` can run packed: a float32 4-D
    activation and a float32 4-D CPU kernel that the graph holds as a constant (or a detached
    view of one) with a version counter (an inference tensor has none)."""
    while isinstance(weight, Node) and weight.target in _ALIASES:
        weight = weight.args[0]
    if not isinstance(activation, Node) or not isinstance(weight, Node) or weight.op != "get_attr":
        return False
    value = activation.meta.get("val")
    kernel = operator.attrgetter(weight.target)(module)
    return (isinstance(value, torch.Tensor) and value.dim() == 4 and value.dtype == torch.float32
            and isinstance(kernel, torch.Tensor) and kernel.dim() == 4 and kernel.dtype == torch.float32
            and kernel.device.type == "cpu" and not kernel.is_inference())
