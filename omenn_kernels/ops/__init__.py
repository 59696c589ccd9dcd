"""The fused ops of the hot rules: one module per op, each with everything the op is.

Each module holds the op's ``torch.library`` registration, its fake (shape) function,
its autograd, its reference math and the entry points of its kernels:

======================  ===========================  ===============================  ==============================
module                  op (``torch.ops.omenn``)     CPU                              CUDA
======================  ===========================  ===============================  ==============================
``activation``          ``activation`` (R4)          ``csrc/activation.cpp``          ``triton_kernels/activation.py``
``conv_bias``           ``conv2d_ones`` (R2)         ``csrc/conv_bias.cpp``           ``triton_kernels/conv_bias.py``
                                                     (``csrc/conv_packed.cpp`` in
                                                     compiled graphs)
``attention``           ``attention`` (R6)           ``csrc/attention.cpp``           ``triton_kernels/attention.py``
``linear_ones``         ``linear_ones`` (R1)         ``csrc/linear_ones.cpp``         aten products
                                                     (aten products)
``batch_norm_ones``     ``batch_norm_ones`` (R3)     aten products                    aten products
``layer_norm_ones``     ``layer_norm_ones`` (R3')    ATen's LayerNorm                 ATen's LayerNorm
``max_pool``            ``max_pool_indices`` (R13')  ATen's max pooling               ATen's max pooling
                                                     (``csrc/max_pool.cpp`` in
                                                     compiled graphs)
======================  ===========================  ===============================  ==============================

Each op is a :class:`FusedOp` (decorator :func:`fused_op`): the ``torch.library`` op that
traces and dispatch modes see, called by the eager backends without the dispatcher's
Python. Ops with a Triton kernel are ``torch.library.triton_op``: under ``torch.compile`` Inductor
sees the Triton kernel itself (and CUDA graphs can capture it); on the CPU the same op
(and ``linear_ones``) calls an opaque op of its own (``activation_cpu``,
``conv2d_ones_backward_cpu``, ``linear_ones_cpu``, ...) whose
CPU kernel is the C++ function, registered with the dispatcher when the extension loads
(:func:`omenn_kernels.native.define_cpu_op`), so that a call runs no Python.

This package alone chooses where a fused op runs instead of a rule's reference math
(:mod:`omenn_kernels.linearize.rules`, which imports nothing from here): each module
gives :func:`fuse` its op's form of a rule and a ``can_fuse`` predicate, for the eager
backends, and :func:`traced_as_aten` says which ops a compiled explanation traces as their
aten math.
"""

from __future__ import annotations

import functools
import importlib.util
import warnings
from typing import Any, Callable, Iterable

import torch

from ..linearize.registry import Rule, attach_fused
from ..linearize.values import Gate, Live, reached


@functools.cache
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        warnings.warn("omenn_kernels: triton is not installed; the fused backend runs the "
                      "reference math on CUDA", RuntimeWarning, stacklevel=3)
        return False
    return True


def kernels_available(tensor: torch.Tensor) -> bool:
    """Whether a fused kernel exists for ``tensor``'s device (CPU: C++, CUDA: Triton)."""
    if tensor.device.type == "cpu":
        from ..native import available

        return available()
    if tensor.device.type == "cuda":
        return _triton_available()
    return False


def constants(*operands: Any) -> bool:
    """Whether no operand depends on the input (a fused op takes its weights as constants)."""
    return not any(isinstance(operand, (Live, Gate)) for operand in operands)


def fills_padding(ones: torch.Tensor) -> bool:
    """Whether R11' fills positions that only padding reaches, where a bias is added over
    ``ones`` (:func:`~omenn_kernels.linearize.values.reached`): the fused ops add it over the
    ones as they are, so the reference math runs there."""
    return reached(ones) is not ones


