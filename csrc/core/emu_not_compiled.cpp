// The emulator's entry points in a build without it (no CUDA headers found, or
// KVPRUNE_ENABLE_EMULATOR=OFF): every kernel call reports kNotCompiled.
#include "kvprune/emu.h"

namespace kvprune::emu {

bool compiled() { return false; }
void set_options(const Options&) {}
Options options() { return {}; }
const char* last_error() { return ""; }
void for_each_launch_count(void (*)(void*, const char*, uint64_t), void*) {}

#include "core/cuda_stubs.inc"

}  // namespace kvprune::emu
