// Execution contexts of the emulator: the OS thread's own (the scheduler) and fibers, each on a
// stack of its own with a guard page below it (an overflow faults instead of corrupting a
// neighbour). Switching saves only what the ABI asks a callee to keep: on x86-64 a few registers
// and the stack pointer (tens of nanoseconds, no system call), elsewhere ucontext. Under
// AddressSanitizer every switch is announced to it (__sanitizer_{start,finish}_switch_fiber).
#pragma once
#include <cstddef>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace cuda_emu {

struct Context {
#if defined(__x86_64__)
  void* stack_pointer = nullptr;
#else
  ucontext_t ucontext;
#endif
  // The stack this context runs on, for AddressSanitizer (learnt on the first switch away from the
  // OS thread's stack).
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
  void* asan_fake_stack = nullptr;
};

// Saves the running context into `from` and resumes `to`; returns when something resumes `from`.
// `from_exits`: `from` is never resumed again (its fiber has finished).
void switch_context(Context& from, Context& to, bool from_exits);

class SchedulerContext;

class Fiber {
 public:
  Fiber() = default;
  Fiber(const Fiber&) = delete;
  Fiber& operator=(const Fiber&) = delete;
  ~Fiber();

  // Prepares the fiber to run entry(arg) from the top of its stack when it is next switched to.
  void start(void (*entry)(void*), void* arg);
  // Switches from this fiber (running) to the scheduler; returns when the scheduler resumes it.
  void switch_to(SchedulerContext& scheduler);
  // Leaves this fiber for good.
  [[noreturn]] void exit_to(SchedulerContext& scheduler);
  // This fiber will never be resumed (its launch failed): its stack can be started afresh.
  void discard();

  Context& context() { return context_; }

 private:
  static void entry_point(Fiber* fiber);

  Context context_;
  void* mapping_ = nullptr;  // guard page + stack
  size_t mapping_size_ = 0;
  void (*entry_)(void*) = nullptr;
  void* arg_ = nullptr;
  friend void fiber_entry_trampoline(Fiber* fiber);
};

class SchedulerContext {
 public:
  void switch_to(Fiber& fiber) { switch_context(context_, fiber.context(), false); }
  Context& context() { return context_; }

 private:
  Context context_;
};

}  // namespace cuda_emu
