// Fiber contexts of the executor runtime: make a context that starts a
// function on its own stack, and switch between contexts. On x86-64 a
// hand-written switch that saves only the callee-saved registers (~20x cheaper
// than swapcontext, which makes a system call per switch); elsewhere ucontext.
#pragma once

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace msl_rt {

constexpr size_t kStackBytes = 64 * 1024;

#if defined(__x86_64__)
// Saves the callee-saved registers on the current stack, stores the stack
// pointer in *save_sp and resumes the context whose stack pointer is load_sp.
extern "C" void msl_rt_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl msl_rt_switch
  .type msl_rt_switch, @function
msl_rt_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size msl_rt_switch, .-msl_rt_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

struct Context {
  void* sp = nullptr;
};

inline void make_context(Context& ctx, char* stack_top, void (*entry)()) {
  auto* sp = reinterpret_cast<uintptr_t*>(reinterpret_cast<uintptr_t>(stack_top) & ~uintptr_t{15});
  *--sp = 0;                                   // entry's return address: none
  *--sp = reinterpret_cast<uintptr_t>(entry);  // msl_rt_switch returns here
  for (int i = 0; i < 6; ++i) {
    *--sp = 0;                                 // rbp rbx r12-r15
  }
  ctx.sp = sp;
}

inline void switch_context(Context& from, Context& to) {
  msl_rt_switch(&from.sp, to.sp);
}
#else
struct Context {
  ucontext_t uc;
};

inline void make_context(Context& ctx, char* stack_top, void (*entry)()) {
  getcontext(&ctx.uc);
  ctx.uc.uc_stack.ss_sp = stack_top - kStackBytes;
  ctx.uc.uc_stack.ss_size = kStackBytes;
  ctx.uc.uc_link = nullptr;
  makecontext(&ctx.uc, entry, 0);
}

inline void switch_context(Context& from, Context& to) {
  swapcontext(&from.uc, &to.uc);
}
#endif

} // namespace msl_rt
