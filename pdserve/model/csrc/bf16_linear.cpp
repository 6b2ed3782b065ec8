// y = x W^T + b for a few rows (a decode step's) with bf16 weights, each weight row read once.
//
// Decode steps have a few rows and are bound by reading the weight; torch's emulated bf16
// matmul costs one pass over the weight per input row, and oneDNN's native one (packed
// weights) read SmolLM2's layers at ~14 GB/s where this kernel reads them at ~23 GB/s on a
// 2-core AVX512-BF16 EPYC (benchmarks/roofline.py). Two paths, by the build's level:
// - AVX512-BF16 (linear_native): vdpbf16ps on 4x4 tiles of weight rows and input rows;
// - otherwise each weight row is widened to float32 as it is read (bf16 is the top half of a
//   float32) and multiplied with up to four input rows at once (independent accumulators, so
//   the loop is not bound by one FMA chain's latency).
// Sums are float32; each output is rounded once to bf16, as a bf16 matmul's. Parallel over
// output features with at::parallel_for, so torch's thread settings apply.
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

#include "panels.h"
#include "simd.h"

namespace {

// From this many rows, blocks of kTileRows weight rows are multiplied with every input row
// while they stay in cache (a prompt's rows); fewer rows read each weight row once.
constexpr int64_t kTiledFrom = 16;
constexpr int64_t kTileRows = 16;

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

#ifdef PDSERVE_AVX512BF16
// Native bf16: vdpbf16ps sums pairs of bf16 products into float32 lanes. One weight row at a
// time against up to four input rows, as the path below: the weight is then read as one
// sequential stream, which measured faster than tiles of 4-8 weight rows read side by side
// (those ran 30-50% slower at 1-2 rows, even with software prefetch: more streams than the
// hardware prefetcher follows). Two accumulators per input row along k keep enough sums in
// flight for vdpbf16ps's latency. The row stays in L1 while further groups of four input rows
// pass over it, so the weight is read from memory once per call.
inline __m512bh chunk(const uint16_t* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

// out[r] = dot(x[r], w) for r < R (out has room for 4).
template <int R>
void row_dots(const uint16_t* w, const uint16_t* const* x, int64_t k, float* out) {
  __m512 even[4], odd[4];
  for (int r = 0; r < 4; ++r) even[r] = odd[r] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    prefetch_stream(w + i);
    prefetch_stream(w + i + 32);
    const __m512bh w0 = chunk(w + i, ~__mmask32(0)), w1 = chunk(w + i + 32, ~__mmask32(0));
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_dpbf16_ps(even[r], chunk(x[r] + i, ~__mmask32(0)), w0);
      odd[r] = _mm512_dpbf16_ps(odd[r], chunk(x[r] + i + 32, ~__mmask32(0)), w1);
    }
  }
  for (; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? ~__mmask32(0) : (__mmask32(1) << (k - i)) - 1;
    const __m512bh wc = chunk(w + i, mask);
    for (int r = 0; r < R; ++r) even[r] = _mm512_dpbf16_ps(even[r], chunk(x[r] + i, mask), wc);
  }
  for (int r = 0; r < 4; ++r) even[r] = _mm512_add_ps(even[r], odd[r]);
  _mm_storeu_ps(out, hsum4(even[0], even[1], even[2], even[3]));
}

// row_dots<4> for two weight rows at once (out0, out1: room for 4 each): every output's sums
// are row_dots' own (the same even and odd chunks, the same tail, the same fold), so a tile's
// results are those of the calls it replaces, bit for bit; the two weight rows share each
// input load.
void pair_dots(const uint16_t* w0, const uint16_t* w1, const uint16_t* const* x, int64_t k,
               float* out0, float* out1) {
  __m512 e0[4], o0[4], e1[4], o1[4];
  for (int r = 0; r < 4; ++r) e0[r] = o0[r] = e1[r] = o1[r] = _mm512_setzero_ps();
  const __mmask32 all = ~__mmask32(0);
  int64_t i = 0;
  for (; i + 64 <= k; i += 64) {
    const __m512bh a0 = chunk(w0 + i, all), a1 = chunk(w0 + i + 32, all);
    const __m512bh b0 = chunk(w1 + i, all), b1 = chunk(w1 + i + 32, all);
    for (int r = 0; r < 4; ++r) {
      const __m512bh lo = chunk(x[r] + i, all), hi = chunk(x[r] + i + 32, all);
      e0[r] = _mm512_dpbf16_ps(e0[r], lo, a0);
      o0[r] = _mm512_dpbf16_ps(o0[r], hi, a1);
      e1[r] = _mm512_dpbf16_ps(e1[r], lo, b0);
      o1[r] = _mm512_dpbf16_ps(o1[r], hi, b1);
    }
  }
  for (; i < k; i += 32) {
    const __mmask32 mask = k - i >= 32 ? all : (__mmask32(1) << (k - i)) - 1;
    const __m512bh a = chunk(w0 + i, mask), b = chunk(w1 + i, mask);
    for (int r = 0; r < 4; ++r) {
      const __m512bh xc = chunk(x[r] + i, mask);
      e0[r] = _mm512_dpbf16_ps(e0[r], xc, a);
      e1[r] = _mm512_dpbf16_ps(e1[r], xc, b);
    }
  }
  for (int r = 0; r < 4; ++r) {
    e0[r] = _mm512_add_ps(e0[r], o0[r]);
    e1[r] = _mm512_add_ps(e1[r], o1[r]);
  }
  _mm_storeu_ps(out0, hsum4(e0[0], e0[1], e0[2], e0[3]));
  _mm_storeu_ps(out1, hsum4(e1[0], e1[1], e1[2], e1[3]));
}

