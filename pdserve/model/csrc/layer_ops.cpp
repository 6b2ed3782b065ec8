// The elementwise parts of a decoder layer in bfloat16 or float32, one pass each over rows of
// activations:
// RMSNorm (alone and after the residual add), the rotary embedding of q and k in place, and
// SiLU(gate) * up. Prefill (model/llama.py) and the fused decode step (decode_layers.cpp) both
// call them. Through torch each is several operators and passes over memory (the norm alone is
// a cast, a square, a mean, an rsqrt, two products and a cast back): at 512 tokens on SmolLM2
// they took a third of the prefill.
//
// The rounding is torch's on the Python path's operators (model/llama.py RMSNorm, model/rope.py
// apply_rotary, F.silu): every result a torch operator would hand back as bf16 is rounded to
// bf16 here too, and the arithmetic between is float32 (in float32 nothing is rounded between). Only the order of the RMSNorm's sum of
// squares differs. Vectors through ATen's own vector types (at::vec, with the level's
// instruction set), so SiLU's exp is torch's own vectorized exp (bf16 SiLU on AVX512 builds: a
// formula of our own that gives the same bits, see silu_bf16). Rows are split over threads
// with at::parallel_for (torch's thread settings).

#include "simd.h"

// at::vec's vector types for this build's level; before any ATen header.
#if defined(PDSERVE_AVX512BF16)
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#elif defined(PDSERVE_AVX2)
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernels.h"

namespace {

using bf16 = at::BFloat16;
using Vec = at::vec::Vectorized<float>;
using VecB = at::vec::Vectorized<bf16>;
constexpr int64_t kStep = VecB::size();  // bf16 elements per step: two float vectors

// A step of up to kStep values as two float vectors (the rest of a short step is zero).
inline std::tuple<Vec, Vec> load(const bf16* p, int64_t count) {
  const VecB v = count >= kStep ? VecB::loadu(p) : VecB::loadu(p, static_cast<int>(count));
  return at::vec::convert_bfloat16_float(v);
}

inline std::tuple<Vec, Vec> load(const float* p, int64_t count) {
  constexpr int64_t half = Vec::size();
  if (count >= kStep) return {Vec::loadu(p), Vec::loadu(p + half)};
  return {Vec::loadu(p, static_cast<int>(std::min(count, half))),
          count > half ? Vec::loadu(p + half, static_cast<int>(count - half)) : Vec(0.f)};
}

// Two float vectors as one of bf16, torch's rounding (to nearest, ties to even). AVX512-BF16's
// conversion is one instruction where at::vec's is a dozen, which bound the rotary embedding,
// the norms and the adds by their roundings (2-core Xeon with AMX: a 2,168-row SmolLM2
// prefill's rotary_ 0.29 -> 0.20 ms a layer; a wave of four 542-token prompts' layer ops 74 ->
// 61 ms, the wave 348-354 -> 322-332 ms, 3 alternating processes). It flushes denormals to
// zero, though: a pair holding one goes through at::vec's. A NaN stays a NaN (its payload
// differs, as it may in torch).
inline VecB to_bf16(const Vec& a, const Vec& b) {
#if defined(PDSERVE_AVX512BF16)
  constexpr int kDenormal = 0x20;  // vfpclassps's category
  if (!(_mm512_fpclass_ps_mask(a, kDenormal) | _mm512_fpclass_ps_mask(b, kDenormal)))
    return VecB(reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));  // b the upper half
#endif
  return at::vec::convert_float_bfloat16(a, b);
}

inline void store(bf16* p, const Vec& a, const Vec& b, int64_t count) {
  const VecB v = to_bf16(a, b);
  if (count >= kStep) {
    v.store(p);
  } else {
    v.store(p, static_cast<int>(count));
  }
}

