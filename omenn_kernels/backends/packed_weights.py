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

oneDNN sums in another order than ATen, which can flip a ReLU gate: before it compiles a
packed graph, the compiled backend explains its check's samples under
:class:`OneDNNConvolutions`, which computes eager ops as such a graph does.

The price is memory: one reordered copy of each such kernel per direction, kept until the
kernel's storage is freed (then dropped at the next packed call).
"""

from __future__ import annotations

import operator
from typing import Callable

import torch
from torch.fx import GraphModule, Node
from torch.utils._python_dispatch import TorchDispatchMode

from ..linearize.registry import arguments
from ..linearize.rules.conv import pair
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


class OneDNNConvolutions(TorchDispatchMode):
    """Eager ops computed as a packed graph computes them: each op of ``decompositions`` (the
    trace's table, :func:`~omenn_kernels.ops.traced_as_aten`) as its aten math, and in it and
    elsewhere each float32 2-D convolution of a 4-D kernel, and each input gradient taken
    alone, through the packed ops.

    The compiled backend explains its check's samples under it before it compiles a packed
    graph: whether oneDNN's summation order moves the explanation beyond the checks'
    tolerance is then learnt at the cost of a fused call of those samples, not of an
    uncompiled run of the whole batch. It runs below autograd: the ops it replaces keep their
    autograd nodes (the fused ops' registered backwards, ATen's convolution backward), whose
    backward ops it sees in turn. Every kernel is taken as a constant, as in a first-order
    explanation; window sums of the ones (the graph folds them) run packed too, exactly, as
    sums of ones.
    """

    def __init__(self, decompositions: dict[torch._ops.OpOverload, Callable]) -> None:
        super().__init__()
        self.decompositions = decompositions

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.decompositions:
            with self:  # off inside its own handler: on again for the math's ops
                return self.decompositions[func](*args, **kwargs)
        if func in (aten.conv2d.default, aten.convolution.default):
            if func is aten.conv2d.default:
                x, weight, bias, stride, padding, dilation, groups = arguments(func, args, kwargs)
                transposed, output_padding = False, [0]
            else:
                x, weight, bias, stride, padding, dilation, transposed, output_padding, groups = \
                    arguments(func, args, kwargs)
            if not transposed and not any(output_padding) and _packable_values(x, weight):
                return conv2d_packed_cpu(x, weight, bias, pair(stride), pair(padding), pair(dilation), groups,
                                         _atens_layout(x, weight))
        elif func is aten.convolution_backward.default:
            grad, x, weight, _bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = \
                arguments(func, args, kwargs)
            if list(mask) == [True, False, False] and not transposed and not any(output_padding) \
                    and _packable_values(grad, weight):
                return (conv2d_input_grad_packed_cpu(grad, weight, list(x.shape[2:]), stride, padding, dilation,
                                                     groups, _atens_layout(grad, weight)), None, None)
        return func(*args, **kwargs)


def _atens_layout(activation: torch.Tensor, kernel: torch.Tensor) -> bool:
    """Whether ATen's CPU convolution of these returns channels-last: where either is laid out so."""
    return any(t.is_contiguous(memory_format=torch.channels_last) and not t.is_contiguous()
               for t in (activation, kernel))


def _channels_last(value: object) -> bool | None:
    """Whether the traced result ``value`` is channels-last (False: contiguous; None: neither),
    the layout the packed op must return, as the graph after it was traced with it."""
    if not isinstance(value, torch.Tensor):
        return None
    if value.is_contiguous():
        return False
    return True if value.is_contiguous(memory_format=torch.channels_last) else None


def _packable(module: GraphModule, activation: object, weight: object) -> bool:
    """Whether a convolution of the graph's ``activation`` with ``weight`` can run packed: a
    kernel that the graph holds as a constant (or a detached view of one), and values that
    :func:`_packable_values` takes."""
    while isinstance(weight, Node) and weight.target in _ALIASES:
        weight = weight.args[0]
    if not isinstance(activation, Node) or not isinstance(weight, Node) or weight.op != "get_attr":
        return False
    return _packable_values(activation.meta.get("val"), operator.attrgetter(weight.target)(module))


def _packable_values(activation: object, kernel: object) -> bool:
    """Whether a convolution of ``activation`` with ``kernel`` can run packed: a float32 4-D
    activation and a float32 4-D CPU kernel with a version counter (an inference tensor has none)."""
    return (isinstance(activation, torch.Tensor) and activation.dim() == 4 and activation.dtype == torch.float32
            and isinstance(kernel, torch.Tensor) and kernel.dim() == 4 and kernel.dtype == torch.float32
            and kernel.device.type == "cpu" and not kernel.is_inference())
