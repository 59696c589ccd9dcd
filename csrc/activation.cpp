// R4: elementwise activations with a detached multiplier ξ.
//
//   forward   y  = x·ξ(x)
//   backward  dx = dy·ξ(x)      (ξ recomputed from x; nothing else is saved)
//
// Every supported kind has f(0) = 0, so the rule's f(0)·O term vanishes. The kind is
// dispatched once, outside the loop (each kind is a type), so the inner loop is a plain
// elementwise loop the compiler can vectorize where ξ has no libm call (relu,
// leaky_relu, hardswish). For float32, GELU, tanh-GELU and SiLU — whose ξ needs erfc or
// exp — use ATen's SIMD vectors (Sleef), as PyTorch's own kernels do, when the build
// targets AVX2 (see omenn_kernels/native.py). Half and bfloat16 are computed in float,
// float64 in double.

#include "omenn_cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace omenn_cpu {
namespace {

constexpr const char* kKinds = "gelu, gelu_tanh, silu, relu, leaky_relu, hardswish";
constexpr int64_t kGrain = 32768;

// ξ for each kind; T is float or double, `slope` is used by leaky_relu only.
// GELU's Φ and tanh-GELU's ½(1 + tanh u) are written in forms equal to the textbook ones
// that do not cancel in the left tail (½(1 + erf z) loses all digits once erf z ≈ −1).
using Vec = at::vec::Vectorized<float>;

struct Gelu {  // Φ(x) = ½(1 + erf(x/√2)) = ½·erfc(−x/√2)
  static constexpr bool kSimd = true;
  template <class T>
  static inline T xi(T x, T) {
    return T(0.5) * std::erfc(x * T(-0.70710678118654752440));
  }
  // SIMD: ½(1 + erf) as PyTorch's GELU computes it; Sleef's erfc is several times slower.
  static inline Vec xi(Vec x) {
    return Vec(0.5f) * (Vec(1.0f) + (x * Vec(0.70710678118654752440f)).erf());
  }
};
struct GeluTanh {  // ½(1 + tanh u) = σ(2u), u = √(2/π)(x + 0.044715x³)
  static constexpr bool kSimd = true;
  template <class T>
  static inline T xi(T x, T) {
    const T two_u = T(1.59576912160573071176) * (x + T(0.044715) * x * x * x);
    return T(1) / (T(1) + std::exp(-two_u));
  }
  static inline Vec xi(Vec x) {
    const Vec two_u = Vec(1.59576912160573071176f) * (x + Vec(0.044715f) * x * x * x);
    return Vec(1.0f) / (Vec(1.0f) + two_u.neg().exp());
  }
};
struct Silu {  // σ(x)
  static constexpr bool kSimd = true;
  template <class T>
  static inline T xi(T x, T) {
    return T(1) / (T(1) + std::exp(-x));
  }
  static inline Vec xi(Vec x) { return Vec(1.0f) / (Vec(1.0f) + x.neg().exp()); }
};
struct Relu {
  static constexpr bool kSimd = false;  // 1[x > 0]
  template <class T>
  static inline T xi(T x, T) {
    return x > T(0) ? T(1) : T(0);
  }
};
struct LeakyRelu {
  static constexpr bool kSimd = false;  // 1 if x > 0 else slope
  template <class T>
  static inline T xi(T x, T slope) {
    return x > T(0) ? T(1) : slope;
  }
};
struct Hardswish {
  static constexpr bool kSimd = false;  // clamp(x + 3, 0, 6)/6
  template <class T>
  static inline T xi(T x, T) {
    return std::min(std::max(x + T(3), T(0)), T(6)) / T(6);
  }
};

// Calls fn(Kind{}) for the named kind.
template <class Fn>
void with_kind(const char* where, const std::string& kind, Fn&& fn) {
  if (kind == "gelu") return fn(Gelu{});
  if (kind == "gelu_tanh") return fn(GeluTanh{});
  if (kind == "silu") return fn(Silu{});
  if (kind == "relu") return fn(Relu{});
  if (kind == "leaky_relu") return fn(LeakyRelu{});
  if (kind == "hardswish") return fn(Hardswish{});
  TORCH_CHECK_VALUE(false, where, ": unknown activation kind '", kind,
                    "'; expected one of: ", kKinds);
}

// Whether float32 loops of Kind use ATen's SIMD vectors (only when built for AVX2 or
// better: the default-capability Vectorized is a scalar emulation).
template <class Kind, class scalar_t>
constexpr bool use_simd() {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  return Kind::kSimd && std::is_same_v<scalar_t, float>;
#else
  return false;
#endif
}

template <class Kind, class scalar_t>
void forward_loop(const scalar_t* x, scalar_t* y, int64_t n, double slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t s = static_cast<opmath_t>(slope);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    if constexpr (use_simd<Kind, scalar_t>()) {
      for (; i + Vec::size() <= end; i += Vec::size()) {
        const Vec v = Vec::loadu(x + i);
        (v * Kind::xi(v)).store(y + i);
      }
    }
    for (; i < end; ++i) {
      const opmath_t v = static_cast<opmath_t>(x[i]);
      y[i] = static_cast<scalar_t>(v * Kind::xi(v, s));
    }
  });
}