inline void store(float* p, const Vec& a, const Vec& b, int64_t count) {
  constexpr int64_t half = Vec::size();
  if (count >= kStep) {
    a.store(p);
    b.store(p + half);
    return;
  }
  a.store(p, static_cast<int>(std::min(count, half)));
  if (count > half) b.store(p + half, static_cast<int>(count - half));
}

// Both vectors as a tensor of T between two operators holds them: rounded to bf16 and widened
// back; float32 as they are.
inline void round(Vec& a, Vec& b, bf16) {
  std::tie(a, b) = at::vec::convert_bfloat16_float(to_bf16(a, b));
}
inline void round(Vec&, Vec&, float) {}

// Calls fn(T{}) with T the element type of x (bfloat16 or float32).
template <typename Fn>
auto dispatch(const torch::Tensor& x, const Fn& fn) {
  if (x.scalar_type() == torch::kFloat) return fn(float{});
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "the layer ops take bfloat16 or float32");
  return fn(bf16{});
}

inline void check_rows(const torch::Tensor& x, const char* name,
                       torch::ScalarType dtype = torch::kBFloat16) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == dtype && x.is_contiguous(), name,
              " is [rows, n] of one dtype (bfloat16 or float32), contiguous");
}

// out = weight * bf16(x * rsqrt(mean(x^2) + eps)) for one row of n.
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  Vec acc0(0.f), acc1(0.f);
  for (int64_t i = 0; i < n; i += kStep) {
    auto [a, b] = load(x + i, n - i);
    acc0 = at::vec::fmadd(a, a, acc0);
    acc1 = at::vec::fmadd(b, b, acc1);
  }
  float lanes[Vec::size()];
  (acc0 + acc1).store(lanes);
  float sum = 0.f;
  for (float lane : lanes) sum += lane;
  const Vec inv(1.f / std::sqrt(sum / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kStep) {
    auto [a, b] = load(x + i, n - i);
    auto [wa, wb] = load(w + i, n - i);
    a = a * inv;
    b = b * inv;
    round(a, b, T{});
    store(out + i, wa * a, wb * b, n - i);
  }
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    const auto dtype = x.scalar_type();
    check_rows(x, "x", dtype);
    TORCH_CHECK(weight.scalar_type() == dtype && weight.numel() == x.size(1),
                "weight is [n] in x's dtype");
    const int64_t m = x.size(0), n = x.size(1);
    auto out = torch::empty_like(x);
    auto w = weight.contiguous();
    const T* xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
    return out;
  });
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor x, torch::Tensor weight,
                                        double eps) {
  return dispatch(h, [&](auto zero) {
    using T = decltype(zero);
    const auto dtype = h.scalar_type();
    check_rows(h, "h", dtype);
    check_rows(x, "x", dtype);
    TORCH_CHECK(h.sizes() == x.sizes(), "h and x have one shape");
    TORCH_CHECK(weight.scalar_type() == dtype && weight.numel() == h.size(1),
                "weight is [n] in h's dtype");
    const int64_t m = h.size(0), n = h.size(1);
    auto sum = torch::empty_like(h);
    auto out = torch::empty_like(h);
    auto w = weight.contiguous();
    const T *hp = h.data_ptr<T>(), *xp = x.data_ptr<T>();
    const T* wp = w.data_ptr<T>();
    T *sp = sum.data_ptr<T>(), *op = out.data_ptr<T>();
    at::parallel_for(0, m, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < n; i += kStep) {
          auto [a0, a1] = load(hp + r * n + i, n - i);
          auto [b0, b1] = load(xp + r * n + i, n - i);
          store(sp + r * n + i, a0 + b0, a1 + b1, n - i);
        }
        norm_row(sp + r * n, wp, op + r * n, n, static_cast<float>(eps));
      }
    });
    return std::vector<torch::Tensor>{sum, out};
  });
}

