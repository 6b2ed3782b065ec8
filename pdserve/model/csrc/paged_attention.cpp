// Fused paged attention on CPU, straight from the paged KV cache, without gathering blocks or a
// per-block loop in Python: prefill over a cached prefix (a run of queries of one sequence)
// through a flash-style tile (attend_tile, below), decode (one query token per sequence) in two
// passes over each part of a sequence's keys and values (decode_head; parts of up to 512
// positions, merged after: DecodePart); scores, softmax and the weighted
// sum of values are accumulated in float32 whatever the cache dtype. Work is split with
// at::parallel_for, so torch's thread settings apply. Decode:
//
// q:            [D, heads, dim]                       (float32 or bfloat16, contiguous)
// cache:        [num_blocks, 2, kv_heads, block, dim] (same dtype, contiguous)
// block_tables: [D, max_blocks] int32 (entries past a sequence's blocks are ignored)
// lengths:      [D] int32, context length of each sequence (>= 1)
// window:       0, or the sliding window: a query at position p sees only [p - window + 1, p]
//               (Hugging Face's sliding_window), positions before that are never read
// returns       [D, heads, dim] in q's dtype

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

// Plain conversions the compiler can vectorize (bfloat16 is the top half of a float32).
inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Prefill over a cached prefix: query i (position first + i) attends to positions [0, first + i]
// (with a window, the last `window` of them).
// Flash-style over the context in chunks of W positions read straight from the paged blocks:
// per (KV head, tile of queries), each chunk's keys are widened and transposed once into float
// [dim][W] and its values widened into [W][dim], shared by the tile's query rows; each row's W
// scores are a register-resident vector, and an online softmax folds the chunk's values into
// float32 accumulators. No gather of the context, no mask tensor.
constexpr int64_t W = 16;

#ifdef PDSERVE_AVX2
// The kernels' vectors (the decode kernels', the tiles' exponentials): eight floats on AVX2
// builds; sixteen on AVX512 builds (the decode kernels: for head dims a multiple of 16). The
// eight-wide kernels were bound by their instructions' count and, in
// the values' fold, by few FMA chains (R rows x 2 vectors); sixteen wide the fold takes R rows x
// C vectors (C = 4 for dims a multiple of 64: 12 chains for SmolLM2's 3 query rows a KV head).
// SmolLM2's decode attention at 560 positions, hot, bf16, 2 threads of an AMX Xeon, per layer:
// batch 1 25.6 -> 22.7 us, batch 4 71 -> 60 (with decode_head's rows found a block at a time:
// 17.7 and 52).
struct Lanes8 {
  using V = __m256;
  static constexpr int64_t width = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return widen8(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm256_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V floor(V a) { return _mm256_floor_ps(a); }
  static V pow2n(V n) {  // 2^n for an integral n in the exponent's range
    const __m256i e = _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127));
    return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
  }
  // [sum a, sum b, sum c, sum d]
  static __m128 sum4(V a, V b, V c, V d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
};
#endif

#ifdef PDSERVE_AVX512BF16
struct Lanes16 {
  using V = __m512;
  static constexpr int64_t width = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return widen16(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V fnma(V a, V b, V c) { return _mm512_fnmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V floor(V a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
  static V pow2n(V n) {
    const __m512i e = _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127));
    return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
  }
  static __m128 sum4(V a, V b, V c, V d) { return hsum4(a, b, c, d); }
};
#endif

#ifdef PDSERVE_AVX2
// e^x for x <= 88 (Cephes' polynomial, as avx_mathfun's; relative error ~1e-7), once for both
// widths: each lane computes the same operations in the same order at either width.
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};
template <class L>
inline typename L::V exp_lanes(typename L::V x) {
  x = L::max(x, L::set1(-87.f));
  const typename L::V fx = L::floor(L::fma(x, L::set1(1.44269504088896341f), L::set1(0.5f)));
  typename L::V r = L::fnma(fx, L::set1(0.693359375f), x);
  r = L::fnma(fx, L::set1(-2.12194440e-4f), r);
  typename L::V y = L::set1(kExpPoly[0]);
  PDSERVE_UNROLL
  for (int i = 1; i < 6; ++i) y = L::fma(y, r, L::set1(kExpPoly[i]));
  y = L::fma(y, L::mul(r, r), L::add(r, L::set1(1.f)));
  return L::mul(y, L::pow2n(fx));
}

inline __m256 exp256(__m256 x) { return exp_lanes<Lanes8>(x); }
#endif

// Folds one chunk (its positions [lo, n) of W visible to this row) into the row's running max
// m, sum of exponentials total and unnormalised output acc [dim]. The chunk's keys and values
// before lo are finite (zero where nothing may be read).
inline void fold_chunk(const float* qr, const float* kt, const float* vf, int64_t lo, int64_t n,
                       int64_t dim, float& m, float& total, float* acc) {
#ifdef PDSERVE_AVX2
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 qd = _mm256_set1_ps(qr[d]);
    s0 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + d * W), s0);
    s1 = _mm256_fmadd_ps(qd, _mm256_loadu_ps(kt + d * W + 8), s1);
  }
  const __m256 index0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 index1 = _mm256_add_ps(index0, _mm256_set1_ps(8.f));
  const __m256 limit = _mm256_set1_ps(static_cast<float>(n));
  const __m256 start = _mm256_set1_ps(static_cast<float>(lo));
  const __m256 visible0 = _mm256_and_ps(_mm256_cmp_ps(index0, limit, _CMP_LT_OQ),
                                        _mm256_cmp_ps(index0, start, _CMP_GE_OQ));
  const __m256 visible1 = _mm256_and_ps(_mm256_cmp_ps(index1, limit, _CMP_LT_OQ),
                                        _mm256_cmp_ps(index1, start, _CMP_GE_OQ));
  const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  s0 = _mm256_blendv_ps(low, s0, visible0);
  s1 = _mm256_blendv_ps(low, s1, visible1);
  const float mx = std::max(m, hmax(_mm256_max_ps(s0, s1)));
  const __m256 top = _mm256_set1_ps(mx);
  const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(s0, top)), visible0);
  const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(s1, top)), visible1);
  const float correction = std::exp(m - mx);
  total = total * correction + hsum(_mm256_add_ps(p0, p1));
  m = mx;
  alignas(32) float p[W];
  _mm256_store_ps(p, p0);
  _mm256_store_ps(p + 8, p1);
  const __m256 corr = _mm256_set1_ps(correction);
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(acc + d), corr);
    for (int64_t j = lo; j < n; ++j) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vf + j * dim + d), a);
    }
    _mm256_storeu_ps(acc + d, a);
  }
  for (; d < dim; ++d) {
    float a = acc[d] * correction;
    for (int64_t j = lo; j < n; ++j) a += p[j] * vf[j * dim + d];
    acc[d] = a;
  }
