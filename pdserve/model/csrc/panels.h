// The work split of the panel kernels (bf16_blocked_linear, f32_blocked_linear): a weight in
// panels of kPanel output features, multiplied with tiles of up to 6 input rows; and, on AVX2
// builds, the float32 tiles both kernels' prompt rows take.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "simd.h"

constexpr int64_t kPanel = 64;
constexpr int64_t kChunkRows = 48;  // rows per work item: a thread's panel stays in L2 across them

// Calls tile(std::integral_constant<int, R>, first row, panel) for every tile of R <= 6 rows of
// every panel of an [m, panels * kPanel] output. Work items are panel-major, so a thread's
// consecutive items share a panel. Which tile a row lands in changes nothing in the kernels'
// sums (each output is one chain), only the speed.
// `enter(p)` is called on the thread that takes panel p's items, before the first of a run of
// them (a thread's items are consecutive, so at most twice per panel and thread).
template <typename Enter, typename Tile>
void for_each_panel_tile(int64_t m, int64_t panels, const Enter& enter, const Tile& tile) {
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, c = item % chunks;
      if (item == begin || c == 0) enter(p);
      const int64_t r1 = std::min(m, (c + 1) * kChunkRows);
      int64_t r = c * kChunkRows;
      for (; r + 6 <= r1; r += 6) tile(std::integral_constant<int, 6>{}, r, p);
      switch (r1 - r) {
        case 1: tile(std::integral_constant<int, 1>{}, r, p); break;
        case 2: tile(std::integral_constant<int, 2>{}, r, p); break;
        case 3: tile(std::integral_constant<int, 3>{}, r, p); break;
        case 4: tile(std::integral_constant<int, 4>{}, r, p); break;
        case 5: tile(std::integral_constant<int, 5>{}, r, p); break;
        default: break;
      }
    }
  });
}

template <typename Tile>
void for_each_panel_tile(int64_t m, int64_t panels, const Tile& tile) {
  for_each_panel_tile(m, panels, [](int64_t) {}, tile);
}

#if defined(PDSERVE_AVX2) && !defined(PDSERVE_AVX512BF16)
namespace f32_panels {

// 16 ymm registers hold a tile of R rows x C vectors of 8 features (R x C <= 12 accumulators),
// so a float32 panel ([k][kPanel]) is taken in 8 / C column groups: a row reads the whole
// panel as one stream (C = 8: each weight is used once, straight from memory), a prompt's tiles
// of 6 rows x 16 features (12 FMAs per 2 weight loads and 6 broadcasts) run at the fp32 FMA
// peak while the panel stays in L2 between its groups. Each output is one FMA chain over the
// inputs in order; outputs and biases float32 (f32_blocked_linear) or bf16 (bf16_blocked_linear's
// widened prompt rows: the sum rounded once, as the bf16 tiles round it). On a 2-core AVX2 EPYC
// the row kernels read SmolLM2's layers at ~10 GB/s in one row (torch's gemv: ~40) and ran
// prompts at ~60 GFLOP/s.
template <int R, int C, typename T>
void columns(const float* x, int64_t k, const float* panel, const T* bias, T* out, int64_t n) {
  __m256 acc[R][C];
  PDSERVE_UNROLL for (int r = 0; r < R; ++r)
    PDSERVE_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; ++i) {
    const float* w = panel + i * kPanel;
    if constexpr (R == 1)  // a decode step's row streams the panel (C = 8: all of its lines)
      for (int c = 0; c < C; c += 2) prefetch_stream(w + 8 * c);
    __m256 wv[C];
    PDSERVE_UNROLL for (int c = 0; c < C; ++c) wv[c] = _mm256_loadu_ps(w + 8 * c);
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * k + i);
      PDSERVE_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xb, wv[c], acc[r][c]);
    }
  }
  PDSERVE_UNROLL for (int c = 0; c < C; ++c) {
    const __m256 add = bias ? load8(bias + 8 * c) : _mm256_setzero_ps();
    PDSERVE_UNROLL for (int r = 0; r < R; ++r) store8(out + r * n + 8 * c, _mm256_add_ps(acc[r][c], add));
  }
}

// A prompt's tiles of 6 rows take 2 vectors at a time (4 passes over the panel); the 4-5 rows
// of a decode step take 3 rows x 4 vectors and the rest, so fewer passes over the panel (4
// rows: 29.5 -> 21 ms over SmolLM2's layers on a 2-core AVX2 EPYC).
template <int R, typename T>
void tile(const float* x, int64_t k, const float* panel, const T* bias, T* out, int64_t n) {
  if constexpr (R == 4 || R == 5) {
    tile<3>(x, k, panel, bias, out, n);
    tile<R - 3>(x + 3 * k, k, panel, bias, out + 3 * n, n);
  } else {
    constexpr int C = R == 1 ? 8 : R <= 3 ? 4 : 2;
    for (int g = 0; g < 8 / C; ++g) {
      const int64_t f = 8 * C * g;
      columns<R, C>(x, k, panel + f, bias ? bias + f : nullptr, out + f, n);
    }
  }
}

}  // namespace f32_panels
#endif
