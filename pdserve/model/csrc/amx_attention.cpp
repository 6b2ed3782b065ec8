// Causal attention of a run of queries in bf16 on AMX-BF16 tiles: the rows kernel's contract
// (prefill_attention.cpp: q holds the run's t positions [offset, offset + t), k and v every
// position before them too), for CPUs with AMX. Built into the avx512 level (the tile code
// carries its own target attribute) and called only where the CPU reports amx_tile and
// amx_bf16 (model/fused.py); elsewhere it refuses.
//
// Per (query head, 16 query rows), in three passes over the keys the rows see:
//   1. S = Q K^T, 16 keys at a time: Q in 32-dim tiles straight from a padded copy of the rows,
//      K pre-packed per KV head as dim pairs by key (the B layout of tdpbf16ps), into fp32;
//   2. an exact softmax per row over S in AVX512 (scaled to base 2, the row's max, 2^x, the
//      sum), P rounded to bf16, positions past the row's own zero;
//   3. O = P V, 32 keys at a time, V pre-packed as key pairs by dim, up to 4 output tiles of 16
//      dims accumulated over every key, then scaled by 1 / sum and rounded to bf16.
// Two passes over S instead of the online softmax: no accumulator to rescale in the tiles, and
// a run's scores (16 rows x its context in fp32) stay in L2 at the lengths a prompt has.

#include "kernels.h"
#include "simd.h"

#if defined(PDSERVE_AVX512BF16)
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using bf16 = at::BFloat16;
constexpr int64_t kRowsTile = 16;  // query rows per tile (a tile's rows)
constexpr int64_t kKeysS = 16;     // keys per score tile (16 fp32 columns)
constexpr int64_t kKeysPV = 32;    // keys per P tile (32 bf16 columns)

// Linux gives a process the AMX tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); once per process.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Every tile 16 rows of 64 bytes: 16 x 32 bf16 (Q, P, packed K and V) or 16 x 16 fp32 (S, O).
// A constant in memory: GCC 12 does not see ldtilecfg read its operand, and dropped the stores
// of a configuration built on the stack (the tiles then fault).
alignas(64) const TileConfig kTiles = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64},
                                       {16, 16, 16, 16, 16, 16, 16, 16}};

__attribute__((target("amx-tile"))) void configure_tiles() { _tile_loadconfig(&kTiles); }

__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// S[16 x n_s*16] (fp32, row stride s_stride floats) = Q (16 x dim, row stride dim) K^T over
// n_s chunks of 16 keys; kp: the KV head's keys as [chunk][dim / 32][16 pairs][16 keys] of
// 32-bit dim pairs.
__attribute__((target("amx-tile,amx-bf16"))) void scores(const bf16* q, const uint32_t* kp,
                                                         int64_t dim, int64_t n_s, float* s,
                                                         int64_t s_stride) {
  const int64_t halves = dim / 32;
  for (int64_t c = 0; c < n_s; ++c) {
    _tile_zero(2);
    for (int64_t h = 0; h < halves; ++h) {
      _tile_loadd(0, q + h * 32, dim * 2);
      _tile_loadd(1, kp + (c * halves + h) * 256, 64);
      _tile_dpbf16ps(2, 0, 1);
    }
    _tile_stored(2, s + c * kKeysS, s_stride * 4);
  }
}

