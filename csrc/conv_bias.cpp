// R2 backward: a 2-D convolution's bias spread with a per-position ones channel.
//
// Forward (not here): the output got bias[c]·Ō[p], Ō = S/stopgrad(S), S[b,p] the sum of
// the ones O (B,1,H,W) over output position p's receptive field (padding counts 0).
// Backward (conv_bias_ones_backward, the kernel of omenn::conv2d_ones_backward_cpu), in two steps:
//   bias_share:        r[b,p] = (Σ_c grad[b,c,p]·bias[c] + grad_ones_out[b,0,p]) / S[b,p]
//                      (0 where S == 0); a bias-free convolution reads no grad, only
//                      grad_ones_out.
//   spread_bias_share: grad_ones_in[b,0,q] = Σ_{p : q ∈ field(p)} r[b,p], a gather per
//                      input position over the kernel taps.
// The ones path is float32, or float64 when grad (for bias_share) or r (for the spread)
// is float64; half and bfloat16 gradients are read and accumulated in float.

#include "omenn_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>

#include <algorithm>
#include <vector>

namespace omenn_cpu {
namespace {

constexpr int64_t kGrain = 32768;  // elementary operations per parallel task, at least
constexpr int64_t kChunk = 1024;   // output positions per bias_share task

// A per-position map: (B, 1, Ho, Wo) or (B, Ho, Wo).
void check_position_map(const char* where, const char* name, const at::Tensor& t, int64_t B,
                        int64_t Ho, int64_t Wo) {
  check_cpu_floating(where, name, t);
  const bool ok = (t.dim() == 4 && t.size(0) == B && t.size(1) == 1 && t.size(2) == Ho &&
                   t.size(3) == Wo) ||
                  (t.dim() == 3 && t.size(0) == B && t.size(1) == Ho && t.size(2) == Wo);
  TORCH_CHECK(ok, where, ": ", name, " must have shape (B, 1, Ho, Wo) = (", B, ", 1, ", Ho, ", ",
              Wo, ") (or (B, Ho, Wo)), got ", t.sizes());
}

struct Span {  // input positions q0, q0 + s, ... (n of them) read outputs p0, p0 + 1, ...
  int64_t q0 = 0, p0 = 0, n = 0;
};

// For one kernel tap at offset `tap` (= tap index · dilation) along an axis with Q input and
// P output positions, stride s and padding-before pad: the input positions q with
// u = q + pad − tap ≥ 0, u ≡ 0 (mod s), u/s < P, and p = u/s.
Span tap_span(int64_t Q, int64_t P, int64_t s, int64_t pad, int64_t tap) {
  int64_t lo = std::max<int64_t>(pad - tap, 0);
  lo = (lo + s - 1) / s * s;
  const int64_t hi = std::min<int64_t>(Q - 1 + pad - tap, (P - 1) * s);
  Span span;
  if (hi < lo) return span;
  span.q0 = lo - pad + tap;
  span.p0 = lo / s;
  span.n = (hi - lo) / s + 1;
  return span;
}

void check_geometry(const char* where, int64_t H, int64_t W, int64_t Ho, int64_t Wo, int64_t kh,
                    int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                    int64_t dw) {
  TORCH_CHECK(H >= 1 && W >= 1, where, ": H and W must be positive, got H=", H, ", W=", W);
  TORCH_CHECK(kh >= 1 && kw >= 1, where, ": kernel size must be positive, got (", kh, ", ", kw,
              ")");
  TORCH_CHECK(sh >= 1 && sw >= 1, where, ": stride must be positive, got (", sh, ", ", sw, ")");
  TORCH_CHECK(dh >= 1 && dw >= 1, where, ": dilation must be positive, got (", dh, ", ", dw,
              ")");
  TORCH_CHECK(ph >= 0 && pw >= 0, where, ": padding must be non-negative, got (", ph, ", ", pw,
              ")");
  TORCH_CHECK(Ho >= 1 && Wo >= 1, where, ": the output must be non-empty, got Ho=", Ho,
              ", Wo=", Wo);
  // The padding after the input is implied by Ho: any of need, ..., need + s − 1 gives Ho
  // outputs. None of them may be negative.
  const int64_t need_h = (Ho - 1) * sh + dh * (kh - 1) + 1 - H - ph;
  const int64_t need_w = (Wo - 1) * sw + dw * (kw - 1) + 1 - W - pw;
  TORCH_CHECK(need_h + sh - 1 >= 0 && need_w + sw - 1 >= 0, where, ": output size (Ho=", Ho,
              ", Wo=", Wo, ") is too small for input (H=", H, ", W=", W, ") with kernel (", kh,
              ", ", kw, "), stride (", sh, ", ", sw, "), padding (", ph, ", ", pw,
              ") and dilation (", dh, ", ", dw, ")");
}

template <class scalar_t, class acc_t>
void bias_share_kernel(const scalar_t* grad, const acc_t* bias, const acc_t* gout,
                       const acc_t* S, acc_t* r, int64_t B, int64_t C, int64_t P) {
  const int64_t chunks = (P + kChunk - 1) / kChunk;
  // Without a bias (bias == nullptr) the channel reduction, the read of grad, is skipped.
  const int64_t channels = bias != nullptr ? C : 0;
  const int64_t per_task = std::min(P, kChunk) * std::max<int64_t>(channels, 1);
  const int64_t grain = std::max<int64_t>(1, kGrain / std::max<int64_t>(per_task, 1));
  at::parallel_for(0, B * chunks, grain, [&](int64_t begin, int64_t end) {
    acc_t acc[kChunk];
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / chunks;
      const int64_t start = (t % chunks) * kChunk;
      const int64_t n = std::min(kChunk, P - start);
      for (int64_t k = 0; k < n; ++k) acc[k] = acc_t(0);
      // Channels outer, positions inner: each grad row is read contiguously.
      for (int64_t c = 0; c < channels; ++c) {
        const acc_t bc = bias[c];
        const scalar_t* row = grad + (b * C + c) * P + start;
        for (int64_t k = 0; k < n; ++k) acc[k] += static_cast<acc_t>(row[k]) * bc;
      }
      const int64_t off = b * P + start;
      if (gout != nullptr) {
        for (int64_t k = 0; k < n; ++k) acc[k] += gout[off + k];
      }
      for (int64_t k = 0; k < n; ++k) {
        const acc_t s = S[off + k];
        r[off + k] = s != acc_t(0) ? acc[k] / s : acc_t(0);
      }
    }
  });
}

template <class acc_t>
void spread_kernel(const acc_t* r, acc_t* out, int64_t B, int64_t H, int64_t W, int64_t Ho,
                   int64_t Wo, int64_t kh, int64_t kw, int64_t sh, int64_t sw, int64_t ph,
                   int64_t pw, int64_t dh, int64_t dw) {
  std::vector<Span> rows(kh), cols(kw);
  for (int64_t i = 0; i < kh; ++i) rows[i] = tap_span(H, Ho, sh, ph, i * dh);
  for (int64_t j = 0; j < kw; ++j) cols[j] = tap_span(W, Wo, sw, pw, j * dw);
  const int64_t per_row = W + kh * kw * ((W + sw - 1) / sw);
  const int64_t grain = std::max<int64_t>(1, kGrain / per_row);
  at::parallel_for(0, B * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / H;
      const int64_t qh = t % H;
      acc_t* o = out + t * W;
      for (int64_t q = 0; q < W; ++q) o[q] = acc_t(0);
      for (int64_t i = 0; i < kh; ++i) {
        const Span& rs = rows[i];
        const int64_t d = qh - rs.q0;
        if (rs.n == 0 || d < 0 || d % sh != 0 || d / sh >= rs.n) continue;
        const acc_t* rrow = r + (b * Ho + rs.p0 + d / sh) * Wo;
        for (int64_t j = 0; j < kw; ++j) {
          const Span& cs = cols[j];
          acc_t* dst = o + cs.q0;
          const acc_t* src = rrow + cs.p0;
          if (sw == 1) {
            for (int64_t k = 0; k < cs.n; ++k) dst[k] += src[k];
          } else {
            for (int64_t k = 0; k < cs.n; ++k) dst[k * sw] += src[k];
          }
        }
      }
    }
  });
}

