"""The audit of PyTorch's core aten operations: each has an OMENN rule or a recorded reason.

The core set is what ``torch.export`` decompositions lower every model to, so a new
core operation in a PyTorch release makes this test fail until it is given a rule or a
reason (``omenn_kernels/linearize/rules/refused.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from omenn_kernels import UnsupportedOpError, explain
from omenn_kernels.linearize import registry
from omenn_kernels.linearize.rules import refused  # noqa: F401  (registers the reasons)


def _core_operations() -> list[torch._ops.OpOverload]:
    """Functional overloads tagged core (no ``out=`` and no in-place variants).

    Listed from every registered aten schema: ``dir(torch.ops.aten)`` shows only the
    packets that the process has touched so far."""
    names = {schema.name.split("::")[1] for schema in torch._C._jit_get_all_schemas()
             if schema.name.startswith("aten::")}
    found = []
    for name in sorted(names):
        packet = getattr(torch.ops.aten, name, None)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            schema = op._schema
            if torch.Tag.core in op.tags and not schema.name.endswith("_") \
                    and not any(argument.is_out for argument in schema.arguments):
                found.append(op)
    return found


def test_every_core_operation_has_a_rule_or_a_reason():
    core = _core_operations()
    assert len(core) > 150  # the tag is still there
    neither = [str(op) for op in core if registry.lookup(op) is None and registry.refusal(op) is None]
    assert neither == []


def test_no_operation_has_both_a_rule_and_a_refusal():
    both = [str(op) for op in registry._REFUSED if registry.lookup(op) is not None]
    assert both == []


class LogSoftmaxHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3).double()

    def forward(self, x):
        return torch.log_softmax(self.head(x), dim=-1)


class ArgMaxIndex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3).double()

    def forward(self, x):
        return self.head(x).gather(1, x.argmax(1, keepdim=True).clamp(max=2)).expand(-1, 3)


@pytest.mark.parametrize("model, reason", [(LogSoftmaxHead(), r"log_softmax.*log Σ exp.*explain the logits"),
                                           (ArgMaxIndex(), r"argmax.*an index chosen by the input's values")],
                         ids=["log_softmax", "argmax"])
def test_a_refused_operation_names_its_reason(model, reason):
    with pytest.raises(UnsupportedOpError, match=reason):
        explain(model, torch.randn(2, 6, dtype=torch.float64), 0)
