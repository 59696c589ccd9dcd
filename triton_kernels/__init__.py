"""Triton kernels for the hot OMENN rules and their thin host launch wrappers."""

from .attention import attention_backward_dv, attention_forward
from .activation import activation_backward, activation_forward
from .conv_bias import bias_share, conv_bias_ones_backward, spread_bias_share
