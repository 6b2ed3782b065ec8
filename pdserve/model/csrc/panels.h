// The work split of the panel kernels (bf16_blocked_linear, f32_blocked_linear): a weight in
// panels of kPanel output features, multiplied with tiles of up to 6 input rows.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

constexpr int64_t kPanel = 64;
constexpr int64_t kChunkRows = 48;  // rows per work item: a thread's panel stays in L2 across them

// Calls tile(std::integral_constant<int, R>, first row, panel) for every tile of R <= 6 rows of
// every panel of an [m, panels * kPanel] output. Work items are panel-major, so a thread's
// consecutive items share a panel. Which tile a row lands in changes nothing in the kernels'
// sums (each output is one chain), only the speed.
template <typename Tile>
void for_each_panel_tile(int64_t m, int64_t panels, const Tile& tile) {
  const int64_t chunks = (m + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, panels * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = item / chunks, c = item % chunks;
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
