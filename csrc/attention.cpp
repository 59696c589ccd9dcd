// R6: attention with its weights held constant, for the CPU.
//
//   forward   out = P·V,  P = softmax(S),  S = Q·(K·scale)ᵀ + bias,  lse = log Σ_j exp(S_ij)
//   backward  dV  = Pᵀ·dO, P = exp(S − lse) recomputed from Q, K and lse
//
// One (batch, head) pair per task. Its (K·scale)ᵀ (D × Tk) is copied once, so that a query
// row's scores are vectors over the keys, and four query rows share each load of it. P
// exists for four rows of Tk values at a time, in cache, never as a T×T block. Per query
// row: Tk·D multiply-adds for the scores, Tk exponentials, Tk·Dv multiply-adds for P·V (or
// for Pᵀ·dO): the arithmetic of the written-out products without their passes over T×T
// memory. float32 uses ATen's exp_u20 (20 ULP, as ATen's own CPU flash attention), float64
// the 1-ULP exp; float16 and bfloat16 are computed in float32.
//
// q, k, v, grad: (B, H, T, D) with any strides but a unit stride along D (the heads of a fused
// qkv projection are read in place). bias: additive, broadcastable to (B, H, Tq, Tk), or none.
// A fully masked row (every score −inf) gives out 0 and lse −inf, and adds nothing to dV.

