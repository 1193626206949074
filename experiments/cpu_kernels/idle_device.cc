// An XLA FFI handler that occupies the "device" for a given time without using a CPU core:
// `host_overhead.py` stands it in for a model step to emulate an accelerator, whose computation
// runs beside the host's Python instead of on the same cores.
//
// Operands: `micros` (s32 scalar), how long the step takes; `tokens` (s32 [n]), passed through.
// Result: s32 [n], a copy of `tokens` (so what follows depends on the wait). The handler sleeps on
// XLA's thread (nanosleep): no CPU time, no Python, no GIL.
#include <time.h>

#include <cerrno>
#include <cstdint>
#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using S32R1 = ffi::Buffer<ffi::S32, 1>;  // aliases: the handler macro cannot take a comma

static ffi::Error IdleDevice(ffi::BufferR0<ffi::S32> micros, S32R1 tokens,
                             ffi::Result<S32R1> out) {
  const int64_t us = micros.typed_data()[0];
  timespec wait{static_cast<time_t>(us / 1000000), static_cast<long>((us % 1000000) * 1000)};
  while (nanosleep(&wait, &wait) != 0 && errno == EINTR) {
  }  // interrupted by a signal: sleep the rest
  std::memcpy(out->typed_data(), tokens.typed_data(), tokens.element_count() * sizeof(int32_t));
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxIdleDevice, IdleDevice,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()  // micros
                                  .Arg<S32R1>()  // tokens
                                  .Ret<S32R1>());  // tokens, after the wait