torch::Tensor add_rows(torch::Tensor a, torch::Tensor b) {
  return dispatch(a, [&](auto zero) {
    using T = decltype(zero);
    check_rows(a, "a", a.scalar_type());
    check_rows(b, "b", a.scalar_type());
    TORCH_CHECK(a.sizes() == b.sizes(), "a and b have one shape");
    auto out = torch::empty_like(a);
    const T *ap = a.data_ptr<T>(), *bp = b.data_ptr<T>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, a.numel(), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; i += kStep) {
        auto [a0, a1] = load(ap + i, end - i);
        auto [b0, b1] = load(bp + i, end - i);
        store(op + i, a0 + b0, a1 + b1, end - i);
      }
    });
    return out;
  });
}

void rotary_(torch::Tensor x, int64_t heads, int64_t head_dim, torch::Tensor cos,
             torch::Tensor sin) {
  dispatch(x, [&](auto zero) {
    using T = decltype(zero);
    const auto dtype = x.scalar_type();
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x is [rows, width] with unit stride along a row");
    TORCH_CHECK(heads * head_dim <= x.size(1) && head_dim % 2 == 0, "heads fit in a row");
    check_rows(cos, "cos", dtype);
    check_rows(sin, "sin", dtype);
    TORCH_CHECK(cos.size(0) == x.size(0) && cos.size(1) == head_dim && sin.sizes() == cos.sizes(),
                "cos and sin are [rows, head_dim]");
    const int64_t m = x.size(0), stride = x.stride(0), half = head_dim / 2;
    T* xp = x.data_ptr<T>();
    const T *cp = cos.data_ptr<T>(), *sp = sin.data_ptr<T>();
    // Row by row, each step of a row's cos and sin loaded once for all its heads (they were
    // loaded per head: 2,168 rows of SmolLM2's 12 heads 0.32 -> 0.29 ms, 2-core Xeon with AMX).
    at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T* row = xp + r * stride;
        const T *c = cp + r * head_dim, *s = sp + r * head_dim;
        for (int64_t i = 0; i < half; i += kStep) {
          const int64_t count = std::min(kStep, half - i);
          const auto [c0, c1] = load(c + i, count);
          const auto [s0, s1] = load(s + i, count);
          const auto [ch0, ch1] = load(c + half + i, count);
          const auto [sh0, sh1] = load(s + half + i, count);
          // rotate_half(v) is (-v[half:], v[:half]); both halves are read before either is
          // written.
          for (int64_t head = 0; head < heads; ++head) {
            T* v = row + head * head_dim;
            auto [a0, a1] = load(v + i, count);
            auto [b0, b1] = load(v + half + i, count);
            Vec ac0 = a0 * c0, ac1 = a1 * c1, bs0 = b0.neg() * s0, bs1 = b1.neg() * s1;
            Vec bc0 = b0 * ch0, bc1 = b1 * ch1, as0 = a0 * sh0, as1 = a1 * sh1;
            round(ac0, ac1, T{});
            round(bs0, bs1, T{});
            round(bc0, bc1, T{});
            round(as0, as1, T{});
            store(v + i, ac0 + bs0, ac1 + bs1, count);
            store(v + half + i, bc0 + as0, bc1 + as1, count);
          }
        }
      }
    });
    return 0;
  });
}

