// Work items shared by the calling thread and XLA's intra-op thread pool (`ffi::ThreadPool`).
//
// RunItems(pool, size, run, ...) calls run(item, following) once for every item in [0, size):
// the handler's thread and up to pool.num_threads() - 1 pool tasks claim items from one atomic
// counter until none is left, and RunItems returns when every item has finished. With
// `claim_ahead` each thread claims its next item before running the current one and passes it
// as `following` (so the current item can prefetch for it; -1 when there is none); otherwise
// `following` is always -1 and items go to whichever thread is free first.
// `enter` runs on a thread before its first item and `leave` after its last (threads that claim
// nothing call neither).
//
// Pool tasks may start after RunItems returned: they then claim nothing and touch only the
// shared state, which they co-own (shared_ptr); so `run` may capture the caller's stack by
// reference.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace llmjax {

struct WorkItems {
  int64_t size = 0;
  bool claim_ahead = false;
  std::function<void(int64_t, int64_t)> run;
  std::function<void()> enter, leave;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::mutex mu;
  std::condition_variable finished;

  void Drain() {
    int64_t item = next.fetch_add(1);
    if (item >= size) return;
    if (enter) enter();
    while (item < size) {
      const int64_t following = claim_ahead ? next.fetch_add(1) : size;
      run(item, following < size ? following : -1);
      if (done.fetch_add(1) + 1 == size) {
        std::lock_guard<std::mutex> lock(mu);
        finished.notify_all();
      }
      item = claim_ahead ? following : next.fetch_add(1);
    }
    if (leave) leave();
  }

  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    finished.wait(lock, [this] { return done.load() == size; });
  }
};

inline void RunItems(xla::ffi::ThreadPool& pool, int64_t size,
                     std::function<void(int64_t, int64_t)> run, bool claim_ahead = false,
                     std::function<void()> enter = {}, std::function<void()> leave = {}) {
  if (size <= 0) return;
  auto items = std::make_shared<WorkItems>();
  items->size = size;
  items->claim_ahead = claim_ahead;
  items->run = std::move(run);
  items->enter = std::move(enter);
  items->leave = std::move(leave);
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(1, pool.num_threads()), size) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([items] { items->Drain(); });
  items->Drain();
  items->Wait();
}

}  // namespace llmjax
