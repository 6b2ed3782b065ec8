// AVX2 helpers shared by the kernels; PDSERVE_AVX2 is defined where the build targets AVX2+FMA
// (the kernels keep a plain C++ path for other CPUs).

#pragma once

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
#endif