#else
  float s[W];
  float mx = m;
  for (int64_t j = lo; j < n; ++j) {
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += qr[d] * kt[d * W + j];
    s[j] = dot;
    mx = std::max(mx, dot);
  }
  const float correction = std::exp(m - mx);
  total *= correction;
  for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
  for (int64_t j = lo; j < n; ++j) {
    const float p = std::exp(s[j] - mx);
    total += p;
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * vf[j * dim + d];
  }
  m = mx;
#endif
}

// fold_chunk for four rows at once: each key and value vector loaded is used by all four.
inline void fold_chunk4(const float* const* qr, const float* kt, const float* vf,
                        const int64_t* lo, const int64_t* n, int64_t dim, float* m, float* total,
                        float* const* acc) {
#ifdef PDSERVE_AVX2
  constexpr int K = 4;
  __m256 s[K][2];
  for (int i = 0; i < K; ++i) s[i][0] = s[i][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * W), k1 = _mm256_loadu_ps(kt + d * W + 8);
    for (int i = 0; i < K; ++i) {
      const __m256 qd = _mm256_set1_ps(qr[i][d]);
      s[i][0] = _mm256_fmadd_ps(qd, k0, s[i][0]);
      s[i][1] = _mm256_fmadd_ps(qd, k1, s[i][1]);
    }
  }
  const __m256 index0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 index1 = _mm256_add_ps(index0, _mm256_set1_ps(8.f));
  const __m256 low = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(32) float p[K][W];
  float corr[K];
  int64_t widest = 0;
  for (int i = 0; i < K; ++i) {
    if (n[i] <= lo[i]) {  // nothing visible to this row in this chunk: it stays as it was
      std::fill(p[i], p[i] + W, 0.f);
      corr[i] = 1.f;
      continue;
    }
    widest = std::max(widest, n[i]);
    const __m256 limit = _mm256_set1_ps(static_cast<float>(n[i]));
    const __m256 start = _mm256_set1_ps(static_cast<float>(lo[i]));
    const __m256 vis0 = _mm256_and_ps(_mm256_cmp_ps(index0, limit, _CMP_LT_OQ),
                                      _mm256_cmp_ps(index0, start, _CMP_GE_OQ));
    const __m256 vis1 = _mm256_and_ps(_mm256_cmp_ps(index1, limit, _CMP_LT_OQ),
                                      _mm256_cmp_ps(index1, start, _CMP_GE_OQ));
    const __m256 a = _mm256_blendv_ps(low, s[i][0], vis0);
    const __m256 b = _mm256_blendv_ps(low, s[i][1], vis1);
    const float mx = std::max(m[i], hmax(_mm256_max_ps(a, b)));
    const __m256 top = _mm256_set1_ps(mx);
    const __m256 p0 = _mm256_and_ps(exp256(_mm256_sub_ps(a, top)), vis0);
    const __m256 p1 = _mm256_and_ps(exp256(_mm256_sub_ps(b, top)), vis1);
    corr[i] = std::exp(m[i] - mx);
    total[i] = total[i] * corr[i] + hsum(_mm256_add_ps(p0, p1));
    m[i] = mx;
    _mm256_store_ps(p[i], p0);  // zero outside [lo[i], n[i])
    _mm256_store_ps(p[i] + 8, p1);
  }
  int64_t d = 0;
  for (; d + 16 <= dim; d += 16) {  // 16 dims of four rows in registers across the chunk
    __m256 a[K][2];
    for (int i = 0; i < K; ++i) {
      const __m256 c = _mm256_set1_ps(corr[i]);
      a[i][0] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d), c);
      a[i][1] = _mm256_mul_ps(_mm256_loadu_ps(acc[i] + d + 8), c);
    }
    for (int64_t j = 0; j < widest; ++j) {
      const __m256 v0 = _mm256_loadu_ps(vf + j * dim + d);
      const __m256 v1 = _mm256_loadu_ps(vf + j * dim + d + 8);
      for (int i = 0; i < K; ++i) {
        const __m256 pj = _mm256_set1_ps(p[i][j]);
        a[i][0] = _mm256_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm256_fmadd_ps(pj, v1, a[i][1]);
      }
    }
    for (int i = 0; i < K; ++i) {
      _mm256_storeu_ps(acc[i] + d, a[i][0]);
      _mm256_storeu_ps(acc[i] + d + 8, a[i][1]);
    }
  }
  for (; d < dim; ++d) {
    for (int i = 0; i < K; ++i) {
      float a = acc[i][d] * corr[i];
      for (int64_t j = 0; j < widest; ++j) a += p[i][j] * vf[j * dim + d];
      acc[i][d] = a;
    }
  }
#else
  for (int i = 0; i < 4; ++i) {
    if (n[i] > lo[i]) fold_chunk(qr[i], kt, vf, lo[i], n[i], dim, m[i], total[i], acc[i]);
  }
#endif
}

#ifdef PDSERVE_AVX512BF16