namespace {

// SiLU(g) = g / (1 + exp(-g)) in float32 (torch's formula, through at::vec's exp).
inline void silu(Vec& a, Vec& b) {
  const Vec one(1.f);
  a = a / (one + a.neg().exp());
  b = b / (one + b.neg().exp());
}

#if defined(PDSERVE_AVX2)
// SiLU(g) = g / (1 + 2^(-g log2 e)), 2^y by exp2_finite (simd.h; y clamped to +-200, where 2^y
// is 0 or inf in float32 anyway: a NaN g stays NaN through the division): rounded
// to bf16 it gives torch's bits for every one of the 65,536 bf16 inputs (the true division
// matters: a reciprocal estimate with a Newton step missed ~16,000 of them), so bf16 rows take
// it in place of the table below and of torch's exp (test_silu_mul_gives_torchs_bits_for_every_
// bf16_gate). On a 2-core Xeon with AMX: a 2,168-token SmolLM2 prefill's silu_mul 1.16 -> 0.96
// ms a layer against the table, 4 rows 4.8 -> 3.8 us against torch's exp (medians of 7); a wave
// of four 542-token prompts in the engine 43 -> 35 ms (both in one process, medians of 6).
// AVX2 builds take it 8 wide (exp2_finite's AVX2 form): a 2,168-token SmolLM2 layer 1.94-1.98
// -> 1.33-1.42 ms against the table's scalar lookups, 4 rows 6.9 -> 5.6 us against torch's exp
// (2 threads of a Zen 5 at that level, 3 alternating runs).
inline Vec silu_bf16(const Vec& g) {
  const Vec y = at::vec::clamp(g * Vec(-kLog2e), Vec(-200.f), Vec(200.f));
  return g / (Vec(exp2_finite(y)) + Vec(1.f));
}
#else
// Generic builds: bf16(SiLU(g)) of every bf16 g, by g's bits: a bf16 input has 65,536 values,
// so the activation is a table of them (128 KiB), computed once by the formula itself (the same
// bits). Looked up, a 2,168-token SmolLM2 prefill's silu_mul took 36 ms where the exp and the
// division took 50 (2-core Zen 4, before silu_bf16). Below kTableRows rows (decode steps) the
// formula stays: the weights streamed between two layers' calls evict the table, and its misses
// would cost more. The lookups are scalar: AVX512 gathers of the entries ran ~1.1x slower.
constexpr int64_t kTableRows = 256;

const bf16* silu_table() {
  static const std::vector<bf16> table = [] {
    std::vector<bf16> t(1 << 16);
    auto* bits = reinterpret_cast<uint16_t*>(t.data());
    for (int64_t i = 0; i < (1 << 16); ++i) bits[i] = static_cast<uint16_t>(i);
    for (int64_t i = 0; i < (1 << 16); i += kStep) {
      auto [a, b] = load(t.data() + i, kStep);
      silu(a, b);
      store(t.data() + i, a, b, kStep);
    }
    return t;
  }();
  return table.data();
}
#endif

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate_up) {
  return dispatch(gate_up, [&](auto zero) {
    using T = decltype(zero);
    check_rows(gate_up, "gate_up", gate_up.scalar_type());
    const int64_t m = gate_up.size(0), inter = gate_up.size(1) / 2;
    TORCH_CHECK(gate_up.size(1) == 2 * inter, "gate_up is [rows, 2 * intermediate]");
    auto out = torch::empty({m, inter}, gate_up.options());
    const T* gp = gate_up.data_ptr<T>();
    T* op = out.data_ptr<T>();
#if !defined(PDSERVE_AVX2)
    const bf16* table = nullptr;  // bf16 rows of a prompt: SiLU by table
    if constexpr (std::is_same_v<T, bf16>) table = m >= kTableRows ? silu_table() : nullptr;
#endif
    at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *g = gp + r * 2 * inter, *u = g + inter;
        for (int64_t i = 0; i < inter; i += kStep) {
          const int64_t count = std::min(kStep, inter - i);
          auto [u0, u1] = load(u + i, count);
          auto [s0, s1] = load(g + i, count);
#if defined(PDSERVE_AVX2)
          if constexpr (std::is_same_v<T, bf16>) {
            s0 = silu_bf16(s0);
            s1 = silu_bf16(s1);
          } else {
            silu(s0, s1);
          }
#else
          if (table != nullptr) {
            const auto* bits = reinterpret_cast<const uint16_t*>(g + i);
            bf16 looked[kStep];
            for (int64_t e = 0; e < count; ++e) looked[e] = table[bits[e]];
            std::tie(s0, s1) = load(looked, count);
          } else {
            silu(s0, s1);
          }
#endif
          round(s0, s1, T{});
          store(op + r * inter + i, s0 * u0, s1 * u1, count);
        }
      }
    });
    return out;
  });
}
