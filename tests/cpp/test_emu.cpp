// test_emu: the CUDA kernels under the SIMT emulator on exact-size buffers (harness
// in test_emu.h; cases in test_emu_prefill.cpp and test_emu_decode.cpp).
#include "test_emu.h"

#include "kvprune/fp8.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <new>

namespace emu_test {
namespace {

int g_cases = 0;
int g_failed = 0;

double value_at(const unsigned char* bytes, Elem elem, int64_t i) {
  switch (elem) {
    case Elem::kF32: {
      float f;
      std::memcpy(&f, bytes + 4 * i, 4);
      return f;
    }
    case Elem::kI32: {
      int32_t v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return v;
    }
    case Elem::kFp8E4M3: return kvprune::fp8_to_float(kvprune::Fp8E4M3{bytes[i]});
    case Elem::kFp8E5M2: return kvprune::fp8_to_float(kvprune::Fp8E5M2{bytes[i]});
    default: {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      return elem == Elem::kF16 ? half_to_float(h) : bf16_to_float(h);
    }
  }
}

// Poison: NaN for every float type (0xff bytes), 0x7f7f7f7f for int32 (not -1, a
// legal padding value).
unsigned char poison_byte(Elem elem) { return elem == Elem::kI32 ? 0x7f : 0xff; }

const char* schedule_name(kvprune::emu::Schedule s) {
  switch (s) {
    case kvprune::emu::Schedule::kForward: return "fwd";
    case kvprune::emu::Schedule::kReverse: return "rev";
    default: return "shuf";
  }
}

std::map<std::string, uint64_t> launch_counts() {
  std::map<std::string, uint64_t> counts;
  kvprune::emu::for_each_launch_count(
      [](void* ctx, const char* name, uint64_t n) { (*static_cast<std::map<std::string, uint64_t>*>(ctx))[name] = n; },
      &counts);
  return counts;
}

std::string config_name(const Config& c) {
  return std::string(schedule_name(c.schedule)) + "/sm" + std::to_string(c.sm_count);
}

}  // namespace

unsigned char g_workspace_fill = 0xff;

Elem elem_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return Elem::kF16;
    case DType::kBFloat16: return Elem::kBF16;
    case DType::kFloat8E4M3: return Elem::kFp8E4M3;
    case DType::kFloat8E5M2: return Elem::kFp8E5M2;
    default: return Elem::kF32;
  }
}
size_t elem_bytes(Elem elem) {
  switch (elem) {
    case Elem::kF16:
    case Elem::kBF16: return 2;
    case Elem::kFp8E4M3:
    case Elem::kFp8E5M2: return 1;
    default: return 4;
  }
}

ExactBuffer::ExactBuffer(size_t bytes, size_t pad) : bytes_(bytes), pad_(pad) {
  base_ = static_cast<unsigned char*>(::operator new(pad + bytes, std::align_val_t{64}));
}
ExactBuffer::~ExactBuffer() { ::operator delete(base_, std::align_val_t{64}); }

double Buffer::value(int64_t i) const { return value_at(mem->data(), elem, i); }

uint16_t float_to_half(float x) {  // round to nearest even; inputs here are finite and small
  uint32_t f;
  std::memcpy(&f, &x, 4);
  const uint32_t sign = (f >> 16) & 0x8000u;
  const float a = std::fabs(x);
  if (a < 6.103515625e-05f) {  // subnormal half: multiples of 2^-24
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.f)));
  }
  uint32_t u;
  std::memcpy(&u, &a, 4);
  const uint32_t exp = (u >> 23) - 127 + 15;
  uint32_t mant = u & 0x7fffffu;
  uint32_t h = (exp << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -out : out;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7f800000u | (mant << 13))
                                  : (sign | ((exp - 15 + 127) << 23) | (mant << 13));
  std::memcpy(&out, &bits, 4);
  return out;
}