at::ScalarType ones_dtype(at::ScalarType st) {
  return st == at::kDouble ? at::kDouble : at::kFloat;
}

// The errors name the op that reaches these functions.
constexpr const char* kWhere = "conv2d_ones_backward_cpu";

at::Tensor bias_share(const at::Tensor& grad, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& grad_ones_out, const at::Tensor& S) {
  constexpr const char* where = kWhere;
  check_cpu_floating(where, "grad", grad);
  TORCH_CHECK(grad.dim() == 4, where, ": grad must have shape (B, Cout, Ho, Wo), got ",
              grad.sizes());
  const int64_t B = grad.size(0), C = grad.size(1), Ho = grad.size(2), Wo = grad.size(3);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    check_cpu_floating(where, "bias", *bias);
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == C, where,
                ": bias must have shape (Cout,) = (", C, ",), got ", bias->sizes());
  }
  check_position_map(where, "S", S, B, Ho, Wo);
  const bool has_gout = grad_ones_out.has_value() && grad_ones_out->defined();
  if (has_gout) check_position_map(where, "grad_ones_out", *grad_ones_out, B, Ho, Wo);

  const auto acc = ones_dtype(grad.scalar_type());
  if (has_bias && !grad.is_contiguous() && grad.is_contiguous(at::MemoryFormat::ChannelsLast)) {
    // Channels-last memory holds one row of C channels per position: Σ_c grad_c·b_c is one
    // matrix-vector product over the (B·Ho·Wo, C) rows, read in place.
    at::Tensor summed =
        at::mv(grad.permute({0, 2, 3, 1}).reshape({B * Ho * Wo, C}).to(acc), bias->to(acc));
    if (has_gout) summed.add_(grad_ones_out->to(acc).reshape({-1}));
    return bias_share(grad, std::nullopt, summed.view({B, Ho, Wo}), S);
  }
  // grad is read only for a bias: a bias-free call does not copy a strided grad either.
  at::Tensor g = grad, bc;
  if (has_bias) {
    g = grad.contiguous();
    bc = bias->to(acc).contiguous();
  }
  const at::Tensor sc = S.to(acc).contiguous();
  at::Tensor goc;
  if (has_gout) goc = grad_ones_out->to(acc).contiguous();
  at::Tensor r = at::empty({B, Ho, Wo}, grad.options().dtype(acc));
  if (r.numel() == 0) return r;
  const int64_t P = Ho * Wo;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), where, [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    bias_share_kernel<scalar_t, acc_t>(has_bias ? g.const_data_ptr<scalar_t>() : nullptr,
                                       has_bias ? bc.const_data_ptr<acc_t>() : nullptr,
                                       has_gout ? goc.const_data_ptr<acc_t>() : nullptr,
                                       sc.const_data_ptr<acc_t>(), r.mutable_data_ptr<acc_t>(),
                                       B, C, P);
  });
  return r;
}