// Many rows (a prompt's): blocks of weight rows that stay in cache while every group of four
// input rows passes over them, two weight rows per tile. Each output is still one row_dots
// sum, so a row's result is the same whichever path, tile or batch computed it.
void linear_native_tiled(const uint16_t* xp, const uint16_t* wp, const at::BFloat16* bp,
                         at::BFloat16* op, int64_t m, int64_t k, int64_t n) {
  at::parallel_for(0, n, kTileRows, [&](int64_t begin, int64_t end) {
    float s0[4], s1[4];
    for (int64_t j0 = begin; j0 < end; j0 += kTileRows) {
      const int64_t j1 = std::min(end, j0 + kTileRows);
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, m - r0);
        const uint16_t* x[4];
        for (int r = 0; r < 4; ++r) x[r] = xp + (r0 + (r < rows ? r : 0)) * k;
        int64_t j = j0;
        for (; j + 2 <= j1; j += 2) {
          pair_dots(wp + j * k, wp + (j + 1) * k, x, k, s0, s1);
          const float add0 = bp ? static_cast<float>(bp[j]) : 0.f;
          const float add1 = bp ? static_cast<float>(bp[j + 1]) : 0.f;
          for (int64_t r = 0; r < rows; ++r) {
            op[(r0 + r) * n + j] = at::BFloat16(s0[r] + add0);
            op[(r0 + r) * n + j + 1] = at::BFloat16(s1[r] + add1);
          }
        }
        for (; j < j1; ++j) {
          row_dots<4>(wp + j * k, x, k, s0);
          const float add = bp ? static_cast<float>(bp[j]) : 0.f;
          for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = at::BFloat16(s0[r] + add);
        }
      }
    }
  });
}

void linear_native(const uint16_t* xp, const uint16_t* wp, const at::BFloat16* bp,
                   at::BFloat16* op, int64_t m, int64_t k, int64_t n) {
  if (m >= kTiledFrom) {
    linear_native_tiled(xp, wp, bp, op, m, k, n);
    return;
  }
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    float sums[4];
    for (int64_t j = begin; j < end; ++j) {
      const float add = bp ? static_cast<float>(bp[j]) : 0.f;
      const uint16_t* wj = wp + j * k;
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t rows = std::min<int64_t>(4, m - r0);
        const uint16_t* x[4] = {xp + r0 * k, xp + (r0 + 1) * k, xp + (r0 + 2) * k,
                                xp + (r0 + 3) * k};  // only the first `rows` are read
        switch (rows) {
          case 1: row_dots<1>(wj, x, k, sums); break;
          case 2: row_dots<2>(wj, x, k, sums); break;
          case 3: row_dots<3>(wj, x, k, sums); break;
          default: row_dots<4>(wj, x, k, sums); break;
        }
        for (int64_t r = 0; r < rows; ++r) op[(r0 + r) * n + j] = at::BFloat16(sums[r] + add);
      }
    }
  });
}

