// Harness of test_emu: every CUDA entry point run by the SIMT emulator
// (kvprune::emu::*_cuda) on buffers of exactly the bytes their layouts need, so that
// AddressSanitizer sees any access past an end; each result compared with the CPU
// backend and, bitwise, between thread schedules (a difference is a race).
//
// A Case owns its buffers. Inputs are filled once; before every call (CPU reference
// first, then the emulator under each Config) in/out buffers are restored and
// outputs poisoned, and afterwards outputs and in/out buffers are snapshotted and
// compared. Inputs must come back unchanged.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kvprune/emu.h"
#include "kvprune/kvprune.h"

namespace emu_test {

using kvprune::DType;
using kvprune::Status;

enum class Elem { kF32, kF16, kBF16, kI32, kFp8E4M3, kFp8E5M2 };
Elem elem_of(DType dtype);
size_t elem_bytes(Elem elem);

// One heap allocation: `pad` bytes, then exactly `bytes` bytes of data (pad > 0
// only misaligns the data pointer; the end is always exact). 64-byte aligned base.
class ExactBuffer {
 public:
  explicit ExactBuffer(size_t bytes, size_t pad = 0);
  ~ExactBuffer();
  ExactBuffer(const ExactBuffer&) = delete;
  ExactBuffer& operator=(const ExactBuffer&) = delete;
  unsigned char* data() const { return base_ + pad_; }
  size_t bytes() const { return bytes_; }

 private:
  unsigned char* base_;
  size_t bytes_, pad_;
};

// The byte a new Workspace is filled with; Case::run changes it between calls so
// that reading workspace bytes no kernel wrote shows as a difference.
extern unsigned char g_workspace_fill;

// A workspace of exactly `bytes` bytes; null when bytes == 0.
struct Workspace {
  explicit Workspace(size_t bytes) : bytes(bytes) {
    if (bytes > 0) {
      buffer = std::make_unique<ExactBuffer>(bytes);
      std::memset(buffer->data(), g_workspace_fill, bytes);
    }
  }
  void* ptr() const { return buffer ? buffer->data() : nullptr; }
  size_t bytes;
  std::unique_ptr<ExactBuffer> buffer;
};

enum class Role { kIn, kInOut, kOut };

// How an output is compared with the CPU reference.
struct Check {
  enum Kind { kExact, kTolerance } kind = kExact;
  double tol = 0;   // kTolerance: |got - ref| <= tol * max |ref| over the row
  int64_t row = 0;  // elements per row (0: the whole buffer is one row)
};
inline Check exact() { return {}; }
inline Check within(double tol, int64_t row = 0) { return {Check::kTolerance, tol, row}; }
// The GPU tolerances of window_scores and decode_scores.
inline double score_tol(DType dtype) { return dtype == DType::kFloat32 ? 1e-4 : 2e-3; }


struct Buffer {
  std::string name;
  Role role;
  Elem elem;
  int64_t count;
  Check check;
  std::unique_ptr<ExactBuffer> mem;
  std::vector<unsigned char> initial;  // inputs, in/out buffers: the state before a call
  void* data() const { return mem->data(); }
  template <typename T>
  T* as() const { return reinterpret_cast<T*>(mem->data()); }
  size_t bytes() const { return mem->bytes(); }
  double value(int64_t i) const;  // element i as a double
};

// ---- element conversions and fills ----------------------------------------------------
uint16_t float_to_half(float x);
float half_to_float(uint16_t h);
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t h);
void store(Buffer& b, int64_t i, float value);  // element i of a float/half buffer
std::mt19937& rng();
void fill_normal(Buffer& b, float stddev = 1.f);  // fp8: random values of magnitude 2^-3..2^3
void fill_uniform(Buffer& b, float lo, float hi, int levels = 0);  // levels > 0: quantised (ties)
void set_ints(Buffer& b, const std::vector<int32_t>& values);

// ---- strided token tensors [B, H, T, D] ------------------------------------------------
struct Tokens {
  int64_t bs = 0, hs = 0, ts = 0;  // element strides
  int64_t span = 0;                // elements from the first to one past the last element
};
// BHND; `pad` extra elements after each row (token stride D + pad).
Tokens bhnd(int64_t B, int64_t H, int64_t T, int64_t D, int64_t pad = 0);
// A BNHD tensor [B, T, H, D] viewed as BHND; `pad` extra elements after each row.
Tokens bnhd(int64_t B, int64_t H, int64_t T, int64_t D, int64_t pad = 0);
inline Tokens layout(bool bnhd_view, int64_t B, int64_t H, int64_t T, int64_t D, int64_t pad = 0) {
  return bnhd_view ? bnhd(B, H, T, D, pad) : bhnd(B, H, T, D, pad);
}
inline kvprune::ConstTokens ctok(const Buffer& b, const Tokens& t) {
  return {b.data(), t.bs, t.hs, t.ts};
}
inline kvprune::MutableTokens mtok(const Buffer& b, const Tokens& t) {
  return {b.data(), t.bs, t.hs, t.ts};
}

// ---- cases ---------------------------------------------------------------------------------
struct Config {
  kvprune::emu::Schedule schedule = kvprune::emu::Schedule::kForward;
  uint64_t seed = 0;
  int sm_count = 132;
};
// kForward and kReverse at 132 SMs, plus kShuffled (seeded) when `shuffled`, and
// the same again for every further SM count.
std::vector<Config> configs(bool shuffled = false, std::vector<int> sm_counts = {132});

using Call = std::function<Status()>;

class Case {
 public:
  explicit Case(std::string name) : name_(std::move(name)) {}
  // A buffer of exactly count * elem_bytes(elem) bytes (`pad` bytes before it).
  Buffer& add(const std::string& name, Role role, Elem elem, int64_t count, Check check = exact(),
              size_t pad = 0);
  // Runs `cpu` (the reference), then `emu` under every config; prints one line.
  // Returns false (and counts a failure) on any error or mismatch.
  bool run(const Call& cpu, const Call& emu, const std::vector<Config>& cfgs = configs());
  // The first emulated call must launch a kernel whose name contains `name` (proves
  // that the case takes the path it is meant to).
  Case& expect_kernel(const std::string& name) {
    kernels_.push_back(name);
    return *this;
  }
  // Harness self-checks: the case passes when run() finds an error.
  Case& expect_failure() {
    expect_failure_ = true;
    return *this;
  }

 private:
  void reset();
  std::vector<std::vector<unsigned char>> snapshot() const;
  void compare_ref(const std::vector<std::vector<unsigned char>>& ref,
                   const std::vector<std::vector<unsigned char>>& got, const std::string& where);
  void fail(const std::string& what);

  std::string name_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
  std::vector<std::string> errors_;
  std::vector<std::string> kernels_;
  bool expect_failure_ = false;
};

// ---- registry --------------------------------------------------------------------------
void harness_checks();  // test_emu.cpp
void prefill_cases();   // test_emu_prefill.cpp
void gather_cases();    // test_emu_gather.cpp
void decode_cases();   // test_emu_decode.cpp

}  // namespace emu_test