// fold_chunk4 for K <= 8 rows on AVX512: a chunk's W positions are one vector, and each key and
// value vector loaded serves K rows (at eight, a third of fold_chunk4's instructions per row;
// a decode query's K = 3 heads of a group run their dot products' FMA chains side by side
// where fold_chunk runs them one row after another). Every lane computes what fold_chunk4's
// (and fold_chunk's) does, in the same order, and the sums across lanes are taken in the same
// tree: a row's bits do not depend on the fold that took it.
template <int K>
inline void fold_rows(const float* const* qr, const float* kt, const float* vf, const int64_t* lo,
                      const int64_t* n, int64_t dim, float* m, float* total, float* const* acc) {
  static_assert(W == 16 && K >= 1 && K <= 8, "a chunk is one 16-lane vector; at most 8 rows");
  __m512 s[K];
  PDSERVE_UNROLL
  for (int i = 0; i < K; ++i) s[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k = _mm512_loadu_ps(kt + d * W);
    PDSERVE_UNROLL
    for (int i = 0; i < K; ++i) s[i] = _mm512_fmadd_ps(_mm512_set1_ps(qr[i][d]), k, s[i]);
  }
  const __m512 low = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  alignas(64) float p[K][W];
  float corr[K];
  int64_t widest = 0;
  for (int i = 0; i < K; ++i) {
    if (n[i] <= lo[i]) {  // nothing visible to this row in this chunk: it stays as it was
      std::fill(p[i], p[i] + W, 0.f);
      corr[i] = 1.f;
      continue;
    }
    widest = std::max(widest, n[i]);
    const __mmask16 visible =
        static_cast<__mmask16>(((1u << n[i]) - 1) & ~((1u << lo[i]) - 1));
    const __m512 a = _mm512_mask_mov_ps(low, visible, s[i]);
    const float mx = std::max(
        m[i], hmax(_mm256_max_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1))));
    const __m512 shifted = _mm512_sub_ps(a, _mm512_set1_ps(mx));
    const __m512 e = _mm512_maskz_mov_ps(visible, exp_lanes<Lanes16>(shifted));
    corr[i] = std::exp(m[i] - mx);
    total[i] = total[i] * corr[i] +
               hsum(_mm256_add_ps(_mm512_castps512_ps256(e), _mm512_extractf32x8_ps(e, 1)));
    m[i] = mx;
    _mm512_store_ps(p[i], e);  // zero outside [lo[i], n[i])
  }
  int64_t d = 0;
  for (; d + 32 <= dim; d += 32) {  // 32 dims of eight rows in registers across the chunk
    __m512 a[K][2];
    PDSERVE_UNROLL
    for (int i = 0; i < K; ++i) {
      const __m512 c = _mm512_set1_ps(corr[i]);
      a[i][0] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d), c);
      a[i][1] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d + 16), c);
    }
    for (int64_t j = 0; j < widest; ++j) {
      const __m512 v0 = _mm512_loadu_ps(vf + j * dim + d);
      const __m512 v1 = _mm512_loadu_ps(vf + j * dim + d + 16);
      PDSERVE_UNROLL
      for (int i = 0; i < K; ++i) {
        const __m512 pj = _mm512_set1_ps(p[i][j]);
        a[i][0] = _mm512_fmadd_ps(pj, v0, a[i][0]);
        a[i][1] = _mm512_fmadd_ps(pj, v1, a[i][1]);
      }
    }
    PDSERVE_UNROLL
    for (int i = 0; i < K; ++i) {
      _mm512_storeu_ps(acc[i] + d, a[i][0]);
      _mm512_storeu_ps(acc[i] + d + 16, a[i][1]);
    }
  }
  for (; d + 16 <= dim; d += 16) {
    __m512 a[K];
    PDSERVE_UNROLL
    for (int i = 0; i < K; ++i) {
      a[i] = _mm512_mul_ps(_mm512_loadu_ps(acc[i] + d), _mm512_set1_ps(corr[i]));
    }
    for (int64_t j = 0; j < widest; ++j) {
      const __m512 v = _mm512_loadu_ps(vf + j * dim + d);
      PDSERVE_UNROLL
      for (int i = 0; i < K; ++i) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(p[i][j]), v, a[i]);
    }
    PDSERVE_UNROLL
    for (int i = 0; i < K; ++i) _mm512_storeu_ps(acc[i] + d, a[i]);
  }
  for (; d < dim; ++d) {  // as fold_chunk4's remainder
    for (int i = 0; i < K; ++i) {
      float a = acc[i][d] * corr[i];
      for (int64_t j = 0; j < widest; ++j) a += p[i][j] * vf[j * dim + d];
      acc[i][d] = a;
    }
  }
}
#endif

#ifdef PDSERVE_AVX512BF16
// fold_rows for k = 1..8 rows.
inline void fold_some(int k, const float* const* qr, const float* kt, const float* vf,
                      const int64_t* lo, const int64_t* n, int64_t dim, float* m, float* total,
                      float* const* acc) {
  switch (k) {
    case 8: return fold_rows<8>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 7: return fold_rows<7>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 6: return fold_rows<6>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 5: return fold_rows<5>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 4: return fold_rows<4>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 3: return fold_rows<3>(qr, kt, vf, lo, n, dim, m, total, acc);
    case 2: return fold_rows<2>(qr, kt, vf, lo, n, dim, m, total, acc);
    default: return fold_rows<1>(qr, kt, vf, lo, n, dim, m, total, acc);
  }
}

// r[i][j] <- r[j][i] for a 16 x 16 block of floats held as sixteen vectors.
inline void transpose16(__m512* r) {
  __m512 t[16];
  PDSERVE_UNROLL
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: rows i, i+1 interleaved
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  PDSERVE_UNROLL
  for (int i = 0; i < 16; i += 4) {  // per lane: column k of rows i..i+3 in r[i + k]
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  __m512 out[16];
  PDSERVE_UNROLL
  for (int k = 0; k < 4; ++k) {  // lane L of r[4i + k] is column 4L + k of rows 4i..4i+3
    const __m512 a = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 b = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 c = _mm512_shuffle_f32x4(r[k], r[4 + k], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512 d = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], _MM_SHUFFLE(3, 1, 3, 1));
    out[k] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0));
    out[k + 4] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(2, 0, 2, 0));
    out[k + 8] = _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1));
    out[k + 12] = _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 1, 3, 1));
  }
  PDSERVE_UNROLL
  for (int i = 0; i < 16; ++i) r[i] = out[i];
}

