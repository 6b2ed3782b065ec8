// Causal attention of a run of queries whose keys and values are at hand as rows: a fresh prompt
// (the run's own, strided views of the fused projection) or a run over a cached prefix (every
// position's, gathered out of the paged cache by model/attention.py; `offset` positions come
// before the run, so query i sees keys up to offset + i). In bf16 through vdpbf16ps for builds
// that target AVX512-BF16 (below); in float32 FMA for both dtypes on AVX2 (fresh_attention). torch's CPU flash attention reached ~55 GFLOP/s on SmolLM2's shapes
// at 512 tokens on a 2-core AVX512-BF16 EPYC (benchmarks/prefill_attention.py), a fifth of the
// host's bf16 GEMM rate, and took as long as all of the layer's linears.
//
// Flash-style, per (KV head, tile of 16 query positions): the tile's rows are its positions
// times the query heads that share the KV head (48 rows for SmolLM2's 9/3 heads), so each block
// of keys and values is read once for all of them. Keys and values are first repacked per KV
// head into pairs along the dot product (vdpbf16ps multiplies pairs of bf16 and adds both into
// one float32 lane): keys as [block of 64][dim / 2][64 keys][2], values as [block of 64][32 key
// pairs][dim][2], each (KV head, block) a work item of its own (gathers and permutes). The
// online softmax steps over two blocks at a time: steps of 128 keys rather than 32 cut its
// per-row work (a maximum, a rescale per row and step) 4x (64: 1.25x faster than 32 at 512
// tokens, 128: ~1.05x more), and each row's sum is kept by lane until the end. Scores accumulate
// in float32, scaled into base 2; the online softmax is float32, its exps through
// exp2_probability in bf16 (relative error 2.7e-6, far below the probabilities' bf16 rounding)
// and exp2_below in float32 (~2e-7); the probabilities are rounded to bf16 for the
// product with the values, as torch's flash attention rounds them; the output is divided by the
// row's sum and rounded once. Tiles are ordered heavy, light, heavy, ... so that at::parallel_for's contiguous split
// gives every thread the same work under the causal mask. In a tile's diagonal block the keys
// past its last position are skipped, 16 at a time (their probabilities are zero: the same
// bits; 6% faster at 542 tokens, 10% at 128, 2-core Zen 4).
//
// q: [T, heads, dim], k, v: [offset + T, kv_heads, dim], bfloat16 or float32 (rows may be
// strided views of a fused qkv); dim a multiple of 32 up to 256. Returns [T, heads, dim].

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

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels.h"

#if defined(PDSERVE_AVX2)
namespace {

using bf16 = at::BFloat16;
constexpr int64_t kKeys = 64;   // keys per block
constexpr int64_t kTile = 16;   // query positions per tile
constexpr int64_t kRows = 4;    // query rows whose scores are computed together
constexpr int64_t kMaxDim = 256;
static_assert(kTile % kRows == 0, "a tile's rows are whole groups of kRows");

struct Tile {
  int64_t kv_head;
  int64_t start;  // first query position
};

// Tiles heavy, light, heavy, ...: tile i of n and tile n - 1 - i side by side.
std::vector<Tile> balanced_tiles(int64_t kv_heads, int64_t t) {
  const int64_t tiles_per_head = (t + kTile - 1) / kTile;
  std::vector<Tile> tiles;
  tiles.reserve(kv_heads * tiles_per_head);
  for (int64_t i = 0; i < (tiles_per_head + 1) / 2; ++i) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      tiles.push_back({g, (tiles_per_head - 1 - i) * kTile});
      if (i != tiles_per_head - 1 - i) tiles.push_back({g, i * kTile});
    }
  }
  return tiles;
}

}  // namespace

// The shape checks the rows kernels make (here and amx_attention.cpp); returns {t, heads, dim,
// kv_heads}. q holds the run's t positions [offset, offset + t); k and v every position before
// them too (offset + t rows).
std::array<int64_t, 4> check_fresh(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t offset,
                                   torch::ScalarType dtype) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v are [T, heads, dim]");
  TORCH_CHECK(q.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "q, k, v share the kernel's dtype");
  const int64_t t = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k.size(1);
  TORCH_CHECK(offset >= 0, "offset (cached positions before the run) is not negative");
  TORCH_CHECK(k.size(0) == offset + t && v.size(0) == offset + t && v.size(1) == kv_heads &&
                  k.size(2) == dim && v.size(2) == dim,
              "k and v hold the offset's positions and q's");
  TORCH_CHECK(dim % 32 == 0 && dim <= kMaxDim, "head dim a multiple of 32, at most 256");
  TORCH_CHECK(heads % kv_heads == 0, "query heads a multiple of KV heads");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 &&
                  q.stride(1) == dim && k.stride(1) == dim && v.stride(1) == dim,
              "each row's heads are contiguous");
  return {t, heads, dim, kv_heads};
}

