// One gate per process between the models a CPU server runs side by side: a short encoder step goes first.
//
// Why: an embedding a person waits on (the query of a retrieval-augmented request: one sentence, ~10-30 ms of an
// encoder step on 2 cores) used to share the cores with the chat model's decode steps, whose threads run as long as
// the step does, and took ~1.4-2x its idle time (benchmarks/results/retrieval_mixed*.md). Here the encoder's step
// holds the gate (worker/cpu_gate.py decides which steps), and a generative model's step waits while it is held:
// at its start, at every layer of the module loop (a forward pre-hook) and of the native decode stack (below). A
// paused step then costs the encoder one layer's time (~1-4 ms) instead of half the machine.
//
// A pause is bounded: each step of a generative model may wait for at most the allowance its engine gives it at the
// step's start, in all (its draft model's steps included), so a stream of embeddings slows decoding but never stops
// it. The wait is a futex on the count of holders, woken by the last release; elsewhere a short nap. Which thread
// waits never changes a result: a paused step resumes the same computation.
#pragma once

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <thread>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

namespace lmserve {

struct GateStats {  // since the process started
  int64_t holds, pauses, paused_us;
};

namespace gate_detail {

inline std::atomic<int32_t> holders{0};  // steps holding the gate now (the futex word)
inline std::atomic<int64_t> holds{0}, pauses{0}, paused_us{0};
inline thread_local int64_t allowance_us = 0;  // what this thread's current step may still wait
inline thread_local int64_t step_waited_us = 0;  // what it has waited

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Sleep while holders == expected, for at most us microseconds (returns early on a wake or a change).
inline void wait_for(int32_t expected, int64_t us) {
#if defined(__linux__)
  timespec t{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  syscall(SYS_futex, reinterpret_cast<int32_t*>(&holders), FUTEX_WAIT_PRIVATE, expected, &t, nullptr, 0);
#else
  (void)expected;
  std::this_thread::sleep_for(std::chrono::microseconds(us < 100 ? us : 100));
#endif
}

}  // namespace gate_detail

inline void gate_hold() {
  gate_detail::holders.fetch_add(1, std::memory_order_acq_rel);
  gate_detail::holds.fetch_add(1, std::memory_order_relaxed);
}

inline void gate_release() {
  if (gate_detail::holders.fetch_sub(1, std::memory_order_acq_rel) == 1) {
#if defined(__linux__)
    syscall(SYS_futex, reinterpret_cast<int32_t*>(&gate_detail::holders), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
            nullptr, 0);
#endif
  }
}

// While the gate is held, wait, within what is left of this thread's allowance; returns the microseconds waited.
// The common case, nobody holding it, is one load.
inline int64_t gate_pause() {
  using namespace gate_detail;
  int32_t held = holders.load(std::memory_order_acquire);
  if (held == 0 || allowance_us <= 0) return 0;
  const int64_t start = now_us(), deadline = start + allowance_us;
  int64_t now = start;
  while (held != 0 && now < deadline) {
    wait_for(held, deadline - now);
    held = holders.load(std::memory_order_acquire);
    now = now_us();
  }
  const int64_t waited = now - start;
  allowance_us -= waited;
  step_waited_us += waited;
  pauses.fetch_add(1, std::memory_order_relaxed);
  paused_us.fetch_add(waited, std::memory_order_relaxed);
  return waited;
}

// A new step on this thread: it may wait `allowance` microseconds in all; it pauses first if the gate is held.
inline int64_t gate_begin_step(int64_t allowance) {
  gate_detail::allowance_us = allowance;
  gate_detail::step_waited_us = 0;
  return gate_pause();
}

// The step has ended: no wait on this thread until the next begins; returns the microseconds the step waited (once:
// a failed step's end after its own, or before a next begin, reads 0, so no wait is counted twice).
inline int64_t gate_end_step() {
  gate_detail::allowance_us = 0;
  const int64_t waited = gate_detail::step_waited_us;
  gate_detail::step_waited_us = 0;
  return waited;
}

inline GateStats gate_stats() {
  using namespace gate_detail;
  return {holds.load(std::memory_order_relaxed), pauses.load(std::memory_order_relaxed),
          paused_us.load(std::memory_order_relaxed)};
}

}  // namespace lmserve