// O[16 x dim] (fp32, row stride dim) = P (16 x n_pv*32 bf16, row stride p_stride) V over n_pv
// chunks of 32 keys; vp: the KV head's values as [chunk][dim / 16][16 key pairs][16 dims] of
// 32-bit key pairs. Four output tiles at a time (two where dim / 16 leaves two).
__attribute__((target("amx-tile,amx-bf16"))) void values(const bf16* p, int64_t p_stride,
                                                         const uint32_t* vp, int64_t dim,
                                                         int64_t n_pv, float* o) {
  const int64_t groups = dim / 16;
  for (int64_t g0 = 0; g0 < groups; g0 += 4) {
    const bool four = groups - g0 >= 4;
    _tile_zero(4);
    _tile_zero(5);
    if (four) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int64_t c = 0; c < n_pv; ++c) {
      _tile_loadd(0, p + c * kKeysPV, p_stride * 2);
      const uint32_t* chunk = vp + (c * groups + g0) * 256;
      _tile_loadd(1, chunk, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, chunk + 256, 64);
      _tile_dpbf16ps(5, 0, 2);
      if (four) {
        _tile_loadd(1, chunk + 512, 64);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(2, chunk + 768, 64);
        _tile_dpbf16ps(7, 0, 2);
      }
    }
    _tile_stored(4, o + g0 * 16, dim * 4);
    _tile_stored(5, o + (g0 + 1) * 16, dim * 4);
    if (four) {
      _tile_stored(6, o + (g0 + 2) * 16, dim * 4);
      _tile_stored(7, o + (g0 + 3) * 16, dim * 4);
    }
  }
}

inline uint32_t pair_at(const bf16* a) {
  uint32_t x;
  std::memcpy(&x, a, 4);
  return x;
}

inline uint16_t bits(bf16 x) {
  uint16_t b;
  std::memcpy(&b, &x, 2);
  return b;
}

}  // namespace
#endif

bool amx_ready() {
#if defined(PDSERVE_AVX512BF16)
  return amx_permitted();
#else
  return false;
#endif
}