// The rows kernels' output: `into` where the caller hands one (the run's rows of the step's
// output, so that nothing is copied after), else a new tensor.
torch::Tensor fresh_output(const c10::optional<torch::Tensor>& into, const torch::Tensor& q) {
  if (!into.has_value()) return torch::empty(q.sizes(), q.options());
  TORCH_CHECK(into->sizes() == q.sizes() && into->scalar_type() == q.scalar_type() &&
                  into->is_contiguous(),
              "into is [T, heads, dim] like q, of its dtype, contiguous");
  return *into;
}
#endif

#if defined(PDSERVE_AVX512BF16)
namespace {

constexpr int64_t kSpan = 2 * kKeys;  // keys per step of the online softmax: two packed blocks
constexpr int kVecs = kSpan / 16;  // float32 vectors of a row's scores in a step
constexpr int kBlockVecs = kKeys / 16;  // the same in a block (the float32 kernel's step)

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// 2^x for a visible score less its row's maximum (finite, x <= 0; masked lanes are zeroed by the
// caller): x = n + f, n = floor(x), f in [0, 1) (vreduceps), 2^f by a degree-4 polynomial
// (relative error 2.7e-6, fitted in relative error at Chebyshev nodes), 2^n by vscalef, which
// floors x itself (under ~-150 the result is 0). The probabilities are rounded to bf16 (2^-9)
// before P V, so the error is far below what the product sees; 6 instructions where exp2_below
// takes 10 (the softmax shares the FMA pipes with vdpbf16ps).
inline __m512 exp2_probability(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(0.013534167241309986f), _mm512_set1_ps(0.052011461907022605f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.24144275612530625f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(0.6930038346109163f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.0000025933668424f));
  return _mm512_scalef_ps(p, x);
}


// Keys [first, first + kKeys) of one KV head as [words][kKeys] 32-bit words (a bf16 pair or a
// float32; `words` per key, zero past t): 16 keys' word w is one gather. Scalar stores, key by
// key, with the heads on threads (3 KV heads on 2), took 15% of a 542-token SmolLM2 call.
void gather_keys(const char* k, int64_t stride_bytes, int64_t t, int64_t words, int64_t first,
                 uint32_t* kw) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i rows = _mm512_mullo_epi32(lane, _mm512_set1_epi32(static_cast<int>(stride_bytes)));
  for (int64_t g = 0; g < kKeys / 16; ++g) {
    const int64_t key = first + 16 * g;
    const int64_t live = std::clamp<int64_t>(t - key, 0, 16);
    const __mmask16 mask = live == 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
    const char* base = k + (live ? key : 0) * stride_bytes;
    for (int64_t w = 0; w < words; ++w) {
      const __m512i word =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask, rows, base + 4 * w, 1);
      _mm512_storeu_si512(kw + w * kKeys + 16 * g, word);
    }
  }
}

// vpermt2w's indices that interleave two vectors of 32 words a and c: out[2i] = a[i],
// out[2i + 1] = c[i], over their first 16 words (Offset 0) or their last 16 (Offset 16).
template <int Offset>
constexpr std::array<int16_t, 32> interleave() {
  std::array<int16_t, 32> index{};
  for (int i = 0; i < 32; ++i) index[i] = static_cast<int16_t>((i % 2) * 32 + Offset + i / 2);
  return index;
}
alignas(64) constexpr std::array<int16_t, 32> kInterleaveLow = interleave<0>();
alignas(64) constexpr std::array<int16_t, 32> kInterleaveHigh = interleave<16>();

// Block `b` of one KV head: its keys as [dim / 2][kKeys][2] and its values as
// [kKeys / 2][dim][2], zero past t; a key pair's value rows interleave through one permute per
// 16 dims.
void pack_block(const bf16* k, const bf16* v, int64_t k_stride, int64_t v_stride, int64_t t,
                int64_t dim, int64_t b, bf16* kb, bf16* vb) {
  const int64_t first = b * kKeys;
  gather_keys(reinterpret_cast<const char*>(k), k_stride * 2, t, dim / 2, first,
              reinterpret_cast<uint32_t*>(kb));
  const __m512i low = _mm512_load_si512(kInterleaveLow.data());
  const __m512i high = _mm512_load_si512(kInterleaveHigh.data());
  for (int64_t p = 0; p < kKeys / 2; ++p) {
    const int64_t key = first + 2 * p;
    bf16* out = vb + p * dim * 2;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i a = key < t ? _mm512_loadu_si512(v + key * v_stride + d) : _mm512_setzero_si512();
      const __m512i c = key + 1 < t ? _mm512_loadu_si512(v + (key + 1) * v_stride + d)
                                    : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * d, _mm512_permutex2var_epi16(a, low, c));
      _mm512_storeu_si512(out + 2 * d + 32, _mm512_permutex2var_epi16(a, high, c));
    }
  }
}

