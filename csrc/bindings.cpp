// Python bindings of the omenn_cpu kernels.
//
// torch/csrc/utils/pybind.h brings pybind11 with torch's type casters (at::Tensor,
// std::optional) and compiles in about a third of the time of torch/extension.h, which
// also pulls in the whole C++ frontend that the bindings do not use.

#if __has_include(<torch/csrc/utils/pybind.h>)
#include <torch/csrc/utils/pybind.h>
#else
#include <torch/extension.h>
#endif

#include "omenn_cpu.h"

namespace py = pybind11;

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
}
