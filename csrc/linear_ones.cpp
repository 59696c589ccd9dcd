// R1 for a linear layer: (x·Wᵀ + b·Ō, Ō), Ō the mean of the ones over the contracted dim.
//
// ATen's products and reductions, the same calls as the op's aten math
// (omenn_kernels/ops/linear_ones.py, value_and_ones), so the results are equal. What the
// C++ kernel saves is the Python of a call: the op is called once per linear layer, and
// at small batches that Python cost as much as the product.

#include <ATen/core/Tensor.h>
#include <ATen/ops/linear.h>

#include "omenn_cpu.h"

namespace omenn_cpu {

std::tuple<at::Tensor, at::Tensor> linear_ones(const at::Tensor& x, const at::Tensor& ones,
                                               const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias) {
  at::Tensor ones_bar = ones.mean(-1, /*keepdim=*/true);
  at::Tensor value = at::linear(x, weight);
  if (bias.has_value() && bias->defined()) {
    value = value.add(bias->mul(ones_bar));
  }
  return {value, ones_bar};
}

}  // namespace omenn_cpu