at::Tensor spread_bias_share(const at::Tensor& r, int64_t H, int64_t W, int64_t kh, int64_t kw,
                             int64_t sh, int64_t sw, int64_t ph, int64_t pw, int64_t dh,
                             int64_t dw) {
  constexpr const char* where = kWhere;
  check_cpu_floating(where, "r", r);
  TORCH_CHECK(r.dim() == 3 || (r.dim() == 4 && r.size(1) == 1), where,
              ": r must have shape (B, Ho, Wo) or (B, 1, Ho, Wo), got ", r.sizes());
  const int64_t B = r.size(0), Ho = r.size(r.dim() - 2), Wo = r.size(r.dim() - 1);
  check_geometry(where, H, W, Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw);
  const auto acc = ones_dtype(r.scalar_type());
  const at::Tensor rc = r.to(acc).contiguous();
  at::Tensor out = at::empty({B, 1, H, W}, r.options().dtype(acc));
  if (B == 0) return out;
  if (acc == at::kDouble) {
    spread_kernel<double>(rc.const_data_ptr<double>(), out.mutable_data_ptr<double>(), B, H, W,
                          Ho, Wo, kh, kw, sh, sw, ph, pw, dh, dw);
  } else {
    spread_kernel<float>(rc.const_data_ptr<float>(), out.mutable_data_ptr<float>(), B, H, W, Ho,
                         Wo, kh, kw, sh, sw, ph, pw, dh, dw);
  }
  return out;
}

}  // namespace

at::Tensor conv_bias_ones_backward(const at::Tensor& grad, const std::optional<at::Tensor>& bias,
                                   const std::optional<at::Tensor>& grad_ones_out,
                                   const at::Tensor& S, int64_t H, int64_t W, int64_t kh,
                                   int64_t kw, int64_t sh, int64_t sw, int64_t ph, int64_t pw,
                                   int64_t dh, int64_t dw) {
  constexpr const char* where = kWhere;
  check_cpu_floating(where, "grad", grad);
  TORCH_CHECK(grad.dim() == 4, where, ": grad must have shape (B, Cout, Ho, Wo), got ",
              grad.sizes());
  // Check the geometry before the reduction, so a wrong call fails fast.
  check_geometry(where, H, W, grad.size(2), grad.size(3), kh, kw, sh, sw, ph, pw, dh, dw);
  return spread_bias_share(bias_share(grad, bias, grad_ones_out, S), H, W, kh, kw, sh, sw, ph,
                           pw, dh, dw);
}

}  // namespace omenn_cpu
