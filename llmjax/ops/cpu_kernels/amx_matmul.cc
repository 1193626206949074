// bfloat16 matmul with float32 accumulation on Intel AMX, called through the XLA FFI.
//
// Handler `LlmjaxAmxMatmul` (registered by llmjax/ops/packed_matmul.py), operands:
//   x      bf16 [M, K]  activations
//   w      [L, ceil(N/32), ceil(K/32), 2, 16, 32], bf16 or u16 (bfloat16 bits): a stack of L
//          pre-packed weights W [K, N] (the model's layers), read in place:
//          w[l, nb, kb, t, r, 2c + p] = W_l[32 kb + 2 r + p, 32 nb + 16 t + c], 0 past K or N.
//          So w[l, nb, kb, t] is one AMX B tile (16 rows of 64 bytes: K pairs interleaved,
//          the VNNI layout) for K rows 32 kb.. and N columns 32 nb + 16 t..; an N block's
//          tiles are contiguous along K.
//   layer  s32 []  which W_l to use
// result: f32 [M, N] = x @ W_layer, every product exact and summed in float32 (TDPBF16PS).
// Shapes that disagree, or a layer out of range, are an InvalidArgument error.
//
// Blocking: a C block is 32 x 32 (four 16 x 16 tiles in registers 0-3; A tiles in 4-5, B in
// 6-7), its K loop 32 deep per step. Tile registers are not renamed, so a step loads each
// register once the previous step's last reader of it is done: A0, B0, B1, A1, each followed
// by the products it enables. Each N block's B panel streams from memory once per item and
// is re-read from L1/L2 for every row block of the item; x stays in L2. x is read in place when K is a multiple of 32; the calling thread
// first copies, zero-padded, what cannot be: the last row block when M is not a multiple of
// 32, or all of x when K is not. Output tiles that stick out past M or N go through a
// scratch tile. Work items are (up to 128 rows, a run of up to 32 consecutive N blocks: as
// many as leave 4 items per thread), so that threads write different 4 KiB pages of y (XLA
// hands over freshly mapped output buffers; two threads faulting on one page serialize), in
// row-chunk order. Items are claimed from an atomic counter by the calling thread and XLA's
// intra-op pool (`ffi::ThreadPool`), each thread one item ahead: each N block prefetches the
// next one's panel (the next item's first) into L2 over its K steps (with few rows the
// weights stream from DRAM). Each thread configures its tiles when it claims its first item
// and releases them when it is done.
//
// `LlmjaxAmxInit()` must succeed first (once per process): 0 when the CPU has AMX-TILE and
// AMX-BF16 and Linux grants the tile data permission (arch_prctl ARCH_REQ_XCOMP_PERM); else
// 1 (no AMX on the CPU) or 2 (permission refused). Without it the handler returns an error.

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cpuid.h>
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

constexpr int64_t kTile = 16;                   // rows of a tile; float32 columns of a C tile
constexpr int64_t kDepth = 32;                  // bfloat16 K values per tile row
constexpr int64_t kBlock = 32;                  // rows and columns of a C block (2 x 2 tiles)
constexpr int64_t kChunkRows = 128;             // rows of a work item (4 row blocks)
constexpr int64_t kPageBlocks = 32;             // N blocks per 4 KiB of a float32 output row
constexpr int64_t kTileElems = kTile * kDepth;  // uint16 elements of an A or B tile
constexpr long kReqXcompPerm = 0x1023;
constexpr long kGetXcompPerm = 0x1022;
constexpr int kXfeatureTileData = 18;

std::atomic<bool> amx_ready{false};

// The tile configuration (palette 1): every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int i = 0; i < 8; ++i) {
      bytes_per_row[i] = kDepth * sizeof(uint16_t);
      rows[i] = kTile;
    }
  }
};

// x as tile rows: `rows` [M, stride] in place (or a zero-padded copy of x), except the last
// row block, read from `last` [32, stride] when it is not null.
struct Problem {
  const uint16_t* rows;
  const uint16_t* last;
  int64_t stride;
  const uint16_t* w;
  float* y;
  int64_t m, n, k_blocks;
};

// Row block `m0..` of x: its first element and row stride in bytes.
struct RowBlock {
  const uint16_t* data;
  int64_t stride_bytes;
};

RowBlock Rows(const Problem& p, int64_t m0) {
  const int64_t stride_bytes = p.stride * int64_t{sizeof(uint16_t)};
  if (p.last != nullptr && m0 + kBlock > p.m) return {p.last, stride_bytes};
  return {p.rows + m0 * p.stride, stride_bytes};
}

