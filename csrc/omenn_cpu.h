// omenn_cpu: CPU kernels for the hot OMENN rules (see DESIGN.md §2–§3).
//
// R4  activation_forward / activation_backward: y = x·ξ(x), dx = dy·ξ(x), ξ recomputed.
// R2  conv_bias_ones_backward: the backward of a 2-D convolution's bias spread with a
//     per-position ones channel.
// R1  linear_ones: a linear layer's value with its bias carried by the mean of the ones.
// R6  attention_forward / attention_backward_dv: softmax attention and dV = Pᵀ·dO, P recomputed
//     one query row at a time.
// R13' max_pool_indices: the arg-max of each window of a max pooling.
// R2  conv2d_packed / conv2d_input_grad_packed: a float32 convolution and its input
//     gradient through oneDNN, each weight reordered once (a cache by weight and version).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <tuple>

namespace omenn_cpu {

// Checks that `t` is a defined CPU tensor of a supported floating dtype; `where` and
// `name` (the function and the argument) go into the error message.
inline void check_cpu_floating(const char* where, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), where, ": ", name, " is an undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), where, ": ", name, " must be a CPU tensor, got device ",
              t.device());
  const auto st = t.scalar_type();
  TORCH_CHECK_TYPE(st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16,
                   where, ": ", name, " must be float32, float64, float16 or bfloat16, got ",
                   st);
}

// y = x·ξ(x) elementwise, same dtype, shape and memory format (contiguous or channels-last) as x.
at::Tensor activation_forward(const at::Tensor& x, const std::string& kind, double slope);

// grad·ξ(x) elementwise, ξ recomputed from x; grad and x have the same shape and dtype; the
// result has x's memory format.
at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& x,
                               const std::string& kind, double slope);

// The ones channel's gradient (B, 1, H, W): r[b,p] = (Σ_c grad[b,c,p]·bias[c] +
// grad_ones_out[b,0,p]) / S[b,p] (0 where S == 0), summed at each input position q over the
// output positions p whose receptive field holds q. ph, pw are the padding before (top, left);
// the padding after is whatever Ho, Wo imply. Float32 (float64 when grad is float64); without
// a bias, grad gives only its shape and dtype.
at::Tensor conv_bias_ones_backward(const at::Tensor& grad, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& grad_ones_out,
                                   const at::Tensor& S, int64_t H, int64_t W, int64_t kh,
                                   int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                   int64_t dh, int64_t dw);

// (softmax((q·scale)·kᵀ + bias)·v, logsumexp) for (B, H, T, D) heads; out is (B, Tq, H, Dv)-major,
// lse float32 (float64 for float64 inputs); a fully masked row gives 0 and −inf.
std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const std::optional<at::Tensor>& bias,
                                                     double scale);

// dV = Pᵀ·grad with P = exp((q·scale)·kᵀ + bias − lse): (B, H, Tk, Dv) contiguous, grad's dtype.
at::Tensor attention_backward_dv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& grad,
                                 const at::Tensor& lse, const std::optional<at::Tensor>& bias,
                                 double scale);

// (x·Wᵀ + b·Ō, Ō) with Ō = mean of ones over its last dim, keepdim; without a bias x·Wᵀ.
std::tuple<at::Tensor, at::Tensor> linear_ones(const at::Tensor& x, const at::Tensor& ones,
                                               const at::Tensor& weight,
                                               const std::optional<at::Tensor>& bias);

// The flat arg-max of each window of a max pooling over the spatial dims of x (N, C, *spatial),
// channels-first and contiguous, as F.max_pool{1,2,3}d(..., return_indices=True) returns it
// (an empty stride: the kernel's).
at::Tensor max_pool_indices(const at::Tensor& x, at::IntArrayRef kernel, at::IntArrayRef stride,
                            at::IntArrayRef padding, at::IntArrayRef dilation, bool ceil_mode);

// conv2d(x, weight, bias) through oneDNN with the weight reordered once per weight version;
// float32, the output channels-last or contiguous as asked.
at::Tensor conv2d_packed(const at::Tensor& x, const at::Tensor& weight,
                         const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                         c10::IntArrayRef padding, c10::IntArrayRef dilation, int64_t groups,
                         bool channels_last);

// The input gradient (B, Cin, *input_size) of conv2d(x, weight) for the output gradient grad:
// the transposed convolution of grad with weight, through oneDNN as conv2d_packed.
at::Tensor conv2d_input_grad_packed(const at::Tensor& grad, const at::Tensor& weight,
                                    c10::IntArrayRef input_size, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    int64_t groups, bool channels_last);

// How many weights conv2d_packed and conv2d_input_grad_packed have reordered in this process
// (a replay of the same weights reorders none).
int64_t packed_weight_reorders();

// Drops every reordered weight kept (they are reordered again when next used); returns how
// many there were.
int64_t clear_packed_weights();

// Drops the reordered copies of `weight` (every entry of its storage); returns how many there were.
// For a change the version counter does not show: a write through `.data`.
int64_t forget_packed_weight(const at::Tensor& weight);

}  // namespace omenn_cpu
