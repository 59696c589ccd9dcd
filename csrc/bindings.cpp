// Python bindings of the omenn_cpu kernels, and their CPU kernels for the dispatcher.
//
// The ops' schemas are defined in Python (omenn_kernels/native.py, define_cpu_op), so that
// tracing and fake tensors work before this extension is built; loading it registers the
// CPU kernels below, which the dispatcher then calls without entering Python.
//
// torch/csrc/utils/pybind.h brings pybind11 with torch's type casters (at::Tensor,
// std::optional) and compiles in about a third of the time of torch/extension.h, which
// also pulls in the whole C++ frontend that the bindings do not use.

#if __has_include(<torch/csrc/utils/pybind.h>)
#include <torch/csrc/utils/pybind.h>
#else
#include <torch/extension.h>
#endif

#include <torch/library.h>

#include <string_view>

#include "omenn_cpu.h"

namespace py = pybind11;

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "omenn_kernels CPU kernels: R4 detached activations and R2 conv-bias ones backward";
  const auto nogil = py::call_guard<py::gil_scoped_release>();

  m.def("activation_forward", &omenn_cpu::activation_forward, nogil,
        "y = x·ξ(x) for kind in gelu, gelu_tanh, silu, relu, leaky_relu, hardswish "
        "(slope: leaky_relu's negative slope)",
        py::arg("x"), py::arg("kind"), py::arg("slope") = 0.01);
  m.def("activation_backward", &omenn_cpu::activation_backward, nogil,
        "grad·ξ(x), ξ recomputed from x", py::arg("grad"), py::arg("x"), py::arg("kind"),
        py::arg("slope") = 0.01);

  m.def("bias_share", &omenn_cpu::bias_share, nogil,
        "r[b,p] = (Σ_c grad[b,c,p]·bias[c] + grad_ones_out[b,0,p]) / S[b,p] (0 where S == 0), "
        "shape (B, Ho, Wo); bias and grad_ones_out may be None (no bias: grad is not read)",
        py::arg("grad"), py::arg("bias"), py::arg("grad_ones_out"), py::arg("S"));
  m.def("spread_bias_share", &omenn_cpu::spread_bias_share, nogil,
        "grad_ones_in[b,0,q] = Σ over output positions p whose receptive field holds q of "
        "r[b,p]; shape (B, 1, H, W); ph, pw: padding before (top, left)",
        py::arg("r"), py::arg("H"), py::arg("W"), py::arg("kh"), py::arg("kw"), py::arg("sh"),
        py::arg("sw"), py::arg("ph"), py::arg("pw"), py::arg("dh"), py::arg("dw"));
  m.def("conv_bias_ones_backward", &omenn_cpu::conv_bias_ones_backward, nogil,
        "spread_bias_share(bias_share(grad, bias, grad_ones_out, S), H, W, ...): the ones "
        "channel's gradient (B, 1, H, W) of a conv's spread bias",
        py::arg("grad"), py::arg("bias"), py::arg("grad_ones_out"), py::arg("S"), py::arg("H"),
        py::arg("W"), py::arg("kh"), py::arg("kw"), py::arg("sh"), py::arg("sw"), py::arg("ph"),
        py::arg("pw"), py::arg("dh"), py::arg("dw"));
  m.def("packed_weight_reorders", &omenn_cpu::packed_weight_reorders,
        "how many weights the packed convolutions (conv2d_packed_cpu, conv2d_input_grad_packed_cpu) "
        "have reordered into oneDNN's layout in this process");
  m.def("clear_packed_weights", &omenn_cpu::clear_packed_weights,
        "drop every reordered weight the packed convolutions keep; returns how many there were");
  m.def("forget_packed_weight", &omenn_cpu::forget_packed_weight,
        "drop the reordered copies of one weight (every entry of its storage); returns how many there were");
}