// Rows [m0, m1) of x [M, K] into `dst` [32 * ceil((m1 - m0) / 32), kp], zero-padded.
void CopyPadded(const uint16_t* x, int64_t k, int64_t m0, int64_t m1, int64_t kp,
                std::vector<uint16_t>& dst) {
  const int64_t rows = (m1 - m0 + kBlock - 1) / kBlock * kBlock;
  dst.assign(rows * kp, 0);
  for (int64_t r = m0; r < m1; ++r) {
    std::memcpy(dst.data() + (r - m0) * kp, x + r * k, k * sizeof(uint16_t));
  }
}

// Where C tile (m0, n0) is stored: in place in y when it lies inside, else in `scratch`
// (then `SpillTile` copies the part inside y).
struct TileOut {
  float* data;
  int64_t stride_bytes;
};

bool TileInside(const Problem& p, int64_t m0, int64_t n0) {
  return m0 + kTile <= p.m && n0 + kTile <= p.n;
}

TileOut TileTarget(const Problem& p, int64_t m0, int64_t n0, float* scratch) {
  if (TileInside(p, m0, n0)) return {p.y + m0 * p.n + n0, p.n * int64_t{sizeof(float)}};
  return {scratch, kTile * int64_t{sizeof(float)}};
}

void SpillTile(const Problem& p, int64_t m0, int64_t n0, const float* scratch) {
  if (TileInside(p, m0, n0) || m0 >= p.m || n0 >= p.n) return;
  const int64_t rows = std::min(kTile, p.m - m0), cols = std::min(kTile, p.n - n0);
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(p.y + (m0 + r) * p.n + n0, scratch + r * kTile, cols * sizeof(float));
  }
}

// Prefetch of the next N block's B panel into L2, `lines_per_step` cache lines per K step.
struct Prefetch {
  static constexpr int64_t kLine = 64;
  const char* next = nullptr;
  const char* end = nullptr;
  int64_t lines_per_step = 0;

  void Step() {
    for (int64_t i = 0; i < lines_per_step && next < end; ++i, next += kLine) {
      _mm_prefetch(next, _MM_HINT_T1);
    }
  }
};

