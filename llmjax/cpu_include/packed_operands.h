// The operands of the packed bfloat16 matmul kernels (amx_matmul.cc, avx512_bf16_matmul.cc),
// checked once for both:
//   x      bf16 [M, K]
//   w      [L, ceil(N/32), ceil(K/32), 2, 16, 32], bf16 or u16 (bfloat16 bits): L packed W [K, N]
//   layer  s32 []  which W_l to use
//   y      f32 [M, N]
// CheckPackedOperands fills `PackedOperands` (the sizes and layer `layer`'s packed weight) or
// returns the InvalidArgument error that names what disagrees.
#pragma once

#include <cstdint>

#include "xla/ffi/api/ffi.h"

namespace llmjax {

constexpr int64_t kPackedDepth = 32;  // K values per packed tile row (16 interleaved pairs)
constexpr int64_t kPackedBlock = 32;  // N columns per packed block (two 16-column tiles)
constexpr int64_t kPackedLanes = 16;  // K pairs per tile; columns per tile

struct PackedOperands {
  int64_t m, k, n, k_blocks, n_blocks;
  const uint16_t* w;  // layer `layer`'s [n_blocks, k_blocks, 2, 16, 32]
};

inline xla::ffi::Error CheckPackedOperands(xla::ffi::Buffer<xla::ffi::BF16, 2>& x, xla::ffi::AnyBuffer& w,
                                           xla::ffi::BufferR0<xla::ffi::S32>& layer,
                                           xla::ffi::Buffer<xla::ffi::F32, 2>& y, PackedOperands& out) {
  using xla::ffi::Error;
  if (w.element_type() != xla::ffi::DataType::BF16 && w.element_type() != xla::ffi::DataType::U16) {
    return Error::InvalidArgument("w must be bfloat16 or uint16 (bfloat16 bits)");
  }
  const auto xd = x.dimensions(), wd = w.dimensions(), yd = y.dimensions();
  const int64_t m = xd[0], k = xd[1], n = yd[1];
  const int64_t k_blocks = (k + kPackedDepth - 1) / kPackedDepth, n_blocks = (n + kPackedBlock - 1) / kPackedBlock;
  if (yd[0] != m || wd.size() != 6 || wd[1] != n_blocks || wd[2] != k_blocks || wd[3] != 2 ||
      wd[4] != kPackedLanes || wd[5] != kPackedDepth) {
    return Error::InvalidArgument("x [M, K], y [M, N] and w [L, ceil(N/32), ceil(K/32), 2, 16, 32] disagree");
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= wd[0]) return Error::InvalidArgument("layer out of range");
  const int64_t layer_elems = n_blocks * k_blocks * 2 * kPackedLanes * kPackedDepth;
  out = {m, k, n, k_blocks, n_blocks, static_cast<const uint16_t*>(w.untyped_data()) + l * layer_elems};
  return Error::Success();
}

}  // namespace llmjax