class FusedOp:
    """A fused op, registered with ``torch.library`` as ``torch.ops.omenn.<name>``, and the
    callable the rules call.

    A custom op called eagerly crosses the dispatcher into Python several times per call
    (its autograd kernel, a redispatch below autograd, its Python kernel, the aliasing
    checks), which on a small model costs as much as its arithmetic. Called where only
    eager PyTorch runs, this runs the op's own function under an ``autograd.Function``
    made of the op's own ``setup_context`` and ``backward``: the same numbers and the same
    autograd graph shape, without those crossings. Wherever something must see the op
    itself (a ``make_fx`` or Dynamo trace, fake tensors, a dispatch mode such as
    ``FlopCounterMode``, a functorch transform, a tensor subclass) the call is the op's.
    """

    def __init__(self, op, function: Callable[..., Any]) -> None:
        self.op = op
        self._function = function
        self._autograd: type[torch.autograd.Function] | None = None
        functools.update_wrapper(self, function)

    def register_fake(self, fake: Callable[..., Any]) -> Callable[..., Any]:
        """The op's fake (shapes from shapes); usable as a decorator."""
        self.op.register_fake(fake)
        return fake

    def register_autograd(self, backward: Callable[..., Any], *, setup_context: Callable[..., Any]) -> None:
        """The op's backward, for the op and for its eager form alike."""
        self.op.register_autograd(backward, setup_context=setup_context)
        function = self._function

        def forward(ctx, *args):  # with ctx, the faster form of autograd.Function.apply
            output = function(*args)
            setup_context(ctx, args, output)
            return output

        name = "".join(part.title() for part in function.__name__.split("_"))
        self._autograd = type(f"{name}Function", (torch.autograd.Function,),
                              {"forward": staticmethod(forward), "backward": staticmethod(backward)})

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs or self._autograd is None or _op_must_be_seen(args):
            return self.op(*args, **kwargs)
        if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
            return self._autograd.apply(*args)
        return self._function(*args)


def _op_must_be_seen(args: tuple) -> bool:
    """Whether a trace, a mode, a transform or a tensor subclass must see a call as the op's."""
    return (torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled()
            or torch._C._are_functorch_transforms_active() or torch.compiler.is_compiling()
            or any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN_TENSORS for a in args))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def fused_op(name: str, *, triton: bool = False) -> Callable[[Callable[..., Any]], FusedOp]:
    """Decorator: ``function`` as the :class:`FusedOp` ``name`` (``"omenn::<op>"``), a
    ``torch.library.triton_op`` where ``triton`` (its CUDA kernels are Triton's, which
    Inductor then sees), else a ``torch.library.custom_op``. Neither mutates its arguments."""
    def define(function: Callable[..., Any]) -> FusedOp:
        register = torch.library.triton_op if triton else torch.library.custom_op
        return FusedOp(register(name, function, mutates_args=()), function)
    return define


def fuse(ops: Iterable, can_fuse: Callable[..., bool], run: Callable[..., Any]) -> None:
    """Attach a fused op's form to the rules of the aten ``ops`` (``Rule.fused``).

    ``can_fuse(op, *args, **kwargs)``: whether the op applies to these operands (their kinds
    and shapes, a kernel for their device). ``run`` (the same arguments): the rule's result
    through the op, or None where R11' fills padded positions (:func:`fills_padding`). The
    rule's reference math runs wherever the op does not. ``run``'s backward must differentiate
    again: explanations differentiable with respect to the parameters run it too.
    """
    def fused_of(rule: Rule) -> Callable[..., Any]:
        def fused(op, *args, **kwargs):
            if can_fuse(op, *args, **kwargs):
                result = run(op, *args, **kwargs)
                if result is not None:
                    return result
            return rule.reference(op, *args, **kwargs)
        return fused
    attach_fused(ops, fused_of)


