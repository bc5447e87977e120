// lmserve's own worker threads for the native kernels: parallel_for with spin-then-park waits.
//
// Why: the kernels used to split their work with at::parallel_for, one OpenMP parallel region per call. A decode
// step of the embedded model makes ~150 such calls, and under the OMP_WAIT_POLICY=PASSIVE that lmserve sets (so a
// busy neighbour does not collapse it, benchmarks/results/busy_neighbour.md) every region woke the sleeping OpenMP
// threads through the kernel: one stream decoded at ~16 ms a token where spinning threads took ~6. Spinning
// threads, in turn, collapse 15x beside one busy process. These workers do both: after a job they poll for the
// next one for a bounded time (the kernels of a step follow each other within microseconds, so a step costs no
// wake-ups), yield the core while they poll (a runnable thread of ours, or a neighbour's, gets it), and then park
// on a futex (between steps, or on a machine where the core is wanted elsewhere).
//
// How a job runs: the caller publishes it, then claims chunks of the range itself, as do the workers that see it;
// a chunk is claimed by one compare-and-swap on a word holding (job number, next index), so a worker that wakes up
// late can never take a chunk of a newer job, and a thread that is descheduled holds back only the chunk it holds,
// never a share assigned in advance (static splits made every other thread wait for it). The caller returns when
// every chunk is done. Which thread computes a chunk never changes a result: the kernels compute each output by the
// same chain whatever the split (their batch-invariance comments).
//
// Run time policy, from what the machine shows rather than from an environment variable:
// - What other processes take. Every 250 ms the caller of a job reads /proc/stat for the CPUs this process may run
//   on and subtracts its own CPU time: the cores others kept busy (steal time, the hypervisor's, counts as busy).
//   Where that rounds to none, the pool uses torch's thread count (torch.set_num_threads, --num-threads) and its
//   workers poll for the next job; where others keep k cores busy, it uses at most the cores they leave free (at
//   least the caller) and its workers poll only briefly (plan_for). On 2 cores beside one busy process that is the caller alone, which
//   is what one sleeping thread gave there (benchmarks/results/busy_neighbour.md), and an idle machine gets the
//   polling threads' speed.
// - Threads descheduled anyway. When the caller, done with its own chunks, waits for another thread's chunk far
//   longer than a chunk takes (more than twice its own longest plus its spin), that thread lost its core mid-chunk.
//   kStallBudget such stalls in a 100 ms window and jobs run on the caller alone for a back-off period (50 ms,
//   doubling while stalls recur, up to 2 s), then all threads are tried again.
//
// Nested or concurrent callers (a kernel inside a job, two Python threads) run their range inline, serially.
#pragma once

#include "kernels.h"  // torch_threads(): torch's thread count, without torch's headers

#include <pthread.h>
#include <sched.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace lmserve {

// Tunables, chosen by measurement (benchmarks/pool_spin.py, results in benchmarks/results/pool_spin.md); the setter
// in bindings.cpp exists for that benchmark.
struct PoolTuning {
  int64_t worker_poll_us = 1000;  // a worker polls (spinning, then yielding) this long for the next job, then parks
  int64_t pure_spin_us = 20;      // ... of which the first part spins without yielding
  int64_t caller_spin_us = 100;   // the caller waits this long for other threads' chunks, then parks
  int64_t chunks_per_thread = 4;  // a job is cut into about threads x this many chunks
  bool adaptive = true;           // follow the machine (plan_for) and back off from stalls; false: fixed threads
};

// How many threads and how long idle workers poll, given the cores others keep busy (MachineWatch).
struct Plan {
  int threads;
  bool poll;  // false: workers poll only kBusyPollUs before they park
};

inline Plan plan_for(int cpus, double others, int requested) {
  const int busy = static_cast<int>(others + 0.5);
  if (busy <= 0) return {requested, true};
  return {std::max(1, std::min(requested, cpus - busy)), false};
}