// One 32 x 32 C block (TwoRowTiles: 32 rows, else the top 16) at rows m0.., columns n0..,
// from row block `a` and B panel `panel`; advances `pf` once per K step.
template <bool TwoRowTiles>
void Block(const Problem& p, const RowBlock& a, const uint16_t* panel, int64_t m0, int64_t n0,
           Prefetch& pf) {
  _tile_zero(0);
  _tile_zero(1);
  if (TwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const auto* a1 = reinterpret_cast<const uint8_t*>(a.data) + kTile * a.stride_bytes;
  for (int64_t kb = 0; kb < p.k_blocks; ++kb) {
    const uint16_t* b = panel + kb * 2 * kTileElems;
    pf.Step();
    _tile_loadd(4, a.data + kb * kDepth, a.stride_bytes);
    _tile_loadd(6, b, kDepth * sizeof(uint16_t));
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + kTileElems, kDepth * sizeof(uint16_t));
    _tile_dpbf16ps(1, 4, 7);
    if (TwoRowTiles) {
      _tile_loadd(5, a1 + kb * kDepth * sizeof(uint16_t), a.stride_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float scratch[4][kTile * kTile];
  const TileOut c0 = TileTarget(p, m0, n0, scratch[0]);
  const TileOut c1 = TileTarget(p, m0, n0 + kTile, scratch[1]);
  _tile_stored(0, c0.data, c0.stride_bytes);
  _tile_stored(1, c1.data, c1.stride_bytes);
  SpillTile(p, m0, n0, scratch[0]);
  SpillTile(p, m0, n0 + kTile, scratch[1]);
  if (TwoRowTiles) {
    const TileOut c2 = TileTarget(p, m0 + kTile, n0, scratch[2]);
    const TileOut c3 = TileTarget(p, m0 + kTile, n0 + kTile, scratch[3]);
    _tile_stored(2, c2.data, c2.stride_bytes);
    _tile_stored(3, c3.data, c3.stride_bytes);
    SpillTile(p, m0 + kTile, n0, scratch[2]);
    SpillTile(p, m0 + kTile, n0 + kTile, scratch[3]);
  }
}

// N block `nb` over rows [m_begin, m_end); prefetches N block `following` (if >= 0).
void Column(const Problem& p, int64_t nb, int64_t m_begin, int64_t m_end, int64_t following) {
  const int64_t panel_elems = p.k_blocks * 2 * kTileElems;
  const uint16_t* panel = p.w + nb * panel_elems;
  Prefetch pf;
  if (following >= 0) {
    pf.next = reinterpret_cast<const char*>(p.w + following * panel_elems);
    pf.end = pf.next + panel_elems * sizeof(uint16_t);
    const int64_t steps = (m_end - m_begin + kBlock - 1) / kBlock * p.k_blocks;
    const int64_t lines = panel_elems * int64_t{sizeof(uint16_t)} / Prefetch::kLine;
    pf.lines_per_step = (lines + steps - 1) / steps;
  }
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kBlock) {
    const RowBlock a = Rows(p, m0);
    if (m_end - m0 > kTile) {
      Block<true>(p, a, panel, m0, nb * kBlock, pf);
    } else {
      Block<false>(p, a, panel, m0, nb * kBlock, pf);
    }
  }
}

// Work item: N blocks [nb0, nb1) over rows [m_begin, m_end), each prefetching the next one's
// panel, the last N block prefetching `next_nb`'s (if >= 0).
void Columns(const Problem& p, int64_t nb0, int64_t nb1, int64_t m_begin, int64_t m_end,
             int64_t next_nb) {
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    Column(p, nb, m_begin, m_end, nb + 1 < nb1 ? nb + 1 : next_nb);
  }
}

ffi::Error AmxMatmul(ffi::ThreadPool pool, Bf16R2 x, ffi::AnyBuffer w, S32R0 layer,
                     ffi::Result<F32R2> y) {
  if (!amx_ready.load()) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "AMX is not enabled (LlmjaxAmxInit)");
  }
  llmjax::PackedOperands ops;
  if (auto error = llmjax::CheckPackedOperands(x, w, layer, *y, ops); error.failure()) return error;
  const int64_t m = ops.m, k = ops.k, n = ops.n, k_blocks = ops.k_blocks, n_blocks = ops.n_blocks;
  if (m == 0 || n == 0) return ffi::Error::Success();
  if (k == 0) {
    std::fill(y->typed_data(), y->typed_data() + m * n, 0.f);
    return ffi::Error::Success();
  }
  const auto* xs = static_cast<const uint16_t*>(x.untyped_data());
  const int64_t kp = k_blocks * kDepth, tail = m % kBlock;
  // The calling thread's copies, reused across calls; they outlive every item (Wait below).
  thread_local std::vector<uint16_t> padded;
  const uint16_t *rows = xs, *last = nullptr;
  if (kp != k) {
    CopyPadded(xs, k, 0, m, kp, padded);
    rows = padded.data();
  } else if (tail != 0) {
    CopyPadded(xs, k, m - tail, m, kp, padded);
    last = padded.data();
  }
  const Problem p{rows, last, kp, ops.w, y->typed_data(), m, n, k_blocks};
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t group = std::clamp<int64_t>(n_blocks / (4 * threads), 1, kPageBlocks);
  const int64_t groups = (n_blocks + group - 1) / group;
  const auto run = [&p, group, groups, n_blocks](int64_t item, int64_t following) {
    const int64_t m_begin = item / groups * kChunkRows, nb0 = item % groups * group;
    Columns(p, nb0, std::min(nb0 + group, n_blocks), m_begin, std::min(m_begin + kChunkRows, p.m),
            following < 0 ? -1 : following % groups * group);
  };
  // Each thread configures its AMX tiles before its first item and releases them after its last.
  static const TileConfig config;
  llmjax::RunItems(pool, (m + kChunkRows - 1) / kChunkRows * groups, run, /*claim_ahead=*/true,
                   [] { _tile_loadconfig(&config); }, [] { _tile_release(); });
  return ffi::Error::Success();
}

}  // namespace

extern "C" int LlmjaxAmxInit() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return 1;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  if (!amx_bf16 || !amx_tile) return 1;
  unsigned long perm = 0;
  if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) != 0 ||
      syscall(SYS_arch_prctl, kGetXcompPerm, &perm) != 0 || !(perm & (1ul << kXfeatureTileData))) {
    return 2;
  }
  amx_ready.store(true);
  return 0;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxAmxMatmul, AmxMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<Bf16R2>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w (packed stack)
                                  .Arg<S32R0>()  // layer
                                  .Ret<F32R2>());  // y
