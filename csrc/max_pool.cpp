// R13' max pooling: the flat arg-max of each window over the spatial dims, as
// F.max_pool{1,2,3}d(..., return_indices=True) returns it, in x's layout (channels-last for
// channels-last images).
//
// ATen's pooling, the same calls as the op's Python kernel (omenn_kernels/ops/max_pool.py,
// indices), so the indices are equal. What the C++ kernel saves is the Python of a call,
// which at small sizes costs more than the pooling.

#include <ATen/core/Tensor.h>
#include <ATen/ops/max_pool1d_with_indices.h>
#include <ATen/ops/max_pool2d_with_indices.h>
#include <ATen/ops/max_pool3d_with_indices.h>

#include "omenn_cpu.h"

namespace omenn_cpu {

namespace {
// Channels from which ATen's CPU max pooling runs faster in channels-last memory, copy included
// (it vectorizes over the channels there); with fewer (an RGB image) the copy costs more.
constexpr int64_t kChannelsLastFrom = 16;
}  // namespace

at::Tensor max_pool_indices(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode) {
  const int64_t spatial = x.dim() - 2;
  TORCH_CHECK(spatial >= 1 && spatial <= 3,
              "max_pool_indices_cpu: x must have shape (N, C, *spatial) with 1 to 3 spatial "
              "dims, got ", x.sizes());
  if (spatial == 1) {
    return std::get<1>(at::max_pool1d_with_indices(x, kernel, stride, padding, dilation, ceil_mode))
        .contiguous();
  }
  if (spatial == 2) {
    // Indices in x's layout: channels-last for a channels-last x (not also contiguous).
    const auto layout = !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)
                            ? at::MemoryFormat::ChannelsLast
                            : at::MemoryFormat::Contiguous;
    const at::Tensor input =
        x.size(1) >= kChannelsLastFrom ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
    return std::get<1>(
               at::max_pool2d_with_indices(input, kernel, stride, padding, dilation, ceil_mode))
        .contiguous(layout);
  }
  return std::get<1>(at::max_pool3d_with_indices(x, kernel, stride, padding, dilation, ceil_mode))
      .contiguous();
}

}  // namespace omenn_cpu
