// AVX-512 helpers whose results are fixed numbers, whatever inlines them: the including file compiles them
// without fast-math or FMA contraction (#pragma GCC optimize before the #include), so GCC can neither
// reassociate nor fuse them differently in different callers. Batch invariance rests on that: a row's sums are
// the same chain of operations whichever kernel shape (tile, batch) computed them.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

namespace lmserve_simd {

// The horizontal sums of 4 vectors [a, b, c, d], each by the same tree of adds: whatever sits beside a vector
// (another row, or zeros in a partial tile), its sum is the same number.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  // 128-bit chunks: [a0 + a2, a1 + a3, b0 + b2, b1 + b3] and the same for c, d
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  // [a, b, c, d] chunks, each the sum of its vector's four chunks; then each chunk's 4 floats
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm512_castps512_ps128(
      _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0), v));
}

// e^x for x <= 0 (scores minus their maximum), within ~2 ulp of expf (Cephes' polynomial on [-ln2/2, ln2/2],
// scaled by 2^n); below -88 the result is 0 or subnormal, as expf's.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // x - n ln2, ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace lmserve_simd
#endif