// attend_tile's chunk of W whole positions from c0 (key(pos): the position's key row, its value
// row kv_stride further), as the element-by-element loop lays it out: keys widened and
// transposed into kt [dim][W] sixteen dims at a time, values widened into vf [W][dim]. The same
// floats; where a tile has few rows to share a chunk this counts: --deterministic's decode
// attention (a query a tile) at 16 x 540 positions 0.82 -> 0.68 ms a layer, a 540-token run's
// tiles within noise (2 threads, AMX Xeon, bf16).
template <typename Key>
inline void widen_chunk16(const Key& key, int64_t c0, int64_t kv_stride, int64_t dim, float* kt,
                          float* vf) {
  decltype(key(c0)) rows[W];
  for (int64_t j = 0; j < W; ++j) rows[j] = key(c0 + j);
  for (int64_t d0 = 0; d0 < dim; d0 += 16) {
    __m512 r[W];
    PDSERVE_UNROLL
    for (int64_t j = 0; j < W; ++j) {
      r[j] = Lanes16::load(rows[j] + d0);
      _mm512_storeu_ps(vf + j * dim + d0, Lanes16::load(rows[j] + kv_stride + d0));
    }
    transpose16(r);
    PDSERVE_UNROLL
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + i) * W, r[i]);
  }
}
#endif

// Per-thread working memory of attend_tile for up to `rows` query rows.
struct Scratch {
  std::vector<float> kt, vf, qf, acc, mx, sum;
  Scratch(int64_t dim, int64_t rows)
      : kt(dim * W), vf(W * dim), qf(rows * dim), acc(rows * dim), mx(rows), sum(rows) {}
};

// Queries q0 .. q0 + nq - 1 of one sequence (query i at position first + i, seeing positions
// [0, first + i], or with a window > 0 the last `window` of them) for the query heads of KV head
// kh: q and out point at the sequence's query 0 ([queries, heads, dim]), table at its block
// table. Positions no query of the tile sees are never read: a windowed layer's blocks behind
// the window may hold nothing of this sequence's.
template <typename T>
void attend_tile(const T* q, const T* cache, const int32_t* table, T* out, int64_t q0, int64_t nq,
                 int64_t kh, int64_t first, int64_t window, int64_t heads, int64_t kv_heads,
                 int64_t block, int64_t dim, float scale, Scratch& w) {
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = block * dim, kv_stride = kv_heads * head_stride;
  const int64_t block_stride = 2 * kv_stride;
  float *kt = w.kt.data(), *vf = w.vf.data(), *qf = w.qf.data(), *acc = w.acc.data();
  float *mx = w.mx.data(), *sum = w.sum.data();
  const int64_t rows = nq * group;  // row r: query q0 + r / group, head kh * group + r % group
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = q + ((q0 + r / group) * heads + kh * group + r % group) * dim;
    for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = to_float(src[d]) * scale;
  }
  std::fill(acc, acc + rows * dim, 0.f);
  std::fill(mx, mx + rows, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rows, 0.f);
  const int64_t last = first + q0 + nq;  // positions the tile needs: [begin, last)
  const int64_t begin = window > 0 ? std::max<int64_t>(0, first + q0 - window + 1) : 0;
  // a row's first visible position (its window's start)
  auto start = [&](int64_t r) {
    return window > 0 ? std::max<int64_t>(0, first + q0 + r / group - window + 1) : 0;
  };
  for (int64_t c0 = begin / W * W; c0 < last; c0 += W) {
    const int64_t width = std::min(W, last - c0);
    const int64_t skip = std::max<int64_t>(0, begin - c0);  // positions of the chunk not read
    auto key = [&](int64_t pos) {
      return cache + table[pos / block] * block_stride + kh * head_stride + (pos % block) * dim;
    };
#ifdef PDSERVE_AVX512BF16
    if (width == W && skip == 0 && dim % 16 == 0) {
      widen_chunk16(key, c0, kv_stride, dim, kt, vf);
    } else
#endif
    {
      if (width < W || skip > 0) std::fill(kt, kt + dim * W, 0.f);  // their scores are masked
      if (skip > 0) std::fill(vf, vf + skip * dim, 0.f);
      for (int64_t j = skip; j < width; ++j) {
        const T* k = key(c0 + j);
        const T* v = k + kv_stride;
        for (int64_t d = 0; d < dim; ++d) {
          kt[d * W + j] = to_float(k[d]);
          vf[j * dim + d] = to_float(v[d]);
        }
      }
    }
    // Row r sees the chunk's positions [lo, n) (causal, windowed); on AVX512 eight rows at a
    // time and the rest in one fold, elsewhere four at a time and the rest one by one.
    auto visible = [&](int64_t r) { return std::min(width, first + q0 + r / group + 1 - c0); };
    auto hidden = [&](int64_t r) { return std::clamp<int64_t>(start(r) - c0, 0, W); };
    int64_t r = 0;
#ifdef PDSERVE_AVX512BF16
    while (r < rows) {  // eight rows at a time, then the rest in one fold
      const int k = static_cast<int>(std::min<int64_t>(8, rows - r));
      const float* qs[8];
      float* as[8];
      int64_t ls[8], ns[8];
      for (int i = 0; i < k; ++i) {
        qs[i] = qf + (r + i) * dim;
        as[i] = acc + (r + i) * dim;
        ls[i] = hidden(r + i);
        ns[i] = visible(r + i);
      }
      fold_some(k, qs, kt, vf, ls, ns, dim, mx + r, sum + r, as);
      r += k;
    }
#endif
    for (; r + 4 <= rows; r += 4) {
      const float* qs[4];
      float* as[4];
      int64_t ls[4], ns[4];
      for (int i = 0; i < 4; ++i) {
        qs[i] = qf + (r + i) * dim;
        as[i] = acc + (r + i) * dim;
        ls[i] = hidden(r + i);
        ns[i] = visible(r + i);
      }
      fold_chunk4(qs, kt, vf, ls, ns, dim, mx + r, sum + r, as);
    }
    for (; r < rows; ++r) {
      const int64_t lo = hidden(r), n = visible(r);
      if (n <= lo) continue;
      fold_chunk(qf + r * dim, kt, vf, lo, n, dim, mx[r], sum[r], acc + r * dim);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    T* dst = out + ((q0 + r / group) * heads + kh * group + r % group) * dim;
    const float inv = 1.f / sum[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[r * dim + d] * inv);
  }
}