#include "omenn_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace omenn_cpu {
namespace {

template <typename T>
using Vec = at::vec::Vectorized<T>;

template <typename T>
inline Vec<T> fast_exp(const Vec<T>& x) {
  if constexpr (std::is_same_v<T, float>) {
    return x.exp_u20();
  } else {
    return x.exp();
  }
}

// Strided views of one 4-D operand: element (b, h, t, d) at data + b·sb + h·sh + t·st + d.
template <typename T>
struct Heads {
  const T* data;
  int64_t sb, sh, st;
  Heads(const at::Tensor& t)
      : data(t.const_data_ptr<T>()), sb(t.stride(0)), sh(t.stride(1)), st(t.stride(2)) {}
  const T* row(int64_t b, int64_t h, int64_t t) const { return data + b * sb + h * sh + t * st; }
};

// (K·scale)ᵀ of one head, (D × Tk), into kt: scaled once here, not in every row's products.
template <typename T>
void transpose_keys(const Heads<T>& k, int64_t b, int64_t h, int64_t tk, int64_t d, T scale,
                    T* kt) {
  for (int64_t j = 0; j < tk; ++j) {
    const T* key = k.row(b, h, j);
    for (int64_t c = 0; c < d; ++c) kt[c * tk + j] = key[c] * scale;
  }
}

// The scores of R query rows (R ≤ kRows), s[r·tk + j] = q_r·(k_j·scale) + bias_r[j], two Vecs
// of keys at a time: each Vec of kt is loaded once for the R rows, and the 2·R sums are
// independent chains of multiply-adds (enough to cover their latency).
template <typename T, int R>
void scores_rows(const T* const* q, const T* kt, int64_t d, int64_t tk, const T* const* bias,
                 int64_t bias_stride, T* s) {
  using V = Vec<T>;
  constexpr int64_t W = V::size();
  int64_t j = 0;
  for (; j + 2 * W <= tk; j += 2 * W) {
    V low[R], high[R];
    for (int r = 0; r < R; ++r) low[r] = high[r] = V(T(0));
    for (int64_t c = 0; c < d; ++c) {
      const V key_low = V::loadu(kt + c * tk + j), key_high = V::loadu(kt + c * tk + j + W);
      for (int r = 0; r < R; ++r) {
        const V query(q[r][c]);
        low[r] = at::vec::fmadd(query, key_low, low[r]);
        high[r] = at::vec::fmadd(query, key_high, high[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      low[r].store(s + r * tk + j);
      high[r].store(s + r * tk + j + W);
    }
  }
  for (; j < tk; j += W) {
    const int64_t lanes = std::min<int64_t>(W, tk - j);
    V acc[R];
    for (int r = 0; r < R; ++r) acc[r] = V(T(0));
    for (int64_t c = 0; c < d; ++c) {
      const V key = V::loadu(kt + c * tk + j, lanes);
      for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(V(q[r][c]), key, acc[r]);
    }
    for (int r = 0; r < R; ++r) acc[r].store(s + r * tk + j, lanes);
  }
  if (bias[0] != nullptr) {
    for (int r = 0; r < R; ++r)
      for (int64_t key = 0; key < tk; ++key) s[r * tk + key] += bias[r][key * bias_stride];
  }
}

// p = exp(s − shift) in place over one row; returns Σ p, summed in a Vec (a scalar sum would
// chain one addition per key).
template <typename T>
T exp_shifted(T* s, int64_t tk, T shift) {
  using V = Vec<T>;
  V total(T(0));
  const V by(shift);
  int64_t j = 0;
  for (; j + V::size() <= tk; j += V::size()) {
    const V p = fast_exp(V::loadu(s + j) - by);
    p.store(s + j);
    total = total + p;
  }
  if (j < tk) {
    const int64_t lanes = tk - j;
    const V p = fast_exp(V::loadu(s + j, lanes) - by);
    p.store(s + j, lanes);
    total = total + V::set(V(T(0)), p, lanes);  // the lanes past the row hold exp(−shift)
  }
  return at::vec::vec_reduce_all<T>([](V& a, V& b) { return a + b; }, total);
}

struct Sizes {
  int64_t batch, heads, tq, tk, d, dv;
};

constexpr int kRows = 4;  // query rows per block: four independent multiply-add chains

// The bias row of (b, h, i) and its stride along the keys, or nullptr.
template <typename T>
const T* bias_row(const at::Tensor& bias, int64_t b, int64_t h, int64_t i, int64_t& stride) {
  if (!bias.defined()) return nullptr;
  stride = bias.stride(3);
  return bias.const_data_ptr<T>() + b * bias.stride(0) + h * bias.stride(1) + i * bias.stride(2);
}

// The scores of the query rows i0 … i0+R−1 of (b, h) into s (R × tk).
template <typename T, int R>
void block_scores(const Heads<T>& q, const T* kt, const at::Tensor& bias, const Sizes& n,
                  int64_t b, int64_t h, int64_t i0, T* s) {
  const T* rows[R];
  const T* bias_rows[R];
  int64_t stride = 0;
  for (int r = 0; r < R; ++r) {
    rows[r] = q.row(b, h, i0 + r);
    bias_rows[r] = bias_row<T>(bias, b, h, i0 + r, stride);
  }
  scores_rows<T, R>(rows, kt, n.d, n.tk, bias_rows, stride, s);
}

// out rows i0 … i0+R−1 of (b, h) and their lse; s: R × tk scratch.
template <typename T, int R>
void forward_block(const Heads<T>& q, const T* kt, const Heads<T>& v, const at::Tensor& bias,
                   const Sizes& n, int64_t b, int64_t h, int64_t i0, T* s, T* out, int64_t ost,
                   T* lse) {
  using V = Vec<T>;
  block_scores<T, R>(q, kt, bias, n, b, h, i0, s);
  T inverse[R];
  for (int r = 0; r < R; ++r) {
    T* row = s + r * n.tk;
    const T top =
        at::vec::reduce_all<T>([](V& a, V& c) { return at::vec::maximum(a, c); }, row, n.tk);
    if (top == -std::numeric_limits<T>::infinity()) {  // every key masked: out 0, lse −inf
      std::fill(row, row + n.tk, T(0));
      inverse[r] = T(0);
      lse[i0 + r] = top;
      continue;
    }
    const T total = exp_shifted(row, n.tk, top);
    inverse[r] = T(1) / total;
    lse[i0 + r] = top + std::log(total);
  }
  for (int64_t c = 0; c < n.dv; c += V::size()) {
    const int64_t lanes = std::min<int64_t>(V::size(), n.dv - c);
    // Even and odd keys in separate sums: 2·R independent chains of multiply-adds.
    V even[R], odd[R];
    for (int r = 0; r < R; ++r) even[r] = odd[r] = V(T(0));
    int64_t j = 0;
    for (; j + 2 <= n.tk; j += 2) {
      const V x0 = V::loadu(v.row(b, h, j) + c, lanes);
      const V x1 = V::loadu(v.row(b, h, j + 1) + c, lanes);
      for (int r = 0; r < R; ++r) {
        even[r] = at::vec::fmadd(V(s[r * n.tk + j]), x0, even[r]);
        odd[r] = at::vec::fmadd(V(s[r * n.tk + j + 1]), x1, odd[r]);
      }
    }
    if (j < n.tk) {
      const V x0 = V::loadu(v.row(b, h, j) + c, lanes);
      for (int r = 0; r < R; ++r) even[r] = at::vec::fmadd(V(s[r * n.tk + j]), x0, even[r]);
    }
    for (int r = 0; r < R; ++r)
      ((even[r] + odd[r]) * V(inverse[r])).store(out + (i0 + r) * ost + c, lanes);
  }
}

// Adds the rows i0 … i0+R−1 of (b, h) to dv (Tk × Dv, contiguous); s: R × tk scratch.
template <typename T, int R>
void backward_dv_block(const Heads<T>& q, const T* kt, const Heads<T>& grad, const T* lse,
                       const at::Tensor& bias, const Sizes& n, int64_t b, int64_t h,
                       int64_t i0, T* s, T* dv) {
  using V = Vec<T>;
  block_scores<T, R>(q, kt, bias, n, b, h, i0, s);
  bool masked[R];
  for (int r = 0; r < R; ++r) {
    T* row = s + r * n.tk;
    // A fully masked row: P = 0, and its gradient (whatever it holds) is not read.
    masked[r] = lse[i0 + r] == -std::numeric_limits<T>::infinity();
    if (masked[r]) {
      std::fill(row, row + n.tk, T(0));
    } else {
      exp_shifted(row, n.tk, lse[i0 + r]);
    }
  }
  for (int64_t c = 0; c < n.dv; c += V::size()) {
    const int64_t lanes = std::min<int64_t>(V::size(), n.dv - c);
    V g[R];
    for (int r = 0; r < R; ++r)
      g[r] = masked[r] ? V(T(0)) : V::loadu(grad.row(b, h, i0 + r) + c, lanes);
    for (int64_t j = 0; j < n.tk; ++j) {
      T* target = dv + j * n.dv + c;
      V x = V::loadu(target, lanes);
      for (int r = 0; r < R; ++r) x = at::vec::fmadd(V(s[r * n.tk + j]), g[r], x);
      x.store(target, lanes);
    }
  }
}

// Runs block<R>(i0) over the query rows in blocks of kRows, the last one shorter.
template <typename Block>
void over_row_blocks(int64_t tq, const Block& block) {
  int64_t i0 = 0;
  for (; i0 + kRows <= tq; i0 += kRows) block(std::integral_constant<int, kRows>{}, i0);
  switch (tq - i0) {
    case 3: block(std::integral_constant<int, 3>{}, i0); break;
    case 2: block(std::integral_constant<int, 2>{}, i0); break;
    case 1: block(std::integral_constant<int, 1>{}, i0); break;
    default: break;
  }
}

template <typename T>
void forward_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& bias, double scale_, const Sizes& n, at::Tensor& out,
                    at::Tensor& lse) {
  const Heads<T> qs(q), ks(k), vs(v);
  const T scale = static_cast<T>(scale_);
  T* out_data = out.data_ptr<T>();
  T* lse_data = lse.data_ptr<T>();  // contiguous (B, H, Tq)
  const int64_t osb = out.stride(0), osh = out.stride(1), ost = out.stride(2);
  at::parallel_for(0, n.batch * n.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> kt(n.d * n.tk), s(kRows * n.tk);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / n.heads, h = pair % n.heads;
      transpose_keys(ks, b, h, n.tk, n.d, scale, kt.data());
      T* out_head = out_data + b * osb + h * osh;
      T* lse_head = lse_data + pair * n.tq;
      over_row_blocks(n.tq, [&](auto rows, int64_t i0) {
        forward_block<T, decltype(rows)::value>(qs, kt.data(), vs, bias, n, b, h, i0, s.data(),
                                                out_head, ost, lse_head);
      });
    }
  });
}

template <typename T>
void backward_dv_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& grad,
                        const at::Tensor& lse, const at::Tensor& bias, double scale_,
                        const Sizes& n, at::Tensor& dv) {
  const Heads<T> qs(q), ks(k), gs(grad);
  const T scale = static_cast<T>(scale_);
  const T* lse_data = lse.const_data_ptr<T>();  // contiguous (B, H, Tq)
  T* dv_data = dv.data_ptr<T>();                // contiguous (B, H, Tk, Dv)
  at::parallel_for(0, n.batch * n.heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> kt(n.d * n.tk), s(kRows * n.tk);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / n.heads, h = pair % n.heads;
      T* dv_head = dv_data + pair * n.tk * n.dv;
      std::fill(dv_head, dv_head + n.tk * n.dv, T(0));
      transpose_keys(ks, b, h, n.tk, n.d, scale, kt.data());
      over_row_blocks(n.tq, [&](auto rows, int64_t i0) {
        backward_dv_block<T, decltype(rows)::value>(qs, kt.data(), gs, lse_data + pair * n.tq,
                                                    bias, n, b, h, i0, s.data(), dv_head);
      });
    }
  });
}

