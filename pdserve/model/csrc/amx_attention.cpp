// Causal attention of a run of queries in bf16 on AMX-BF16 tiles: the rows kernel's contract
// (prefill_attention.cpp: q holds the run's t positions [offset, offset + t), k and v every
// position before them too), for CPUs with AMX. Built into the avx512 level (the tile code
// carries its own target attribute) and called only where the CPU reports amx_tile and
// amx_bf16 (model/fused.py); elsewhere it refuses.
//
// Per (query head, 32 query rows: two tiles of 16), in three passes over the keys the rows see:
//   1. S = Q K^T, 32 keys at a time: Q in 32-dim tiles from a padded copy of the rows, K
//      pre-packed per KV head as dim pairs by key (the B layout of tdpbf16ps), into fp32;
//   2. an exact softmax per row over S in AVX512 (scaled to base 2, the row's max, 2^x, the
//      sum), P rounded to bf16, positions past the row's own zero;
//   3. O = P V, 32 keys at a time, V pre-packed as key pairs by dim, 32 output dims at a time
//      accumulated over every key, then scaled by 1 / sum and rounded to bf16.
// Two passes over S instead of the online softmax: no accumulator to rescale in the tiles, and
// a run's scores (32 rows x its context in fp32) stay in L2 at the lengths a prompt has.
//
// What made it fast, a 542-token SmolLM2 prompt's layer on a 2-core Xeon with AMX-BF16 (2
// threads, medians of 9 alternating; the first version, one row tile by one key tile at a
// time, 0.59 ms): passes 1 and 3 multiply 2 x 2 tiles a step (each tile loaded is used twice,
// four sums independent) and K and V are packed by AVX512 transposes and permutes, not element
// by element; the per-thread buffers start on a cache line, so no tile row straddles two (a
// tile store of S split across lines took as long as the products: 0.51 -> 0.41 ms); the
// softmax's max runs four chains and its exponentials two (a vmaxps waits on the last: 0.41
// -> 0.35 ms).

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
constexpr int64_t kTile = 16;      // rows of a tile: query rows, keys of a score tile, dims of O
constexpr int64_t kRows = 32;      // query rows per item: two row tiles
constexpr int64_t kKeys = 32;      // keys per step of passes 1 and 3 (two score tiles, a P tile)

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

// S[32 x n*32] (fp32, row stride s_stride floats) = Q (32 x dim, row stride dim) K^T over n
// steps of 32 keys; kp: the KV head's keys as [16-key block][dim / 32][16 pairs][16 keys] of
// 32-bit dim pairs (whole steps: a 32-key step is two of these blocks).
__attribute__((target("amx-tile,amx-bf16"))) void scores(const bf16* q, const uint32_t* kp,
                                                         int64_t dim, int64_t n, float* s,
                                                         int64_t s_stride) {
  const int64_t halves = dim / 32, block = halves * 256;  // a 16-key block's words
  const bf16* q1 = q + kTile * dim;
  float* s1 = s + kTile * s_stride;
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t* k0 = kp + 2 * c * block;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t h = 0; h < halves; ++h) {
      _tile_loadd(0, q + h * 32, dim * 2);
      _tile_loadd(1, q1 + h * 32, dim * 2);
      _tile_loadd(2, k0 + h * 256, 64);
      _tile_loadd(3, k0 + block + h * 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, s + c * kKeys, s_stride * 4);
    _tile_stored(5, s1 + c * kKeys, s_stride * 4);
    _tile_stored(6, s + c * kKeys + kTile, s_stride * 4);
    _tile_stored(7, s1 + c * kKeys + kTile, s_stride * 4);
  }
}

