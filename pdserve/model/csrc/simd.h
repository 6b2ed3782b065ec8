// SIMD helpers shared by the kernels. The build of each instruction-set level (model/isa.py,
// model/fused.py) defines what it targets: PDSERVE_AVX2 where it targets AVX2+FMA, and also
// PDSERVE_AVX512BF16 where it targets AVX512 with AVX512_BF16 (the kernels keep a plain C++
// path for other CPUs).

#pragma once

#include <cstdint>

// Unrolls the loop it precedes before GCC decides where a tile's accumulators live: loops over
// an array of vector accumulators not unrolled early keep the array in memory and store every
// accumulator on every step (GCC 12: a third of the FMA peak in the AVX2 panel tiles).
#define PDSERVE_UNROLL _Pragma("GCC unroll 16")

// A decode step reads each weight once, as one stream per thread, in pieces of a few hundred
// KiB (one linear's share): the hardware prefetcher alone kept SmolLM2's layers at 18-25 GB/s
// on 2 threads of an AMX Xeon, where a reduction over the same bytes reads 37-40. Loading the
// line kStreamAhead bytes ahead into L2 as each line is read gave 30-33 GB/s, in the row kernel
// and the panels alike (one row through all 120 layer weights, A/B in one process; 2-6 KiB
// ahead within noise of each other, into L1 slower, a non-temporal hint far slower), and the
// batch-1 decode step 11.4 -> 9.6 ms (benchmarks/roofline.py, roofline-amx-*.json).
constexpr int64_t kStreamAhead = 3072;
inline void prefetch_stream(const void* line) {
  __builtin_prefetch(static_cast<const char*>(line) + kStreamAhead, 0, 2);  // prefetcht1
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PDSERVE_AVX2 1

// The sum of a vector's eight floats.
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The largest of a vector's eight floats.
inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 bf16 (any 2-byte type holding bf16 bits, e.g. at::BFloat16) widened to float32.
template <typename B>
inline __m256 widen8(const B* p) {
  static_assert(sizeof(B) == 2, "bf16 is two bytes");
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 floats rounded to bf16 as at::BFloat16(float) rounds them (to nearest even, NaN -> 0x7FC0).
template <typename B>
inline void store_bf16(B* out, __m256 v) {
  static_assert(sizeof(B) == 2, "bf16 is two bytes");
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_srli_epi32(r, 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

// 8 float32 or bf16 values in or out as float32: the kernels' rows of either dtype.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }
template <typename B>
inline __m256 load8(const B* p) {
  return widen8(p);
}
template <typename B>
inline void store8(B* out, __m256 v) {
  store_bf16(out, v);
}

constexpr float kLog2e = 1.4426950408889634f;

// 2^f for f in [0, 1), highest power first: a degree-6 polynomial (least squares in relative
// error at Chebyshev nodes: 8.4e-8 in float32), by FMA in this order at every width.
constexpr float kExp2Fraction[7] = {0.00021690609171362595f, 0.0012443081508078993f,
                                    0.009678472554484075f,   0.055483524723948505f,
                                    0.24022979581425247f,    0.6931469870574744f,
                                    1.0000000018154933f};

// 2^x for x in [-200, 200], 8 wide: x = n + f with n = floor(x) and f = x - n (exact), 2^f by
// kExp2Fraction, 2^n built in the exponent field with n clamped to [-127, 128], so that 2^128
// is inf and 2^-127 is 0. The AVX512 exp2_finite's bits wherever the result is a normal float32
// or inf; a subnormal result (x < -126) is 0 here: where 1 + 2^x is taken the same bits, and a
// probability that small is below any rounding of its row's sum (whose largest term is 1).
inline __m256 exp2_finite(__m256 x) {
  const __m256 n = _mm256_floor_ps(x);
  const __m256 f = _mm256_sub_ps(x, n);
  __m256 p = _mm256_fmadd_ps(f, _mm256_set1_ps(kExp2Fraction[0]), _mm256_set1_ps(kExp2Fraction[1]));
  for (int i = 2; i < 7; ++i) p = _mm256_fmadd_ps(f, p, _mm256_set1_ps(kExp2Fraction[i]));
  const __m256 clamped = _mm256_min_ps(_mm256_max_ps(n, _mm256_set1_ps(-127.f)), _mm256_set1_ps(128.f));
  const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(clamped), _mm256_set1_epi32(127));
  return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
}
#endif

#if defined(PDSERVE_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__) && defined(__AVX512BF16__)
#define PDSERVE_AVX512BF16 1

// The sums of four vectors' sixteen floats each, as one vector [sum a, sum b, sum c, sum d].
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // Interleave and add pairwise inside each 128-bit lane, then add the four lanes.
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(abcd),
                                    _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
}

// 16 bf16 (any 2-byte type holding bf16 bits) widened to float32.
template <typename B>
inline __m512 widen16(const B* p) {
  static_assert(sizeof(B) == 2, "bf16 is two bytes");
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// 2^x for scores already in base 2 (scaled by log2(e)) less their row's maximum, so x <= 0 or
// -inf (masked): x = n + f with n = round(x), |f| <= 1/2; 2^f by Cephes' exp2f polynomial
// (relative error ~2e-7, below exp_u20's), 2^n by vscalef. -inf and anything under -200 give 0
// exactly. 11 instructions where ATen's exp_u20 and the subtraction take 21 (the softmax shares
// the FMA pipes with vdpbf16ps): a 542-token SmolLM2 prompt's bf16 attention 1.13 -> 1.07 ms
// per layer (2 threads, 2-core Zen 4, alternating in one process).
inline __m512 exp2_below(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-200.f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(1.535336188319500e-4f), _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// 2^x for finite x: x = n + f with n = floor(x), f in [0, 1) (vreduceps); 2^f by the degree-6
// polynomial kExp2Fraction, 2^n by vscalef, which floors x itself (under ~-150 the result is 0,
// over 128 inf). Two instructions fewer than exp2_below, which also takes -inf.
inline __m512 exp2_finite(__m512 x) {
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_fmadd_ps(f, _mm512_set1_ps(kExp2Fraction[0]), _mm512_set1_ps(kExp2Fraction[1]));
  for (int i = 2; i < 7; ++i) p = _mm512_fmadd_ps(f, p, _mm512_set1_ps(kExp2Fraction[i]));
  return _mm512_scalef_ps(p, x);
}
#endif