struct PoolStats {  // counters since the pool started (for tests and profiles)
  int64_t jobs, inline_jobs, worker_parks, wakeups, caller_parks, stalls, backoffs;
};

struct MachineView {  // the watch's latest reading and the plan it gave
  int cpus;
  double others;
  int threads;
  bool poll;
};

namespace pool_detail {

#if defined(__linux__)
// Sleep while *addr == expected (returns at once if it differs); wake every sleeper on addr.
inline void futex_wait(std::atomic<int32_t>* addr, int32_t expected) {
  syscall(SYS_futex, reinterpret_cast<int32_t*>(addr), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

inline void futex_wake_all(std::atomic<int32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<int32_t*>(addr), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}
#else
// Elsewhere a parked thread naps and looks again (callers re-check their condition in a loop).
inline void futex_wait(std::atomic<int32_t>* addr, int32_t expected) {
  if (addr->load(std::memory_order_acquire) == expected) std::this_thread::sleep_for(std::chrono::microseconds(50));
}

inline void futex_wake_all(std::atomic<int32_t>*) {}
#endif

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

inline int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline thread_local bool in_job = false;  // this thread is running a chunk (nested calls run inline)

using ChunkFn = void (*)(void* ctx, int64_t begin, int64_t end);

// The cores other processes keep busy on the CPUs this process may run on, from /proc/stat (busy jiffies, steal
// included) minus this process's own CPU time, smoothed over the last samples. Zero where /proc/stat is absent.
class MachineWatch {
 public:
  MachineWatch() {
#if defined(__linux__)
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
      for (int c = 0; c < CPU_SETSIZE; ++c)
        if (CPU_ISSET(c, &set)) mine_.push_back(c);
    }
    const long hz = sysconf(_SC_CLK_TCK);
    hz_ = hz > 0 ? static_cast<double>(hz) : 100.0;
#else  // no affinity mask or /proc/stat: every core, and busy_jiffies() reads nothing (others stay 0)
    for (unsigned c = 0; c < std::max(1u, std::thread::hardware_concurrency()); ++c) mine_.push_back(static_cast<int>(c));
#endif
    if (mine_.empty()) mine_.push_back(0);
  }

  int cpus() const { return static_cast<int>(mine_.size()); }
  double others() const { return others_.load(std::memory_order_relaxed); }

  // Take a sample if the last is kSampleUs old (at time t, microseconds).
  void maybe_sample(int64_t t) {
    if (t - last_us_ < kSampleUs) return;
    const double busy = busy_jiffies();
    timespec own{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &own);
    const double own_s = own.tv_sec + own.tv_nsec * 1e-9;
    if (last_us_ != 0 && busy >= 0 && last_busy_ >= 0) {
      const double wall = (t - last_us_) * 1e-6;
      const double now = std::max(0.0, (busy - last_busy_) / hz_ / wall - (own_s - last_own_s_) / wall);
      // after a long pause the old value says nothing
      others_.store(wall > 1.0 ? now : 0.5 * others() + 0.5 * now, std::memory_order_relaxed);
    }
    last_us_ = t;
    last_busy_ = busy;
    last_own_s_ = own_s;
  }

 private:
  // user + nice + system + irq + softirq + steal of our CPUs (USER_HZ ticks), or -1 where /proc/stat is unreadable
  double busy_jiffies() const {
#if !defined(__linux__)
    return -1;
#endif
    std::FILE* f = std::fopen("/proc/stat", "r");
    if (!f) return -1;
    char line[512];
    double total = 0;
    while (std::fgets(line, sizeof(line), f)) {
      int cpu = -1;
      unsigned long long v[8] = {};
      if (std::sscanf(line, "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu", &cpu, &v[0], &v[1], &v[2], &v[3], &v[4],
                      &v[5], &v[6], &v[7]) != 9)
        continue;  // the aggregate "cpu " line and the rest of the file
      if (std::find(mine_.begin(), mine_.end(), cpu) != mine_.end())
        total += static_cast<double>(v[0] + v[1] + v[2] + v[5] + v[6] + v[7]);  // not idle (3), iowait (4)
    }
    std::fclose(f);
    return total;
  }

  static constexpr int64_t kSampleUs = 250000;
  std::vector<int> mine_;
  double hz_ = 100.0, last_busy_ = -1, last_own_s_ = 0;
  std::atomic<double> others_{0.0};  // read by machine() from any thread
  int64_t last_us_ = 0;
};

class Pool {
 public:
  static Pool& get() {
    static Pool* pool = [] {
      auto* p = new Pool();  // never destroyed: detached workers may outlive static destructors at exit
      pthread_atfork(nullptr, nullptr, [] { Pool::get().after_fork_in_child(); });
      return p;
    }();
    return *pool;
  }

  PoolTuning tuning;

  // Run fn(ctx, b, e) over [begin, end) in chunks of at least `grain`, on up to `threads` threads (caller included).
  void run(int64_t begin, int64_t end, int64_t grain, int threads, ChunkFn fn, void* ctx) {
    const int64_t n = end - begin;
    threads = static_cast<int>(std::min<int64_t>(threads, (n + grain - 1) / grain));
    if (threads <= 1 || in_job || busy_.exchange(true, std::memory_order_acquire)) return run_inline(begin, end, fn, ctx);
    if (tuning.adaptive) {
      const int64_t t = now_us();
      watch_.maybe_sample(t);
      const Plan plan = plan_for(watch_.cpus(), watch_.others(), threads);
      poll_us_.store(plan.poll ? tuning.worker_poll_us : std::min(tuning.worker_poll_us, kBusyPollUs),
                     std::memory_order_relaxed);
      threads = t < backoff_until_us_ ? 1 : plan.threads;  // a back-off: threads lost their cores mid-chunk
      if (threads <= 1) {
        busy_.store(false, std::memory_order_release);
        return run_inline(begin, end, fn, ctx);
      }
    } else {
      poll_us_.store(tuning.worker_poll_us, std::memory_order_relaxed);
    }
    ensure_workers(threads - 1);
    jobs_.fetch_add(1, std::memory_order_relaxed);
    int64_t chunk = std::max<int64_t>(grain, (n + threads * tuning.chunks_per_thread - 1) /
                                                 (threads * tuning.chunks_per_thread));
    chunk = std::max<int64_t>(chunk, (n + kMaxChunks - 1) / kMaxChunks);
    const auto chunks = static_cast<uint32_t>((n + chunk - 1) / chunk);
    fn_ = fn;
    ctx_ = ctx;
    begin_ = begin;
    end_ = end;
    chunk_ = chunk;
    error_ = nullptr;
    participants_.store(threads - 1, std::memory_order_relaxed);
    pending_.store(static_cast<int32_t>(chunks), std::memory_order_relaxed);
    const uint32_t job = ++job_id_;
    claim_.store(pack(job, chunks, 0), std::memory_order_release);  // publishes the fields above with the job
    epoch_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      wakeups_.fetch_add(1, std::memory_order_relaxed);
      futex_wake_all(&epoch_);
    }
    wait_done(work(job, true));
    std::exception_ptr error = error_;
    busy_.store(false, std::memory_order_release);
    if (error) std::rethrow_exception(error);
  }

  MachineView machine() const {
    const Plan plan = plan_for(watch_.cpus(), watch_.others(), torch_threads());
    return {watch_.cpus(), watch_.others(), plan.threads, plan.poll};
  }

  PoolStats stats() const {
    return {jobs_.load(), inline_jobs_.load(), worker_parks_.load(), wakeups_.load(), caller_parks_.load(),
            stalls_.load(), backoffs_.load()};
  }

 private:
  // (job number, chunk count, next chunk index): a claim is checked against its own job's count, in one word
  static uint64_t pack(uint32_t job, uint32_t chunks, uint32_t index) {
    return (static_cast<uint64_t>(job) << 32) | (static_cast<uint64_t>(chunks) << 16) | index;
  }

  void run_inline(int64_t begin, int64_t end, ChunkFn fn, void* ctx) {
    inline_jobs_.fetch_add(1, std::memory_order_relaxed);
    const bool outer = in_job;
    in_job = true;
    try {
      fn(ctx, begin, end);
    } catch (...) {
      in_job = outer;
      throw;
    }
    in_job = outer;
  }

  // Claim and run chunks of job `job` until none is left or a newer job has replaced it. The caller (`timed`) gets
  // back its longest chunk in microseconds: what another thread's chunk should take too.
  int64_t work(uint32_t job, bool timed = false) {
    in_job = true;
    int64_t longest = 0;
    for (;;) {
      uint64_t word = claim_.load(std::memory_order_acquire);
      uint32_t index;
      do {
        index = static_cast<uint32_t>(word & 0xFFFF);
        if (static_cast<uint32_t>(word >> 32) != job || index >= ((word >> 16) & 0xFFFF)) {
          in_job = false;
          return longest;
        }
      } while (!claim_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire));
      // claimed: the job stays live until this chunk is counted done, so the fields are its own and stable
      const int64_t b = begin_ + static_cast<int64_t>(index) * chunk_, e = std::min(end_, b + chunk_);
      const int64_t t0 = timed ? now_us() : 0;
      try {
        fn_(ctx_, b, e);
      } catch (...) {
        std::lock_guard<std::mutex> lock(error_mutex_);
        if (!error_) error_ = std::current_exception();
      }
      if (timed) longest = std::max(longest, now_us() - t0);
      if (pending_.fetch_sub(1, std::memory_order_seq_cst) == 1 && caller_waiting_.load(std::memory_order_seq_cst))
        futex_wake_all(&pending_);
    }
  }