template <typename T>
void prefill_kernel(const T* q, const T* cache, const int32_t* table, T* out, int64_t queries,
                    int64_t heads, int64_t kv_heads, int64_t block, int64_t dim,
                    int64_t context, int64_t window, float scale) {
  constexpr int64_t TILE = 32;  // queries per work item
  const int64_t tiles = (queries + TILE - 1) / TILE;
  at::parallel_for(0, kv_heads * tiles, 1, [&](int64_t begin, int64_t end) {
    Scratch w(dim, TILE * (heads / kv_heads));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t kh = item / tiles, q0 = (item % tiles) * TILE;
      attend_tile(q, cache, table, out, q0, std::min(TILE, queries - q0), kh, context - queries,
                  window, heads, kv_heads, block, dim, scale, w);
    }
  });
}

// Decode: each sequence's one query, for the `group` query heads of one KV head, in two passes
// over the visible positions. Pass 1 dots every key row (read once, in place, contiguous) with
// the group's rows, four positions at a time into one vector of scores each; then a plain
// softmax of the scores; pass 2 folds the value rows in chunks of DECODE_CHUNK positions (held
// in L1 while every dimension of every row takes them). The flash-style tile above widens and
// transposes each chunk of keys element by element, and a tile of one query cannot share that
// work: 4 sequences of 560 positions on SmolLM2 took 6.6 ms a step (30 layers, bf16, Zen 4,
// 2 threads) through it, 4.5-5 ms this way (1.8 ms with the cache's blocks hot: the rest is
// reading them).
constexpr int64_t DECODE_CHUNK = 64;

// A thread's items, cold, read their cache lines at ~10 GB/s: the dot products' chains keep few
// loads in flight, and a software prefetch of a position's own block a few blocks ahead came
// too late (no change). Prefetching the *next* item's key and value rows, spread over this
// item's first pass (a few lines every four positions), and the first item's own value rows
// likewise, gives them time: per layer of a cold step, 1.16-1.58x in bf16 and 1.01-1.36x in
// fp32 on a 2-core Zen 4 (benchmarks/decode_attention.py, 1-64 sequences of 512-1200
// positions); a few us slower per step where the rows are few and cached. Only the loads move;
// the sums are the same.
class Prefetcher {
 public:
  // Spans of `span_bytes` (a multiple of 64: one KV head's rows of a block).
  void set_span(int64_t span_bytes) { span_lines_ = span_bytes / 64; }
  // Queue the span at `p`.
  void add(const void* p) { spans_.push_back(static_cast<const char*>(p)); }
  // Spread what is queued over `steps` calls of step().
  void start(int64_t steps) {
    const int64_t lines = static_cast<int64_t>(spans_.size()) * span_lines_;
    per_ = steps > 0 ? (lines + steps - 1) / steps : lines;
  }
  void step() {
    for (int64_t k = 0; k < per_ && span_ < spans_.size(); ++k) {
      __builtin_prefetch(spans_[span_] + 64 * line_);
      if (++line_ == span_lines_) {
        line_ = 0;
        ++span_;
      }
    }
  }
  void reserve(int64_t spans) { spans_.reserve(spans); }
  void clear() {
    spans_.clear();
    per_ = line_ = 0;
    span_ = 0;
  }

 private:
  std::vector<const char*> spans_;
  int64_t span_lines_ = 0, per_ = 0, line_ = 0;
  size_t span_ = 0;
};

struct DecodeScratch {
  std::vector<float> qf, scores, acc, total;
  std::vector<const void*> keys;  // each visible position's key row (its value row kv_stride on)
  Prefetcher ahead;
};

#ifdef PDSERVE_AVX2
// Scores of R query rows (qf, dim floats each, already scaled) against four key rows k[0..3]
// into s[r * stride + 0..3]; dim a multiple of L::width.
template <class L, int R, typename T>
inline void dot4(const float* qf, const T* const* k, int64_t dim, float* s, int64_t stride) {
  typename L::V acc[R][4];
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    PDSERVE_UNROLL
    for (int j = 0; j < 4; ++j) acc[r][j] = L::zero();
  }
  for (int64_t d = 0; d < dim; d += L::width) {
    const typename L::V k0 = L::load(k[0] + d), k1 = L::load(k[1] + d);
    const typename L::V k2 = L::load(k[2] + d), k3 = L::load(k[3] + d);
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      const typename L::V qd = L::load(qf + r * dim + d);
      acc[r][0] = L::fma(qd, k0, acc[r][0]);
      acc[r][1] = L::fma(qd, k1, acc[r][1]);
      acc[r][2] = L::fma(qd, k2, acc[r][2]);
      acc[r][3] = L::fma(qd, k3, acc[r][3]);
    }
  }
  PDSERVE_UNROLL
  for (int r = 0; r < R; ++r) {
    _mm_storeu_ps(s + r * stride, L::sum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  }
}

// acc[r * dim + d] += sum over j < n of p[r * stride + j] * v[j][d] for R rows, C vectors of
// dimensions at a time (dim a multiple of C * L::width). Each dimension is its own chain over
// j in order, so C changes no bit.
template <class L, int R, int C, typename T>
inline void fold_values(const float* p, int64_t stride, const T* const* v, int64_t n,
                        int64_t dim, float* acc) {
  for (int64_t d = 0; d < dim; d += C * L::width) {
    typename L::V a[R][C];
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) a[r][c] = L::load(acc + r * dim + d + c * L::width);
    }
    for (int64_t j = 0; j < n; ++j) {
      typename L::V vc[C];
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) vc[c] = L::load(v[j] + d + c * L::width);
      PDSERVE_UNROLL
      for (int r = 0; r < R; ++r) {
        const typename L::V pj = L::set1(p[r * stride + j]);
        PDSERVE_UNROLL
        for (int c = 0; c < C; ++c) a[r][c] = L::fma(pj, vc[c], a[r][c]);
      }
    }
    PDSERVE_UNROLL
    for (int r = 0; r < R; ++r) {
      PDSERVE_UNROLL
      for (int c = 0; c < C; ++c) L::store(acc + r * dim + d + c * L::width, a[r][c]);
    }
  }
}

// Calls f(std::integral_constant<int, R>, r) for the query rows [r, r + R) of `rows`, four at
// most a call (their accumulators stay in registers).
template <typename F>
inline void by_four_rows(int64_t rows, const F& f) {
  for (int64_t r = 0; r < rows; r += 4) {
    switch (std::min<int64_t>(4, rows - r)) {
      case 4: f(std::integral_constant<int, 4>{}, r); break;
      case 3: f(std::integral_constant<int, 3>{}, r); break;
      case 2: f(std::integral_constant<int, 2>{}, r); break;
      default: f(std::integral_constant<int, 1>{}, r); break;
    }
  }
}