// Scores of kRows query rows (bf16 pairs) against the first J vectors of 16 keys of a block,
// scaled, into out[row * kKeys + key]: J known at compile time keeps the accumulators in
// registers. Every row of the group is stored (rows is a multiple of kRows).
template <int J>
void block_scores(const bf16* kb, const uint32_t* const* qr, int64_t dim, float scale,
                  float* out, int64_t stride) {
  __m512 sc[kRows][J];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < J; ++j) sc[i][j] = _mm512_setzero_ps();
  for (int64_t d2 = 0; d2 < dim / 2; ++d2) {
    __m512i kv[J];
    for (int j = 0; j < J; ++j) kv[j] = _mm512_loadu_si512(kb + (d2 * kKeys + 16 * j) * 2);
    for (int i = 0; i < kRows; ++i) {
      const __m512i qq = _mm512_set1_epi32(static_cast<int>(qr[i][d2]));
      for (int j = 0; j < J; ++j) sc[i][j] = _mm512_dpbf16_ps(sc[i][j], as_bh(qq), as_bh(kv[j]));
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < J; ++j)
      _mm512_storeu_ps(out + i * stride + 16 * j, _mm512_mul_ps(sc[i][j], _mm512_set1_ps(scale)));
}

// The same for float32 queries against keys packed [dim][kKeys].
template <int J>
void block_scores(const float* kb, const float* const* qr, int64_t dim, float scale,
                  float* out) {
  __m512 sc[kRows][J];
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < J; ++j) sc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    __m512 kv[J];
    for (int j = 0; j < J; ++j) kv[j] = _mm512_loadu_ps(kb + d * kKeys + 16 * j);
    for (int i = 0; i < kRows; ++i) {
      const __m512 qq = _mm512_set1_ps(qr[i][d]);
      for (int j = 0; j < J; ++j) sc[i][j] = _mm512_fmadd_ps(qq, kv[j], sc[i][j]);
    }
  }
  for (int i = 0; i < kRows; ++i)
    for (int j = 0; j < J; ++j)
      _mm512_storeu_ps(out + i * kKeys + 16 * j, _mm512_mul_ps(sc[i][j], _mm512_set1_ps(scale)));
}

}  // namespace
#endif