// The layers' layout on AVX512-BF16 builds (bf16_blocked_linear): the weight in panels of
// kPanel output features, each panel k/2 pairs of its features' consecutive inputs
// ([n/64, k/2, 64, 2], built by model/linear.py's block_weight). vdpbf16ps then takes an input
// pair broadcast to every lane against a panel's 64 features, so each output is one float32
// chain over the pairs in order, whatever the number of rows, the tile or the thread: no
// horizontal sums, and tiles of 6 rows x 64 features (24 accumulators, 10 loads per 24
// vdpbf16ps) run at the host's bf16 GEMM peak (~440 GFLOP/s on a 2-core AVX512-BF16 EPYC, as
// oneDNN's), while a decode step's row reads each panel as one sequential stream. The row
// kernels above sum along k, which a tile cannot share across rows at that speed (their tiled
// path peaked at 130-250 GFLOP/s).
template <int R>
void panel_tile(const uint16_t* x, int64_t k, const uint16_t* panel, const at::BFloat16* bias,
                at::BFloat16* out, int64_t n) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    const uint16_t* w = panel + kp * 2 * kPanel;
    if constexpr (R <= 4)  // a decode step's tile streams the panel (a prompt's reuse it in L2)
      for (int c = 0; c < 4; ++c) prefetch_stream(w + 32 * c);
    __m512bh wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = (__m512bh)_mm512_loadu_si512(w + 32 * c);
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * k + 2 * kp, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xb, wv[c]);
    }
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 add = bias ? widen16(bias + 16 * c) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][c], add));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * n + 16 * c), (__m256i)y);
    }
  }
}

#elif defined(PDSERVE_AVX2)
// The same panels where bf16 is emulated (AVX2 builds): a word of a panel holds one feature's
// weights for an input pair, so one load of 8 words gives, shifted and masked, 8 features'
// float32 weights for each input of the pair. The inputs are widened to float32 once per call
// and broadcast, and each output is one FMA chain over the inputs in order (R rows x C vectors
// of 8 features, R x C <= 12 accumulators, as in f32_blocked_linear's AVX2 tiles): a decode
// step's rows read a panel as one stream at half float32's bytes, without a float32 copy of the
// weights. A prompt's rows take the float32 tiles instead (blocked_wide below).

template <int R, int C>
void panel_columns(const float* x, int64_t k, const uint16_t* panel, const at::BFloat16* bias,
                   at::BFloat16* out, int64_t n) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 acc[R][C];
  PDSERVE_UNROLL for (int r = 0; r < R; ++r)
    PDSERVE_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    const uint16_t* w = panel + kp * 2 * kPanel;
    if constexpr (R == 1)  // a decode step's row streams the panel (C = 8: all of a pair's lines)
      for (int c = 0; c < C; c += 2) prefetch_stream(w + 16 * c);
    __m256 x0[R], x1[R];
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) {
      x0[r] = _mm256_broadcast_ss(x + r * k + 2 * kp);
      x1[r] = _mm256_broadcast_ss(x + r * k + 2 * kp + 1);
    }
    PDSERVE_UNROLL for (int c = 0; c < C; ++c) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * c));
      const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
      PDSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(x0[r], even, acc[r][c]);
      const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(words, high));
      PDSERVE_UNROLL for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(x1[r], odd, acc[r][c]);
    }
  }
  PDSERVE_UNROLL for (int c = 0; c < C; ++c) {
    const __m256 add = bias ? widen8(bias + 8 * c) : _mm256_setzero_ps();
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) {
      store_bf16(out + r * n + 8 * c, _mm256_add_ps(acc[r][c], add));
    }
  }
}

// Tiles of more than 3 rows go 3 rows at a time: a pair's weights are shifted and masked once
// for 3 rows x 4 vectors (24 FMAs for 4 loads and 6 broadcasts), where 6 rows x 2 vectors
// would take 24 broadcasts and spill (117 vs ~150 GFLOP/s at 512 rows on a 2-core AVX2 EPYC).
template <int R>
void panel_tile(const float* x, int64_t k, const uint16_t* panel, const at::BFloat16* bias,
                at::BFloat16* out, int64_t n) {
  if constexpr (R > 2) {
    panel_tile<2>(x, k, panel, bias, out, n);
    panel_tile<R - 2>(x + 2 * k, k, panel, bias, out + 2 * n, n);
  } else {
    constexpr int C = R == 1 ? 8 : 4;
    for (int g = 0; g < 8 / C; ++g) {
      const int64_t f = 8 * C * g;
      panel_columns<R, C>(x, k, panel + 2 * f, bias ? bias + f : nullptr, out + f, n);
    }
  }
}

// From kWidenFrom rows (a prompt's), each thread widens the panel it takes to float32 once, in
// f32_blocked_linear's layout ([k][kPanel]: a word's low half is the even input's weight, its
// high half the odd input's), and runs the float32 tiles (panels.h) over it: the shifts and
// masks leave the FMA loop, whose tiles of 6 rows x 16 features need 2 loads and 6 broadcasts
// per 12 FMAs. Widening is exact and each output is the same FMA chain over the inputs in
// order, so the bits are the tiles' above, whatever the rows. This build on 2 threads of a Zen 5
// EPYC: 2,168 rows x 576 -> 3,072 217 -> 241 GFLOP/s, x 1,536 -> 576 212 -> 234, 542 rows of
// the latter 201 -> 246; level at 24 rows, below which the panel's widening costs what it saves.
// The engine's wave of four 542-token SmolLM2 prompts at this level (PDSERVE_ISA=avx2, two
// alternating runs of benchmarks/prefill_breakdown.py): linears 2,184 / 2,275 -> 2,008 / 2,056 ms.
constexpr int64_t kWidenFrom = 24;