def traced_as_aten(device: torch.device, differentiable: bool = False) -> dict:
    """The fused ops that a compiled explanation on ``device`` traces as their aten math: a
    decomposition table for ``make_fx``, so that Inductor fuses them with their neighbours.

    A custom op reaches Inductor as an opaque call, with its inputs and outputs written to
    memory: an activation and the normalization before it are two passes over the
    activations where Inductor's own kernel makes one. LayerNorm's op is traced as aten on
    every device (ATen's LayerNorm and products, which Inductor fuses with their
    neighbours). On CUDA every op but attention (whose Triton kernels never write the T×T
    weights) and the convolution's ones backward (one Triton kernel where aten needs a
    window-sum convolution) is traced as aten. On the
    CPU the activations, the convolutions and the linear layers' input gradient are (a traced
    convolution is called by the compiled graph itself, not through a custom op's Python
    call); attention (``csrc/attention.cpp``, never the T×T weights), BatchNorm and the
    linear layers' forward stay opaque calls (traced, BatchNorm made a batch of ResNet-50
    slower, and the linear forward made Inductor's code generation several times slower);
    without a parameter gradient the linear forward is traced as its C++ op
    (``linear_ones_cpu``) and max pooling's arg-max as its own (``max_pool_indices_cpu``),
    which the compiled graph calls without the custom op's Python, and the convolutions' ones
    backward as its sum over channels in aten followed by the C++ op without a bias
    (:func:`~omenn_kernels.ops.conv_bias.ones_gradient_summed_in_aten`).

    A ``differentiable`` explanation (``create_graph``, differentiated again by AOTAutograd)
    keeps the convolutions' input gradient an op of its own, whose registered backward takes
    the weight's part as a weight gradient; differentiated as aten, it is a convolution over
    the batch, as in autograd's double backward of a convolution.
    """
    from ..native import available as native_available

    omenn = torch.ops.omenn
    table = {omenn.activation.default: activation.reference,
             omenn.activation_backward.default: activation.reference_backward,
             omenn.linear_input_grad.default: linear_ones.input_grad,
             omenn.conv2d_ones.default: conv_bias.value_and_ones,
             omenn.layer_norm_ones.default: layer_norm_ones.value_and_ones}
    if not differentiable:
        table[omenn.conv2d_input_grad.default] = conv_bias.input_grad
        if device.type == "cpu" and native_available():
            table[omenn.linear_ones.default] = linear_ones.value_and_ones_cpu
            table[omenn.conv2d_ones_backward.default] = conv_bias.ones_gradient_summed_in_aten
            table[omenn.max_pool_indices.default] = max_pool.max_pool_indices_cpu
    if device.type == "cuda":
        table.update({omenn.linear_ones.default: linear_ones.value_and_ones,
                      omenn.batch_norm_ones.default: batch_norm_ones.value,
                      omenn.batch_norm_ones_backward.default: batch_norm_ones.gradients})
    return table


def shape_only_outputs() -> dict:
    """For each fused op with an output that is a function of some arguments alone: output
    index → those arguments' indices, and the function of the op's arguments that computes the
    output from them, reading no more than the others' dtype. The output ones of
    ``conv2d_ones`` (``S > 0``) and of ``linear_ones`` (the mean of the input ones) depend on the
    ones and ``S`` only, so a compiled explanation folds them into constants where those are
    shape-only (:mod:`omenn_kernels.backends.shape_only`), without running the op."""
    omenn = torch.ops.omenn
    linear = {1: ((1,), lambda x, ones, *_: linear_ones.output_ones(ones))}
    return {omenn.conv2d_ones.default: {1: ((1, 2), lambda x, ones, window_sum, *_:
                                            conv_bias.output_ones(window_sum, x.dtype))},
            omenn.linear_ones.default: linear, omenn.linear_ones_cpu.default: linear}


# Each module attaches its op's form of a rule.
from . import activation, attention, batch_norm_ones, conv_bias, layer_norm_ones, linear_ones, max_pool  # noqa: E402

__all__ = ["FusedOp", "activation", "attention", "batch_norm_ones", "conv_bias", "constants", "fills_padding",
           "fuse", "fused_op", "kernels_available", "layer_norm_ones", "linear_ones", "max_pool", "shape_only_outputs",
           "traced_as_aten"]