  // The caller, after its own chunks (the longest took `own_us`): spin for the others' briefly, then park until the
  // last one wakes it, so that this core is free to run a thread that was descheduled while it held a chunk. A wait
  // far longer than a chunk takes is counted as such a stall.
  void wait_done(int64_t own_us) {
    int32_t left = pending_.load(std::memory_order_acquire);
    if (left == 0) return;
    const int64_t t0 = now_us();
    for (int64_t spins = 1; left != 0; ++spins) {
      cpu_relax();
      left = pending_.load(std::memory_order_acquire);
      if (left != 0 && (spins & 63) == 0 && now_us() - t0 > tuning.caller_spin_us) break;
    }
    if (left == 0) return;
    caller_parks_.fetch_add(1, std::memory_order_relaxed);
    caller_waiting_.store(true, std::memory_order_seq_cst);
    while ((left = pending_.load(std::memory_order_seq_cst)) != 0) futex_wait(&pending_, left);
    caller_waiting_.store(false, std::memory_order_relaxed);
    const int64_t t1 = now_us();
    if (t1 - t0 > 2 * own_us + tuning.caller_spin_us) note_stall(t1);
  }

  // Too many stalls in a window: run on the caller alone for a while, longer each time it recurs.
  void note_stall(int64_t t) {
    stalls_.fetch_add(1, std::memory_order_relaxed);
    if (!tuning.adaptive) return;
    if (t - window_start_us_ > kWindowUs) {
      if (t - backoff_until_us_ > 4 * kWindowUs) backoff_ms_ = kMinBackoffMs;  // calm for a while: start over
      window_start_us_ = t;
      window_stalls_ = 0;
    }
    if (++window_stalls_ >= kStallBudget) {
      backoffs_.fetch_add(1, std::memory_order_relaxed);
      backoff_until_us_ = t + backoff_ms_ * 1000;
      backoff_ms_ = std::min<int64_t>(2 * backoff_ms_, kMaxBackoffMs);
      window_stalls_ = 0;
    }
  }

