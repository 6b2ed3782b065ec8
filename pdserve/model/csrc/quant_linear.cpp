// y = x W^T (+ b) with weight-only quantized W, the way llama.cpp multiplies on CPU: each row of
// x is first rounded to int8 in groups of 32 (one float step per group, as GGUF's Q8_1), then
// every group's dot product is taken in integers (AVX2's unsigned x signed byte multiply-add)
// and scaled once. torch's weight-only kernels widen every weight to float instead, which
// costs ~3x the time it takes to read the 4-bit weights at one row (SmolLM2 decode here).
//
// int4 (q4_linear): W[n, 32g + i] = d[n, g] * q + m[n, g] with q in 0..15 (GGUF Q4_1's layout):
//   qs [N, K/2] uint8: group g is bytes 16g..16g+15, byte i holds q[32g + i] in its low
//   nibble and q[32g + 16 + i] in its high one;  dm [N, 2, K/32] float32: the d, then the m.
//   A group's sum is d * dx * sum(q * xq) + m * dx * sum(xq).
// int8 (q8_linear): W[n, k] = s[n] * q with q in -127..127;  w [N, K] int8, s [N] float32.
//
// x: [M, K] bfloat16 or float32 (K a multiple of 32); returns [M, N] in x's dtype, each output
// rounded once. Parallel over output features with at::parallel_for (torch's thread settings).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t G = 32;  // group size along K, for weights and activations alike
constexpr int64_t R = 4;   // rows of x multiplied per pass over a weight row

// x rounded to int8 per group: xq [M, K], dx [M, K/G] (the step), sx [M, K/G] = dx * sum(xq).
struct Q8Rows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
};

Q8Rows quantize_rows(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / G;
  auto xf = x.to(torch::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  Q8Rows out{std::vector<int8_t>(m * k), std::vector<float>(m * groups),
             std::vector<float>(m * groups)};
  at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* v = xp + i * G;
      float amax = 0.f;
      for (int64_t j = 0; j < G; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.f;
      const float inv = d > 0.f ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* q = out.q.data() + i * G;
      for (int64_t j = 0; j < G; ++j) {
        q[j] = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        sum += q[j];
      }
      out.d[i] = d;
      out.s[i] = d * static_cast<float>(sum);
    }
  });
  return out;
}

// Sum of a[i] * b[i] over n floats.
inline float dot_floats(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// One int4 weight row (nibbles `qs`, steps `d`, minimums `mn`, K/G each) against ROWS rows of
// quantized x starting at `first`. ROWS is a constant so the accumulators stay in registers.
template <int ROWS>
inline void q4_dots(const uint8_t* qs, const float* d, const float* mn, const Q8Rows& x,
                    int64_t first, int64_t k, float* out) {
  const int64_t groups = k / G;
  const int8_t* xq = x.q.data() + first * k;
  const float* xd = x.d.data() + first * groups;
#ifdef PDSERVE_AVX2
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  // Two accumulators per row, even and odd groups (unrolled, so they stay in registers): the
  // loop is not bound by one FMA chain's latency.
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  auto group = [&](int64_t g, int half) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + g * 16));
    const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), low);
    for (int r = 0; r < ROWS; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * k + g * G));
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
      acc[r][half] = _mm256_fmadd_ps(_mm256_set1_ps(d[g] * xd[r * groups + g]),
                                     _mm256_cvtepi32_ps(p), acc[r][half]);
    }
  };
  int64_t g = 0;
  for (; g + 1 < groups; g += 2) {
    group(g, 0);
    group(g + 1, 1);
  }
  if (g < groups) group(g, 0);
  for (int r = 0; r < ROWS; ++r) {
    out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) +
             dot_floats(mn, x.s.data() + (first + r) * groups, groups);
  }
#else
  for (int r = 0; r < ROWS; ++r) {
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* xg = xq + r * k + g * G;
      int dot = 0;
      for (int64_t i = 0; i < 16; ++i) {
        dot += (qs[g * 16 + i] & 0x0F) * xg[i] + (qs[g * 16 + i] >> 4) * xg[16 + i];
      }
      sum += d[g] * xd[r * groups + g] * dot;
    }
    out[r] = sum + dot_floats(mn, x.s.data() + (first + r) * groups, groups);
  }
#endif
}

