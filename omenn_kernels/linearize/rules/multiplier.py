"""R5': held multipliers — non-linear functions of LIVE values that only scale other LIVE values.

``y = x · g(x)`` with ``g`` computed normally, then held constant (a gate, as R5 holds
softmax and sigmoid results): RMS normalization ``x · rsqrt(mean(x²) + ε)``, global
response normalization ``x · (‖x‖ / mean ‖x‖)``, and gated MLPs ``(x W₂) ⊙ silu(x W₁)``,
where ``diag(silu(x W₁)) · W₂`` is the input-dependent weight. The graph walker decides
where an operation is such a multiplier (``Rule.multiplier_args``); everywhere else the
operations below have no linear form (no ``reference``) and the walker refuses them.
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