template <typename T>
inline void dot4_rows(const float* qf, int64_t rows, const T* const* k, int64_t dim, float* s,
                      int64_t stride) {
  by_four_rows(rows, [&](auto group, int64_t r) {
    constexpr int R = decltype(group)::value;
#ifdef PDSERVE_AVX512BF16
    if (dim % 16 == 0) return dot4<Lanes16, R>(qf + r * dim, k, dim, s + r * stride, stride);
#endif
    dot4<Lanes8, R>(qf + r * dim, k, dim, s + r * stride, stride);
  });
}

template <typename T>
inline void fold_values_rows(const float* p, int64_t stride, int64_t rows, const T* const* v,
                             int64_t n, int64_t dim, float* acc) {
  by_four_rows(rows, [&](auto group, int64_t r) {
    constexpr int R = decltype(group)::value;
    const float* pr = p + r * stride;
    float* a = acc + r * dim;
#ifdef PDSERVE_AVX512BF16
    if (dim % 64 == 0) return fold_values<Lanes16, R, 4>(pr, stride, v, n, dim, a);
    if (dim % 32 == 0) return fold_values<Lanes16, R, 2>(pr, stride, v, n, dim, a);
    if (dim % 16 == 0) return fold_values<Lanes16, R, 1>(pr, stride, v, n, dim, a);
#endif
    if (dim % 16 == 0) return fold_values<Lanes8, R, 2>(pr, stride, v, n, dim, a);
    fold_values<Lanes8, R, 1>(pr, stride, v, n, dim, a);
  });
}
#endif

// The group's query rows of KV head kh (q and out at the sequence's [heads, dim]) over the
// positions [begin, length) of the sequence whose block table is `table`.
//
// Whether decode_head's passes go four positions (values: a chunk of rows) at a time through
// the vector kernels, and so step the prefetcher decode_kernel fills: AVX2 and AVX512 builds,
// head dims a multiple of 8.
constexpr bool vector_rows(int64_t dim) {
#ifdef PDSERVE_AVX2
  return dim % 8 == 0;
#else
  return dim < 0;  // never
#endif
}

// The positions [begin, begin + n) of a part (DecodePart below); `partial` null: the output
// rows, normalised, into `out`; else the part's unnormalised rows, then each row's maximum
// score and its sum of exps, for merge_parts.
template <typename T>
void decode_head(const T* q, const T* cache, const int32_t* table, T* out, int64_t begin,
                 int64_t n, int64_t kh, int64_t heads, int64_t kv_heads, int64_t block,
                 int64_t dim, float scale, DecodeScratch& w, float* partial) {
  const int64_t group = heads / kv_heads;
  const int64_t head_stride = block * dim, kv_stride = kv_heads * head_stride;
  const int64_t block_stride = 2 * kv_stride;
  w.qf.resize(group * dim);
  w.scores.resize(group * n);
  w.acc.assign(group * dim, 0.f);
  w.total.resize(group);
  float *qf = w.qf.data(), *s = w.scores.data(), *acc = w.acc.data(), *total = w.total.data();
  for (int64_t r = 0; r < group; ++r) {
    const T* src = q + (kh * group + r) * dim;
    for (int64_t d = 0; d < dim; ++d) qf[r * dim + d] = to_float(src[d]) * scale;
  }
  // Every visible position's key row, walked block by block (a division per position, twice,
  // cost a quarter of the kernel's time hot).
  w.keys.resize(n);
  const T** keys = reinterpret_cast<const T**>(w.keys.data());
  for (int64_t i = 0; i < n;) {
    const int64_t pos = begin + i;
    const T* row = cache + table[pos / block] * block_stride + kh * head_stride;
    for (int64_t o = pos % block; o < block && i < n; ++o, ++i) keys[i] = row + o * dim;
  }
  // Pass 1: every visible position's score for each row.
  int64_t i = 0;
#ifdef PDSERVE_AVX2
  if (vector_rows(dim)) {
    w.ahead.start(n / 4);
    for (; i + 4 <= n; i += 4) {
      w.ahead.step();
      dot4_rows(qf, group, keys + i, dim, s + i, n);
    }
  }
#endif
  for (; i < n; ++i) {
    const T* k = keys[i];
    for (int64_t r = 0; r < group; ++r) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += qf[r * dim + d] * to_float(k[d]);
      s[r * n + i] = dot;
    }
  }
  // Softmax of each row's scores, unnormalised (divided by the sum at the end).
  for (int64_t r = 0; r < group; ++r) {
    float* row = s + r * n;
    float mx = -std::numeric_limits<float>::infinity();
    int64_t j = 0;
#ifdef PDSERVE_AVX2
    __m256 m8 = _mm256_set1_ps(mx);
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(row + j));
    mx = hmax(m8);
#endif
    for (; j < n; ++j) mx = std::max(mx, row[j]);
    if (partial != nullptr) partial[group * dim + r] = mx;
    j = 0;
    float sum = 0.f;
#ifdef PDSERVE_AVX2
    const __m256 top = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), top));
      _mm256_storeu_ps(row + j, e);
      sum8 = _mm256_add_ps(sum8, e);
    }
    sum = hsum(sum8);
#endif
    for (; j < n; ++j) {
      row[j] = std::exp(row[j] - mx);
      sum += row[j];
    }
    total[r] = sum;
  }
  // Pass 2: the values, weighted, DECODE_CHUNK positions at a time.
  const T* v[DECODE_CHUNK];
  for (int64_t c = 0; c < n; c += DECODE_CHUNK) {
    const int64_t width = std::min(DECODE_CHUNK, n - c);
    for (int64_t j = 0; j < width; ++j) v[j] = keys[c + j] + kv_stride;
#ifdef PDSERVE_AVX2
    if (vector_rows(dim)) {
      fold_values_rows(s + c, n, group, v, width, dim, acc);
      continue;
    }
#endif
    for (int64_t r = 0; r < group; ++r) {
      for (int64_t j = 0; j < width; ++j) {
        const float p = s[r * n + c + j];
        for (int64_t d = 0; d < dim; ++d) acc[r * dim + d] += p * to_float(v[j][d]);
      }
    }
  }
  if (partial != nullptr) {
    std::copy(acc, acc + group * dim, partial);
    std::copy(total, total + group, partial + group * dim + group);
    return;
  }
  for (int64_t r = 0; r < group; ++r) {
    T* dst = out + (kh * group + r) * dim;
    const float inv = 1.f / total[r];
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[r * dim + d] * inv);
  }
}

