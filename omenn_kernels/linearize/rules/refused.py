"""Core aten operations that have no OMENN rule, each with the reason.

Every operation of PyTorch's core aten set has a rule in this package or an entry here
(``tests/linearize/test_core_aten_audit.py`` keeps it so). An operation listed here is
still computed wherever its operands are constants; only an input-dependent operand
makes the linearization stop, with an error that names this reason.
"""

from __future__ import annotations

import torch

from ..registry import refuse

aten = torch.ops.aten

_REASONS = (
    ([aten._log_softmax, aten.log_softmax],
     "log-softmax subtracts an input-dependent constant, log Σ exp, which no ones channel carries; "
     "explain the logits before it (the model's last linear layer, or output=)"),
    ([aten.argmax, aten.argmin],
     "an index chosen by the input's values is used as an index; amax, max(dim), sort and topk hold "
     "their selection (R1'), and max pooling its arg-max (R13')"),
    ([aten.nonzero], "its output's shape depends on the input's values"),
    ([aten.masked_scatter],
     "it fills the masked positions with the source's elements in order across the whole tensor, "
     "which mixes the samples of a batch"),
    ([aten._local_scalar_dense],
     "it reads an input-dependent value to the host (.item()): the model's control flow or shapes "
     "depend on the input, which one linearized graph cannot follow"),
    ([aten.as_strided],
     "arbitrary strides over the input's storage (possibly overlapping) have no per-position ones"),
    ([aten._fft_r2c, aten._fft_c2r],
     "its values are complex, and the ones channel is real"),
    ([aten.embedding, aten._embedding_bag],
     "it reads rows of a table by index: a table that depends on the input has no batch dimension "
     "to explain per sample; explain the model on its embeddings (feature_dim=-1)"),
    ([aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional],
     "batch normalization in training mode normalizes by the batch's statistics, which mix the "
     "samples: explain the model in eval mode (model.eval())"),
    ([aten.native_dropout], "dropout in training mode is random: explain the model in eval mode (model.eval())"),
    ([aten.rand, aten.randn, aten.randperm, aten.empty.memory_format, aten.empty_strided, aten.full,
      aten.arange, aten.scalar_tensor],
     "it creates a tensor from no input-dependent operand (always CONST)"),
    ([aten.convolution_backward, aten.embedding_dense_backward, aten.native_group_norm_backward,
      aten.native_layer_norm_backward, aten._adaptive_avg_pool2d_backward, aten.avg_pool2d_backward,
      aten.max_pool2d_with_indices_backward],
     "a backward operation, which a model's forward does not contain"),
)
for ops, why in _REASONS:
    refuse(ops, why)