uint16_t float_to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void store(Buffer& b, int64_t i, float value) {
  switch (b.elem) {
    case Elem::kF32: b.as<float>()[i] = value; break;
    case Elem::kF16: b.as<uint16_t>()[i] = float_to_half(value); break;
    case Elem::kBF16: b.as<uint16_t>()[i] = float_to_bf16(value); break;
    case Elem::kI32: b.as<int32_t>()[i] = static_cast<int32_t>(value); break;
    case Elem::kFp8E4M3:
    case Elem::kFp8E5M2: std::abort();  // fill_normal draws fp8 bytes directly
  }
}

std::mt19937& rng() {
  static std::mt19937 gen(20240917);
  return gen;
}

void fill_normal(Buffer& b, float stddev) {
  if (b.elem == Elem::kFp8E4M3 || b.elem == Elem::kFp8E5M2) {  // sign, exponent 2^-3..2^3, mantissa
    const bool e4m3 = b.elem == Elem::kFp8E4M3;
    std::uniform_int_distribution<int> sign(0, 1), exponent(-3, 3), mantissa(0, e4m3 ? 7 : 3);
    for (int64_t i = 0; i < b.count; ++i) {
      const int e = exponent(rng()) + (e4m3 ? 7 : 15);
      b.as<uint8_t>()[i] = static_cast<uint8_t>(sign(rng()) << 7 | e << (e4m3 ? 3 : 2) | mantissa(rng()));
    }
    return;
  }
  std::normal_distribution<float> normal(0.f, stddev);
  for (int64_t i = 0; i < b.count; ++i) {
    float x = normal(rng());
    if (x == 0.f) x = stddev;  // never zero
    store(b, i, x);
  }
}

void fill_uniform(Buffer& b, float lo, float hi, int levels) {
  std::uniform_real_distribution<float> uniform(lo, hi);
  for (int64_t i = 0; i < b.count; ++i) {
    float x = uniform(rng());
    if (levels > 0) x = lo + std::floor((x - lo) / (hi - lo) * levels) * (hi - lo) / levels;
    store(b, i, x);
  }
}

void set_ints(Buffer& b, const std::vector<int32_t>& values) {
  if (static_cast<int64_t>(values.size()) != b.count || b.elem != Elem::kI32) {
    std::fprintf(stderr, "set_ints: %s has %lld elements, got %zu values\n", b.name.c_str(),
                 static_cast<long long>(b.count), values.size());
    std::abort();
  }
  if (!values.empty()) std::memcpy(b.data(), values.data(), values.size() * 4);
}

namespace {
Tokens finish(int64_t B, int64_t H, int64_t T, int64_t D, Tokens t) {
  t.span = (B == 0 || H == 0 || T == 0) ? 0 : (B - 1) * t.bs + (H - 1) * t.hs + (T - 1) * t.ts + D;
  return t;
}
}  // namespace

Tokens bhnd(int64_t B, int64_t H, int64_t T, int64_t D, int64_t pad) {
  Tokens t;
  t.ts = D + pad;
  t.hs = T * t.ts;
  t.bs = H * t.hs;
  return finish(B, H, T, D, t);
}

Tokens bnhd(int64_t B, int64_t H, int64_t T, int64_t D, int64_t pad) {
  Tokens t;
  t.hs = D + pad;
  t.ts = H * t.hs;
  t.bs = T * t.ts;
  return finish(B, H, T, D, t);
}

std::vector<Config> configs(bool shuffled, std::vector<int> sm_counts) {
  std::vector<Config> out;
  for (int sm : sm_counts) {
    out.push_back({kvprune::emu::Schedule::kForward, 0, sm});
    out.push_back({kvprune::emu::Schedule::kReverse, 0, sm});
    if (shuffled) out.push_back({kvprune::emu::Schedule::kShuffled, 0x5eed0000u + sm, sm});
  }
  return out;
}

Buffer& Case::add(const std::string& name, Role role, Elem elem, int64_t count, Check check,
                  size_t pad) {
  auto b = std::make_unique<Buffer>();
  b->name = name;
  b->role = role;
  b->elem = elem;
  b->count = count;
  b->check = check;
  b->mem = std::make_unique<ExactBuffer>(static_cast<size_t>(count) * elem_bytes(elem), pad);
  std::memset(b->data(), poison_byte(elem), b->bytes());
  buffers_.push_back(std::move(b));
  return *buffers_.back();
}

