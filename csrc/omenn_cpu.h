// omenn_cpu: CPU kernels for the hot OMENN rules (see DESIGN.md §2–§3).
//
// R4  activation_forward / activation_backward: y = x·ξ(x), dx = dy·ξ(x), ξ recomputed.
// R2  bias_share / spread_bias_share / conv_bias_ones_backward: the backward of a 2-D
//     convolution's bias spread with a per-position ones channel.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace omenn_cpu {

// y = x·ξ(x) elementwise, same dtype and shape as x (contiguous).
at::Tensor activation_forward(const at::Tensor& x, const std::string& kind, double slope);

// grad·ξ(x) elementwise, ξ recomputed from x; grad and x have the same shape and dtype.
at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& x,
                               const std::string& kind, double slope);

// r[b,p] = (Σ_c grad[b,c,p]·bias[c] + grad_ones_out[b,0,p]) / S[b,p], 0 where S == 0.
// Returns (B, Ho, Wo), float32 (float64 when grad is float64).
at::Tensor bias_share(const at::Tensor& grad, const at::Tensor& bias,
                      const std::optional<at::Tensor>& grad_ones_out, const at::Tensor& S);

// out[b,0,q] = Σ over output positions p whose receptive field holds q of r[b,p].
// ph, pw are the padding before (top, left); the padding after is whatever Ho, Wo imply.
at::Tensor spread_bias_share(const at::Tensor& r, int64_t H, int64_t W, int64_t kh, int64_t kw,
                             int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                             int64_t dw);

// spread_bias_share(bias_share(grad, bias, grad_ones_out, S), ...): (B, 1, H, W).
at::Tensor conv_bias_ones_backward(const at::Tensor& grad, const at::Tensor& bias,
                                   const std::optional<at::Tensor>& grad_ones_out,
                                   const at::Tensor& S, int64_t H, int64_t W, int64_t kh,
                                   int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                   int64_t dh, int64_t dw);

}  // namespace omenn_cpu
