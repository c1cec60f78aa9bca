// Cooperative fibers for the SIMT emulator: one per emulated CUDA thread, each on
// its own stack. A fiber runs from resume() until it calls suspend() (or finish()),
// then control returns to the code that resumed it (the block scheduler).
//
// x86-64 switches with a few instructions of its own (callee-saved registers, the
// SSE and x87 control words, the stack pointer: no system call, no signal mask);
// other architectures use POSIX ucontext. Under AddressSanitizer every switch is
// announced to it, so stack checks stay exact on fiber stacks.
#pragma once

#include <cstddef>

namespace kvprune::emu::detail {

class Fiber {
 public:
  using Entry = void (*)(void* arg);

  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber();

  // Makes the next resume() start entry(arg) afresh on this fiber's stack (allocated on
  // first use, kept for reuse; a guard page below it turns an overflow into a fault).
  // A fiber abandoned half-way may be reset.
  void reset(Entry entry, void* arg);
  // Runs the fiber until it suspends or finishes. Only from outside the fiber.
  void resume();
  // Only from inside the fiber: returns control to resume()'s caller.
  void suspend();
  // Like suspend(), for a fiber whose entry has returned: it is never resumed again
  // until the next reset().
  [[noreturn]] void finish();

  static constexpr size_t kStackBytes =
#if defined(__SANITIZE_ADDRESS__)
      512 * 1024;  // sanitizer redzones make frames several times larger
#else
      128 * 1024;
#endif

 private:
  void switch_out(bool finishing);

  char* mapping_ = nullptr;  // guard page + stack
  char* stack_ = nullptr;    // lowest usable byte
  void* context_ = nullptr;  // saved fiber context (a stack pointer, or a ucontext_t*)
  void* caller_ = nullptr;   // saved context of resume()'s caller
  Entry entry_ = nullptr;
  void* arg_ = nullptr;
  // AddressSanitizer bookkeeping of the two stacks involved in a switch.
  void* fake_stack_ = nullptr;
  const void* caller_stack_bottom_ = nullptr;
  size_t caller_stack_size_ = 0;

  static void start(Fiber* self);
  friend void fiber_start_trampoline(Fiber* self);
};

}  // namespace kvprune::emu::detail