void Case::reset() {
  for (auto& b : buffers_) {
    if (b->role == Role::kOut) {
      std::memset(b->data(), poison_byte(b->elem), b->bytes());
    } else if (b->bytes() > 0) {
      std::memcpy(b->data(), b->initial.data(), b->bytes());
    }
  }
}

std::vector<std::vector<unsigned char>> Case::snapshot() const {
  std::vector<std::vector<unsigned char>> out;
  for (const auto& b : buffers_) {
    const unsigned char* p = static_cast<const unsigned char*>(b->data());
    out.emplace_back(p, p + b->bytes());
  }
  return out;
}

void Case::fail(const std::string& what) { errors_.push_back(what); }

void Case::compare_ref(const std::vector<std::vector<unsigned char>>& ref,
                       const std::vector<std::vector<unsigned char>>& got, const std::string& where) {
  for (size_t k = 0; k < buffers_.size(); ++k) {
    const Buffer& b = *buffers_[k];
    if (b.role == Role::kIn) {
      if (got[k] != b.initial) fail(where + ": input " + b.name + " was modified");
      continue;
    }
    if (got[k] == ref[k]) continue;
    const int64_t row = b.check.row > 0 ? b.check.row : std::max<int64_t>(b.count, 1);
    int shown = 0;
    int64_t bad = 0;
    for (int64_t r0 = 0; r0 < b.count; r0 += row) {
      const int64_t r1 = std::min(b.count, r0 + row);
      double row_max = 0;
      if (b.check.kind == Check::kTolerance)
        for (int64_t i = r0; i < r1; ++i) {
          const double v = std::fabs(value_at(ref[k].data(), b.elem, i));
          if (std::isfinite(v)) row_max = std::max(row_max, v);
        }
      const size_t eb = elem_bytes(b.elem);
      for (int64_t i = r0; i < r1; ++i) {
        if (std::memcmp(ref[k].data() + i * eb, got[k].data() + i * eb, eb) == 0) continue;
        const double x = value_at(ref[k].data(), b.elem, i), y = value_at(got[k].data(), b.elem, i);
        if (b.check.kind == Check::kTolerance && std::fabs(x - y) <= b.check.tol * row_max) continue;
        ++bad;
        if (shown++ < 4) {
          char line[200];
          std::snprintf(line, sizeof line, "%s: %s[%lld] = %.9g, CPU %.9g (row max %.3g)", where.c_str(),
                        b.name.c_str(), static_cast<long long>(i), y, x, row_max);
          fail(line);
        }
      }
    }
    if (bad > 0) fail(where + ": " + b.name + ": " + std::to_string(bad) + " elements differ from the CPU");
  }
}