// O[32 x dim] (fp32, row stride dim) = P (32 x n*32 bf16, row stride p_stride) V over n steps
// of 32 keys; vp: the KV head's values as [step][dim / 16][16 key pairs][16 dims] of 32-bit key
// pairs. 32 output dims (two tiles) for both row tiles at a time.
__attribute__((target("amx-tile,amx-bf16"))) void values(const bf16* p, int64_t p_stride,
                                                         const uint32_t* vp, int64_t dim,
                                                         int64_t n, float* o) {
  const int64_t groups = dim / 16;
  const bf16* p1 = p + kTile * p_stride;
  float* o1 = o + kTile * dim;
  for (int64_t g = 0; g < groups; g += 2) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t c = 0; c < n; ++c) {
      const uint32_t* chunk = vp + (c * groups + g) * 256;
      _tile_loadd(0, p + c * kKeys, p_stride * 2);
      _tile_loadd(1, p1 + c * kKeys, p_stride * 2);
      _tile_loadd(2, chunk, 64);
      _tile_loadd(3, chunk + 256, 64);
      _tile_dpbf16ps(4, 0, 2);
      _tile_dpbf16ps(5, 1, 2);
      _tile_dpbf16ps(6, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
    _tile_stored(4, o + g * 16, dim * 4);
    _tile_stored(5, o1 + g * 16, dim * 4);
    _tile_stored(6, o + (g + 1) * 16, dim * 4);
    _tile_stored(7, o1 + (g + 1) * 16, dim * 4);
  }
}

// C[32 x 32] (fp32, row stride ldc floats) = A (32 rows of k inputs, row stride lda) times 32
// output features of a weight in amx_linear's tiles (chunks of 32 inputs: two 16-feature tiles
// of 16 input pairs each), the sums along k in order, chunk by chunk.
constexpr int64_t kWeightAhead = 4;  // chunks of 32 inputs (2 KiB of weights each)
__attribute__((target("amx-tile,amx-bf16"))) void linear_tile(const bf16* a, int64_t lda,
                                                              const bf16* w, int64_t chunks,
                                                              float* c, int64_t ldc) {
  const bf16* a1 = a + kTile * lda;
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t k = 0; k < chunks; ++k) {
    const char* ahead = reinterpret_cast<const char*>(w + (k + kWeightAhead) * 1024);
    for (int line = 0; line < 2048; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    _tile_loadd(0, a + k * 32, lda * 2);
    _tile_loadd(2, w + k * 1024, 64);
    _tile_loadd(1, a1 + k * 32, lda * 2);
    _tile_loadd(3, w + k * 1024 + 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 1, 2);
    _tile_dpbf16ps(6, 0, 3);
    _tile_dpbf16ps(7, 1, 3);
  }
  _tile_stored(4, c, ldc * 4);
  _tile_stored(5, c + kTile * ldc, ldc * 4);
  _tile_stored(6, c + kTile, ldc * 4);
  _tile_stored(7, c + kTile * ldc + kTile, ldc * 4);
}

// 16 rows of 16 32-bit words transposed in registers (row r, word w -> row w, word r).
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lanes: [a0 b0 a1 b1] of rows i, i + 4, i + 8, i + 12
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// Keys [first, first + 16) of one KV head (row stride ks elements; those past ctx zero) as
// [dim / 32][16 pairs][16 keys] words.
void pack_keys(const bf16* k, int64_t ks, int64_t first, int64_t ctx, int64_t dim,
               uint32_t* out) {
  for (int64_t h = 0; h < dim / 32; ++h) {
    __m512i r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = first + i < ctx ? _mm512_loadu_si512(k + (first + i) * ks + h * 32)
                             : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(out + h * 256 + i * 16, r[i]);
  }
}