// The AVX2 build's fresh-prompt attention, both dtypes: float32 FMA throughout (bf16 has no
// multiply here), the same tiles and online softmax as the avx512 kernels with 8-lane vectors.
// bf16 inputs are widened as they are packed and the output is rounded once (probabilities stay
// float32: closer to the definition than torch's bf16 flash attention, which rounds them).
// Keys of a KV head are transposed into blocks [dim][kKeys], values kept as rows [key][dim],
// all float32. Register tiles of kFmaRows rows x 16 keys (scores) and kFmaRows rows x 16 output
// dims (P V): 12 accumulators, 2 loads and 6 broadcasts per 12 FMAs, within AVX2's 16 registers
// (4 rows, 8 accumulators: a 542-token SmolLM2 call 1.86-1.92 ms against 1.74-1.78, 2 threads
// of a Zen 5 at this level, 3 alternating runs). Scores are scaled into base 2 and their exps
// taken by exp2_finite (simd.h), as the avx512 kernels take them: a call 1.86 -> 1.81 ms (bf16),
// 1.84 -> 1.82 (float32) against ATen's exp_u20 (medians of 5 alternating runs; the error
// against the float64 definition as before, the output's rounding's). Key chunks past a tile's
// last position are skipped (the diagonal block's upper triangle). torch's
// SDPA (GQA expanded) ran at ~50 GFLOP/s on SmolLM2's shapes at 542 tokens on a 2-core AVX2
// EPYC, a sixth of a prefill's time.
#if defined(PDSERVE_AVX2) && !defined(PDSERVE_AVX512BF16)
namespace {

constexpr int64_t kChunk = 16;  // keys (scores) or output dims (P V) per register tile
constexpr int64_t kFmaRows = 6;  // query rows per register tile


template <typename T>
torch::Tensor fresh_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, double scale, int64_t offset,
                              const c10::optional<torch::Tensor>& into, torch::ScalarType dtype) {
  const auto shape = check_fresh(q, k, v, offset, dtype);
  const int64_t t = shape[0], heads = shape[1], dim = shape[2], kv_heads = shape[3];
  const int64_t ctx = offset + t;  // keys: the cached positions, then the run's
  const int64_t group = heads / kv_heads;
  const int64_t rows = kTile * group;
  const int64_t blocks = (ctx + kKeys - 1) / kKeys;
  const int64_t per_head = blocks * kKeys * dim;
  auto out = fresh_output(into, q);
  // zero past T: masked scores meet finite keys, zero probabilities finite values
  auto kpack = torch::zeros({kv_heads, per_head}, q.options().dtype(torch::kFloat));
  auto vpack = torch::zeros({kv_heads, per_head}, q.options().dtype(torch::kFloat));
  const T* qp = q.data_ptr<T>();
  const T* kptr = k.data_ptr<T>();
  const T* vptr = v.data_ptr<T>();
  float* kpp = kpack.data_ptr<float>();
  float* vpp = vpack.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t j = 0; j < ctx; ++j) {
        const T* kr = kptr + j * ks + g * dim;
        float* kb = kpp + g * per_head + (j / kKeys) * kKeys * dim + j % kKeys;
        for (int64_t d = 0; d < dim; ++d) kb[d * kKeys] = static_cast<float>(kr[d]);
        float* vr = vpp + g * per_head + j * dim;
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(vr + d, load8(vptr + j * vs + g * dim + d));
      }
    }
  });
  const std::vector<Tile> tiles = balanced_tiles(kv_heads, t);
  const __m256 vscale = _mm256_set1_ps(static_cast<float>(scale) * kLog2e);  // scores in base 2
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    // every row of a register tile is stored, rows past n too: room for whole tiles
    const int64_t padded = (rows + kFmaRows - 1) / kFmaRows * kFmaRows;
    std::vector<float> acc(padded * dim), scores(padded * kKeys), qrows(rows * dim);
    std::vector<float> row_max(rows), row_sum(rows), alphas(rows);
    for (int64_t job = begin; job < end; ++job) {
      const Tile tile = tiles[job];
      const int64_t positions = std::min(kTile, t - tile.start);
      const int64_t n = positions * group;  // row r = position r / group, head r % group
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        for (int64_t d = 0; d < dim; d += 8) _mm256_storeu_ps(&qrows[r * dim + d], load8(qp + pos * qs + head * dim + d));
      }
      std::fill(acc.begin(), acc.begin() + n * dim, 0.f);
      std::fill(row_max.begin(), row_max.begin() + n, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + n, 0.f);
      const int64_t last = offset + tile.start + positions - 1;
      const float* kb_all = kpp + tile.kv_head * per_head;
      const float* vb_all = vpp + tile.kv_head * per_head;
      for (int64_t b = 0; b * kKeys <= last; ++b) {
        const float* kb = kb_all + b * kKeys * dim;
        const float* vb = vb_all + b * kKeys * dim;
        const int64_t span = std::min(kKeys, last - b * kKeys + 1);  // keys any row sees
        const int64_t chunks = (span + kChunk - 1) / kChunk;
        for (int64_t r0 = 0; r0 < n; r0 += kFmaRows) {
          const int64_t live = std::min(kFmaRows, n - r0);
          const float* qr[kFmaRows];  // rows past n repeat the group's first
          PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) qr[i] = &qrows[(r0 + (i < live ? i : 0)) * dim];
          for (int64_t c = 0; c < chunks; ++c) {
            __m256 sc[kFmaRows][2];
            PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) sc[i][0] = sc[i][1] = _mm256_setzero_ps();
            const float* kc = kb + c * kChunk;
            for (int64_t d = 0; d < dim; ++d) {
              const __m256 k0 = _mm256_loadu_ps(kc + d * kKeys), k1 = _mm256_loadu_ps(kc + d * kKeys + 8);
              PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) {
                const __m256 qq = _mm256_broadcast_ss(qr[i] + d);
                sc[i][0] = _mm256_fmadd_ps(qq, k0, sc[i][0]);
                sc[i][1] = _mm256_fmadd_ps(qq, k1, sc[i][1]);
              }
            }
            PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) {
              float* s = &scores[(r0 + i) * kKeys + c * kChunk];
              _mm256_storeu_ps(s, _mm256_mul_ps(sc[i][0], vscale));
              _mm256_storeu_ps(s + 8, _mm256_mul_ps(sc[i][1], vscale));
            }
          }
        }
        // Online softmax, row by row; keys past the row's position (and chunks not computed)
        // are masked; the probabilities replace the scores.
        for (int64_t r = 0; r < n; ++r) {
          const int64_t pos = offset + tile.start + r / group;
          float* s = &scores[r * kKeys];
          const int64_t visible = std::clamp<int64_t>(pos - b * kKeys + 1, 0, kKeys);
          const int64_t vecs = (visible + 7) / 8;
          __m256 sv[kKeys / 8];
          __m256 mx = neg_inf;
          for (int64_t j = 0; j < vecs; ++j) {
            const __m256i in = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(visible - 8 * j)), lane);
            sv[j] = _mm256_blendv_ps(neg_inf, _mm256_loadu_ps(s + 8 * j), _mm256_castsi256_ps(in));
            mx = _mm256_max_ps(mx, sv[j]);
          }
          const float m = std::max(row_max[r], hmax(mx));
          alphas[r] = std::exp2(row_max[r] - m);  // 0 on the first block
          row_max[r] = m;
          const __m256 mv = _mm256_set1_ps(m), floor = _mm256_set1_ps(-200.f);
          __m256 sum = _mm256_setzero_ps();
          for (int64_t j = 0; j < vecs; ++j) {  // masked keys (-inf) and 2^-200 give 0
            const __m256 p = exp2_finite(_mm256_max_ps(_mm256_sub_ps(sv[j], mv), floor));
            sum = _mm256_add_ps(sum, p);
            _mm256_storeu_ps(s + 8 * j, p);
          }
          for (int64_t j = vecs * 8; j < span; ++j) s[j] = 0.f;  // keys this row cannot see
          row_sum[r] = row_sum[r] * alphas[r] + hsum(sum);
        }
        // acc = acc * alpha + P V over the keys any row sees, kFmaRows rows x 16 dims at a time.
        for (int64_t r0 = 0; r0 < n; r0 += kFmaRows) {
          const int64_t live = std::min(kFmaRows, n - r0);
          int64_t rr[kFmaRows];
          PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) rr[i] = r0 + (i < live ? i : 0);
          for (int64_t d = 0; d < dim; d += kChunk) {
            __m256 c[kFmaRows][2];
            PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) {
              const __m256 a = _mm256_set1_ps(alphas[rr[i]]);
              c[i][0] = _mm256_mul_ps(_mm256_loadu_ps(&acc[rr[i] * dim + d]), a);
              c[i][1] = _mm256_mul_ps(_mm256_loadu_ps(&acc[rr[i] * dim + d + 8]), a);
            }
            for (int64_t key = 0; key < span; ++key) {
              const __m256 v0 = _mm256_loadu_ps(vb + key * dim + d), v1 = _mm256_loadu_ps(vb + key * dim + d + 8);
              PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) {
                const __m256 pq = _mm256_broadcast_ss(&scores[rr[i] * kKeys + key]);
                c[i][0] = _mm256_fmadd_ps(pq, v0, c[i][0]);
                c[i][1] = _mm256_fmadd_ps(pq, v1, c[i][1]);
              }
            }
            // every row of the group is stored (rows past n are never read): a loop bound
            // known at compile time keeps c in registers
            PDSERVE_UNROLL for (int i = 0; i < kFmaRows; ++i) {
              _mm256_storeu_ps(&acc[(r0 + i) * dim + d], c[i][0]);
              _mm256_storeu_ps(&acc[(r0 + i) * dim + d + 8], c[i][1]);
            }
          }
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        const __m256 inv = _mm256_set1_ps(1.f / row_sum[r]);
        T* dst = op + (pos * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 8) store8(dst + d, _mm256_mul_ps(_mm256_loadu_ps(&acc[r * dim + d]), inv));
      }
    }
  });
  return out;
}

}  // namespace
#endif

