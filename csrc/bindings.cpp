// The omenn_cpu kernels' registrations with the dispatcher (no Python module: the library is
// loaded with torch.ops.load_library, which runs these static registrations).
//
// The schemas of the compute ops are defined in Python (omenn_kernels/native.py,
// define_cpu_op), so that tracing and fake tensors work before this library is built; loading
// it registers their CPU kernels below, which the dispatcher then calls without entering Python.
//
// The packed convolutions' cache of reordered weights is managed by three ops defined here,
// schema and kernel: they are called from Python outside of traced graphs, and two of them take
// no tensor, so no backend key would reach a CPU kernel (a catch-all kernel serves every call).

#include <torch/library.h>

#include <string_view>

#include "omenn_cpu.h"

namespace {

at::Tensor activation_op(const at::Tensor& x, std::string_view kind, double slope) {
  return omenn_cpu::activation_forward(x, std::string(kind), slope);
}

at::Tensor activation_backward_op(const at::Tensor& grad, const at::Tensor& x,
                                  std::string_view kind, double slope) {
  return omenn_cpu::activation_backward(grad, x, std::string(kind), slope);
}

void check_pair(const char* name, c10::IntArrayRef value) {
  TORCH_CHECK(value.size() == 2, "conv2d_ones_backward_cpu: ", name,
              " must have two entries (height, width), got ", value);
}

at::Tensor conv2d_ones_backward_op(const at::Tensor& grad, const at::Tensor& grad_ones,
                                   const std::optional<at::Tensor>& bias,
                                   const at::Tensor& window_sum, c10::IntArrayRef input_size,
                                   c10::IntArrayRef kernel_size, c10::IntArrayRef stride,
                                   c10::IntArrayRef padding, c10::IntArrayRef dilation) {
  check_pair("input_size", input_size);
  check_pair("kernel_size", kernel_size);
  check_pair("stride", stride);
  check_pair("padding", padding);
  check_pair("dilation", dilation);
  return omenn_cpu::conv_bias_ones_backward(
      grad, bias, grad_ones, window_sum, input_size[0], input_size[1], kernel_size[0],
      kernel_size[1], stride[0], stride[1], padding[0], padding[1], dilation[0], dilation[1]);
}

}  // namespace

TORCH_LIBRARY_IMPL(omenn, CPU, m) {
  m.impl("activation_cpu", &activation_op);
  m.impl("activation_backward_cpu", &activation_backward_op);
  m.impl("conv2d_ones_backward_cpu", &conv2d_ones_backward_op);
  m.impl("attention_cpu", &omenn_cpu::attention_forward);
  m.impl("attention_backward_dv_cpu", &omenn_cpu::attention_backward_dv);
  m.impl("linear_ones_cpu", &omenn_cpu::linear_ones);
  m.impl("max_pool_indices_cpu", &omenn_cpu::max_pool_indices);
  m.impl("conv2d_packed_cpu", &omenn_cpu::conv2d_packed);
  m.impl("conv2d_input_grad_packed_cpu", &omenn_cpu::conv2d_input_grad_packed);
}

TORCH_LIBRARY_FRAGMENT(omenn, m) {
  // How many weights conv2d_packed_cpu and conv2d_input_grad_packed_cpu have reordered into
  // oneDNN's layout in this process.
  m.def("packed_weight_reorders() -> int", &omenn_cpu::packed_weight_reorders);
  // Drop every reordered weight kept; returns how many there were.
  m.def("clear_packed_weights() -> int", &omenn_cpu::clear_packed_weights);
  // Drop the reordered copies of one weight (every entry of its storage); returns how many.
  m.def("forget_packed_weight(Tensor weight) -> int", &omenn_cpu::forget_packed_weight);
}