torch::Tensor prefill_attention_amx(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset) {
#if !defined(PDSERVE_AVX512BF16)
  TORCH_CHECK(false, "prefill_attention_amx needs the avx512 build on a CPU with AMX");
  return q;
#else
  TORCH_CHECK(amx_permitted(), "the kernel cannot use AMX tiles here (no amx_tile, or Linux "
              "refused the tile state)");
  const auto shape = check_fresh(q, k, v, offset, torch::kBFloat16);
  const int64_t t = shape[0], heads = shape[1], dim = shape[2], kv_heads = shape[3];
  const int64_t ctx = offset + t, group = heads / kv_heads;
  const int64_t chunks_s = (ctx + kKeysS - 1) / kKeysS;
  const int64_t chunks_pv = (ctx + kKeysPV - 1) / kKeysPV;
  const int64_t halves = dim / 32, groups16 = dim / 16;
  // Packed per KV head, the keys past the context zero.
  auto kpack = torch::zeros({kv_heads, chunks_s * halves * 256}, q.options().dtype(torch::kInt32));
  auto vpack = torch::zeros({kv_heads, chunks_pv * groups16 * 256}, q.options().dtype(torch::kInt32));
  const bf16* kptr = k.data_ptr<bf16>();
  const bf16* vptr = v.data_ptr<bf16>();
  uint32_t* kpp = reinterpret_cast<uint32_t*>(kpack.data_ptr<int32_t>());
  uint16_t* vpp = reinterpret_cast<uint16_t*>(vpack.data_ptr<int32_t>());
  const int64_t ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);
  at::parallel_for(0, kv_heads * chunks_pv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / chunks_pv, c2 = item % chunks_pv;
      for (int64_t key = c2 * kKeysPV; key < std::min(ctx, (c2 + 1) * kKeysPV); ++key) {
        const bf16* kr = kptr + key * ks + g * kh;
        uint32_t* kd = kpp + g * chunks_s * halves * 256 + (key / kKeysS) * halves * 256;
        for (int64_t pair = 0; pair < dim / 2; ++pair)  // [chunk][half][pair % 16][key % 16]
          kd[(pair / 16) * 256 + (pair % 16) * 16 + key % kKeysS] = pair_at(kr + 2 * pair);
        const bf16* vr = vptr + key * vs + g * vh;
        const int64_t in = key % kKeysPV;  // [chunk][dims / 16][key pair][dim % 16][key % 2]
        uint16_t* vd = vpp + (g * chunks_pv + c2) * groups16 * 512 + (in / 2) * 32 + in % 2;
        for (int64_t d = 0; d < dim; ++d) vd[(d / 16) * 512 + (d % 16) * 2] = bits(vr[d]);
      }
    }
  });

  auto out = torch::empty({t, heads, dim}, q.options());
  const bf16* qptr = q.data_ptr<bf16>();
  bf16* optr = out.data_ptr<bf16>();
  const int64_t qs = q.stride(0), qh = q.stride(1);
  const int64_t tiles = (t + kRowsTile - 1) / kRowsTile;
  const float scale2 = static_cast<float>(scale) * kLog2e;
  // Items heavy, light, heavy, ...: the last rows' tile sees the most keys.
  std::vector<std::pair<int64_t, int64_t>> items;  // (query head, tile)
  for (int64_t i = 0; i < (tiles + 1) / 2; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      items.emplace_back(h, tiles - 1 - i);
      if (i != tiles - 1 - i) items.emplace_back(h, i);
    }
  const int64_t s_stride = chunks_pv * kKeysPV;  // scores and P rows: whole P chunks
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> qbuf(kRowsTile * dim);
    std::vector<float> sbuf(kRowsTile * s_stride);
    std::vector<bf16> pbuf(kRowsTile * s_stride);
    std::vector<float> obuf(kRowsTile * dim);
    float inv_sum[kRowsTile];
    configure_tiles();
    for (int64_t item = begin; item < end; ++item) {
      const auto [h, tile] = items[item];
      const int64_t g = h / group, first = tile * kRowsTile;
      const int64_t rows = std::min(kRowsTile, t - first);
      const int64_t seen = offset + first + rows;  // keys the tile's last row sees
      const int64_t n_s = (seen + kKeysS - 1) / kKeysS, n_pv = (seen + kKeysPV - 1) / kKeysPV;
      for (int64_t r = 0; r < kRowsTile; ++r) {
        bf16* dst = qbuf.data() + r * dim;
        if (r < rows)
          std::memcpy(dst, qptr + (first + r) * qs + h * qh, dim * 2);
        else
          std::memset(dst, 0, dim * 2);
      }
      scores(qbuf.data(), kpp + g * chunks_s * halves * 256, dim, n_s, sbuf.data(), s_stride);
      const int64_t width = n_pv * kKeysPV;
      for (int64_t r = 0; r < kRowsTile; ++r) {
        float* srow = sbuf.data() + r * s_stride;
        bf16* prow = pbuf.data() + r * s_stride;
        const int64_t n = r < rows ? offset + first + r + 1 : 0;  // keys this row sees
        __m512 mx = _mm512_set1_ps(-INFINITY);
        for (int64_t j = 0; j < n; j += 16) {
          const __mmask16 m = j + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - j)) - 1);
          mx = _mm512_mask_max_ps(mx, m, mx, _mm512_maskz_loadu_ps(m, srow + j));
        }
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale2);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t j = 0; j < width; j += 16) {
          const __mmask16 m = j + 16 <= n ? 0xFFFF
                              : j < n     ? static_cast<__mmask16>((1u << (n - j)) - 1)
                                          : 0;
          const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(srow + j), _mm512_set1_ps(scale2), top);
          const __m512 e = _mm512_maskz_mov_ps(m, exp2_below(x));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
        }
        inv_sum[r] = n ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
      }
      values(pbuf.data(), s_stride, reinterpret_cast<const uint32_t*>(vpp) +
                                        g * chunks_pv * groups16 * 256,
             dim, n_pv, obuf.data());
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        bf16* dst = optr + ((first + r) * heads + h) * dim;
        for (int64_t d = 0; d < dim; d += 16) {
          const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(obuf.data() + r * dim + d), inv);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(o)));
        }
      }
    }
    release_tiles();
  });
  return out;
#endif
}
