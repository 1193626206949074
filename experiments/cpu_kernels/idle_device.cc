// An XLA FFI handler that occupies the "device" for a given time without using a CPU core:
// `host_overhead.py` stands it in for a model step to emulate an accelerator, whose computation
// runs beside the host's Python instead of on the same cores.
//
// Operands: `micros` (s32 scalar), how long the step takes; `tokens` (s32 [n]), passed through.
// Result: s32 [n], a copy of `tokens` (so what follows depends on the wait). The handler sleeps on
// XLA's thread (nanosleep): no CPU time, no Python, no GIL.
//
// Each wait's begin and end (CLOCK_MONOTONIC, the clock of Python's `time.perf_counter` on Linux)
// are recorded, up to kMaxSpans of them; `LlmjaxIdleDeviceSpans` (plain C, for ctypes) hands them
// over and starts a new record, so the host can see how long the device sat idle between steps.
// Steps run one after another (each takes the previous one's donated cache), so a record is never
// written by two waits at once; read it only while no step is in flight.
#include <time.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using S32R1 = ffi::Buffer<ffi::S32, 1>;  // aliases: the handler macro cannot take a comma

constexpr int64_t kMaxSpans = 1 << 16;
static int64_t g_spans[kMaxSpans][2];  // [begin, end] of each wait, ns
static std::atomic<int64_t> g_num_spans{0};

static int64_t NowNs() {
  timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}

static ffi::Error IdleDevice(ffi::BufferR0<ffi::S32> micros, S32R1 tokens,
                             ffi::Result<S32R1> out) {
  const int64_t us = micros.typed_data()[0];
  const int64_t begin = NowNs();
  timespec wait{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
  }  // interrupted by a signal: sleep the rest
  const int64_t i = g_num_spans.fetch_add(1);
  if (i < kMaxSpans) {
    g_spans[i][0] = begin;
    g_spans[i][1] = NowNs();
  }
  std::memcpy(out->typed_data(), tokens.typed_data(), tokens.element_count() * sizeof(int32_t));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxIdleDevice, IdleDevice,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // micros
                                  .Arg<S32R1>()  // tokens
                                  .Ret<S32R1>());  // tokens, after the wait

// Copies the recorded waits (at most `capacity`, the earliest) into `out` ([capacity][2] int64,
// begin and end in ns) and starts a new record. Returns how many were copied.
extern "C" int64_t LlmjaxIdleDeviceSpans(int64_t* out, int64_t capacity) {
  int64_t n = g_num_spans.exchange(0);
  n = n < kMaxSpans ? n : kMaxSpans;
  n = n < capacity ? n : capacity;
  std::memcpy(out, g_spans, n * 2 * sizeof(int64_t));
  return n;
}