  void worker_loop(int index) {
    int32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      seen = wait_for_epoch(seen);
      if (index < participants_.load(std::memory_order_relaxed))
        work(static_cast<uint32_t>(claim_.load(std::memory_order_acquire) >> 32));
    }
  }

  // Poll for an epoch other than `seen`: spin, then spin yielding the core, then park until woken.
  int32_t wait_for_epoch(int32_t seen) {
    const int64_t t0 = now_us();
    for (int64_t spins = 1;; ++spins) {
      const int32_t e = epoch_.load(std::memory_order_acquire);
      if (e != seen) return e;
      if ((spins & 63) != 0) {
        cpu_relax();
        continue;
      }
      const int64_t waited = now_us() - t0;
      if (waited < tuning.pure_spin_us) continue;
      if (waited < poll_us_.load(std::memory_order_relaxed)) {
        sched_yield();
        continue;
      }
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      if (epoch_.load(std::memory_order_seq_cst) == seen) {
        worker_parks_.fetch_add(1, std::memory_order_relaxed);
        futex_wait(&epoch_, seen);
      }
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  void ensure_workers(int wanted) {
    while (static_cast<int>(workers_.size()) < wanted) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { worker_loop(index); });
      workers_.back().detach();
    }
  }

  // fork() copies only the calling thread: the child starts its own workers when it first needs them.
  void after_fork_in_child() {
    workers_.clear();  // detached: nothing to join
    busy_.store(false);
    sleepers_.store(0);
    caller_waiting_.store(false);
  }

  static constexpr int64_t kMaxChunks = 0xFFFF;
  static constexpr int64_t kBusyPollUs = 50;  // a worker's poll while others keep cores busy: a step's own gaps
  static constexpr int64_t kWindowUs = 100000;  // stalls are counted per 100 ms
  static constexpr int kStallBudget = 8;        // this many in a window: back off
  static constexpr int64_t kMinBackoffMs = 50, kMaxBackoffMs = 2000;

  std::vector<std::thread> workers_;
  std::atomic<bool> busy_{false};
  alignas(64) std::atomic<uint64_t> claim_{0};    // see pack()
  alignas(64) std::atomic<int32_t> pending_{0};   // chunks of the live job not yet done
  alignas(64) std::atomic<int32_t> epoch_{0};     // bumped per job: what idle workers watch
  alignas(64) std::atomic<int32_t> sleepers_{0};  // workers parked on epoch_
  std::atomic<bool> caller_waiting_{false};
  std::atomic<int> participants_{0};
  std::atomic<int64_t> poll_us_{1000};  // the workers' poll budget now (the plan's)
  MachineWatch watch_;                  // the caller's, under busy_
  std::atomic<int64_t> jobs_{0}, inline_jobs_{0}, worker_parks_{0}, wakeups_{0}, caller_parks_{0}, stalls_{0}, backoffs_{0};
  // the live job (written by the caller before it publishes claim_, read by a thread after a successful claim)
  uint32_t job_id_ = 0;
  ChunkFn fn_ = nullptr;
  void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1;
  std::exception_ptr error_;
  std::mutex error_mutex_;
  // the back-off policy (the caller's, under busy_)
  int64_t window_start_us_ = 0, backoff_until_us_ = 0, backoff_ms_ = kMinBackoffMs;
  int window_stalls_ = 0;
};

}  // namespace pool_detail

// at::parallel_for's contract (f(begin, end) over chunks of at least `grain`; a range of at most `grain` runs
// inline) on lmserve's pool, with torch's thread count.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (end <= begin) return;
  grain = std::max<int64_t>(grain, 1);
  if (end - begin <= grain) return f(begin, end);
  auto call = [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
  pool_detail::Pool::get().run(begin, end, grain, torch_threads(), call,
                               const_cast<void*>(static_cast<const void*>(&f)));
}

inline PoolTuning& pool_tuning() { return pool_detail::Pool::get().tuning; }
inline PoolStats pool_stats() { return pool_detail::Pool::get().stats(); }
inline MachineView pool_machine() { return pool_detail::Pool::get().machine(); }

}  // namespace lmserve