// Values [first, first + 32) of one KV head (those past ctx zero) as [dim / 16][16 key pairs]
// [16 dims][2 keys] bf16: keys 2i and 2i + 1 interleaved dim by dim.
void pack_values(const bf16* v, int64_t vs, int64_t first, int64_t ctx, int64_t dim,
                 uint16_t* out) {
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40,
                                      8, 39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int64_t pair = 0; pair < 16; ++pair) {
    const int64_t a = first + 2 * pair, b = a + 1;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i ra = a < ctx ? _mm512_loadu_si512(v + a * vs + d) : _mm512_setzero_si512();
      const __m512i rb = b < ctx ? _mm512_loadu_si512(v + b * vs + d) : _mm512_setzero_si512();
      // dims d..d+15 of both keys, then d+16..d+31
      _mm512_storeu_si512(out + (d / 16) * 512 + pair * 32, _mm512_permutex2var_epi16(ra, lo, rb));
      _mm512_storeu_si512(out + (d / 16 + 1) * 512 + pair * 32,
                          _mm512_permutex2var_epi16(ra, hi, rb));
    }
  }
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
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into) {
#if !defined(PDSERVE_AVX512BF16)
  TORCH_CHECK(false, "prefill_attention_amx needs the avx512 build on a CPU with AMX");
  return q;
#else
  TORCH_CHECK(amx_permitted(), "the kernel cannot use AMX tiles here (no amx_tile, or Linux "
              "refused the tile state)");
  const auto shape = check_fresh(q, k, v, offset, torch::kBFloat16);
  const int64_t t = shape[0], heads = shape[1], dim = shape[2], kv_heads = shape[3];
  const int64_t ctx = offset + t, group = heads / kv_heads;
  const int64_t steps = (ctx + kKeys - 1) / kKeys;  // 32-key steps of the context
  const int64_t k_step = 2 * (dim / 32) * 256, v_step = (dim / 16) * 256;  // words per step
  // Packed per KV head, the keys past the context zero.
  auto kpack = torch::empty({kv_heads, steps * k_step}, q.options().dtype(torch::kInt32));
  auto vpack = torch::empty({kv_heads, steps * v_step}, q.options().dtype(torch::kInt32));
  const bf16* kptr = k.data_ptr<bf16>();
  const bf16* vptr = v.data_ptr<bf16>();
  uint32_t* kpp = reinterpret_cast<uint32_t*>(kpack.data_ptr<int32_t>());
  uint32_t* vpp = reinterpret_cast<uint32_t*>(vpack.data_ptr<int32_t>());
  const int64_t ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, kv_heads * steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / steps, c = item % steps, first = c * kKeys;
      uint32_t* kd = kpp + (g * steps + c) * k_step;
      pack_keys(kptr + g * dim, ks, first, ctx, dim, kd);
      pack_keys(kptr + g * dim, ks, first + kTile, ctx, dim, kd + k_step / 2);
      pack_values(vptr + g * dim, vs, first, ctx, dim,
                  reinterpret_cast<uint16_t*>(vpp + (g * steps + c) * v_step));
    }
  });

  auto out = fresh_output(into, q);
  const bf16* qptr = q.data_ptr<bf16>();
  bf16* optr = out.data_ptr<bf16>();
  const int64_t qs = q.stride(0), qh = q.stride(1);
  const int64_t blocks = (t + kRows - 1) / kRows;
  const float scale2 = static_cast<float>(scale) * kLog2e;
  // Items heavy, light, heavy, ...: the last rows' block sees the most keys.
  std::vector<std::pair<int64_t, int64_t>> items;  // (query head, block of rows)
  for (int64_t i = 0; i < (blocks + 1) / 2; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      items.emplace_back(h, blocks - 1 - i);
      if (i != blocks - 1 - i) items.emplace_back(h, i);
    }
  const int64_t s_stride = steps * kKeys;  // scores and P rows: whole steps
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    // One buffer, each part on a cache line of its own (a tile's rows then never split one)
    const int64_t q_bytes = kRows * dim * 2, s_bytes = kRows * s_stride * 4;
    const int64_t p_bytes = kRows * s_stride * 2, o_bytes = kRows * dim * 4;
    std::vector<char> buf(q_bytes + s_bytes + p_bytes + o_bytes + 64);
    char* base = buf.data() + (64 - reinterpret_cast<uintptr_t>(buf.data()) % 64) % 64;
    bf16* qb = reinterpret_cast<bf16*>(base);
    float* sb = reinterpret_cast<float*>(base + q_bytes);
    bf16* pb = reinterpret_cast<bf16*>(base + q_bytes + s_bytes);
    float* ob = reinterpret_cast<float*>(base + q_bytes + s_bytes + p_bytes);
    float inv_sum[kRows];
    configure_tiles();
    for (int64_t item = begin; item < end; ++item) {
      const auto [h, block] = items[item];
      const int64_t g = h / group, first = block * kRows;
      const int64_t rows = std::min(kRows, t - first);
      const int64_t seen = offset + first + rows;  // keys the block's last row sees
      const int64_t n = (seen + kKeys - 1) / kKeys;
      for (int64_t r = 0; r < kRows; ++r) {
        bf16* dst = qb + r * dim;
        if (r < rows)
          std::memcpy(dst, qptr + (first + r) * qs + h * qh, dim * 2);
        else
          std::memset(dst, 0, dim * 2);
      }
      scores(qb, kpp + g * steps * k_step, dim, n, sb, s_stride);
      const int64_t width = n * kKeys;
      for (int64_t r = 0; r < kRows; ++r) {
        float* srow = sb + r * s_stride;
        bf16* prow = pb + r * s_stride;
        const int64_t seen_r = r < rows ? offset + first + r + 1 : 0;  // keys this row sees
        __m512 mx = _mm512_set1_ps(-INFINITY), m1 = mx, m2 = mx, m3 = mx;
        int64_t j = 0;
        for (; j + 64 <= seen_r; j += 64) {  // four chains: a max waits 4 cycles on the last
          mx = _mm512_max_ps(mx, _mm512_loadu_ps(srow + j));
          m1 = _mm512_max_ps(m1, _mm512_loadu_ps(srow + j + 16));
          m2 = _mm512_max_ps(m2, _mm512_loadu_ps(srow + j + 32));
          m3 = _mm512_max_ps(m3, _mm512_loadu_ps(srow + j + 48));
        }
        for (; j + 16 <= seen_r; j += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(srow + j));
        mx = _mm512_max_ps(_mm512_max_ps(mx, m1), _mm512_max_ps(m2, m3));
        const __mmask16 tail = static_cast<__mmask16>((1u << (seen_r - j)) - 1);
        if (tail) mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, srow + j));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx) * scale2);
        const __m512 s2 = _mm512_set1_ps(scale2);
        __m512 sum = _mm512_setzero_ps(), sum1 = sum;
        for (j = 0; j + 32 <= seen_r; j += 32) {
          const __m512 e = exp2_finite(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), s2, top));
          const __m512 e1 = exp2_finite(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j + 16), s2, top));
          sum = _mm512_add_ps(sum, e);
          sum1 = _mm512_add_ps(sum1, e1);
          _mm512_storeu_si512(prow + j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e)));
        }
        for (; j + 16 <= seen_r; j += 16) {
          const __m512 e = exp2_finite(_mm512_fmsub_ps(_mm512_loadu_ps(srow + j), s2, top));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
        }
        sum = _mm512_add_ps(sum, sum1);
        if (tail) {
          const __m512 x = _mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, srow + j), s2, top);
          const __m512 e = _mm512_maskz_mov_ps(tail, exp2_finite(x));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
          j += 16;
        }
        for (; j < width; j += 16)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(prow + j), _mm256_setzero_si256());
        inv_sum[r] = seen_r ? 1.f / _mm512_reduce_add_ps(sum) : 0.f;
      }
      values(pb, s_stride, vpp + g * steps * v_step, dim, n, ob);
      for (int64_t r = 0; r < rows; ++r) {
        const __m512 inv = _mm512_set1_ps(inv_sum[r]);
        bf16* dst = optr + ((first + r) * heads + h) * dim;
        for (int64_t d = 0; d < dim; d += 16) {
          const __m512 o = _mm512_mul_ps(_mm512_loadu_ps(ob + r * dim + d), inv);
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

// x W^T (+ bias) on AMX tiles, every row's bits independent of the batch (--deterministic on AMX
// hosts: linear.py amx_tiles). x [M, K] bf16; w [N / 32, K / 32, 2, 16, 16, 2] bf16: for 32 output
// features and 32 inputs, two tiles of 16 input pairs by 16 features (tdpbf16ps's B layout);
// bias [N] bf16 or none. Each thread takes whole rows, 32 at a time (the last ones padded with
// zero rows; with fewer than 4 row blocks a thread, every row and its share of the features), and
// 256 output features at a time (their weights stay in L2 while its rows pass);
// each output is one float32 sum along k in order, plus the bias, rounded to bf16 once (as
// the panels, AVX512-BF16's conversion: a denormal output flushes to zero). A row's
// sums never meet another row's: the same bits alone and in any batch.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#if !defined(PDSERVE_AVX512BF16)
  TORCH_CHECK(false, "amx_linear needs the avx512 build on a CPU with AMX");
  return x;
#else
  TORCH_CHECK(amx_permitted(), "amx_linear cannot use AMX tiles here (no amx_tile, or Linux "
              "refused the tile state)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x is [M, K] bf16");
  x = x.contiguous();
  TORCH_CHECK(w.dim() == 6 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() &&
                  w.size(2) == 2 && w.size(3) == 16 && w.size(4) == 16 && w.size(5) == 2,
              "w is [N / 32, K / 32, 2, 16, 16, 2] bf16 (linear.py amx_tiles)");
  const int64_t m = x.size(0), k = x.size(1), blocks_n = w.size(0), n = blocks_n * 32;
  const int64_t chunks = w.size(1);
  TORCH_CHECK(k == chunks * 32, "x's width ", k, " is not the weight's ", chunks * 32);
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->numel()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->numel() == n &&
                    bias->is_contiguous(),
                "bias is [N] bf16");
    bp = bias->data_ptr<bf16>();
  }
  auto out = torch::empty({m, n}, x.options());
  if (m == 0) return out;
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = w.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t row_blocks = (m + kRows - 1) / kRows;
  // Each thread its own rows where there are enough row blocks; fewer (a decode step's rows, a
  // short run): each thread all rows and its own output features, so that the weights are read
  // once (at 64 rows by rows took 1.4x oneDNN's time, by features about its time). Either way
  // an output's sum is the same.
  const int64_t threads = at::get_num_threads();
  const bool by_rows = row_blocks >= 4 * threads;  // else each thread would read all weights
  const int64_t parts = by_rows ? threads : std::min(threads, blocks_n);
  constexpr int64_t kPanel = 8;  // 32-feature blocks a thread's rows pass over at a time
  at::parallel_for(0, parts, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float c[kRows * 32];
    std::vector<bf16> padded;  // the last row block, padded with zero rows
    configure_tiles();
    for (int64_t part = begin; part < end; ++part) {
      const int64_t b0 = by_rows ? row_blocks * part / parts : 0;
      const int64_t b1 = by_rows ? row_blocks * (part + 1) / parts : row_blocks;
      const int64_t f0 = by_rows ? 0 : blocks_n * part / parts;
      const int64_t f1 = by_rows ? blocks_n : blocks_n * (part + 1) / parts;
      const int64_t tail_rows = m - (row_blocks - 1) * kRows;
      if (b1 == row_blocks && tail_rows < kRows) {
        padded.assign(kRows * k, bf16(0.f));
        std::memcpy(padded.data(), xp + (row_blocks - 1) * kRows * k, tail_rows * k * 2);
      }
      for (int64_t j0 = f0; j0 < f1; j0 += kPanel) {
        const int64_t j1 = std::min(f1, j0 + kPanel);
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t r0 = b * kRows, rows = std::min(kRows, m - r0);
          const bf16* a = rows < kRows ? padded.data() : xp + r0 * k;
          for (int64_t j = j0; j < j1; ++j) {
            linear_tile(a, k, wp + j * chunks * 1024, chunks, c, 32);
            __m512 b_lo = _mm512_setzero_ps(), b_hi = b_lo;
            if (bp != nullptr) {
              b_lo = widen16(bp + j * 32);
              b_hi = widen16(bp + j * 32 + 16);
            }
            for (int64_t r = 0; r < rows; ++r) {
              const __m512 lo = _mm512_add_ps(_mm512_load_ps(c + r * 32), b_lo);
              const __m512 hi = _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), b_hi);
              _mm512_storeu_si512(op + (r0 + r) * n + j * 32,
                                  reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
            }
          }
        }
      }
    }
    release_tiles();
  });
  return out;
#endif
}
