/* FMA roofline probe: the fp32 multiply-add rate one core and all cores reach, and the bf16
 * dot-product rate where the CPU has one (AVX512-BF16 vdpbf16ps).
 *
 * Built on the fly by bench/roofline.py with the system C compiler (-O2 plus -mavx512f -mfma,
 * or -mavx2 -mfma, as the CPU offers, and -mavx512bf16 where it has it) and loaded with
 * ctypes; never part of the package. Each thread runs ACC independent accumulator registers
 * through `iters` rounds of acc = acc * m + a (one FMA per accumulator per round), so the FMA
 * units never wait on a previous result (ACC >= latency x FMA ports: 4 cycles x 2 ports = 8 on
 * current x86 cores). flops = 2 * lanes * ACC * iters * threads. The bf16 probe runs
 * acc = vdpbf16ps(acc, a, b) the same way: 4 flops per fp32 lane (two products, two adds).
 */
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#define LANES 16
typedef __m512 vec;
#define VSET(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
static float vsum(vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 vec;
#define VSET(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
static float vsum(vec v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
#else
#include <math.h>
#define LANES 1
typedef float vec;
#define VSET(x) (x)
#define VFMA(a, b, c) fmaf(a, b, c)
static float vsum(vec v) { return v; }
#endif

#define ACC 16

struct job {
  int64_t iters;
  float seed; /* runtime value, so the compiler cannot fold the loop */
  float result;
};

static void* run(void* arg) {
  struct job* j = (struct job*)arg;
  vec acc[ACC];
  for (int i = 0; i < ACC; ++i) acc[i] = VSET(j->seed + (float)i);
  const vec m = VSET(0.999999f), a = VSET(1e-7f);
  for (int64_t it = 0; it < j->iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) acc[i] = VFMA(acc[i], m, a);
  }
  float s = 0.f;
  for (int i = 0; i < ACC; ++i) s += vsum(acc[i]);
  j->result = s;
  return 0;
}

/* Lanes of one vector FMA in this build (16: AVX-512, 8: AVX2, 1: scalar). */
int fma_lanes(void) { return LANES; }

#if defined(__AVX512BF16__)
static void* run_bf16(void* arg) {
  struct job* j = (struct job*)arg;
  __m512 acc[ACC];
  for (int i = 0; i < ACC; ++i) acc[i] = _mm512_set1_ps(j->seed + (float)i);
  const __m512bh a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3f), _mm512_set1_ps(1e-3f));
  const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(j->seed), _mm512_set1_ps(j->seed));
  for (int64_t it = 0; it < j->iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < ACC; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  float s = 0.f;
  for (int i = 0; i < ACC; ++i) s += _mm512_reduce_add_ps(acc[i]);
  j->result = s;
  return 0;
}
#endif

/* GFLOP/s of `threads` threads each running `body` for `iters` rounds of `flops_per_round`
 * (wall time of the slowest). */
static double timed(void* (*body)(void*), int threads, int64_t iters, double flops_per_round) {
  pthread_t tid[256];
  struct job jobs[256];
  if (threads < 1) threads = 1;
  if (threads > 256) threads = 256;
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int t = 0; t < threads; ++t) {
    jobs[t].iters = iters;
    jobs[t].seed = 1.0f + (float)t;
    if (t > 0) pthread_create(&tid[t], 0, body, &jobs[t]);
  }
  body(&jobs[0]);
  for (int t = 1; t < threads; ++t) pthread_join(tid[t], 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double sec = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
  volatile float sink = 0.f;
  for (int t = 0; t < threads; ++t) sink += jobs[t].result;
  (void)sink;
  return flops_per_round * (double)iters * threads / sec / 1e9;
}

/* fp32 FMA GFLOP/s of `threads` threads each running `iters` rounds. */
double fma_gflops(int threads, int64_t iters) { return timed(run, threads, iters, 2.0 * LANES * ACC); }

/* bf16 dot-product GFLOP/s (vdpbf16ps; 0 in a build without AVX512-BF16), rounds as above. */
double bf16_gflops(int threads, int64_t iters) {
#if defined(__AVX512BF16__)
  return timed(run_bf16, threads, iters, 4.0 * 16 * ACC);
#else
  (void)threads;
  (void)iters;
  return 0.0;
#endif
}
