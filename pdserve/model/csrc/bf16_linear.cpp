// y = x W^T + b for a few rows with bf16 weights, on CPUs without native bf16 matmuls.
//
// torch's emulated bf16 matmul costs one pass over the weight per input row; decode steps have
// a few rows and are bound by reading the weight. Here each weight row is read once, widened
// to float32 as it is read (bf16 is the top half of a float32), and multiplied with up to four
// input rows at once (independent accumulators, so the loop is not bound by one FMA
// chain's latency). Sums are float32; each output is rounded once to bf16, as a bf16 matmul's.
// Parallel over output features with at::parallel_for, so torch's thread settings apply.
//
// x:    [M, K] bfloat16, contiguous
// w:    [N, K] bfloat16, contiguous
// bias: [N] bfloat16 or undefined
// returns [M, N] bfloat16

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &word, sizeof f);
  return f;
}

// Dot products of one weight row with R float32 input rows of length k (rows past `rows` repeat
// the first: R independent accumulators keep the loop off one FMA chain's latency).
template <int R>
inline void dots(const uint16_t* w, const float* x, int64_t k, int64_t rows, float* out) {
  const float* xs[4];
  for (int r = 0; r < R; ++r) xs[r] = x + (r < rows ? r * k : 0);
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
  if constexpr (R == 2) {
    const float *x0 = xs[0], *x1 = xs[1];
#pragma omp simd reduction(+ : a0, a1)
    for (int64_t i = 0; i < k; ++i) {
      const float wi = widen(w[i]);
      a0 += wi * x0[i];
      a1 += wi * x1[i];
    }
  } else {
    static_assert(R == 4, "R is 2 or 4");
    const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t i = 0; i < k; ++i) {
      const float wi = widen(w[i]);
      a0 += wi * x0[i];
      a1 += wi * x1[i];
      a2 += wi * x2[i];
      a3 += wi * x3[i];
    }
  }
  const float all[4] = {a0, a1, a2, a3};
  for (int64_t r = 0; r < rows; ++r) out[r] = all[r];
}

}  // namespace

torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && w.scalar_type() == torch::kBFloat16,
              "x and w are bfloat16");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == w.size(0),
                "bias is bfloat16 [N]");
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto xf = x.to(torch::kFloat).contiguous();
  auto out = torch::empty({m, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  const at::BFloat16* bp = has_bias ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    float acc[4];
    for (int64_t j = begin; j < end; ++j) {
      const float add = bp ? static_cast<float>(bp[j]) : 0.f;
      const uint16_t* wj = wp + j * k;
      for (int64_t r = 0; r < m; r += 4) {
        const int64_t rows = std::min<int64_t>(4, m - r);
        const float* xr = xp + r * k;
        if (rows <= 2) {
          dots<2>(wj, xr, k, rows, acc);
        } else {
          dots<4>(wj, xr, k, rows, acc);
        }
        for (int64_t i = 0; i < rows; ++i) op[(r + i) * n + j] = at::BFloat16(acc[i] + add);
      }
    }
  });
  return out;
}
