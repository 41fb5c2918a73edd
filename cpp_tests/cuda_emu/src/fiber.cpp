#include "fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if defined(__SANITIZE_ADDRESS__)
#define CUDA_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define CUDA_EMU_ASAN 1
#endif
#endif
#if defined(CUDA_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

#if defined(__x86_64__)
// cuda_emu_switch(&from_sp, to_sp): pushes the callee-saved registers, the SSE control word and
// the x87 control word on the current stack, stores the stack pointer, loads the other one and
// pops the same frame there. cuda_emu_fiber_start is where a new fiber's first switch returns
// to: it calls the entry function in r12 with the argument in r13 (System V ABI).
extern "C" void cuda_emu_switch(void** from_stack_pointer, void* to_stack_pointer);
extern "C" void cuda_emu_fiber_start();
asm(R"(
  .text
  .p2align 4
  .globl cuda_emu_switch
  .hidden cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
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
  .size cuda_emu_switch, .-cuda_emu_switch

  .p2align 4
  .globl cuda_emu_fiber_start
  .hidden cuda_emu_fiber_start
  .type cuda_emu_fiber_start, @function
cuda_emu_fiber_start:
  movq %r13, %rdi
  callq *%r12
  ud2
  .size cuda_emu_fiber_start, .-cuda_emu_fiber_start
)");
#endif

namespace cuda_emu {
namespace {

size_t stack_bytes() {
  const char* kib = std::getenv("CUDA_EMU_STACK_KIB");
#if defined(CUDA_EMU_ASAN)
  const size_t fallback = 1024;  // instrumented frames are several times larger
#else
  const size_t fallback = 256;
#endif
  return (kib ? std::strtoull(kib, nullptr, 10) : fallback) * 1024;
}

thread_local Context* switching_from = nullptr;

[[noreturn]] void die(const char* what) {
  std::perror(what);
  std::abort();
}

}  // namespace

void switch_context(Context& from, Context& to, bool from_exits) {
  switching_from = &from;
#if defined(CUDA_EMU_ASAN)
  __sanitizer_start_switch_fiber(from_exits ? nullptr : &from.asan_fake_stack, to.stack_bottom, to.stack_size);
#else
  (void)from_exits;
#endif
#if defined(__x86_64__)
  cuda_emu_switch(&from.stack_pointer, to.stack_pointer);
#else
  if (swapcontext(&from.ucontext, &to.ucontext) != 0) die("cuda_emu: swapcontext");
#endif
#if defined(CUDA_EMU_ASAN)
  __sanitizer_finish_switch_fiber(from.asan_fake_stack, nullptr, nullptr);
#endif
}

void fiber_entry_trampoline(Fiber* fiber) { Fiber::entry_point(fiber); }

void Fiber::entry_point(Fiber* fiber) {
#if defined(CUDA_EMU_ASAN)
  Context* from = switching_from;  // the scheduler: learn its stack for the switches back
  __sanitizer_finish_switch_fiber(nullptr, &from->stack_bottom, &from->stack_size);
#endif
  fiber->entry_(fiber->arg_);
  std::fprintf(stderr, "cuda_emu: a fiber's entry returned\n");
  std::abort();
}

#if !defined(__x86_64__)
namespace {
// makecontext passes int arguments only: the fiber's address comes in two halves.
void ucontext_entry(unsigned high, unsigned low) {
  fiber_entry_trampoline(reinterpret_cast<Fiber*>((uintptr_t{high} << 32) | uintptr_t{low}));
}
}  // namespace
#endif

void Fiber::start(void (*entry)(void*), void* arg) {
  entry_ = entry;
  arg_ = arg;
  if (mapping_ == nullptr) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t stack = (stack_bytes() + page - 1) / page * page;
    mapping_size_ = stack + page;
    mapping_ = mmap(nullptr, mapping_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (mapping_ == MAP_FAILED) die("cuda_emu: mmap of a fiber stack");
    if (mprotect(mapping_, page, PROT_NONE) != 0) die("cuda_emu: mprotect of a fiber stack's guard page");
    context_.stack_bottom = static_cast<char*>(mapping_) + page;
    context_.stack_size = stack;
  }
  char* top = static_cast<char*>(const_cast<void*>(context_.stack_bottom)) + context_.stack_size;
#if defined(__x86_64__)
  // The frame cuda_emu_switch pops: control words, r15, r14, r13 = this, r12 = entry, rbx, rbp = 0,
  // then the return address cuda_emu_fiber_start, which runs with a 16-byte aligned stack.
  uint64_t* frame = reinterpret_cast<uint64_t*>(top - 128);
  std::memset(frame, 0, 128);
  uint32_t mxcsr;
  uint16_t x87;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(x87));
  std::memcpy(reinterpret_cast<char*>(frame), &mxcsr, sizeof(mxcsr));
  std::memcpy(reinterpret_cast<char*>(frame) + 4, &x87, sizeof(x87));
  frame[3] = reinterpret_cast<uint64_t>(this);                    // r13
  frame[4] = reinterpret_cast<uint64_t>(&fiber_entry_trampoline);  // r12
  frame[7] = reinterpret_cast<uint64_t>(&cuda_emu_fiber_start);   // return address
  context_.stack_pointer = frame;
#else
  if (getcontext(&context_.ucontext) != 0) die("cuda_emu: getcontext");
  context_.ucontext.uc_stack.ss_sp = const_cast<void*>(context_.stack_bottom);
  context_.ucontext.uc_stack.ss_size = context_.stack_size;
  context_.ucontext.uc_link = nullptr;
  const uintptr_t self = reinterpret_cast<uintptr_t>(this);
  makecontext(&context_.ucontext, reinterpret_cast<void (*)()>(&ucontext_entry), 2,
              static_cast<unsigned>(self >> 32), static_cast<unsigned>(self & 0xFFFFFFFFu));
#endif
}

void Fiber::switch_to(SchedulerContext& scheduler) { switch_context(context_, scheduler.context(), false); }

void Fiber::exit_to(SchedulerContext& scheduler) {
  switch_context(context_, scheduler.context(), true);
  std::fprintf(stderr, "cuda_emu: a finished fiber was resumed\n");
  std::abort();
}

void Fiber::discard() {
#if defined(CUDA_EMU_ASAN)
  // The frames of a fiber that never resumes keep their redzones poisoned; its next start reuses them.
  __asan_unpoison_memory_region(context_.stack_bottom, context_.stack_size);
#endif
  context_.asan_fake_stack = nullptr;
}

Fiber::~Fiber() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

}  // namespace cuda_emu
