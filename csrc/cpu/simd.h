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
// Relative error about 1e-7: Horner form of the degree-7 Taylor series of 2^f
// on f in [-0.5, 0.5] times an exponent built from the rounded integer part.
template <int kLanes>
inline Vec<kLanes> exp2(Vec<kLanes> x) {
  using V = Vec<kLanes>;
  using I = IntVec<kLanes>;
  const I underflow = x < splat<kLanes>(-126.f);
  x = vmax<kLanes>(x, splat<kLanes>(-126.f));
  const V shifted = x + 0.5f;
  I whole = __builtin_convertvector(shifted, I);  // truncates toward zero
  whole -= (shifted < __builtin_convertvector(whole, V)) ? I{} + 1 : I{};  // -> floor
  const V frac = x - __builtin_convertvector(whole, V);  // in [-0.5, 0.5]
  constexpr float c1 = 0.69314718056f, c2 = 0.24022650695f, c3 = 0.05550410866f,
                  c4 = 0.00961812911f, c5 = 0.00133335581f, c6 = 0.00015403530f,
                  c7 = 0.00001525273f;
  V poly = splat<kLanes>(c7);
  poly = poly * frac + c6;
  poly = poly * frac + c5;
  poly = poly * frac + c4;
  poly = poly * frac + c3;
  poly = poly * frac + c2;
  poly = poly * frac + c1;
  poly = poly * frac + 1.f;
  const I scale_bits = (whole + 127) << 23;
  V scale;
  std::memcpy(&scale, &scale_bits, sizeof(scale));
  const V result = poly * scale;
  return underflow ? V{} : result;
}

}  // namespace kvprune::cpu::simd