// A sequence's decode attention is split into parts of at most kDecodePart positions (equal
// parts, their number set by the visible length alone, so a sequence's output does not depend
// on the batch or the threads), each a work item, merged in order after. One sequence's KV heads
// alone (3 for SmolLM2 on 2 threads) left a thread idle for a third of the kernel, and an item
// of thousands of positions outgrew L2 with the next item's rows prefetched beside it: per
// layer, cold, SmolLM2 bf16, 2 threads of a Zen 5 (medians of 3 alternating runs), 1 x 2,048
// positions 113 -> 62 us, 1 x 8,192 520 -> 250, 4 x 4,096 674 -> 506, 16 x 600 352 -> 261; 4 x
// 560 and 64 x 600 level (50-53, 1,076-1,085); parts of 256 or 1,024 no better.
constexpr int64_t kDecodePart = 512;

struct DecodePart {
  int64_t seq, kh, begin, n;  // positions [begin, begin + n) of KV head kh
  int64_t slot;               // its partial rows' slot, or -1 (the sequence's only part)
};

// A (sequence, KV head) in parts: their slots [first_slot, first_slot + parts).
struct SplitHead {
  int64_t seq, kh, first_slot, parts;
};

// Floats of a part's slot: the group's rows, then their maxima and sums (decode_head's
// `partial`).
inline int64_t slot_floats(int64_t group, int64_t dim) { return group * (dim + 2); }

// out = sum_p acc_p e^(m_p - m) / sum_p total_p e^(m_p - m) over the parts of `head`, m the
// largest m_p, p in order.
template <typename T>
void merge_parts(const float* slots, const SplitHead& head, int64_t group, int64_t dim, T* out,
                 std::vector<float>& acc) {
  const int64_t slot_size = slot_floats(group, dim), first = head.first_slot, parts = head.parts;
  acc.assign(group * dim, 0.f);
  for (int64_t r = 0; r < group; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) m = std::max(m, slots[(first + p) * slot_size + group * dim + r]);
    float total = 0.f;
    float* a = acc.data() + r * dim;
    for (int64_t p = 0; p < parts; ++p) {
      const float* slot = slots + (first + p) * slot_size;
      const float f = std::exp(slot[group * dim + r] - m);
      total += slot[group * dim + group + r] * f;
      for (int64_t d = 0; d < dim; ++d) a[d] += slot[r * dim + d] * f;
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) out[r * dim + d] = static_cast<T>(a[d] * inv);
  }
}

// `exact` (--deterministic): each sequence's query as a tile of one through attend_tile, the
// prefix runs' own code, so a position's attention is the same bits whether it was decoded or
// recomputed in a run (a preempted request, the canary); otherwise decode_head.
template <typename T>
void decode_kernel(const T* q, const T* cache, const int32_t* tables, const int32_t* lengths,
                   T* out, int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t block,
                   int64_t dim, int64_t max_blocks, int64_t window, float scale, bool exact) {
  if (exact) {
    at::parallel_for(0, num_seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch w(dim, heads / kv_heads);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / kv_heads, kh = item % kv_heads;
        attend_tile(q + s * heads * dim, cache, tables + s * max_blocks, out + s * heads * dim,
                    0, 1, kh, lengths[s] - 1, window, heads, kv_heads, block, dim, scale, w);
      }
    });
    return;
  }
  const int64_t group = heads / kv_heads;
  std::vector<DecodePart> items;
  std::vector<SplitHead> split;
  items.reserve(num_seqs * kv_heads);
  int64_t slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t length = lengths[s];
    const int64_t first = window > 0 ? std::max<int64_t>(0, length - window) : 0;
    const int64_t n = length - first;
    const int64_t parts = (n + kDecodePart - 1) / kDecodePart;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      if (parts <= 1) {
        items.push_back({s, kh, first, n, -1});
        continue;
      }
      split.push_back({s, kh, slots, parts});
      for (int64_t p = 0; p < parts; ++p) {
        const int64_t b = first + n * p / parts, e = first + n * (p + 1) / parts;
        items.push_back({s, kh, b, e - b, slots++});
      }
    }
  }
  std::vector<float> partials(slots * slot_floats(group, dim));
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    DecodeScratch w;
    w.ahead.reserve(3 * max_blocks);  // the most one item queues: its values, the next's rows
    const int64_t head_bytes = block * dim * static_cast<int64_t>(sizeof(T));
    w.ahead.set_span(head_bytes);
    const bool prefetch = vector_rows(dim) && head_bytes % 64 == 0;  // decode_head steps it
    // one KV head's rows of every block of item `it`: keys (0) or values (1)
    auto queue = [&](int64_t it, int half) {
      const DecodePart& part = items[it];
      for (int64_t b = part.begin / block; b < (part.begin + part.n + block - 1) / block; ++b) {
        const int64_t entry = tables[part.seq * max_blocks + b];
        w.ahead.add(cache + ((entry * 2 + half) * kv_heads + part.kh) * block * dim);
      }
    };
    for (int64_t item = begin; item < end; ++item) {
      const DecodePart& part = items[item];
      w.ahead.clear();
      if (prefetch) {
        if (item == begin) queue(item, 1);  // this item's values: nothing fetched them earlier
        if (item + 1 < end) {
          queue(item + 1, 0);
          queue(item + 1, 1);
        }
      }
      const int64_t s = part.seq;
      decode_head(q + s * heads * dim, cache, tables + s * max_blocks, out + s * heads * dim,
                  part.begin, part.n, part.kh, heads, kv_heads, block, dim, scale, w,
                  part.slot < 0 ? nullptr : partials.data() + part.slot * slot_floats(group, dim));
    }
  });
  at::parallel_for(0, static_cast<int64_t>(split.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc;
    for (int64_t i = begin; i < end; ++i) {
      const SplitHead& head = split[i];
      merge_parts(partials.data(), head, group, dim,
                  out + (head.seq * heads + head.kh * group) * dim, acc);
    }
  });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                               torch::Tensor lengths, double scale, int64_t window, bool exact) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "q [D, heads, dim], cache [N, 2, kvh, bs, dim]");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "q and cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must share a dtype");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && lengths.scalar_type() == torch::kInt32,
              "block_tables and lengths are int32");
  auto tables = block_tables.contiguous();
  auto lens = lengths.contiguous();
  const int64_t num_seqs = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(2), block = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(tables.size(0) == num_seqs && lens.size(0) == num_seqs, "one row per sequence");
  TORCH_CHECK(window >= 0, "window is 0 (none) or positive");
  auto out = torch::empty_like(q);
  const int64_t max_blocks = tables.size(1);
  if (q.scalar_type() == torch::kFloat) {
    decode_kernel<float>(q.data_ptr<float>(), cache.data_ptr<float>(), tables.data_ptr<int32_t>(),
                         lens.data_ptr<int32_t>(), out.data_ptr<float>(), num_seqs, heads,
                         kv_heads, block, dim, max_blocks, window, static_cast<float>(scale),
                         exact);
  } else if (q.scalar_type() == torch::kBFloat16) {
    using B = at::BFloat16;
    decode_kernel<B>(q.data_ptr<B>(), cache.data_ptr<B>(), tables.data_ptr<int32_t>(),
                     lens.data_ptr<int32_t>(), out.data_ptr<B>(), num_seqs, heads, kv_heads,
                     block, dim, max_blocks, window, static_cast<float>(scale), exact);
  } else {
    TORCH_CHECK(false, "paged_decode_attention supports float32 and bfloat16");
  }
  return out;
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor cache,
                                     torch::Tensor block_tables, torch::Tensor lengths,
                                     double scale, int64_t window) {
  return decode_attention(q, cache, block_tables, lengths, scale, window, false);
}

