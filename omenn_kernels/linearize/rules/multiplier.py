"""R5': held multipliers — non-linear functions of LIVE values that only scale other LIVE values.

``y = x · g(x)`` with ``g`` computed normally, then held constant (a gate, as R5 holds
softmax and sigmoid results): RMS normalization ``x · rsqrt(mean(x²) + ε)``, global
response normalization ``x · (‖x‖ / mean ‖x‖)``, and gated MLPs ``(x W₂) ⊙ silu(x W₁)``,
where ``diag(silu(x W₁)) · W₂`` is the input-dependent weight. The graph walker decides
where an operation is such a multiplier (``Rule.multiplier_args``); everywhere else the
operations below have no linear form (no ``reference``) and the walker refuses them.

Piecewise-constant functions (comparisons, logical and bitwise operations, rounding,
``sign``) are held multipliers too: a mask ``x > 0`` that multiplies ``x`` or chooses
between branches of ``where`` (``rules/selection.py``) is held like ReLU's ``ξ``; their
derivative is zero, so holding them changes no gradient.
"""

from __future__ import annotations

import torch

from ..registry import Rule, register

aten = torch.ops.aten


register([aten.rsqrt, aten.sqrt, aten.reciprocal, aten.exp, aten.log, aten.abs, aten.linalg_vector_norm,
          aten.norm, aten.erf],
         Rule("R5' held multiplier", None, multiplier_args=(0,)))
register([aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar],
         Rule("R5' held multiplier", None, multiplier_args=(0, 1)))
register([aten.log10, aten.log2, aten.acosh, aten.var.correction, aten.var.dim, aten.var.default,
          aten.prod.default, aten.prod.dim_int, aten._cdist_forward, aten._pdist_forward, aten.any],
         Rule("R5' held multiplier", None, multiplier_args=(0,)))
register([aten.atan2, aten.fmod, aten.remainder],
         Rule("R5' held multiplier", None, multiplier_args=(0, 1)))
register([aten.gt, aten.ge, aten.lt, aten.le, aten.eq, aten.ne, aten.logical_and, aten.logical_or,
          aten.logical_xor, aten.bitwise_and, aten.bitwise_or, aten.bitwise_xor],
         Rule("R5' held mask (piecewise constant)", None, multiplier_args=(0, 1)))
register([aten.logical_not, aten.bitwise_not, aten.isnan, aten.isinf, aten.sign, aten.floor, aten.ceil,
          aten.round, aten.trunc],
         Rule("R5' held mask (piecewise constant)", None, multiplier_args=(0,)))
