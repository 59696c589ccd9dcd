"""R3 and R3': normalizations.

R3 (BatchNorm in eval mode, per-channel affine maps): ``x·s + b'·O`` with
``s = γ/√(var+ε)`` and ``b' = β − mean·s``; the ones pass through.
R3' (LayerNorm, GroupNorm, RMSNorm): centring stays linear, ``1/σ`` (or 1/rms) is a
detached multiplier, ``γ`` scales and ``β`` is carried by ``Ō``, the mean of the ones
over the normalized dimensions.

Fused op ``omenn::batch_norm_ones`` (R3): the value ``x·s + b'`` without multiplying by
the ones (they are 1 wherever a shift is added, ``require_reached``), and a backward of
``dy·s`` for the input and ``Σ_c dy·b'`` for the ones, instead of the reference's
broadcast products and their gradients. Its backward is made of differentiable
products with ``s`` and ``b'``, so explanations differentiable with respect to the
parameters run it too.
"""

from __future__ import annotations

import torch

from ..registry import Rule, RuleError, arguments, register
from ..values import Live, full_ones, plain, require_reached, with_parameter_gradient

aten = torch.ops.aten


def _channel_view(param: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A per-channel (dim 1) parameter shaped to broadcast against ``like``."""
    return param.view(1, -1, *([1] * (like.dim() - 2)))


def batch_norm_affine(x: Live, weight, bias, running_mean, running_var, eps: float) -> Live:
    """R3: eval-mode BatchNorm as the per-channel affine map ``x·s + b'·O``."""
    scale, shift = _affine_of(weight, bias, running_mean, running_var, eps)
    require_reached(x.ones)
    value = x.value * _channel_view(scale, x.value) + _channel_view(shift, x.value) * x.ones
    return Live(value, x.ones)


def _affine_of(weight, bias, running_mean, running_var, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    scale = torch.rsqrt(running_var + eps)
    if weight is not None:
        scale = scale * weight
    shift = -running_mean * scale
    return scale, shift if bias is None else shift + bias


@torch.library.custom_op("omenn::batch_norm_ones", mutates_args=())
def batch_norm_ones(x: torch.Tensor, ones: torch.Tensor, scale: torch.Tensor,
                    shift: torch.Tensor) -> torch.Tensor:
    """R3's value ``x·s + b'`` (the ones are 1 wherever they are used).

    Rounded as the reference rounds it (no fused multiply-add): a last-bit difference
    can flip a later ReLU whose input is within rounding of 0.
    """
    return x * _channel_view(scale, x) + _channel_view(shift, x)


@batch_norm_ones.register_fake
def _batch_norm_ones_fake(x, ones, scale, shift):
    return torch.empty_like(x)


def _batch_norm_ones_setup(ctx, inputs, output) -> None:
    _x, ones, scale, shift = inputs
    ctx.ones_shape = ones.shape
    ctx.save_for_backward(scale, shift)


@torch.library.custom_op("omenn::batch_norm_ones_backward", mutates_args=())
def batch_norm_ones_backward(grad: torch.Tensor, scale: torch.Tensor,
                             shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """R3's backward with ones shared per pixel: ``dy·s`` and ``Σ_c dy·b'`` (N, 1, H, W)."""
    grad_x = grad * _channel_view(scale, grad)
    # Σ_c dy·b' per pixel as one batched vector-matrix product (~9× faster than a 1×1
    # convolution to a single channel on CPU).
    per_pixel = torch.matmul(shift.to(grad.dtype), grad.flatten(2))
    return grad_x, per_pixel.view(grad.shape[0], 1, *grad.shape[2:])


@batch_norm_ones_backward.register_fake
def _batch_norm_ones_backward_fake(grad, scale, shift):
    return torch.empty_like(grad), grad.new_empty(grad.shape[0], 1, *grad.shape[2:])


def _batch_norm_ones_backward_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _batch_norm_ones_backward_grad(ctx, grad_grad_x, grad_grad_ones):
    """Linear in ``dy``, ``s`` and ``b'``: ``d(dy) = ddx·s + b'·ddo`` in one product-sum (and
    in the input's memory layout, where autograd's outer product of ``b'`` would be
    channels-last), ``ds = Σ ddx·dy`` and ``db' = Σ dy·ddo``."""
    grad, scale, shift = ctx.saved_tensors
    grad_grad = grad_scale = grad_shift = None
    if ctx.needs_input_grad[0]:
        grad_grad = torch.addcmul(grad_grad_x * _channel_view(scale, grad),
                                  _channel_view(shift, grad).to(grad.dtype), grad_grad_ones)
    if ctx.needs_input_grad[1]:
        grad_scale = (grad_grad_x * grad).sum((0, 2, 3)).to(scale.dtype)
    if ctx.needs_input_grad[2]:
        per_channel = torch.matmul(grad.flatten(2), grad_grad_ones.flatten(1).unsqueeze(-1))
        grad_shift = per_channel.sum((0, 2)).to(shift.dtype)
    return grad_grad, grad_scale, grad_shift


batch_norm_ones_backward.register_autograd(_batch_norm_ones_backward_grad,
                                           setup_context=_batch_norm_ones_backward_setup)


def _batch_norm_ones_grad(ctx, grad):
    scale, shift = ctx.saved_tensors
    if len(ctx.ones_shape) == 4 and ctx.ones_shape[1] == 1:  # ones shared by the channels
        grad_x, grad_ones = batch_norm_ones_backward(grad, scale, shift)
        return grad_x, grad_ones.sum_to_size(ctx.ones_shape), None, None
    grad_x = grad * _channel_view(scale, grad)
    if len(ctx.ones_shape) > 1 and ctx.ones_shape[1] == 1:
        grad_ones = (grad * _channel_view(shift, grad)).sum(1, keepdim=True)
    else:
        grad_ones = grad * _channel_view(shift, grad)
    return grad_x, grad_ones.sum_to_size(ctx.ones_shape), None, None


batch_norm_ones.register_autograd(_batch_norm_ones_grad, setup_context=_batch_norm_ones_setup)


def _affine_gradients(x: torch.Tensor):
    reduced = [0, *range(2, x.dim())]
    return lambda grad: ((grad * x).sum(reduced), grad.sum(reduced))


def _fused_batch_norm_no_training(op, *args, value_gradient: bool = False, **kwargs):
    x, weight, bias, mean, var, _momentum, eps = arguments(op, args, kwargs)
    require_reached(x.ones)
    scale, shift = _affine_of(weight, bias, mean, var, eps)
    empty = x.value.new_empty(0)
    value = batch_norm_ones(x.value, x.ones, scale, shift)
    if value_gradient:  # the gradient of s and b' on a node of its own (Rule.fused_differentiable)
        value = with_parameter_gradient(value, (scale, shift), _affine_gradients(x.value.detach()))
    return Live(value, x.ones), empty, empty


def _batch_norm_no_training(op, *args, **kwargs):
    x, weight, bias, mean, var, _momentum, eps = arguments(op, args, kwargs)
    out = batch_norm_affine(x, weight, bias, mean, var, eps)
    empty = x.value.new_empty(0)
    return out, empty, empty


def _batch_norm(op, *args, **kwargs):
    x, weight, bias, mean, var, training, _momentum, eps, _cudnn = arguments(op, args, kwargs)
    if training or mean is None:
        raise RuleError("batch normalization with batch statistics (training mode) mixes the "
                        "samples of a batch", "R3 (eval-mode BatchNorm with running statistics)")
    return batch_norm_affine(x, weight, bias, mean, var, eps)


def normalized(x: Live, dims: list[int], weight, bias, eps: float, centre: bool = True) -> Live:
    """R3': ``(x − mean)·stopgrad(1/σ)·γ + β·Ō`` over ``dims`` (RMS form when not ``centre``)."""
    value = x.value
    frozen = plain(x)
    if centre:
        value = value - value.mean(dims, keepdim=True)
        # The mean of squared deviations, not Tensor.var: equal, and ~7× faster on CPU.
        deviation = frozen - frozen.mean(dims, keepdim=True)
        inverse_scale = torch.rsqrt(deviation.pow(2).mean(dims, keepdim=True) + eps)
    else:
        inverse_scale = torch.rsqrt(frozen.pow(2).mean(dims, keepdim=True) + eps)
    value = value * inverse_scale
    if weight is not None:
        value = value * weight
    ones = x.ones.mean(dims, keepdim=True)
    if bias is not None:
        require_reached(ones)
        value = value + bias * ones
    return Live(value, ones)


def _layer_norm(op, *args, **kwargs):
    x, shape, weight, bias, eps = arguments(op, args, kwargs)[:5]
    dims = list(range(-len(shape), 0))
    out = normalized(x, dims, weight, bias, eps)
    if op is aten.native_layer_norm.default:
        empty = x.value.new_empty(0)
        return out, empty, empty
    return out


def _rms_norm(op, *args, **kwargs):
    x, shape, weight, eps = arguments(op, args, kwargs)
    eps = torch.finfo(x.value.dtype).eps if eps is None else eps
    return normalized(x, list(range(-len(shape), 0)), weight, None, eps, centre=False)


def _grouped(x: Live, groups: int, weight, bias, eps: float) -> Live:
    batch = x.value.shape[0]
    as_groups = Live(x.value.reshape(batch, groups, -1), full_ones(x).reshape(batch, groups, -1),
                     plain(x).reshape(batch, groups, -1))
    out = normalized(as_groups, [-1], None, None, eps)
    value = out.value.reshape(x.value.shape)
    ones = out.ones.expand(out.value.shape).reshape(x.value.shape)
    if weight is not None:
        value = value * _channel_view(weight, value)
    if bias is not None:
        value = value + _channel_view(bias, value) * ones
    return Live(value, ones)


def _group_norm(op, *args, **kwargs):
    x, groups, weight, bias, eps, _cudnn = arguments(op, args, kwargs)
    return _grouped(x, groups, weight, bias, eps)


def _native_group_norm(op, *args, **kwargs):
    x, weight, bias, _n, _c, _hw, groups, eps = arguments(op, args, kwargs)
    empty = x.value.new_empty(0)
    return _grouped(x, groups, weight, bias, eps), empty, empty


register([aten._native_batch_norm_legit_no_training],
         Rule("R3 BatchNorm (eval)", _batch_norm_no_training, _fused_batch_norm_no_training,
              fused_differentiable=True, held_multipliers=False))
register([aten.batch_norm], Rule("R3 BatchNorm (eval)", _batch_norm, held_multipliers=False))
register([aten.layer_norm, aten.native_layer_norm], Rule("R3' LayerNorm", _layer_norm))
register([aten.rms_norm], Rule("R3' RMSNorm", _rms_norm))
register([aten.group_norm], Rule("R3' GroupNorm", _group_norm))
register([aten.native_group_norm], Rule("R3' GroupNorm", _native_group_norm))