torch::Tensor prefill_attention_bf16(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into) {
#if defined(PDSERVE_AVX2) && !defined(PDSERVE_AVX512BF16)
  return fresh_attention<bf16>(q, k, v, scale, offset, into, torch::kBFloat16);
#elif !defined(PDSERVE_AVX512BF16)
  TORCH_CHECK(false, "prefill_attention_bf16 needs an avx2 or avx512 build");
  return q;
#else
  const auto shape = check_fresh(q, k, v, offset, torch::kBFloat16);
  const int64_t t = shape[0], heads = shape[1], dim = shape[2], kv_heads = shape[3];
  const int64_t ctx = offset + t;  // keys: the cached positions, then the run's
  const int64_t group = heads / kv_heads;
  const int64_t rows = kTile * group;  // query rows of a tile
  const int64_t blocks = (ctx + kKeys - 1) / kKeys;
  auto out = fresh_output(into, q);
  auto kpack = torch::empty({kv_heads, blocks * kKeys * dim}, q.options());
  auto vpack = torch::empty({kv_heads, blocks * kKeys * dim}, q.options());
  const bf16* qp = q.data_ptr<bf16>();
  const bf16* kptr = k.data_ptr<bf16>();
  const bf16* vptr = v.data_ptr<bf16>();
  bf16* kpp = kpack.data_ptr<bf16>();
  bf16* vpp = vpack.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, b = item % blocks;
      const int64_t at = (g * blocks + b) * kKeys * dim;
      pack_block(kptr + g * dim, vptr + g * dim, ks, vs, ctx, dim, b, kpp + at, vpp + at);
    }
  });

  const std::vector<Tile> tiles = balanced_tiles(kv_heads, t);
  const float fscale = static_cast<float>(scale) * kLog2e;  // scores in base 2
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows * dim);              // output rows, float32
    std::vector<float> scores(rows * kSpan);         // one step's scores
    std::vector<bf16> probs(rows * kSpan);           // rounded to bf16 for P V
    std::vector<float> row_max(rows), alphas(rows);
    std::vector<__m512> row_sum(rows);  // per row, by lane: summed once at the end
    std::vector<uint32_t> qrows(rows * dim / 2);     // the tile's query rows as bf16 pairs
    for (int64_t job = begin; job < end; ++job) {
      const Tile tile = tiles[job];
      const int64_t positions = std::min(kTile, t - tile.start);
      const int64_t n = positions * group;  // rows in use; row r = position r / group, head r % group
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        std::memcpy(&qrows[r * dim / 2], qp + pos * qs + head * dim, dim * sizeof(bf16));
      }
      std::fill(acc.begin(), acc.begin() + n * dim, 0.f);
      std::fill(row_max.begin(), row_max.begin() + n, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + n, _mm512_setzero_ps());
      const int64_t last = offset + tile.start + positions - 1;  // the tile's last position
      const bf16* kb_all = kpp + tile.kv_head * blocks * kKeys * dim;
      const bf16* vb_all = vpp + tile.kv_head * blocks * kKeys * dim;
      for (int64_t b = 0; b * kSpan <= last; ++b) {
        const bf16* kb = kb_all + b * kSpan * dim;
        const bf16* vb = vb_all + b * kSpan * dim;
        // Keys past the tile's last position (the diagonal block's upper part) are never
        // computed: only the first `vecs` vectors of 16 keys (the rows' masks zero the rest, so
        // the sums are the same bits).
        const int64_t span = std::min(kSpan, last - b * kSpan + 1);
        const int vecs = static_cast<int>((span + 15) / 16);
        for (int64_t r0 = 0; r0 < n; r0 += kRows) {
          const int64_t live = std::min(kRows, n - r0);
          const uint32_t* qr[kRows];  // rows past n repeat the group's first
          for (int i = 0; i < kRows; ++i) qr[i] = &qrows[(r0 + (i < live ? i : 0)) * dim / 2];
          for (int half = 0; half * 4 < vecs; ++half) {
            const bf16* kh = kb + half * kKeys * dim;
            float* dst = &scores[r0 * kSpan + half * kKeys];
            switch (vecs - 4 * half) {
              case 1: block_scores<1>(kh, qr, dim, fscale, dst, kSpan); break;
              case 2: block_scores<2>(kh, qr, dim, fscale, dst, kSpan); break;
              case 3: block_scores<3>(kh, qr, dim, fscale, dst, kSpan); break;
              default: block_scores<4>(kh, qr, dim, fscale, dst, kSpan); break;
            }
          }
        }
        // Online softmax, row by row, over the step's first `vecs` vectors (the rest are never
        // read); keys past the row's position are masked out of the maximum and their
        // probabilities are zero.
        for (int64_t r = 0; r < n; ++r) {
          const int64_t pos = offset + tile.start + r / group;
          const float* s = &scores[r * kSpan];
          const int64_t visible = std::clamp<int64_t>(pos - b * kSpan + 1, 0, kSpan);
          __m512 sv[kVecs];
          __mmask16 seen[kVecs];
          __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
          for (int j = 0; j < kVecs; ++j) {
            if (j >= vecs) break;
            const int64_t in = std::clamp<int64_t>(visible - 16 * j, 0, 16);
            seen[j] = in == 16 ? 0xFFFF : static_cast<__mmask16>((1u << in) - 1);
            sv[j] = _mm512_loadu_ps(s + 16 * j);
            mx = _mm512_mask_max_ps(mx, seen[j], mx, sv[j]);
          }
          const float m = std::max(row_max[r], _mm512_reduce_max_ps(mx));
          // 0 on the first block (2^-200 is 0 in float32)
          alphas[r] = m == row_max[r] ? 1.f : _mm512_cvtss_f32(exp2_below(_mm512_set1_ps(row_max[r] - m)));
          row_max[r] = m;
          const __m512 mv = _mm512_set1_ps(m);
          __m512 sum = _mm512_setzero_ps();
          for (int j = 0; j < kVecs; j += 2) {  // pairs: the second past vecs is zeros, unread
            if (j >= vecs) break;
            const __m512 p0 = _mm512_maskz_mov_ps(seen[j], exp2_probability(_mm512_sub_ps(sv[j], mv)));
            const __m512 p1 = j + 1 < vecs ? _mm512_maskz_mov_ps(seen[j + 1], exp2_probability(_mm512_sub_ps(sv[j + 1], mv)))
                                           : _mm512_setzero_ps();
            sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
            // probabilities to bf16 (round to nearest even)
            _mm512_storeu_si512(&probs[r * kSpan + 16 * j], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p1, p0)));
          }
          row_sum[r] = _mm512_add_ps(_mm512_mul_ps(row_sum[r], _mm512_set1_ps(alphas[r])), sum);
        }
        // acc = acc * alpha + P V, kRows rows at a time: each row's kSpan / 2 probability pairs
        // against the values' key pairs, 64 output dims at a time (the values' loads shared by
        // the rows).
        const uint32_t* pp = reinterpret_cast<const uint32_t*>(probs.data());
        for (int64_t r0 = 0; r0 < n; r0 += kRows) {
          const int64_t live = std::min(kRows, n - r0);
          for (int64_t d = 0; d < dim; d += 64) {
            const int64_t width = std::min<int64_t>(64, dim - d) / 16;  // vectors
            __m512 c[kRows][4];
            for (int i = 0; i < kRows; ++i) {
              const int64_t r = r0 + (i < live ? i : 0);
              const __m512 a = _mm512_set1_ps(alphas[r]);
              for (int j = 0; j < 4; ++j) {
                c[i][j] = j < width ? _mm512_mul_ps(_mm512_loadu_ps(&acc[r * dim + d + j * 16]), a)
                                    : _mm512_setzero_ps();
              }
            }
            for (int64_t k2 = 0; k2 < 8 * vecs; ++k2) {  // zero probabilities past them
              const bf16* vrow = vb + (k2 * dim + d) * 2;
              __m512i vv[4];
              for (int j = 0; j < 4; ++j) {
                vv[j] = j < width ? _mm512_loadu_si512(vrow + j * 32) : _mm512_setzero_si512();
              }
              for (int i = 0; i < kRows; ++i) {
                const int64_t r = r0 + (i < live ? i : 0);
                const __m512i pq = _mm512_set1_epi32(static_cast<int>(pp[r * kSpan / 2 + k2]));
                for (int j = 0; j < 4; ++j) c[i][j] = _mm512_dpbf16_ps(c[i][j], as_bh(pq), as_bh(vv[j]));
              }
            }
            for (int i = 0; i < live; ++i) {
              for (int j = 0; j < width; ++j) _mm512_storeu_ps(&acc[(r0 + i) * dim + d + j * 16], c[i][j]);
            }
          }
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        const float inv = 1.f / _mm512_reduce_add_ps(row_sum[r]);
        bf16* dst = op + (pos * heads + head) * dim;
        const float* o = &acc[r * dim];
        for (int64_t d = 0; d < dim; d += 32) {
          const __m512bh h = _mm512_cvtne2ps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + d + 16), _mm512_set1_ps(inv)),
                                                 _mm512_mul_ps(_mm512_loadu_ps(o + d), _mm512_set1_ps(inv)));
          _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(h));
        }
      }
    }
  });
  return out;
