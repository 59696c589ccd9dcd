"""R1: linear maps and matrix products with a CONST (or gate) operand.

``y = xW + b·Ō`` with ``Ō`` the mean of the ones over the contracted dimension.
A product of a gate with LIVE tokens (``A·V`` written out) is attention: R6.

Fused op ``omenn::linear_ones``: :mod:`omenn_kernels.ops.linear_ones`. Output features
that only feed gates (the query and key thirds of a fused ``qkv`` projection) receive no
gradient, for any input: the graph walker finds them once (``Rule.receiving``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..registry import Rule, RuleError, arguments, register
from ..values import Gate, Live, reached
from .attention import attended

aten = torch.ops.aten

_TWO_LIVE = RuleError("both operands of the matrix product depend on the input and neither is a "
                      "gate (softmax/sigmoid weights)", "R9 (a product of two LIVE tensors is unsupported)")


def _linear(op, *args, receiving: tuple[int, int] | None = None, model_result: torch.Tensor | None = None,
            **kwargs):
    """R1 for ``F.linear``: ``xWᵀ + b·Ō`` (autograd finds the receiving features itself); the
    reference computes the product itself, whatever ``model_result`` gives (its fused form takes it)."""
    x, weight, bias = arguments(op, args, kwargs)
    if not isinstance(x, Live) or isinstance(weight, (Live, Gate)) or isinstance(bias, (Live, Gate)):
        raise RuleError("the weight or bias of a linear layer depends on the input",
                        "R1 (CONST weight and bias)")
    value = F.linear(x.value, weight)
    ones = x.ones.mean(-1, keepdim=True)
    if bias is not None:
        ones = reached(ones)
        value = value + bias * ones
    return Live(value, ones)


def _right_constant(x: Live, weight: torch.Tensor, product) -> Live:
    """``x @ W`` with CONST ``W``: the ones are averaged over x's last (contracted) dim."""
    value = product(x.value, weight)
    if x.value.dim() == 1:
        return Live(value, x.ones.mean())
    return Live(value, x.ones.mean(-1, keepdim=weight.dim() > 1))


def _left_constant(weight: torch.Tensor, x: Live, product) -> Live:
    """``W @ x`` with CONST ``W``: the ones are averaged over x's contracted dim (-2)."""
    value = product(weight, x.value)
    if x.value.dim() == 1:
        return Live(value, x.ones.mean())
    return Live(value, x.ones.mean(-2, keepdim=weight.dim() > 1))


def _matmul(op, *args, **kwargs):
    """R1 for mm/bmm/matmul with one CONST operand; R6 when the other operand is a gate."""
    a, b = arguments(op, args, kwargs)[:2]
    if isinstance(a, Live) and isinstance(b, Live):
        raise _TWO_LIVE
    if isinstance(a, Gate) and a.value.dim() >= 2 and b.value.dim() >= 2:
        return attended(a.value, b)
    if isinstance(b, Gate) and a.value.dim() >= 2 and b.value.dim() >= 2:
        transposed = attended(b.value.transpose(-2, -1),
                              Live(a.value.transpose(-2, -1), a.ones.transpose(-2, -1)))
        return Live(transposed.value.transpose(-2, -1), transposed.ones.transpose(-2, -1))
    if isinstance(a, Live):
        return _right_constant(a, b, op)
    return _left_constant(a, b, op)


def _addmm(op, *args, receiving: tuple[int, int] | None = None, model_result: torch.Tensor | None = None,
           **kwargs):
    """R1 for ``β·bias + α·(m1 @ m2)`` with LIVE ``m1`` and CONST ``m2`` and bias (a ``Conv1D``
    layer): ``α·(m1 @ m2) + β·bias·Ō``, as :func:`_linear`."""
    bias, m1, m2, beta, alpha = arguments(op, args, kwargs)
    if not isinstance(m1, Live) or isinstance(m2, (Live, Gate)) or isinstance(bias, (Live, Gate)):
        raise RuleError("addmm is supported with a LIVE left factor and CONST weight and bias",
                        "R1 (CONST weight and bias)")
    ones = reached(m1.ones.mean(-1, keepdim=True))
    return Live(torch.addmm(beta * bias * ones, m1.value, m2, alpha=alpha), ones)