template <class Kind, class scalar_t>
void backward_loop(const scalar_t* g, const scalar_t* x, scalar_t* out, int64_t n,
                   double slope) {
  using opmath_t = at::opmath_type<scalar_t>;
  const opmath_t s = static_cast<opmath_t>(slope);
  at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    if constexpr (use_simd<Kind, scalar_t>()) {
      for (; i + Vec::size() <= end; i += Vec::size()) {
        (Vec::loadu(g + i) * Kind::xi(Vec::loadu(x + i))).store(out + i);
      }
    }
    for (; i < end; ++i) {
      const opmath_t v = static_cast<opmath_t>(x[i]);
      out[i] = static_cast<scalar_t>(static_cast<opmath_t>(g[i]) * Kind::xi(v, s));
    }
  });
}

}  // namespace

at::Tensor activation_forward(const at::Tensor& x, const std::string& kind, double slope) {
  constexpr const char* where = "activation_forward";
  check_cpu_floating(where, "x", x);
  // In x's layout (channels-last stays channels-last, as with ATen's elementwise ops): the
  // loop runs over memory, the same for every layout.
  const auto layout = x.suggest_memory_format();
  const at::Tensor xc = x.contiguous(layout);
  at::Tensor y = at::empty_like(xc, layout);
  const int64_t n = xc.numel();
  with_kind(where, kind, [&](auto k) {
    using Kind = decltype(k);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), where, [&] {
      forward_loop<Kind, scalar_t>(xc.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
                                   n, slope);
    });
  });
  return y;
}

at::Tensor activation_backward(const at::Tensor& grad, const at::Tensor& x,
                               const std::string& kind, double slope) {
  constexpr const char* where = "activation_backward";
  check_cpu_floating(where, "grad", grad);
  check_cpu_floating(where, "x", x);
  TORCH_CHECK(grad.sizes() == x.sizes(), where, ": grad and x must have the same shape, got ",
              grad.sizes(), " and ", x.sizes());
  TORCH_CHECK_TYPE(grad.scalar_type() == x.scalar_type(), where,
                   ": grad and x must have the same dtype, got ", grad.scalar_type(), " and ",
                   x.scalar_type());
  const auto layout = x.suggest_memory_format();
  const at::Tensor gc = grad.contiguous(layout);
  const at::Tensor xc = x.contiguous(layout);
  at::Tensor out = at::empty_like(xc, layout);
  const int64_t n = xc.numel();
  with_kind(where, kind, [&](auto k) {
    using Kind = decltype(k);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, xc.scalar_type(), where, [&] {
      backward_loop<Kind, scalar_t>(gc.const_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(),
                                    out.mutable_data_ptr<scalar_t>(), n, slope);
    });
  });
  return out;
}

}  // namespace omenn_cpu