bool Case::run(const Call& cpu, const Call& emu, const std::vector<Config>& cfgs) {
  ++g_cases;
  const auto start = std::chrono::steady_clock::now();
  for (auto& b : buffers_) {
    if (b->role != Role::kOut) {
      const unsigned char* p = static_cast<const unsigned char*>(b->data());
      b->initial.assign(p, p + b->bytes());
    }
  }
  kvprune::emu::set_options({kvprune::emu::Schedule::kForward, 0, 132, 0});
  g_workspace_fill = 0xff;
  reset();
  const Status cs = cpu();
  if (cs != Status::kOk) fail(std::string("CPU reference: ") + kvprune::status_string(cs));
  const auto ref = snapshot();
  std::map<int, std::pair<std::string, std::vector<std::vector<unsigned char>>>> first;  // per SM count
  std::string names;
  std::map<std::string, uint64_t> counts_before = launch_counts();
  std::vector<std::string> launched;
  for (const Config& c : cfgs) {
    const std::string where = config_name(c);
    names += (names.empty() ? "" : " ") + where;
    kvprune::emu::set_options({c.schedule, c.seed, c.sm_count, 0});
    g_workspace_fill = static_cast<unsigned char>(g_workspace_fill == 0xff ? 0x7f : 0xff);  // NaN, 3.4e38
    reset();
    const Status es = emu();
    if (es != Status::kOk) {
      fail(where + ": emulator returned " + kvprune::status_string(es) + ": " + kvprune::emu::last_error());
      continue;
    }
    const auto got = snapshot();
    if (launched.empty()) {
      for (const auto& [kernel, n] : launch_counts())
        if (n > counts_before[kernel]) launched.push_back(kernel);
      for (const auto& want : kernels_)
        if (std::none_of(launched.begin(), launched.end(),
                         [&](const std::string& k) { return k.find(want) != std::string::npos; }))
          fail(where + ": no kernel matching '" + want + "' was launched");
    }
    compare_ref(ref, got, where);
    auto it = first.find(c.sm_count);
    if (it == first.end()) {
      first.emplace(c.sm_count, std::make_pair(where, got));
      continue;
    }
    for (size_t k = 0; k < buffers_.size(); ++k)
      if (buffers_[k]->role != Role::kIn && got[k] != it->second.second[k])
        fail("RACE: " + buffers_[k]->name + " differs bitwise between " + it->second.first + " and " + where);
  }
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const bool ok = expect_failure_ ? !errors_.empty() : errors_.empty();
  std::printf("[%s] %-58s %5.2f s  (%s)\n", ok ? " ok " : "FAIL", name_.c_str(), secs, names.c_str());
  if (expect_failure_) std::printf("       %s\n", ok ? "caught, as it should be:" : "NOT caught");
  for (const auto& e : errors_) std::printf("       %s\n", e.c_str());
  if (std::getenv("TEST_EMU_VERBOSE"))
    for (const auto& k : launched) std::printf("       launched %s\n", k.c_str());
  std::fflush(stdout);
  if (!ok) ++g_failed;
  return ok;
}

// The harness must catch what it is there to catch: an element the emulated call
// did not write (poison), a schedule-dependent output (race), a modified input.
void harness_checks() {
  {
    Case c("self-check: an unwritten output element shows");
    Buffer& out = c.add("out", Role::kOut, Elem::kF32, 100, within(1e-4));
    c.expect_failure().run(
        [&] { std::fill_n(out.as<float>(), 100, 1.f); return Status::kOk; },
        [&] { std::fill_n(out.as<float>(), 99, 1.f); return Status::kOk; });
  }
  {
    Case c("self-check: a schedule-dependent output shows");
    Buffer& out = c.add("out", Role::kOut, Elem::kI32, 4);
    c.expect_failure().run(
        [&] { std::fill_n(out.as<int32_t>(), 4, 0); return Status::kOk; },
        [&] {
          std::fill_n(out.as<int32_t>(), 4, 0);
          out.as<int32_t>()[3] = static_cast<int32_t>(kvprune::emu::options().schedule);
          return Status::kOk;
        });
  }
  {
    Case c("self-check: a modified input shows");
    Buffer& in = c.add("in", Role::kIn, Elem::kF32, 10);
    fill_normal(in);
    c.expect_failure().run([&] { return Status::kOk; }, [&] { in.as<float>()[9] = 0.f; return Status::kOk; });
  }
}

}  // namespace emu_test

int main() {
  if (!kvprune::emu::compiled()) {
    std::printf("emulator not compiled into this build\n");
    return 1;
  }
  const auto start = std::chrono::steady_clock::now();
  emu_test::harness_checks();
  emu_test::prefill_cases();
  emu_test::decode_cases();
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (std::getenv("TEST_EMU_KERNELS"))
    kvprune::emu::for_each_launch_count(
        [](void*, const char* name, uint64_t n) { std::printf("  %8llu  %s\n", static_cast<unsigned long long>(n), name); },
        nullptr);
  std::printf("test_emu: %d cases, %d failed, %.1f s\n", emu_test::g_cases, emu_test::g_failed, secs);
  return emu_test::g_failed == 0 && emu_test::g_cases > 0 ? 0 : 1;
}