#endif
}

// The same in float32 for the avx512 build (FMA, no bf16 rounding anywhere): keys of a KV head
// transposed into blocks [dim][kKeys], values as they are ([kKeys][dim]), probabilities kept in
// float32. torch's SDPA took 5.4 ms per layer on a 542-token SmolLM2 prompt (2 threads, the
// math path for float32 with GQA expanded), a fifth of the float32 prefill.
torch::Tensor prefill_attention_f32(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    double scale, int64_t offset,
                                    c10::optional<torch::Tensor> into) {
#if defined(PDSERVE_AVX2) && !defined(PDSERVE_AVX512BF16)
  return fresh_attention<float>(q, k, v, scale, offset, into, torch::kFloat);
#elif !defined(PDSERVE_AVX512BF16)
  TORCH_CHECK(false, "prefill_attention_f32 needs an avx2 or avx512 build");
  return q;
#else
  const auto shape = check_fresh(q, k, v, offset, torch::kFloat);
  const int64_t t = shape[0], heads = shape[1], dim = shape[2], kv_heads = shape[3];
  const int64_t ctx = offset + t;  // keys: the cached positions, then the run's
  const int64_t group = heads / kv_heads;
  const int64_t rows = kTile * group;
  const int64_t blocks = (ctx + kKeys - 1) / kKeys;
  const int64_t per_head = blocks * kKeys * dim;
  auto out = fresh_output(into, q);
  auto kpack = torch::empty({kv_heads, per_head}, q.options());
  auto vpack = torch::empty({kv_heads, per_head}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kptr = k.data_ptr<float>();
  const float* vptr = v.data_ptr<float>();
  float* kpp = kpack.data_ptr<float>();
  float* vpp = vpack.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  // Keys transposed by gathers, values row by row, zero past the keys; (KV head, block) on threads.
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, first = item % blocks * kKeys;
      float* vb = vpp + g * per_head + first * dim;
      gather_keys(reinterpret_cast<const char*>(kptr + g * dim), ks * 4, ctx, dim, first,
                  reinterpret_cast<uint32_t*>(kpp + g * per_head + first * dim));
      const int64_t live = std::clamp<int64_t>(ctx - first, 0, kKeys);
      for (int64_t j = 0; j < live; ++j) {
        std::memcpy(vb + j * dim, vptr + (first + j) * vs + g * dim, dim * sizeof(float));
      }
      std::fill(vb + live * dim, vb + kKeys * dim, 0.f);
    }
  });
  const std::vector<Tile> tiles = balanced_tiles(kv_heads, t);
  const float fscale = static_cast<float>(scale) * kLog2e;  // scores in base 2
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(rows * dim), scores(rows * kKeys), qrows(rows * dim);
    std::vector<float> row_max(rows), row_sum(rows), alphas(rows);
    for (int64_t job = begin; job < end; ++job) {
      const Tile tile = tiles[job];
      const int64_t positions = std::min(kTile, t - tile.start);
      const int64_t n = positions * group;  // row r = position r / group, head r % group
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        std::memcpy(&qrows[r * dim], qp + pos * qs + head * dim, dim * sizeof(float));
      }
      std::fill(acc.begin(), acc.begin() + n * dim, 0.f);
      std::fill(row_max.begin(), row_max.begin() + n, -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.begin() + n, 0.f);
      const int64_t last = offset + tile.start + positions - 1;
      const float* kb_all = kpp + tile.kv_head * per_head;
      const float* vb_all = vpp + tile.kv_head * per_head;
      for (int64_t b = 0; b * kKeys <= last; ++b) {
        const float* kb = kb_all + b * kKeys * dim;
        const float* vb = vb_all + b * kKeys * dim;
        // as the bf16 kernel: keys past the tile's last position are never computed
        const int64_t span = std::min(kKeys, last - b * kKeys + 1);
        const int vecs = static_cast<int>((span + 15) / 16);
        for (int64_t r0 = 0; r0 < n; r0 += kRows) {
          const int64_t live = std::min(kRows, n - r0);
          const float* qr[kRows];
          for (int i = 0; i < kRows; ++i) qr[i] = &qrows[(r0 + (i < live ? i : 0)) * dim];
          float* dst = &scores[r0 * kKeys];
          switch (vecs) {
            case 1: block_scores<1>(kb, qr, dim, fscale, dst); break;
            case 2: block_scores<2>(kb, qr, dim, fscale, dst); break;
            case 3: block_scores<3>(kb, qr, dim, fscale, dst); break;
            default: block_scores<kBlockVecs>(kb, qr, dim, fscale, dst); break;
          }
        }
        const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t r = 0; r < n; ++r) {
          const int64_t pos = offset + tile.start + r / group;
          float* s = &scores[r * kKeys];
          const int64_t visible = std::clamp<int64_t>(pos - b * kKeys + 1, 0, kKeys);
          __m512 sv[kBlockVecs];
          __m512 mx = neg_inf;
          for (int j = 0; j < kBlockVecs; ++j) {
            const int64_t in = std::clamp<int64_t>(visible - 16 * j, 0, 16);
            const __mmask16 mask = in == 16 ? 0xFFFF : (1u << in) - 1;
            sv[j] = _mm512_mask_blend_ps(mask, neg_inf, _mm512_loadu_ps(s + 16 * j));
            mx = _mm512_max_ps(mx, sv[j]);
          }
          const float m = std::max(row_max[r], _mm512_reduce_max_ps(mx));
          alphas[r] = std::exp2(row_max[r] - m);
          row_max[r] = m;
          const __m512 mv = _mm512_set1_ps(m);
          __m512 sum = _mm512_setzero_ps();
          for (int j = 0; j < vecs; ++j) {  // the vectors past vecs would add zeros
            const __m512 p = exp2_below(_mm512_sub_ps(sv[j], mv));
            sum = _mm512_add_ps(sum, p);
            _mm512_storeu_ps(s + 16 * j, p);  // the probabilities replace the scores
          }
          row_sum[r] = row_sum[r] * alphas[r] + _mm512_reduce_add_ps(sum);
        }
        // acc = acc * alpha + P V, kRows rows at a time, 64 output dims at a time.
        for (int64_t r0 = 0; r0 < n; r0 += kRows) {
          const int64_t live = std::min(kRows, n - r0);
          for (int64_t d = 0; d < dim; d += 64) {
            const int64_t width = std::min<int64_t>(64, dim - d) / 16;
            __m512 c[kRows][4];
            for (int i = 0; i < kRows; ++i) {
              const int64_t r = r0 + (i < live ? i : 0);
              const __m512 a = _mm512_set1_ps(alphas[r]);
              for (int j = 0; j < 4; ++j) {
                c[i][j] = j < width ? _mm512_mul_ps(_mm512_loadu_ps(&acc[r * dim + d + j * 16]), a)
                                    : _mm512_setzero_ps();
              }
            }
            for (int64_t key = 0; key < 16 * vecs; ++key) {  // zero probabilities past them
              const float* vrow = vb + key * dim + d;
              __m512 vv[4];
              for (int j = 0; j < 4; ++j) vv[j] = j < width ? _mm512_loadu_ps(vrow + j * 16) : _mm512_setzero_ps();
              for (int i = 0; i < kRows; ++i) {
                const int64_t r = r0 + (i < live ? i : 0);
                const __m512 pq = _mm512_set1_ps(scores[r * kKeys + key]);
                for (int j = 0; j < 4; ++j) c[i][j] = _mm512_fmadd_ps(pq, vv[j], c[i][j]);
              }
            }
            for (int i = 0; i < live; ++i) {
              for (int j = 0; j < width; ++j) _mm512_storeu_ps(&acc[(r0 + i) * dim + d + j * 16], c[i][j]);
            }
          }
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = tile.start + r / group, head = tile.kv_head * group + r % group;
        const __m512 inv = _mm512_set1_ps(1.f / row_sum[r]);
        float* dst = op + (pos * heads + head) * dim;
        for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(&acc[r * dim + d]), inv));
      }
    }
  });
  return out;
#endif
}