// One int8 weight row against ROWS rows of quantized x (the row scale is applied by the caller).
template <int ROWS>
inline void q8_dots(const int8_t* w, const Q8Rows& x, int64_t first, int64_t k, float* out) {
  const int64_t rows = ROWS;
  const int64_t groups = k / G;
#ifdef PDSERVE_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[ROWS];
  for (int64_t r = 0; r < rows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + g * G));
    const __m256i wabs = _mm256_sign_epi8(wv, wv);  // |w| as unsigned bytes (w >= -127)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = first + r;
      const __m256i xv =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row * k + g * G));
      // |w| * (x with w's sign) = w * x; pairs sum to at most 2 * 127 * 127, no saturation.
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, _mm256_sign_epi8(xv, wv)), ones);
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(x.d[row * groups + g]), _mm256_cvtepi32_ps(p),
                               acc[r]);
    }
  }
  for (int64_t r = 0; r < rows; ++r) out[r] = hsum(acc[r]);
#else
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t row = first + r;
    float sum = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* xq = x.q.data() + row * k + g * G;
      int dot = 0;
      for (int64_t i = 0; i < G; ++i) dot += w[g * G + i] * xq[i];
      sum += x.d[row * groups + g] * dot;
    }
    out[r] = sum;
  }
#endif
}

// Calls dots.template operator()<ROWS> with ROWS = rows (1..R), a compile-time constant.
template <typename Dots>
inline void dispatch_rows(int64_t rows, Dots&& dots) {
  switch (rows) {
    case 1: dots(std::integral_constant<int, 1>{}); break;
    case 2: dots(std::integral_constant<int, 2>{}); break;
    case 3: dots(std::integral_constant<int, 3>{}); break;
    default: dots(std::integral_constant<int, 4>{}); break;
  }
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % G == 0, "x is [M, K] with K a multiple of 32");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat,
              "x is bfloat16 or float32");
}

// out[r, j] = dot(j, rows) * scale(j) + bias[j], rounded to x's dtype.
template <typename Dots, typename Scale>
torch::Tensor run(const torch::Tensor& x, int64_t n, const c10::optional<torch::Tensor>& bias,
                  Dots dots, Scale scale) {
  const int64_t m = x.size(0);
  const Q8Rows xq = quantize_rows(x);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias is [N]");
    b = bias->to(torch::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  auto outf = torch::empty({m, n}, x.options().dtype(torch::kFloat));
  float* op = outf.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    float acc[R];
    for (int64_t j = begin; j < end; ++j) {
      const float s = scale(j), add = bp ? bp[j] : 0.f;
      for (int64_t r = 0; r < m; r += R) {
        const int64_t rows = std::min<int64_t>(R, m - r);
        dispatch_rows(rows, [&](auto n_rows) { dots(j, xq, r, n_rows, acc); });
        for (int64_t i = 0; i < rows; ++i) op[(r + i) * n + j] = acc[i] * s + add;
      }
    }
  });
  return x.scalar_type() == torch::kFloat ? outf : outf.to(x.scalar_type());
}

}  // namespace

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor dm,
                        c10::optional<torch::Tensor> bias) {
  check_x(x);
  const int64_t k = x.size(1), n = qs.size(0);
  TORCH_CHECK(qs.scalar_type() == torch::kUInt8 && qs.is_contiguous() && qs.dim() == 2 &&
                  qs.size(1) * 2 == k,
              "qs is [N, K/2] uint8, contiguous");
  TORCH_CHECK(dm.scalar_type() == torch::kFloat && dm.is_contiguous() && dm.numel() == n * k / G * 2,
              "dm is [N, 2, K/32] float32, contiguous");
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const float* d = dm.data_ptr<float>();
  const int64_t groups = k / G;
  return run(
      x, n, bias,
      [&](int64_t j, const Q8Rows& xq, int64_t first, auto rows, float* acc) {
        const float* dj = d + j * 2 * groups;
        q4_dots<decltype(rows)::value>(q + j * (k / 2), dj, dj + groups, xq, first, k, acc);
      },
      [](int64_t) { return 1.f; });
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor w, torch::Tensor scales,
                        c10::optional<torch::Tensor> bias) {
  check_x(x);
  const int64_t k = x.size(1), n = w.size(0);
  TORCH_CHECK(w.scalar_type() == torch::kInt8 && w.is_contiguous() && w.dim() == 2 && w.size(1) == k,
              "w is [N, K] int8, contiguous");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.numel() == n && scales.is_contiguous(),
              "scales is [N] float32");
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  return run(
      x, n, bias,
      [&](int64_t j, const Q8Rows& xq, int64_t first, auto rows, float* acc) {
        q8_dots<decltype(rows)::value>(wp + j * k, xq, first, k, acc);
      },
      [&](int64_t j) { return s[j]; });
}
