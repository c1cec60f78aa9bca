// Fiber stacks and context switches (see fiber.h).
#include "emu/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define KVPRUNE_EMU_ASAN 1
#endif

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace kvprune::emu::detail {

#if defined(__x86_64__)
extern "C" void kvprune_emu_switch(void** save_context, void* load_context);
extern "C" void kvprune_emu_fiber_entry();

// kvprune_emu_switch(save, load): pushes the callee-saved registers and the MXCSR and
// x87 control words, stores the stack pointer in *save, loads `load` and pops the same
// set from there. A fresh context (see reset) "returns" into kvprune_emu_fiber_entry,
// which calls r13(r12) on a 16-byte aligned stack.
asm(R"(
    .text
    .p2align 4
    .globl kvprune_emu_switch
    .hidden kvprune_emu_switch
    .type kvprune_emu_switch, @function
kvprune_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size kvprune_emu_switch, .-kvprune_emu_switch

    .p2align 4
    .globl kvprune_emu_fiber_entry
    .hidden kvprune_emu_fiber_entry
    .type kvprune_emu_fiber_entry, @function
kvprune_emu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size kvprune_emu_fiber_entry, .-kvprune_emu_fiber_entry
)");
#endif

namespace {

size_t page_bytes() {
  static const size_t bytes = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return bytes;
}

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "kvprune emulator: %s\n", what);
  std::abort();
}

}  // namespace

void fiber_start_trampoline(Fiber* self) { Fiber::start(self); }

Fiber::~Fiber() {
  if (mapping_ != nullptr) munmap(mapping_, kStackBytes + page_bytes());
#if !defined(__x86_64__)
  delete static_cast<ucontext_t*>(context_);
  delete static_cast<ucontext_t*>(caller_);
#endif
}

void Fiber::reset(Entry entry, void* arg) {
  entry_ = entry;
  arg_ = arg;
  if (mapping_ == nullptr) {
    void* p = mmap(nullptr, kStackBytes + page_bytes(), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) die("cannot map a fiber stack");
    mapping_ = static_cast<char*>(p);
    if (mprotect(mapping_, page_bytes(), PROT_NONE) != 0) die("cannot protect a fiber guard page");
    stack_ = mapping_ + page_bytes();
  }
#if defined(KVPRUNE_EMU_ASAN)
  // A fiber abandoned half-way (a failed launch) left its frames' redzones poisoned.
  __asan_unpoison_memory_region(stack_, kStackBytes);
#endif
#if defined(__x86_64__)
  const auto top = reinterpret_cast<uintptr_t>(stack_ + kStackBytes) & ~uintptr_t{15};
  auto* frame = reinterpret_cast<uint64_t*>(top) - 8;  // what kvprune_emu_switch pops
  uint32_t mxcsr = 0;
  uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  frame[0] = mxcsr | (static_cast<uint64_t>(fpcw) << 32);
  frame[1] = frame[2] = 0;                                        // r15, r14
  frame[3] = reinterpret_cast<uint64_t>(&fiber_start_trampoline);  // r13: function
  frame[4] = reinterpret_cast<uint64_t>(this);                    // r12: its argument
  frame[5] = frame[6] = 0;                                        // rbx, rbp
  frame[7] = reinterpret_cast<uint64_t>(&kvprune_emu_fiber_entry);  // return address
  context_ = frame;
#else
  if (context_ == nullptr) {
    context_ = new ucontext_t;
    caller_ = new ucontext_t;
  }
  auto* ctx = static_cast<ucontext_t*>(context_);
  if (getcontext(ctx) != 0) die("getcontext failed");
  ctx->uc_stack.ss_sp = stack_;
  ctx->uc_stack.ss_size = kStackBytes;
  ctx->uc_link = nullptr;
  const auto bits = reinterpret_cast<uintptr_t>(this);
  makecontext(ctx, reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo) {
                fiber_start_trampoline(
                    reinterpret_cast<Fiber*>((static_cast<uintptr_t>(hi) << 32) | lo));
              }),
              2, static_cast<unsigned>(bits >> 32), static_cast<unsigned>(bits));
#endif
}

void Fiber::start(Fiber* self) {
#if defined(KVPRUNE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &self->caller_stack_bottom_, &self->caller_stack_size_);
#endif
  self->entry_(self->arg_);
  self->finish();
}

void Fiber::resume() {
#if defined(KVPRUNE_EMU_ASAN)
  void* caller_fake_stack = nullptr;
  __sanitizer_start_switch_fiber(&caller_fake_stack, stack_, kStackBytes);
#endif
#if defined(__x86_64__)
  kvprune_emu_switch(&caller_, context_);
#else
  swapcontext(static_cast<ucontext_t*>(caller_), static_cast<ucontext_t*>(context_));
#endif
#if defined(KVPRUNE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(caller_fake_stack, nullptr, nullptr);
#endif
}

void Fiber::switch_out(bool finishing) {
#if defined(KVPRUNE_EMU_ASAN)
  __sanitizer_start_switch_fiber(finishing ? nullptr : &fake_stack_, caller_stack_bottom_,
                                 caller_stack_size_);
#else
  (void)finishing;
#endif
#if defined(__x86_64__)
  kvprune_emu_switch(&context_, caller_);
#else
  swapcontext(static_cast<ucontext_t*>(context_), static_cast<ucontext_t*>(caller_));
#endif
#if defined(KVPRUNE_EMU_ASAN)
  __sanitizer_finish_switch_fiber(fake_stack_, &caller_stack_bottom_, &caller_stack_size_);
#endif
}

void Fiber::suspend() { switch_out(false); }

void Fiber::finish() {
  switch_out(true);
  die("a finished fiber was resumed");
}

}  // namespace kvprune::emu::detail
