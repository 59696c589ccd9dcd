// R1 for a linear layer: (x·Wᵀ + b·Ō, Ō), Ō the mean of the ones over the contracted dim.
//
// ATen's products and reductions, the same calls as the op's aten math
// (omenn_kernels/ops/linear_ones.py, value_and_ones), so the results are equal. What the
// C++ kernel saves is the Python of a call: the op is called once per linear layer, and
// at small batches that Python cost as much as the product.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>

#include "omenn_cpu.h"

namespace omenn_cpu {

std::tuple<at::Tensor, at::Tensor> linear_ones(const at::Tensor& x, const at::Tensor& ones,
                                               const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias) {
  at::Tensor ones_bar = ones.mean(-1, /*keepdim=*/true);
  if (!bias.has_value() || !bias->defined()) {
    return {at::linear(x, weight), ones_bar};
  }
  // b·Ō written first and the product accumulated onto it (β = 1): one pass over the output
  // besides the product's, as F.linear's copy of its bias.
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = 1;
  at::Tensor value = at::mul(ones_bar.expand(sizes), *bias);
  value.view({-1, weight.size(0)}).addmm_(x.reshape({-1, x.size(-1)}), weight.t());
  return {value, ones_bar};
}

}  // namespace omenn_cpu