void check_heads(const char* where, const char* name, const at::Tensor& t) {
  check_cpu_floating(where, name, t);
  TORCH_CHECK(t.dim() == 4, where, ": ", name, " must be (B, H, T, D), got shape ", t.sizes());
}

// The sizes of q (B, H, Tq, D), k (B, H, Tk, D) and the values or gradient (B, H, T, Dv), checked
// to be heads of one batch and one head count, q and k of one head size.
Sizes checked_sizes(const char* where, const at::Tensor& q, const at::Tensor& k, const char* name,
                    const at::Tensor& values) {
  check_heads(where, "q", q);
  check_heads(where, "k", k);
  check_heads(where, name, values);
  const Sizes n{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), values.size(3)};
  TORCH_CHECK(k.size(0) == n.batch && k.size(1) == n.heads && k.size(3) == n.d &&
                  values.size(0) == n.batch && values.size(1) == n.heads,
              where, ": q ", q.sizes(), ", k ", k.sizes(), " and ", name, " ", values.sizes(),
              " are not heads (B, H, T, D) of one batch and head count, q and k of one head size");
  return n;
}

// A unit stride along the last dim (views of other strides are read in place), in `work`.
at::Tensor rows_of(const at::Tensor& t, at::ScalarType work) {
  at::Tensor r = t.scalar_type() == work ? t : t.to(work);
  return r.size(-1) <= 1 || r.stride(-1) == 1 ? r : r.contiguous();
}