inline void widen_panel(const uint16_t* panel, int64_t k, float* wide) {
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t kp = 0; kp < k / 2; ++kp) {
    const uint16_t* w = panel + kp * 2 * kPanel;
    float* even = wide + 2 * kp * kPanel;
    PDSERVE_UNROLL for (int c = 0; c < 8; ++c) {
      const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * c));
      _mm256_storeu_ps(even + 8 * c, _mm256_castsi256_ps(_mm256_slli_epi32(words, 16)));
      _mm256_storeu_ps(even + kPanel + 8 * c, _mm256_castsi256_ps(_mm256_and_si256(words, high)));
    }
  }
}

// This thread's float32 panel (kept between calls, grown as needed).
inline float* wide_panel(int64_t size) {
  thread_local std::vector<float> wide;
  if (static_cast<int64_t>(wide.size()) < size) wide.resize(size);
  return wide.data();
}

void blocked_wide(const float* xp, const uint16_t* wp, const at::BFloat16* bp, at::BFloat16* op,
                  int64_t m, int64_t k, int64_t n) {
  const auto enter = [&](int64_t p) { widen_panel(wp + p * k * kPanel, k, wide_panel(k * kPanel)); };
  for_each_panel_tile(m, n / kPanel, enter, [&](auto rows, int64_t r, int64_t p) {
    const auto* bias = bp ? bp + p * kPanel : nullptr;
    f32_panels::tile<decltype(rows)::value>(xp + r * k, k, wide_panel(k * kPanel), bias,
                                            op + r * n + p * kPanel, n);
  });
}
#endif

#ifdef PDSERVE_AVX2
// xp: the inputs as the build's tiles read them (bf16 for vdpbf16ps, else widened to float32).
template <typename X>
void blocked(const X* xp, const uint16_t* wp, const at::BFloat16* bp, at::BFloat16* op,
             int64_t m, int64_t k, int64_t n) {
  for_each_panel_tile(m, n / kPanel, [&](auto rows, int64_t r, int64_t p) {
    const auto* bias = bp ? bp + p * kPanel : nullptr;
    panel_tile<decltype(rows)::value>(xp + r * k, k, wp + p * k * kPanel, bias,
                                      op + r * n + p * kPanel, n);
  });
}
#endif

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
  auto out = torch::empty({m, n}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  const at::BFloat16* bp = has_bias ? b.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
#ifdef PDSERVE_AVX512BF16
  auto xc = x.contiguous();
  linear_native(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), wp, bp, op, m, k,
                n);
  return out;
#else
  auto xf = x.to(torch::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
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
#endif
}


torch::Tensor bf16_blocked_linear(torch::Tensor x, torch::Tensor w,
                                  c10::optional<torch::Tensor> bias) {
#ifdef PDSERVE_AVX2
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x is [M, K] bfloat16");
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() &&
                  w.size(2) == kPanel && w.size(3) == 2 && w.size(1) * 2 == x.size(1),
              "w is [N / 64, K / 2, 64, 2] bfloat16 (model/linear.py's block_weight)");
  const int64_t m = x.size(0), k = x.size(1), n = w.size(0) * kPanel;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == n,
                "bias is bfloat16 [N]");
  }
  torch::Tensor b = has_bias ? bias->contiguous() : torch::Tensor();
  auto out = torch::empty({m, n}, x.options());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  at::BFloat16* bp = has_bias ? b.data_ptr<at::BFloat16>() : nullptr;
#ifdef PDSERVE_AVX512BF16
  auto xc = x.contiguous();
  blocked(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), wp, bp,
          out.data_ptr<at::BFloat16>(), m, k, n);
#else
  auto xf = x.to(torch::kFloat).contiguous();
  if (m >= kWidenFrom) {
    blocked_wide(xf.data_ptr<float>(), wp, bp, out.data_ptr<at::BFloat16>(), m, k, n);
  } else {
    blocked(xf.data_ptr<float>(), wp, bp, out.data_ptr<at::BFloat16>(), m, k, n);
  }
#endif
  return out;
#else
  TORCH_CHECK(false, "bf16_blocked_linear needs an avx2 or avx512 build");
  return x;
#endif
}