torch::Tensor paged_decode_attention_exact(torch::Tensor q, torch::Tensor cache,
                                           torch::Tensor block_tables, torch::Tensor lengths,
                                           double scale, int64_t window) {
  return decode_attention(q, cache, block_tables, lengths, scale, window, true);
}

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor cache,
                                      torch::Tensor block_table, int64_t context_len,
                                      double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "q [Q, heads, dim], cache [N, 2, kvh, bs, dim]");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "q and cache must be contiguous");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "q and cache must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && block_table.dim() == 1,
              "block_table is [blocks] int32");
  const int64_t queries = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = cache.size(2), block = cache.size(3);
  TORCH_CHECK(cache.size(4) == dim && heads % kv_heads == 0, "head shapes do not match");
  TORCH_CHECK(queries >= 1 && context_len >= queries, "1 <= queries <= context_len");
  TORCH_CHECK(block_table.size(0) * block >= context_len, "the block table covers the context");
  TORCH_CHECK(window >= 0, "window is 0 (none) or positive");
  auto table = block_table.contiguous();
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat) {
    prefill_kernel<float>(q.data_ptr<float>(), cache.data_ptr<float>(), table.data_ptr<int32_t>(),
                          out.data_ptr<float>(), queries, heads, kv_heads, block, dim,
                          context_len, window, static_cast<float>(scale));
  } else if (q.scalar_type() == torch::kBFloat16) {
    using B = at::BFloat16;
    prefill_kernel<B>(q.data_ptr<B>(), cache.data_ptr<B>(), table.data_ptr<int32_t>(),
                      out.data_ptr<B>(), queries, heads, kv_heads, block, dim, context_len,
                      window, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "paged_prefill_attention supports float32 and bfloat16");
  }
  return out;
}

// A step's new keys and values into their slots: k, v [T, kv_heads, dim] (rows may be strided
// views of a fused qkv; each row's heads contiguous), slot_blocks and slot_offsets [T] int64.
// torch's index_put_ with the two index tensors the cache layout needs took ~1 ms per layer and
// tensor for a 512-token prompt on SmolLM2 (2 threads): a tenth of the prefill. A copy of one
// head's row per (token, head) is what it does, byte for byte.
void write_kv_(torch::Tensor cache, torch::Tensor k, torch::Tensor v, torch::Tensor slot_blocks,
               torch::Tensor slot_offsets) {
  TORCH_CHECK(cache.dim() == 5 && cache.is_contiguous(), "cache is [N, 2, kvh, bs, dim], contiguous");
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k.sizes() == v.sizes(), "k, v are [T, kvh, dim]");
  TORCH_CHECK(k.scalar_type() == cache.scalar_type() && v.scalar_type() == cache.scalar_type(),
              "k, v are in the cache's dtype");
  const int64_t t = k.size(0), kv_heads = k.size(1), dim = k.size(2);
  const int64_t blocks = cache.size(0), block = cache.size(3);
  TORCH_CHECK(cache.size(2) == kv_heads && cache.size(4) == dim, "head shapes do not match");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k.stride(1) == dim && v.stride(1) == dim,
              "each row's heads are contiguous");
  TORCH_CHECK(slot_blocks.scalar_type() == torch::kLong && slot_offsets.scalar_type() == torch::kLong &&
                  slot_blocks.numel() == t && slot_offsets.numel() == t,
              "slot_blocks and slot_offsets are [T] int64");
  auto sb = slot_blocks.contiguous(), so = slot_offsets.contiguous();
  const int64_t* bp = sb.data_ptr<int64_t>();
  const int64_t* op = so.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(bp[i] >= 0 && bp[i] < blocks && op[i] >= 0 && op[i] < block, "slot out of range");
  }
  const int64_t size = cache.element_size();
  const int64_t row_bytes = dim * size, half = kv_heads * block * dim * size;
  char* base = static_cast<char*>(cache.data_ptr());
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  const int64_t ks = k.stride(0) * size, vs = v.stride(0) * size;
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      char* slot = base + bp[i] * 2 * half + op[i] * row_bytes;
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(slot + h * block * row_bytes, kp + i * ks + h * row_bytes, row_bytes);
        std::memcpy(slot + half + h * block * row_bytes, vp + i * vs + h * row_bytes, row_bytes);
      }
    }
  });
}
