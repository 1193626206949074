// bfloat16 matmul with float32 accumulation on AVX512-BF16 (VDPBF16PS), called through the XLA
// FFI: for CPUs with bfloat16 dot instructions but no AMX (AMD Zen 4 and later, Intel Cooper Lake).
//
// Handler `LlmjaxAvx512Bf16Matmul` (registered by llmjax/ops/packed_matmul.py): the operands, the
// packed weight layout and the result are those of `LlmjaxAmxMatmul` (amx_matmul.cc):
//   x      bf16 [M, K]  activations
//   w      [L, ceil(N/32), ceil(K/32), 2, 16, 32], bf16 or u16: a stack of L packed W [K, N],
//          w[l, nb, kb, t, r, 2c + p] = W_l[32 kb + 2 r + p, 32 nb + 16 t + c], 0 past K or N
//   layer  s32 []  which W_l to use
// result: f32 [M, N] = x @ W_layer, every product exact and summed in float32.
// Row r of tile (nb, kb, t) holds K pair 16 kb + r of 16 columns, interleaved: one 64-byte vector
// in VDPBF16PS's layout. Shapes that disagree, or a layer out of range, are an InvalidArgument.
//
// Blocking: a C block is up to 12 rows x 32 columns (24 vector accumulators); per K pair it
// loads the two B vectors of its N block and, per row, broadcasts the row's two bfloat16 values
// of that pair. Each N block's panel (K/2 vectors of 128 bytes) is read from memory once per work
// item (the hardware prefetcher follows it; software prefetching measured no faster) and from
// L1/L2 for the item's other row blocks. x is read in place when K is a multiple of 32, else
// from a copy zero-padded to one. Output columns past N are masked off. Work items are those of
// the AMX kernel: up to 128 rows by a run of consecutive N blocks that leaves 4 items per thread
// (so threads write different 4 KiB pages of y), claimed by the calling thread and XLA's
// intra-op pool. Needs no initialisation; the caller checks that the CPU has AVX512-BF16.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "packed_operands.h"
#include "work_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using Bf16R2 = ffi::Buffer<ffi::BF16, 2>;
using S32R0 = ffi::BufferR0<ffi::S32>;
using F32R2 = ffi::Buffer<ffi::F32, 2>;

namespace {

constexpr int64_t kLanes = 16;        // float32 columns of a vector; K pairs of a tile
constexpr int64_t kDepth = 32;        // bfloat16 K values of a tile row
constexpr int64_t kBlock = 32;        // columns of an N block (two vectors)
constexpr int64_t kRows = 12;         // rows of a C block
constexpr int64_t kChunkRows = 128;   // rows of a work item
constexpr int64_t kPageBlocks = 32;   // N blocks per 4 KiB of a float32 output row
constexpr int64_t kPanelPairStride = 2 * kLanes * kDepth;  // uint16 elements per K block of a panel

struct Problem {
  const uint16_t* x;  // [M, stride]
  int64_t stride;
  const uint16_t* w;  // this layer's [ceil(N/32), k_blocks, 2, 16, 32]
  float* y;           // [M, N]
  int64_t m, n, k_blocks;
};

// Rows [m0, m0 + R) x the 32 columns of N block `panel` (columns n0..), over all of K.
template <int R>
void Block(const Problem& p, const uint16_t* panel, int64_t m0, int64_t n0) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* rows = p.x + m0 * p.stride;
  for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
    const uint16_t* tile = panel + kb * kPanelPairStride;
    const uint16_t* xk = rows + kb * kDepth;
    for (int64_t pair = 0; pair < kLanes; ++pair) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(tile + pair * kDepth);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(tile + (kLanes + pair) * kDepth);
      for (int r = 0; r < R; ++r) {
        int32_t bits;
        std::memcpy(&bits, xk + r * p.stride + 2 * pair, sizeof(bits));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(bits);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t col = n0 + half * kLanes;
    if (col >= p.n) break;
    const __mmask16 mask = col + kLanes <= p.n ? __mmask16(0xFFFF) : __mmask16((1u << (p.n - col)) - 1);
    for (int r = 0; r < R; ++r) _mm512_mask_storeu_ps(p.y + (m0 + r) * p.n + col, mask, acc[r][half]);
  }
}

template <int R>
void BlockUpTo(const Problem& p, const uint16_t* panel, int64_t m0, int64_t n0, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return BlockUpTo<R - 1>(p, panel, m0, n0, rows);
  }
  Block<R>(p, panel, m0, n0);
}

// N block `nb` over rows [m_begin, m_end), in row blocks of near-equal height (64 rows: 10, 10,
// 11, 11, 11, 11), none over kRows.
void Column(const Problem& p, int64_t nb, int64_t m_begin, int64_t m_end) {
  const uint16_t* panel = p.w + nb * p.k_blocks * kPanelPairStride;
  const int64_t rows = m_end - m_begin, blocks = (rows + kRows - 1) / kRows;
  for (int64_t b = 0, m0 = m_begin; b < blocks; ++b) {
    const int64_t height = (m_end - m0) / (blocks - b);
    BlockUpTo<kRows>(p, panel, m0, nb * kBlock, height);
    m0 += height;
  }
}

ffi::Error Avx512Bf16Matmul(ffi::ThreadPool pool, Bf16R2 x, ffi::AnyBuffer w, S32R0 layer,
                            ffi::Result<F32R2> y) {
  llmjax::PackedOperands ops;
  if (auto error = llmjax::CheckPackedOperands(x, w, layer, *y, ops); error.failure()) return error;
  const int64_t m = ops.m, k = ops.k, n = ops.n, k_blocks = ops.k_blocks, n_blocks = ops.n_blocks;
  if (m == 0 || n == 0) return ffi::Error::Success();
  const auto* xs = static_cast<const uint16_t*>(x.untyped_data());
  const int64_t kp = k_blocks * kDepth;
  // x is read up to column kp: in place when K is a multiple of 32, else from a padded copy.
  thread_local std::vector<uint16_t> padded;
  const uint16_t* rows = xs;
  if (kp != k) {
    padded.assign(m * kp, 0);
    for (int64_t r = 0; r < m; ++r) std::memcpy(padded.data() + r * kp, xs + r * k, k * sizeof(uint16_t));
    rows = padded.data();
  }
  const Problem p{rows, kp, ops.w, y->typed_data(), m, n, k_blocks};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t group = std::clamp<int64_t>(n_blocks / (4 * threads), 1, kPageBlocks);
  const int64_t groups = (n_blocks + group - 1) / group;
  const auto run = [&p, group, groups, n_blocks](int64_t item, int64_t) {
    const int64_t m_begin = item / groups * kChunkRows, nb0 = item % groups * group;
    const int64_t nb1 = std::min(nb0 + group, n_blocks), m_end = std::min(m_begin + kChunkRows, p.m);
    for (int64_t nb = nb0; nb < nb1; ++nb) Column(p, nb, m_begin, m_end);
  };
  llmjax::RunItems(pool, (m + kChunkRows - 1) / kChunkRows * groups, run);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxAvx512Bf16Matmul, Avx512Bf16Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16R2>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w (packed stack)
                                  .Arg<S32R0>()  // layer
                                  .Ret<F32R2>());  // y
