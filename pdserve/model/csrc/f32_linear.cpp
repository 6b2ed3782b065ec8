// y = x W^T + b for a few rows (a decode step's) with float32 weights, each weight row read once.
//
// torch's float32 linear reads SmolLM2's layers at ~10 GB/s for one row and ~7-8 GB/s for 2-8
// rows on a 2-core AVX512-BF16 EPYC (one pass over the weight per row, or a GEMM that is not
// tuned for so few rows); a decode step is bound by reading the weight, which this kernel does
// once per four rows (benchmarks/roofline.py).
//
// Each output is one row's dot product in a fixed order that does not depend on how many rows
// the call has: 16-lane partial sums along k (GCC vector types, so every build level runs the
// same lanes), a fixed tree over the lanes, then the tail and the bias. A row's result is
// therefore the same alone and in any batch this kernel takes (tests/model/test_f32_linear.py),
// which keeps float32 output independent of the batch in decode steps.
//
// x:    [M, K] float32
// w:    [N, K] float32, contiguous
// bias: [N] float32 or undefined
// returns [M, N] float32

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace {

typedef float lanes __attribute__((vector_size(64)));  // 16 floats
constexpr int64_t kLanes = 16;
constexpr int kRows = 4;  // input rows per pass over a weight row
constexpr int64_t kPrefetch = 512;  // floats ahead of the weight's loads

inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The sum of the 16 lanes, pairwise in a fixed order.
inline float fold(lanes v) {
  float a[kLanes];
  std::memcpy(a, &v, sizeof a);
  for (int64_t width = kLanes / 2; width > 0; width /= 2) {
    for (int64_t i = 0; i < width; ++i) a[i] += a[i + width];
  }
  return a[0];
}

// out[r] = dot(w, x[r]) for the R input rows x[0..R). Every row's sum goes through the same
// per-lane steps whatever R is (one accumulator per row, the same fold), so R only chooses how
// many rows share a pass over the weight row.
template <int R>
inline void row_dots(const float* w, const float* const* x, int64_t k, float* out) {
  lanes acc[R] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    __builtin_prefetch(w + i + kPrefetch);
    const lanes wv = load(w + i);
    for (int r = 0; r < R; ++r) acc[r] += wv * load(x[r] + i);
  }
  for (int r = 0; r < R; ++r) {
    float tail = 0.f;
    for (int64_t j = i; j < k; ++j) tail += w[j] * x[r][j];
    out[r] = fold(acc[r]) + tail;
  }
}

}  // namespace

torch::Tensor f32_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat,
              "x and w are float32");
  TORCH_CHECK(w.is_contiguous(), "w must be contiguous");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == w.size(0),
                "bias is float32 [N]");
  }
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0);
  auto xc = x.contiguous();
  auto out = torch::empty({m, n}, x.options());
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    float sums[kRows];
    for (int64_t j = begin; j < end; ++j) {
      const float* wj = wp + j * k;
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - r0);
        const float* rs[kRows];
        for (int r = 0; r < kRows; ++r) rs[r] = xp + (r0 + (r < rows ? r : 0)) * k;
        switch (rows) {
          case 1: row_dots<1>(wj, rs, k, sums); break;
          case 2: row_dots<2>(wj, rs, k, sums); break;
          case 3: row_dots<3>(wj, rs, k, sums); break;
          default: row_dots<4>(wj, rs, k, sums); break;
        }
        const float add = bp ? bp[j] : 0.f;
        for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = sums[r] + add;
      }
    }
  });
  return out;
}
