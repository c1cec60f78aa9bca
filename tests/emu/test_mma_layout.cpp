// The emulated mma.sync.m16n8k16 against the fragment layouts of the PTX ISA
// ("Matrix Fragments for mma.m16n8k16 with floating point type"), written here from
// the manual's piecewise definitions, independently of the emulator's own table:
// a warp loads random A (16x16), B (16x8), C (16x8) fragments by that table, runs
// simt::mma_m16n8k16, and D must equal A*B + C computed on the host.
#define KVPRUNE_EMULATOR_BUILD 1
#include "cuda/simt.cuh"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <type_traits>

namespace kvprune::emu::mma_layout_test {

struct Fragments {
  uint32_t a[32][4];  // per lane: a0..a3, two elements each (low half = lower index)
  uint32_t b[32][2];
  float c[32][4];
  float d[32][4];  // out
};

__global__ void mma_kernel(Fragments* f, int bf16) {
  const int lane = static_cast<int>(threadIdx.x);
  float acc[4];
  for (int i = 0; i < 4; ++i) acc[i] = f->c[lane][i];
  const uint32_t* a = f->a[lane];
  if (bf16) {
    simt::mma_m16n8k16<__nv_bfloat16>(acc, a[0], a[1], a[2], a[3], f->b[lane][0], f->b[lane][1]);
  } else {
    simt::mma_m16n8k16<__half>(acc, a[0], a[1], a[2], a[3], f->b[lane][0], f->b[lane][1]);
  }
  for (int i = 0; i < 4; ++i) f->d[lane][i] = acc[i];
}

// ---- the ISA's tables, element by element (groupID = lane >> 2, tig = lane % 4) ----
// A: row = groupID for ai, 0 <= i < 2 || 4 <= i < 6; groupID + 8 otherwise.
//    col = tig * 2 + (i & 1) for i < 4; tig * 2 + (i & 1) + 8 for i >= 4.
void a_position(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = ((0 <= i && i < 2) || (4 <= i && i < 6)) ? group : group + 8;
  *col = i < 4 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
}
// B: row = tig * 2 + (i & 1) for bi, i < 2; tig * 2 + (i & 1) + 8 for i >= 2. col = groupID.
void b_position(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = i < 2 ? tig * 2 + (i & 1) : tig * 2 + (i & 1) + 8;
  *col = group;
}
// C, D: row = groupID for ci, i < 2; groupID + 8 otherwise. col = tig * 2 + (i & 1).
void c_position(int lane, int i, int* row, int* col) {
  const int group = lane >> 2, tig = lane % 4;
  *row = i < 2 ? group : group + 8;
  *col = tig * 2 + (i & 1);
}

template <typename T>
uint16_t bits_of(float x) {
  T h;
  if constexpr (std::is_same_v<T, __half>) {
    h = __float2half_rn(x);
  } else {
    h = __float2bfloat16_rn(x);
  }
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

template <typename T>
float value_of(uint16_t u) {
  T h;
  std::memcpy(&h, &u, 2);
  if constexpr (std::is_same_v<T, __half>) {
    return __half2float(h);
  } else {
    return __bfloat162float(h);
  }
}

// Element i of a register list: register i / 2, low half for even i.
void put(uint32_t* regs, int i, uint16_t bits) {
  uint32_t& r = regs[i / 2];
  r = (i % 2 == 0) ? ((r & 0xffff0000u) | bits) : ((r & 0x0000ffffu) | (uint32_t{bits} << 16));
}

template <typename T>
int run(bool bf16, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-2.f, 2.f);
  float a[16][16], b[16][8], c[16][8];
  Fragments f{};
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 8; ++i) {
      int r, col;
      a_position(lane, i, &r, &col);
      const uint16_t bits = bits_of<T>(uniform(rng));
      a[r][col] = value_of<T>(bits);
      put(f.a[lane], i, bits);
    }
    for (int i = 0; i < 4; ++i) {
      int r, col;
      b_position(lane, i, &r, &col);
      const uint16_t bits = bits_of<T>(uniform(rng));
      b[r][col] = value_of<T>(bits);
      put(f.b[lane], i, bits);
    }
    for (int i = 0; i < 4; ++i) {
      int r, col;
      c_position(lane, i, &r, &col);
      c[r][col] = f.c[lane][i] = uniform(rng);
    }
  }
  const auto status = [&] {
    simt::launch<mma_kernel>(dim3(1), dim3(32), 0, nullptr, &f, bf16 ? 1 : 0);
    return simt::get_last_error();
  }();
  if (status != cudaSuccess) {
    std::printf("FAIL: mma launch: %s\n", last_error());
    return 1;
  }
  int failures = 0;
  for (int lane = 0; lane < 32; ++lane) {
    for (int i = 0; i < 4; ++i) {
      int r, col;
      c_position(lane, i, &r, &col);
      double want = c[r][col];
      for (int k = 0; k < 16; ++k) want += static_cast<double>(a[r][k]) * b[k][col];
      if (std::fabs(f.d[lane][i] - want) > 1e-5 * (1.0 + std::fabs(want))) {
        std::printf("FAIL: %s lane %d d%d (D[%d][%d]) = %g, want %g\n", bf16 ? "bf16" : "f16", lane,
                    i, r, col, f.d[lane][i], want);
        ++failures;
      }
    }
  }
  return failures;
}

}  // namespace kvprune::emu::mma_layout_test

int main() {
  using namespace kvprune::emu::mma_layout_test;
  int failures = 0;
  for (unsigned seed = 1; seed <= 3; ++seed) {
    failures += run<__half>(false, seed);
    failures += run<__nv_bfloat16>(true, seed);
  }
  std::printf("%s: emulated mma.sync m16n8k16 f16/bf16 vs the PTX ISA fragment layouts\n",
              failures == 0 ? "ok" : "FAILED");
  return failures == 0 ? 0 : 1;
}