at::ScalarType work_type(const at::Tensor& t) {
  return t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor bias_4d(const char* where, const std::optional<at::Tensor>& bias, const Sizes& n,
                   at::ScalarType work) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  check_cpu_floating(where, "bias", *bias);
  TORCH_CHECK(bias->dim() <= 4, where, ": bias must have at most 4 dims, got ", bias->sizes());
  at::Tensor b = bias->to(work);
  std::vector<int64_t> shape(4 - b.dim(), 1);
  shape.insert(shape.end(), b.sizes().begin(), b.sizes().end());
  return b.view(shape).expand({n.batch, n.heads, n.tq, n.tk});
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                                     const at::Tensor& v,
                                                     const std::optional<at::Tensor>& bias,
                                                     double scale) {
  const Sizes n = checked_sizes("attention_cpu", q, k, "v", v);
  TORCH_CHECK(v.size(2) == n.tk, "attention_cpu: v ", v.sizes(), " does not have the ", n.tk,
              " tokens of k ", k.sizes());
  const at::ScalarType work = work_type(q);
  const at::Tensor qw = rows_of(q, work), kw = rows_of(k, work), vw = rows_of(v, work);
  const at::Tensor bw = bias_4d("attention_cpu", bias, n, work);
  // (B, Tq, H, Dv)-major: the layout in which the model's next reshape (heads → features) is
  // a view.
  at::Tensor out =
      at::empty({n.batch, n.tq, n.heads, n.dv}, q.options().dtype(work)).transpose(1, 2);
  at::Tensor lse = at::empty({n.batch, n.heads, n.tq}, q.options().dtype(work));
  if (n.tk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<double>::infinity());
  } else if (n.tq > 0) {
    AT_DISPATCH_FLOATING_TYPES(work, "attention_cpu", [&] {
      forward_kernel<scalar_t>(qw, kw, vw, bw, scale, n, out, lse);
    });
  }
  if (q.scalar_type() != work) out = out.to(q.scalar_type());
  return {out, lse};
}

at::Tensor attention_backward_dv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& grad,
                                 const at::Tensor& lse, const std::optional<at::Tensor>& bias,
                                 double scale) {
  const Sizes n = checked_sizes("attention_backward_dv_cpu", q, k, "grad", grad);
  TORCH_CHECK(grad.size(2) == n.tq && lse.dim() == 3 && lse.size(0) == n.batch &&
                  lse.size(1) == n.heads && lse.size(2) == n.tq,
              "attention_backward_dv_cpu: grad ", grad.sizes(), " and lse ", lse.sizes(),
              " do not match q ", q.sizes());
  const at::ScalarType work = work_type(q);
  const at::Tensor qw = rows_of(q, work), kw = rows_of(k, work), gw = rows_of(grad, work);
  const at::Tensor lw = lse.to(work).contiguous();
  const at::Tensor bw = bias_4d("attention_backward_dv_cpu", bias, n, work);
  at::Tensor dv = at::empty({n.batch, n.heads, n.tk, n.dv}, grad.options().dtype(work));
  if (n.tq == 0 || n.tk == 0) {
    dv.zero_();
  } else {
    AT_DISPATCH_FLOATING_TYPES(work, "attention_backward_dv_cpu", [&] {
      backward_dv_kernel<scalar_t>(qw, kw, gw, lw, bw, scale, n, dv);
    });
  }
  return grad.scalar_type() == work ? dv : dv.to(grad.scalar_type());
}

}  // namespace omenn_cpu
