// Fixed-width float vectors for the CPU kernels, written with GCC/Clang vector
// extensions so that one source compiles to AVX-512, AVX2 or plain SSE code
// depending on the flags of the translation unit that includes it.
//
// Translation units that include this header with different -m flags must wrap
// everything in a namespace of their own (see window_scores_isa.h), so the
// linker never mixes instruction sets.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE__)
#include <immintrin.h>
#endif

namespace kvprune::cpu::simd {

template <int kLanes>
struct FloatVec {
  typedef float type __attribute__((vector_size(kLanes * 4)));
  typedef int32_t int_type __attribute__((vector_size(kLanes * 4)));
};

template <int kLanes>
using Vec = typename FloatVec<kLanes>::type;

template <int kLanes>
using IntVec = typename FloatVec<kLanes>::int_type;

template <int kLanes>
inline Vec<kLanes> load(const float* p) {
  Vec<kLanes> v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <int kLanes>
inline void store(float* p, Vec<kLanes> v) {
  std::memcpy(p, &v, sizeof(v));
}

// Store that bypasses the caches when `p` is vector-aligned (for data read back
// much later). Call stream_fence() before other threads read what was stored.
template <int kLanes>
inline void stream_store(float* p, Vec<kLanes> v) {
  if (reinterpret_cast<uintptr_t>(p) % sizeof(v) != 0) return store<kLanes>(p, v);
#if defined(__AVX512F__)
  if constexpr (kLanes == 16) return _mm512_stream_ps(p, (__m512)v);
#endif
#if defined(__AVX__)
  if constexpr (kLanes == 8) return _mm256_stream_ps(p, (__m256)v);
#endif
#if defined(__SSE__)
  if constexpr (kLanes == 4) return _mm_stream_ps(p, (__m128)v);
#endif
  store<kLanes>(p, v);
}

inline void stream_fence() {
#if defined(__SSE__)
  _mm_sfence();
#endif
}

template <int kLanes>
inline Vec<kLanes> splat(float x) {
  return Vec<kLanes>{} + x;
}

template <int kLanes>
inline Vec<kLanes> vmax(Vec<kLanes> a, Vec<kLanes> b) {
  return a > b ? a : b;
}

template <int kLanes>
inline float horizontal_sum(Vec<kLanes> v) {
  float total = 0.f;
  for (int i = 0; i < kLanes; ++i) total += v[i];
  return total;
}

// 2^x for x <= 128, with results below 2^-126 (and x = -inf) flushed to zero.
// Relative error below 1e-7: x = n + f with n = round(x) and f in [-0.5, 0.5];
// 2^f is a degree-6 polynomial fitted for relative error on that interval, and
// 2^n is built from the bits of x + 1.5 * 2^23, whose low mantissa bits hold n.
template <int kLanes>
inline Vec<kLanes> exp2(Vec<kLanes> x) {
  using V = Vec<kLanes>;
  using I = IntVec<kLanes>;
  const I underflow = x < splat<kLanes>(-126.f);
  x = vmax<kLanes>(x, splat<kLanes>(-126.f));
  const V round_magic = splat<kLanes>(12582912.f);  // 1.5 * 2^23
  const V shifted = x + round_magic;               // round to nearest integer
  const V frac = x - (shifted - round_magic);      // in [-0.5, 0.5]
  constexpr float c1 = 0.6931471824645996f, c2 = 0.24022646248340607f,
                  c3 = 0.05550328642129898f, c4 = 0.009618489071726799f,
                  c5 = 0.0013399930903688073f, c6 = 0.0001534580806037411f;
  V poly = splat<kLanes>(c6);
  poly = poly * frac + c5;
  poly = poly * frac + c4;
  poly = poly * frac + c3;
  poly = poly * frac + c2;
  poly = poly * frac + c1;
  poly = poly * frac + 1.f;
  typedef uint32_t Bits __attribute__((vector_size(kLanes * 4)));
  Bits bits;
  std::memcpy(&bits, &shifted, sizeof(bits));
  // The low 9 bits of `bits` are n + 127 (in [1, 255]): shifted into the exponent
  // field they make 2^n; the higher bits fall off the top (unsigned, so it wraps).
  const Bits scale_bits = (bits + 127u) << 23;
  V scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  const V result = poly * scale;
  return underflow ? V{} : result;
}

}  // namespace kvprune::cpu::simd
