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
#include "panels.h"
#include "simd.h"

namespace {

#ifdef PDSERVE_AVX512BF16
typedef float lanes __attribute__((vector_size(64)));  // 16 floats
#else
// The same 16 lanes as two halves of 8: where registers are narrower than 64 bytes GCC lowers a
// 64-byte vector type through the stack (on a 2-core AVX2 EPYC this kernel then read weights at
// ~10 GB/s); the halves stay in ymm registers. Lane for lane the same operations, so the same
// bits as the AVX512 build's.
typedef float half_lanes __attribute__((vector_size(32)));
struct lanes {
  half_lanes lo, hi;
  lanes& operator+=(const lanes& o) {
    lo += o.lo;
    hi += o.hi;
    return *this;
  }
};
inline lanes operator*(const lanes& a, const lanes& b) { return {a.lo * b.lo, a.hi * b.hi}; }
#endif
constexpr int64_t kLanes = 16;
constexpr int kRows = 4;  // input rows per pass over a weight row
constexpr int64_t kPrefetch = 512;  // floats ahead of the weight's loads

#ifdef PDSERVE_AVX512BF16
inline lanes load(const float* p) {
  lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
#else
inline lanes load(const float* p) {
  half_lanes lo, hi;
  std::memcpy(&lo, p, sizeof lo);
  std::memcpy(&hi, p + 8, sizeof hi);
  return {lo, hi};
}
#endif

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
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r] += wv * load(x[r] + i);
  }
  PDSERVE_UNROLL for (int r = 0; r < R; ++r) {
    float tail = 0.f;
    for (int64_t j = i; j < k; ++j) tail += w[j] * x[r][j];
    out[r] = fold(acc[r]) + tail;
  }
}

// row_dots<4> for two weight rows at once: each output's sums are row_dots' own (the same
// lanes, the same fold, the same tail), so the results are those of the two calls it replaces,
// bit for bit; the weight rows share each input load.
inline void pair_dots(const float* w0, const float* w1, const float* const* x, int64_t k,
                      float* out0, float* out1) {
  lanes a[kRows] = {}, b[kRows] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    const lanes v0 = load(w0 + i), v1 = load(w1 + i);
    PDSERVE_UNROLL for (int r = 0; r < kRows; ++r) {
      const lanes xv = load(x[r] + i);
      a[r] += v0 * xv;
      b[r] += v1 * xv;
    }
  }
  PDSERVE_UNROLL for (int r = 0; r < kRows; ++r) {
    float t0 = 0.f, t1 = 0.f;
    for (int64_t j = i; j < k; ++j) {
      t0 += w0[j] * x[r][j];
      t1 += w1[j] * x[r][j];
    }
    out0[r] = fold(a[r]) + t0;
    out1[r] = fold(b[r]) + t1;
  }
}

// From this many rows (a prompt's), blocks of kTileRows weight rows are multiplied with every
// group of input rows while they stay in cache, two weight rows per tile; fewer rows read each
// weight row once. Either way each output is one row_dots sum.
constexpr int64_t kTiledFrom = 16;
constexpr int64_t kTileRows = 16;

void linear_tiled(const float* xp, const float* wp, const float* bp, float* op, int64_t m,
                  int64_t k, int64_t n) {
  at::parallel_for(0, n, kTileRows, [&](int64_t begin, int64_t end) {
    float s0[kRows], s1[kRows];
    for (int64_t j0 = begin; j0 < end; j0 += kTileRows) {
      const int64_t j1 = std::min(end, j0 + kTileRows);
      for (int64_t r0 = 0; r0 < m; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m - r0);
        const float* rs[kRows];
        for (int r = 0; r < kRows; ++r) rs[r] = xp + (r0 + (r < rows ? r : 0)) * k;
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
          pair_dots(wp + j * k, wp + (j + 1) * k, rs, k, s0, s1);
          const float add0 = bp ? bp[j] : 0.f, add1 = bp ? bp[j + 1] : 0.f;
          for (int64_t r = 0; r < rows; ++r) {
            op[(r0 + r) * n + j] = s0[r] + add0;
            op[(r0 + r) * n + j + 1] = s1[r] + add1;
          }
        }
        for (; j < j1; ++j) {
          row_dots<kRows>(wp + j * k, rs, k, s0);
          const float add = bp ? bp[j] : 0.f;
          for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = s0[r] + add;
        }
      }
    }
  });
}

#ifdef PDSERVE_AVX512BF16
// The float32 layers' layout on AVX512 builds (f32_blocked_linear): the weight in panels of
// kPanel output features, each panel the features' weights input by input ([n/64, k, 64],
// model/linear.py's block_weight). An input broadcast to every lane meets a panel's 64
// features in 4 FMAs, so each output is one FMA chain over k in order, whatever the rows, tile
// or thread: tiles of 6 rows x 64 features (24 accumulators) reach the host's fp32 GEMM peak
// (~200 GFLOP/s on a 2-core AVX512-BF16 EPYC, where torch's F.linear ran the prompt's linears
// at ~150-160), and one row reads each panel as one stream.
template <int R>
void panel_tile(const float* x, int64_t k, const float* panel, const float* bias, float* out,
                int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * kPanel;
    if constexpr (R <= 4)  // a decode step's tile streams the panel (a prompt's reuse it in L2)
      for (int c = 0; c < 4; ++c) prefetch_stream(w + 16 * c);
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_ps(w + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * k + i]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xb, wv[c], acc[r][c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 add = bias ? _mm512_loadu_ps(bias + 16 * c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(out + r * n + 16 * c, _mm512_add_ps(acc[r][c], add));
    }
  }
}

#elif defined(PDSERVE_AVX2)
// The same panels on AVX2 builds: the same FMA chain per output, so the same bits as the AVX512
// tiles above (panels.h's f32_panels, which bf16_blocked_linear's prompt rows take too).
template <int R>
void panel_tile(const float* x, int64_t k, const float* panel, const float* bias, float* out,
                int64_t n) {
  f32_panels::tile<R>(x, k, panel, bias, out, n);
}
#endif

#ifdef PDSERVE_AVX2
void blocked(const float* xp, const float* wp, const float* bp, float* op, int64_t m, int64_t k,
             int64_t n) {
  for_each_panel_tile(m, n / kPanel, [&](auto rows, int64_t r, int64_t p) {
    const auto* bias = bp ? bp + p * kPanel : nullptr;
    panel_tile<decltype(rows)::value>(xp + r * k, k, wp + p * k * kPanel, bias,
                                      op + r * n + p * kPanel, n);
  });
}
#endif

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
  if (m >= kTiledFrom) {
    linear_tiled(xp, wp, bp, op, m, k, n);
    return out;
  }
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


torch::Tensor f32_blocked_linear(torch::Tensor x, torch::Tensor w,
                                 c10::optional<torch::Tensor> bias) {
#ifdef PDSERVE_AVX2
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat, "x is [M, K] float32");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kFloat && w.is_contiguous() &&
                  w.size(2) == kPanel && w.size(1) == x.size(1),
              "w is [N / 64, K, 64] float32 (model/linear.py's block_weight)");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0) * kPanel;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat && bias->numel() == n, "bias is float32 [N]");
  }
  auto xc = x.contiguous();
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  auto out = torch::empty({m, n}, x.options());
  blocked(xc.data_ptr<float>(), w.data_ptr<float>(), has_bias ? b.data_ptr<float>() : nullptr,
          out.data_ptr<float>(), m, k, n);
  return out;
#else
  TORCH_CHECK(false, "f32_blocked_linear needs an avx2 or avx512 build");
  return x;
#endif
}