def _subscripts(equation: str) -> tuple[list[str], str]:
    """The letters of each operand and of the result of an explicit einsum equation."""
    equation = equation.replace(" ", "")
    if "->" not in equation or "..." in equation:
        raise RuleError(f"einsum equation {equation!r}: only explicit equations ('ij,jk->ik') without "
                        "ellipsis are linearized", "R1' (einsum with an explicit output)")
    inputs, output = equation.split("->")
    return inputs.split(","), output


def _einsum(op, *args, **kwargs):
    """R1' for einsum linear in its one LIVE operand.

    Every other operand CONST: the ones are averaged over the LIVE operand's contracted
    letters (as R1 over a matrix product's contracted dim) and broadcast over the
    result's other letters. A gate and a LIVE operand as a batched matrix product
    (``…ij,…jd->…id``, in any letter order): attention (R6), through the same rule as
    ``A·V`` written with ``matmul``.
    """
    equation, operands = arguments(op, args, kwargs)[:2]
    subscripts, output = _subscripts(equation)
    live = [i for i, operand in enumerate(operands) if isinstance(operand, Live)]
    if len(live) != 1:
        raise RuleError("more than one operand of the einsum depends on the input and none is a gate",
                        "R9 (a product of two LIVE tensors is unsupported)")
    (index,) = live
    x, letters = operands[index], subscripts[index]
    gates = [i for i, operand in enumerate(operands) if isinstance(operand, Gate)]
    if gates:
        return _gated_einsum(operands, subscripts, output, index, gates)
    value = torch.einsum(equation, *(operand.value if isinstance(operand, Live) else operand for operand in operands))
    kept = "".join(letter for letter in letters if letter in output)
    ones = x.ones.reshape((1,) * (x.value.dim() - x.ones.dim()) + tuple(x.ones.shape))
    sizes = dict(zip(letters, ones.shape))  # 1 along the letters the ones are shared on
    contracted = math.prod(sizes[letter] for letter in letters if letter not in output)
    ones = torch.einsum(f"{letters}->{kept}", ones) / contracted
    shape = [sizes[letter] if letter in kept else 1 for letter in output]
    order = [letter for letter in output if letter in kept]
    ones = ones.permute(*[kept.index(letter) for letter in order]).reshape(shape)
    return Live(value, ones)


def _gated_einsum(operands: list, subscripts: list[str], output: str, index: int, gates: list[int]) -> Live:
    """``A·V`` written as an einsum of a gate ``A`` and LIVE ``V``: permuted into ``matmul``'s
    layout, attended (R6), and permuted back."""
    if len(operands) != 2:
        raise RuleError("an einsum of a gate with more than one other operand", "R6 (A·V with a gate A)")
    gate, weights = subscripts[gates[0]], operands[gates[0]].value
    letters, values = subscripts[index], operands[index]
    contracted = [letter for letter in letters if letter in gate and letter not in output]
    batch = [letter for letter in output if letter in gate and letter in letters]
    query = [letter for letter in gate if letter not in letters]
    feature = [letter for letter in letters if letter not in gate]
    if len(contracted) != 1 or len(query) != 1 or len(feature) != 1 or \
            sorted(output) != sorted(batch + query + feature) or len(gate) != len(batch) + 2 or \
            len(letters) != len(batch) + 2:
        raise RuleError(f"the einsum {','.join(subscripts)}->{output} of a gate and a LIVE operand is not a batched "
                        "matrix product", "R6 (A·V with a gate A)")
    order_gate, order_values = batch + query + contracted, batch + contracted + feature
    to_gate = [gate.index(letter) for letter in order_gate]
    to_values = [letters.index(letter) for letter in order_values]
    ones = values.ones.expand(values.value.shape)
    product = attended(weights.permute(to_gate), Live(values.value.permute(to_values), ones.permute(to_values)))
    result = batch + query + feature
    back = [result.index(letter) for letter in output]
    return Live(product.value.permute(back), product.ones.permute(back))


register([aten.linear], Rule("R1 linear", _linear, receiving=True, takes_model_result=True))
register([aten.matmul, aten.mm, aten.bmm],
         Rule("R1 matrix product / R6 attention", _matmul, factor_args=(0, 1)))
register([aten.addmm], Rule("R1 linear", _addmm, receiving=True, takes_model_result=True))
register([aten.einsum], Rule("R1' einsum / R6 attention", _einsum, factor_args=(1,)))
