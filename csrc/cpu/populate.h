// Page population for freshly allocated outputs.
//
// A new multi-megabyte buffer from malloc is usually a fresh mapping: the first
// write to each 4 KiB page takes a fault, and on virtual machines a fault costs as
// much as copying the page several times. Populating a range in one system call is
// much cheaper than faulting it page by page, and when each worker populates the
// range it is about to write, the faulting runs in parallel.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace kvprune::cpu {

// Makes the whole pages inside [begin, begin + bytes) present and writable (a no-op
// where the OS lacks MADV_POPULATE_WRITE, Linux < 5.14). Pages already present
// cost little.
inline void populate_for_write(void* begin, size_t bytes) {
#if defined(__linux__) && defined(MADV_POPULATE_WRITE)
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + bytes) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_POPULATE_WRITE);
#else
  (void)begin;
  (void)bytes;
#endif
}

}  // namespace kvprune::cpu
