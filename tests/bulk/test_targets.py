"""Target specifications: parsing, checks, resolution to class pairs and read-out weights."""

import pytest
import torch

from omenn_kernels.bulk.targets import NO_CLASS, parse_targets, readout_weights
from omenn_kernels.errors import TargetError


def test_parse_counts_and_items():
    spec = parse_targets("predicted, label,7,top3,3-5,label-predicted")
    assert spec.count == 1 + 1 + 1 + 3 + 1 + 1
    assert spec.items == (("class", "predicted"), ("class", "label"), ("class", 7), ("top", 3),
                          ("contrast", 3, 5), ("contrast", "label", "predicted"))
    assert spec.needs_labels
    assert not parse_targets("top2,predicted").needs_labels


@pytest.mark.parametrize("text, message", [
    ("", "empty"), ("  ", "empty"), ("best", "unknown target"), ("top0", "k ≥ 1"), ("3-3", "itself"),
    ("-3", "unknown target"), ("3-", "unknown target"), ("predicted,,top", "unknown target"),
])
def test_parse_rejects(text, message):
    with pytest.raises(TargetError, match=message):
        parse_targets(text)


def test_check_range_and_labels():
    with pytest.raises(TargetError, match="out of range"):
        parse_targets("10").check(10, has_labels=False)
    with pytest.raises(TargetError, match="out of range"):
        parse_targets("1-12").check(10, has_labels=False)
    with pytest.raises(TargetError, match="more classes"):
        parse_targets("top11").check(10, has_labels=False)
    with pytest.raises(TargetError, match="no labels"):
        parse_targets("label").check(10, has_labels=False)
    parse_targets("9,top10,label-0").check(10, has_labels=True)


def test_resolve_pairs():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 1.0, 4.0]])
    labels = torch.tensor([2, 3])
    pairs = parse_targets("predicted,label,0,top2,label-predicted,1-label").resolve(logits, labels)
    n = NO_CLASS
    expected = torch.tensor([
        [[1, n], [2, n], [0, n], [1, n], [2, n], [2, 1], [1, 2]],
        [[0, n], [3, n], [0, n], [0, n], [3, n], [3, 0], [1, 3]],
    ])
    assert torch.equal(pairs, expected)


def test_resolve_label_needs_every_label():
    with pytest.raises(TargetError, match="folder label"):
        parse_targets("label").resolve(torch.zeros(2, 4), torch.tensor([1, -1]))
    with pytest.raises(TargetError, match="out of range"):
        parse_targets("label").resolve(torch.zeros(2, 4), torch.tensor([1, 4]))


def test_readout_weights_read_out_the_pairs():
    pairs = torch.tensor([[[1, NO_CLASS], [2, 0]], [[3, 1], [0, NO_CLASS]]])
    weights = readout_weights(pairs, 4, torch.float64)
    logits = torch.randn(2, 4, dtype=torch.float64)
    readout = (weights * logits.unsqueeze(1)).sum(-1)
    expected = torch.stack([torch.stack([logits[0, 1], logits[0, 2] - logits[0, 0]]),
                            torch.stack([logits[1, 3] - logits[1, 1], logits[1, 0]])])
    assert torch.equal(readout, expected)
