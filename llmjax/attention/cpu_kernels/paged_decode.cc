// Attention over the paged KV cache for XLA:CPU, called through the XLA FFI.
//
// Handler `LlmjaxPagedDecode` (registered by llmjax/attention/native.py), operands:
//   q               f32 [T, H, D], D a multiple of 32
//   k_cache         [L, num_blocks, block_size, Hkv, D], f32 or u16 (bfloat16 bit patterns)
//   v_cache         same shape and dtype as k_cache
//   layer           s32 []  the layer of the caches to read
//   query_start_loc s32 [S+1]
//   seq_lens        s32 [S]
//   block_tables    s32 [S, B]
//   num_decodes     s32 []
// attributes: sm_scale (f32), decode_only (bool); result: f32 [T, H, D].
//
// Every row of `llmjax.attention.xla.ragged_paged_attention`: request i's new tokens are
// q[query_start_loc[i] + j], j < q_len_i, at positions seq_lens[i] - q_len_i + j; each attends
// with softmax(q.k * sm_scale) to the positions up to its own, query head h reading KV head
// h / (H / Hkv). Decode requests (i < num_decodes, or all when decode_only) have one token:
// only q[query_start_loc[i]] is computed. Rows of no request are 0; a request's tokens at flat
// index >= T are dropped. The cache is read in place; slots past a context are never read.
// Math is float32 in 16-lane vectors (GNU vector extensions: AVX-512 registers with
// -march=native on x86, narrower ones elsewhere). Work items, run by the calling thread and
// XLA's intra-op thread pool off one atomic counter (with decode rows and at least two items a
// thread, each thread claiming its next item ahead): the prefill tiles (longest context
// first), then the decode rows.
//
// Decode rows: along the block table in chunks of kChunk keys (the next chunk prefetched
// into L2 meanwhile; over the last, the first chunk of the item the thread claimed next), with an online softmax per head: each context slot's K and V rows come from
// memory once (a KV head's G query heads reuse them from the CPU caches). Values are handled
// 32 at a time ("pairs" of vectors): float32 as two consecutive vectors; bfloat16 as one
// 64-byte load split into its even and odd elements by a shift and a mask (exact), q and the
// accumulators being kept in that same order. Scores: per key, lane-wise partial sums of q.k;
// 16 keys' partials are summed at once by a transposing tree of pairwise shuffles. A work item
// is a decode row and a range of its KV heads (split when rows are few).
//
// Prefill rows: a work item is a tile (a request's consecutive new tokens, about kTileRows /
// G of them) and one KV head: its rows (token, query head of the group) attend together, rows
// in vector lanes, so the tile shares each key and value it loads and its softmax needs no
// reduction across lanes. Per chunk of kChunk keys (chunks past the tile's last position are
// skipped; the last one stops there): the chunk's K and V rows are widened to float32 in
// scratch; scores^T [keys, rows] = K q^T and acc^T [D, rows] += V^T p^T are register-blocked
// products (MulBlock); masking (key position > row position) and the online softmax run
// lane-wise. Scratch per thread: about (2 * D + kChunk) * kTileRows + 2 * kChunk * D floats.
//
// An out-of-range layer, block id or context length (a prefill request's below its q_len), or
// a head dim that is not a multiple of 32, is an InvalidArgument error (nothing is read).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <new>
#include <string>
#include <vector>

#include "work_items.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

using F32R3 = ffi::Buffer<ffi::F32, 3>;
using S32R0 = ffi::BufferR0<ffi::S32>;
using S32R1 = ffi::Buffer<ffi::S32, 1>;
using S32R2 = ffi::Buffer<ffi::S32, 2>;

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kPair = 2 * kLanes;  // values per pair of vectors
constexpr int64_t kChunk = 64;         // keys per online-softmax step (a multiple of kLanes)
typedef float Vec __attribute__((vector_size(kLanes * 4)));
typedef int32_t Lanes __attribute__((vector_size(kLanes * 4)));
typedef uint32_t Bits __attribute__((vector_size(kLanes * 4)));

inline Vec Load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, Vec v) { std::memcpy(p, &v, sizeof v); }

inline Vec AsFloats(Bits b) {
  Vec v;
  std::memcpy(&v, &b, sizeof v);
  return v;
}

// 32 stored values as float32 vectors, in pair order (see the header comment).
struct Pair {
  Vec a, b;
};

inline Pair LoadPair(const float* p) { return {Load(p), Load(p + kLanes)}; }

inline Pair LoadPair(const uint16_t* p) {
  Bits x;
  std::memcpy(&x, p, sizeof x);  // lane i: bfloat16 2i in its low half, 2i + 1 in its high half
  return {AsFloats(x << 16), AsFloats(x & 0xffff0000u)};
}

// Pair order of d float32 values (d a multiple of 32) for the storage type of the last
// argument (a tag, not read), and back (scaled).
inline void ToPairOrder(const float* src, int64_t d, float* dst, const float*) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void ToPairOrder(const float* src, int64_t d, float* dst, const uint16_t*) {
  for (int64_t c = 0; c < d; c += kPair) {
    for (int64_t i = 0; i < kLanes; ++i) {
      dst[c + i] = src[c + 2 * i];
      dst[c + kLanes + i] = src[c + 2 * i + 1];
    }
  }
}

inline void FromPairOrder(const float* src, int64_t d, float scale, float* dst, const float*) {
  for (int64_t i = 0; i < d; ++i) dst[i] = src[i] * scale;
}

inline void FromPairOrder(const float* src, int64_t d, float scale, float* dst, const uint16_t*) {
  for (int64_t c = 0; c < d; c += kPair) {
    for (int64_t i = 0; i < kLanes; ++i) {
      dst[c + 2 * i] = src[c + i] * scale;
      dst[c + 2 * i + 1] = src[c + kLanes + i] * scale;
    }
  }
}

// Lanes 0-7: sums of a's adjacent lane pairs; lanes 8-15: the same for b.
inline Vec PairSums(Vec a, Vec b) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
#else
  constexpr Lanes even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  constexpr Lanes odd = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
#endif
}

// Lane j of the result: the sum of p[j]'s lanes (p is clobbered).
inline Vec SumLanes(Vec* p) {
  for (int64_t i = 0; i < 8; ++i) p[i] = PairSums(p[2 * i], p[2 * i + 1]);
  for (int64_t i = 0; i < 4; ++i) p[i] = PairSums(p[2 * i], p[2 * i + 1]);
  for (int64_t i = 0; i < 2; ++i) p[i] = PairSums(p[2 * i], p[2 * i + 1]);
  return PairSums(p[0], p[1]);
}

// A reduction of one vector's lanes (a pairwise tree).
template <typename Op>
inline float ReduceLanes(Vec x, Op op) {
  float t[kLanes];
  std::memcpy(t, &x, sizeof t);
  for (int64_t w = kLanes / 2; w > 0; w /= 2) {
    for (int64_t i = 0; i < w; ++i) t[i] = op(t[i], t[i + w]);
  }
  return t[0];
}

// exp(x) for x <= 0, lane-wise (Cephes' expf: relative error ~2e-7); below exp(-87), ~1.6e-38.
inline Vec ExpNonPositive(Vec x) {
  const Vec lo = Vec{} - 87.f;
  x = x < lo ? lo : x;
  const Vec magic = Vec{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  const Vec n = (x * 1.44269504088896341f + magic) - magic;
  const Vec r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  Vec p = Vec{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Vec y = p * r * r + r + 1.f;
  const Lanes e = (__builtin_convertvector(n, Lanes) + 127) << 23;
  Vec scale;
  std::memcpy(&scale, &e, sizeof scale);
  return y * scale;
}

inline float Exp(float x) { return ExpNonPositive(Vec{} + x)[0]; }

struct Geometry {
  int64_t block_size, kv_heads, group, head_dim, max_blocks;
};

inline int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Per-thread scratch for one work item: q, acc [heads, D] (pair order); m, l [heads];
// s [heads, kChunk]; keys, next [kChunk]: cache slots (element offsets of KV head 0 in the
// layer) of this chunk and the next; rows [KV heads, kChunk]: the chunk's rows of one cache.
template <typename T>
struct Scratch {
  std::vector<float> q, acc, m, l, s;
  std::vector<int64_t> keys, next;
  std::vector<const T*> rows;
  void Reset(int64_t heads, int64_t kv_heads, int64_t d) {
    q.resize(heads * d);
    acc.assign(heads * d, 0.f);
    m.assign(heads, -1e30f);
    l.assign(heads, 0.f);
    s.resize(heads * kChunk);
    keys.resize(kChunk);
    next.resize(kChunk);
    rows.resize(kv_heads * kChunk);
  }
};

// keys[j] = the element offset (KV head 0) in the layer of the slot of context position
// first + j, for j < n.
inline void ChunkSlots(const int32_t* table, int64_t first, int64_t n, const Geometry& g,
                       int64_t slot, int64_t* keys) {
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = first + j;
    keys[j] = (static_cast<int64_t>(table[pos / g.block_size]) * g.block_size +
               pos % g.block_size) * slot;
  }
}

// rows[h * kChunk + j] = x's row of key j for KV head h0 + h, for j < n rounded up to whole
// vectors (keys past n repeat key n - 1).
template <typename T>
void RowPointers(const T* x, const int64_t* keys, int64_t n, int64_t h0, int64_t h1, int64_t d,
                 const T** rows) {
  for (int64_t h = 0; h < h1 - h0; ++h) {
    for (int64_t j = 0; j < RoundUp(n, kLanes); ++j) {
      rows[h * kChunk + j] = x + keys[std::min(j, n - 1)] + (h0 + h) * d;
    }
  }
}

// The cache level the decode rows' prefetches fill (__builtin_prefetch's locality): 2, L2.
// Into L1 (3) measured slower: the next chunk (48 KiB of K and V for a row of SmolLM2 in
// bfloat16) does not fit beside the current one in a 32 KiB L1. experiments/decode_attention.py
// builds the kernel both ways and times them side by side.
#ifndef LLMJAX_PREFETCH_LOCALITY
#define LLMJAX_PREFETCH_LOCALITY 2
#endif
// Whether a decode row prefetches the first chunk of its thread's next item (1, the default);
// experiments/decode_attention.py also builds the kernel without (0).
#ifndef LLMJAX_PREFETCH_FOLLOWING
#define LLMJAX_PREFETCH_FOLLOWING 1
#endif

// Prefetches bytes [offset, offset + bytes) of the slots keys[0, n) of x.
template <typename T>
void Prefetch(const T* x, const int64_t* keys, int64_t n, int64_t offset, int64_t bytes) {
  for (int64_t j = 0; j < n; ++j) {
    const char* row = reinterpret_cast<const char*>(x + keys[j] + offset);
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, LLMJAX_PREFETCH_LOCALITY);
  }
}

// s[j] = q . rows[j] for j < n rounded up to whole vectors; q in pair order, np pairs (kNp: np
// if known statically). 16 keys at a time, their lane-wise partial sums side by side
// (independent chains), then SumLanes.
template <int64_t kNp, typename T>
void Scores(const float* q, const T* const* rows, int64_t n, int64_t np, float* s) {
  np = kNp ? kNp : np;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const T* const* r = rows + j0;
    Vec p[kLanes] = {};
    for (int64_t c = 0; c < np; ++c) {
      const Vec qa = Load(q + c * kPair), qb = Load(q + c * kPair + kLanes);
      for (int64_t jj = 0; jj < kLanes; ++jj) {
        const Pair k = LoadPair(r[jj] + c * kPair);
        p[jj] += qa * k.a;
        p[jj] += qb * k.b;
      }
    }
    Store(s + j0, SumLanes(p));
  }
}

// acc += sum_j w[j] * rows[j] for j < n (acc in pair order, np pairs). With np known
// statically, acc stays in registers and keys go round kSets accumulators (independent chains).
template <int64_t kNp, typename T>
void Accumulate(float* acc, const float* w, const T* const* rows, int64_t n, int64_t np) {
  if constexpr (kNp > 0) {
    constexpr int64_t kSets = std::clamp<int64_t>(8 / kNp, 1, 4);
    Vec a[kSets][2 * kNp] = {};
    int64_t j = 0;
    for (; j + kSets <= n; j += kSets) {
      for (int64_t t = 0; t < kSets; ++t) {
        for (int64_t c = 0; c < kNp; ++c) {
          const Pair v = LoadPair(rows[j + t] + c * kPair);
          a[t][2 * c] += w[j + t] * v.a;
          a[t][2 * c + 1] += w[j + t] * v.b;
        }
      }
    }
    for (; j < n; ++j) {
      for (int64_t c = 0; c < kNp; ++c) {
        const Pair v = LoadPair(rows[j] + c * kPair);
        a[0][2 * c] += w[j] * v.a;
        a[0][2 * c + 1] += w[j] * v.b;
      }
    }
    for (int64_t c = 0; c < 2 * kNp; ++c) {
      Vec sum = Load(acc + c * kLanes);
      for (int64_t t = 0; t < kSets; ++t) sum += a[t][c];
      Store(acc + c * kLanes, sum);
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t c = 0; c < np; ++c) {
        const Pair v = LoadPair(rows[j] + c * kPair);
        float* ac = acc + c * kPair;
        Store(ac, Load(ac) + w[j] * v.a);
        Store(ac + kLanes, Load(ac + kLanes) + w[j] * v.b);
      }
    }
  }
}

// Online-softmax step of one head over a chunk's n scores s, held in whole vectors (lanes past
// n: ignored). The scores are replaced by their weights (0 past n); updates the running max m
// and sum l and returns the factor the head's accumulator is rescaled by.
inline float SoftmaxStep(float* s, int64_t n, float& m, float& l) {
  constexpr Lanes lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const Vec lowest = Vec{} - 3.4e38f;
  Vec vmax = lowest;
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const Lanes valid = lane + static_cast<int32_t>(j0) < static_cast<int32_t>(n);
    const Vec x = valid ? Load(s + j0) : lowest;
    vmax = x > vmax ? x : vmax;
  }
  const float m_new =
      std::max(m, ReduceLanes(vmax, [](float a, float b) { return std::max(a, b); }));
  Vec sum = {};
  for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
    const Lanes valid = lane + static_cast<int32_t>(j0) < static_cast<int32_t>(n);
    const Vec e = valid ? ExpNonPositive(Load(s + j0) - m_new) : Vec{};
    Store(s + j0, e);
    sum += e;
  }
  const float alpha = Exp(m - m_new);
  l = l * alpha + ReduceLanes(sum, [](float a, float b) { return a + b; });
  m = m_new;
  return alpha;
}

// A decode work item's keys: a row's block ids and context length, and its KV heads [h0, h1).
struct RowPart {
  const int32_t* table = nullptr;  // nullptr: no item
  int64_t context = 0, h0 = 0, h1 = 0;
};

// One decode row, KV heads [h0, h1) (`row`): q_row [H, D] -> out_row [H, D] for query heads
// [h0 * G, h1 * G). k, v: one layer [num_blocks, bs, Hkv, D]. kNp: D / 32 when known at compile
// time, else 0. Over its last chunk it prefetches the first chunk of `following`, the item its
// thread runs next, if any.
template <int64_t kNp, typename T>
void AttendRow(const float* q_row, const T* k, const T* v, const RowPart& row,
               const RowPart& following, float sm_scale, const Geometry& g, Scratch<T>& sc,
               float* out_row) {
  const int32_t* table = row.table;
  const int64_t context = row.context, h0 = row.h0, h1 = row.h1;
  const int64_t d = g.head_dim, np = d / kPair, gs = g.group, nh = h1 - h0;
  const int64_t heads = nh * gs, first = h0 * gs;
  const int64_t slot = g.kv_heads * d;  // elements per cache slot
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));  // bytes of one KV head per slot
  sc.Reset(heads, nh, d);
  for (int64_t h = 0; h < heads; ++h) {
    ToPairOrder(q_row + (first + h) * d, d, sc.q.data() + h * d, k);
    for (int64_t i = 0; i < d; ++i) sc.q[h * d + i] *= sm_scale;
  }
  const T** rows = sc.rows.data();
  ChunkSlots(table, 0, std::min(kChunk, context), g, slot, sc.keys.data());
  for (int64_t c0 = 0; c0 < context; c0 += kChunk) {
    const int64_t n = std::min(kChunk, context - c0);
    // The next chunk (this row's, else the following item's first) is elsewhere in memory:
    // fetch it meanwhile, spread over this chunk's work rather than in one burst.
    const int64_t* keys = sc.keys.data();
    int64_t n_next = std::min(kChunk, context - c0 - n), heads_from = h0, heads_to = h1;
    if (n_next > 0) {
      ChunkSlots(table, c0 + n, n_next, g, slot, sc.next.data());
    } else if (LLMJAX_PREFETCH_FOLLOWING && following.table) {
      n_next = std::min(kChunk, following.context);
      heads_from = following.h0, heads_to = following.h1;
      ChunkSlots(following.table, 0, n_next, g, slot, sc.next.data());
    }
    RowPointers(k, keys, n, h0, h1, d, rows);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t lo = h * n_next / heads, hi = (h + 1) * n_next / heads;
      const int64_t offset = heads_from * d, span = (heads_to - heads_from) * bytes;
      Prefetch(k, sc.next.data() + lo, hi - lo, offset, span);
      Prefetch(v, sc.next.data() + lo, hi - lo, offset, span);
      Scores<kNp>(sc.q.data() + h * d, rows + (h / gs) * kChunk, n, np, sc.s.data() + h * kChunk);
    }
    for (int64_t h = 0; h < heads; ++h) {
      const float alpha = SoftmaxStep(sc.s.data() + h * kChunk, n, sc.m[h], sc.l[h]);
      if (alpha != 1.f) {
        for (int64_t i = 0; i < d; ++i) sc.acc[h * d + i] *= alpha;
      }
    }
    RowPointers(v, keys, n, h0, h1, d, rows);
    for (int64_t h = 0; h < heads; ++h) {
      Accumulate<kNp>(sc.acc.data() + h * d, sc.s.data() + h * kChunk, rows + (h / gs) * kChunk,
                      n, np);
    }
    std::swap(sc.keys, sc.next);
  }
  for (int64_t h = 0; h < heads; ++h) {
    const float inv = sc.l[h] > 0.f ? 1.f / sc.l[h] : 0.f;
    FromPairOrder(sc.acc.data() + h * d, d, inv, out_row + (first + h) * d, k);
  }
}

constexpr int64_t kTileRows = 48;  // rows (tokens x group) a prefill tile aims for
constexpr int64_t kBlock = 8;      // output rows of one MulBlock (keys, or value dims)
constexpr int64_t kMaxVecs = 3;    // row vectors of one MulBlock (kBlock * kMaxVecs registers)

// 64-byte aligned float scratch that only grows; Get(n): n floats, contents unspecified.
class Floats {
 public:
  float* Get(int64_t n) {
    if (n > size_) {
      data_.reset(new (std::align_val_t(64)) float[n]);
      size_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(float* p) const { ::operator delete[](p, std::align_val_t(64)); }
  };
  std::unique_ptr<float[], Free> data_;
  int64_t size_ = 0;
};

// d stored values (d a multiple of kLanes) widened to float32.
inline void Widen(const float* src, int64_t d, float* dst) {
  std::memcpy(dst, src, d * sizeof(float));
}

inline void Widen(const uint16_t* src, int64_t d, float* dst) {
  typedef uint16_t Halves __attribute__((vector_size(kLanes * 2)));
  for (int64_t c = 0; c < d; c += kLanes) {
    Halves h;
    std::memcpy(&h, src + c, sizeof h);
    Store(dst + c, AsFloats(__builtin_convertvector(h, Bits) << 16));
  }
}

// For i < kBlock and the kVecs vectors of 16 rows at a + v * kLanes (row k of a at a + k *
// stride), with out's row i at out + i * stride:
//   out[i][v] = (scale ? out[i][v] * scale[v] : 0) + sum_{k < depth} b[i * bi + k * bk] * a[k][v]
// (b's elements broadcast to all lanes, the kBlock x kVecs sums held in registers).
template <int64_t kVecs>
void MulBlock(const float* a, const float* b, int64_t bi, int64_t bk, int64_t depth,
              int64_t stride, const float* scale, float* out) {
  Vec acc[kBlock][kVecs];
  for (int64_t i = 0; i < kBlock; ++i) {
    for (int64_t v = 0; v < kVecs; ++v) {
      acc[i][v] = scale ? Load(out + i * stride + v * kLanes) * Load(scale + v * kLanes) : Vec{};
    }
  }
  for (int64_t k = 0; k < depth; ++k) {
    Vec x[kVecs];
    for (int64_t v = 0; v < kVecs; ++v) x[v] = Load(a + k * stride + v * kLanes);
    for (int64_t i = 0; i < kBlock; ++i) {
      const float w = b[i * bi + k * bk];
      for (int64_t v = 0; v < kVecs; ++v) acc[i][v] += w * x[v];
    }
  }
  for (int64_t i = 0; i < kBlock; ++i) {
    for (int64_t v = 0; v < kVecs; ++v) Store(out + i * stride + v * kLanes, acc[i][v]);
  }
}

// MulBlock over all `stride` rows (stride / kLanes vectors, kMaxVecs at a time) and outputs
// i < count (a multiple of kBlock); scale, when given, holds one factor per row.
void MulRows(const float* a, const float* b, int64_t bi, int64_t bk, int64_t depth,
             int64_t stride, int64_t count, const float* scale, float* out) {
  for (int64_t r = 0; r < stride; r += kMaxVecs * kLanes) {
    const int64_t vecs = std::min(kMaxVecs, (stride - r) / kLanes);
    const auto mul = vecs == 1 ? MulBlock<1> : vecs == 2 ? MulBlock<2> : MulBlock<3>;
    for (int64_t i = 0; i < count; i += kBlock) {
      mul(a + r, b + i * bi, bi, bk, depth, stride, scale ? scale + r : nullptr,
          out + i * stride + r);
    }
  }
}

// Online-softmax step of `stride` rows (whole vectors) over a chunk of n keys at positions
// c0 + j: s[j * stride + r], row r's score of key j, becomes its weight (0 where the key is
// past the row's position pos[r]); updates the running max m and sum l, and sets alpha to
// the factor each row's accumulators are rescaled by.
void SoftmaxRows(float* s, int64_t n, int64_t stride, int64_t c0, const float* pos, float* m,
                 float* l, float* alpha) {
  for (int64_t r = 0; r < stride; r += kLanes) {
    const Vec p = Load(pos + r), m_old = Load(m + r);
    Vec m_new = m_old;
    for (int64_t j = 0; j < n; ++j) {
      const Vec x = Load(s + j * stride + r);
      m_new = (p >= static_cast<float>(c0 + j)) & (x > m_new) ? x : m_new;
    }
    Vec sum = {};
    for (int64_t j = 0; j < n; ++j) {
      const Vec e = p >= static_cast<float>(c0 + j)
                        ? ExpNonPositive(Load(s + j * stride + r) - m_new) : Vec{};
      Store(s + j * stride + r, e);
      sum += e;
    }
    const Vec a = ExpNonPositive(m_old - m_new);
    Store(l + r, Load(l + r) * a + sum);
    Store(m + r, m_new);
    Store(alpha + r, a);
  }
}

// Per-thread scratch of a prefill tile with `stride` rows: q^T and acc^T [D, stride], scores
// [kChunk, stride], the chunk's keys and values [kChunk, D] in float32; per row: position
// (float, -1 for padding rows), m, l, alpha.
struct TileScratch {
  Floats qt, acc, scores, keys, values, pos, m, l, alpha;
};

// A prefill work item's tokens: `count` new tokens of request `req` from flat token `token0`,
// at positions pos0, pos0 + 1, ...
struct Tile {
  int64_t req, token0, pos0, count;
};

// One tile, KV head kh: row r is token r / G of the tile with query head kh * G + r % G; rows
// are padded to whole vectors. q [T, H, D] -> out [T, H, D] (the tile's rows only). k, v: one
// layer [num_blocks, bs, Hkv, D]; table: the request's block ids.
template <typename T>
void AttendTile(const float* q, const T* k, const T* v, const int32_t* table, const Tile& t,
                int64_t kh, int64_t num_heads, float sm_scale, const Geometry& g,
                TileScratch& sc, float* out) {
  const int64_t d = g.head_dim, gs = g.group, rows = t.count * gs;
  const int64_t stride = RoundUp(rows, kLanes), slot = g.kv_heads * d;
  float *qt = sc.qt.Get(d * stride), *acc = sc.acc.Get(d * stride);
  float *s = sc.scores.Get(kChunk * stride), *keys = sc.keys.Get(kChunk * d);
  float *values = sc.values.Get(kChunk * d), *pos = sc.pos.Get(stride), *m = sc.m.Get(stride);
  float *l = sc.l.Get(stride), *alpha = sc.alpha.Get(stride);
  std::fill(qt, qt + d * stride, 0.f);
  std::fill(acc, acc + d * stride, 0.f);
  std::fill(pos, pos + stride, -1.f);
  std::fill(m, m + stride, -1e30f);
  std::fill(l, l + stride, 0.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((t.token0 + r / gs) * num_heads + kh * gs + r % gs) * d;
    for (int64_t i = 0; i < d; ++i) qt[i * stride + r] = src[i] * sm_scale;
    pos[r] = static_cast<float>(t.pos0 + r / gs);
  }
  const int64_t end = t.pos0 + t.count;  // keys past the tile's last position: never visible
  for (int64_t c0 = 0; c0 < end; c0 += kChunk) {
    const int64_t n = std::min(kChunk, end - c0), padded = RoundUp(n, kBlock);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = c0 + j;
      const int64_t offset =
          (static_cast<int64_t>(table[p / g.block_size]) * g.block_size + p % g.block_size) *
              slot + kh * d;
      Widen(k + offset, d, keys + j * d);
      Widen(v + offset, d, values + j * d);
    }
    std::fill(keys + n * d, keys + padded * d, 0.f);
    MulRows(qt, keys, d, 1, d, stride, padded, nullptr, s);       // s [padded, stride]
    SoftmaxRows(s, n, stride, c0, pos, m, l, alpha);
    MulRows(s, values, 1, d, n, stride, d, alpha, acc);           // acc [d, stride]
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
    float* dst = out + ((t.token0 + r / gs) * num_heads + kh * gs + r % gs) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = acc[i * stride + r] * inv;
  }
}

// The work items: tiles[i / Hkv] with KV head i % Hkv for i < tiles.size() * Hkv, then the
// decode rows (each split into `splits` ranges of KV heads).
template <typename T>
void Run(ffi::ThreadPool& pool, const float* q, const T* k, const T* v,
         const std::vector<Tile>& tiles, const std::vector<int64_t>& rows, const int32_t* qsl,
         const int32_t* seq_lens, const int32_t* tables, int64_t num_heads, float sm_scale,
         const Geometry& g, float* out) {
  const int64_t workers = std::max<int64_t>(1, pool.num_threads());
  const int64_t num_rows = static_cast<int64_t>(rows.size());
  const int64_t tile_items = static_cast<int64_t>(tiles.size()) * g.kv_heads;
  // Few rows: split each row's KV heads too, so every thread gets work.
  const int64_t splits =
      num_rows ? std::clamp<int64_t>((2 * workers + num_rows - 1) / num_rows, 1, g.kv_heads) : 1;
  // Decode item i (counted after the tiles): row rows[i / splits], KV heads part i % splits.
  const auto row_part = [&, splits](int64_t i) {
    const int64_t r = rows[i / splits], part = i % splits;
    return RowPart{tables + r * g.max_blocks, seq_lens[r], g.kv_heads * part / splits,
                   g.kv_heads * (part + 1) / splits};
  };
  const auto run = [&, tile_items](int64_t item, int64_t following) {
    if (item < tile_items) {
      thread_local TileScratch scratch;
      const Tile& t = tiles[item / g.kv_heads];
      AttendTile(q, k, v, tables + t.req * g.max_blocks, t, item % g.kv_heads, num_heads,
                 sm_scale, g, scratch, out);
      return;
    }
    thread_local Scratch<T> scratch;
    const int64_t i = rows[(item - tile_items) / splits], row_elems = num_heads * g.head_dim;
    const auto attend = g.head_dim == 64    ? AttendRow<2, T>
                        : g.head_dim == 128 ? AttendRow<4, T>
                                            : AttendRow<0, T>;
    attend(q + qsl[i] * row_elems, k, v, row_part(item - tile_items),
           following >= tile_items ? row_part(following - tile_items) : RowPart{}, sm_scale, g,
           scratch, out + qsl[i] * row_elems);
  };
  // With decode rows, each thread claims its next item ahead, so that a decode row can prefetch
  // for it; not when there are fewer than two items a thread (a thread would hold one that
  // another could run at once).
  const int64_t items = tile_items + num_rows * splits;
  llmjax::RunItems(pool, items, run, /*claim_ahead=*/num_rows > 0 && items >= 2 * workers);
}

ffi::Error PagedAttention(ffi::ThreadPool pool, F32R3 q, ffi::AnyBuffer k_cache,
                          ffi::AnyBuffer v_cache, S32R0 layer, S32R1 query_start_loc,
                          S32R1 seq_lens, S32R2 block_tables, S32R0 num_decodes, float sm_scale,
                          bool decode_only, ffi::Result<F32R3> out) {
  const auto qd = q.dimensions(), cd = k_cache.dimensions(), td = block_tables.dimensions();
  const auto dtype = k_cache.element_type();
  if (cd.size() != 5 || !(v_cache.dimensions() == cd) || v_cache.element_type() != dtype) {
    return ffi::Error::InvalidArgument("k_cache and v_cache must be [L, blocks, bs, Hkv, D] alike");
  }
  if (dtype != ffi::DataType::F32 && dtype != ffi::DataType::U16) {
    return ffi::Error::InvalidArgument("the cache must be float32 or uint16 (bfloat16 bits)");
  }
  const int64_t num_tokens = qd[0], num_heads = qd[1], num_seqs = seq_lens.dimensions()[0];
  const Geometry g{cd[2], cd[3], cd[3] > 0 ? num_heads / cd[3] : 0, cd[4], td[1]};
  if (qd[2] != g.head_dim || g.kv_heads == 0 || num_heads % g.kv_heads != 0) {
    return ffi::Error::InvalidArgument("q must be [T, H, D] with H a multiple of Hkv");
  }
  if (g.head_dim % kPair != 0) return ffi::Error::InvalidArgument("D must be a multiple of 32");
  if (query_start_loc.dimensions()[0] != num_seqs + 1 || td[0] != num_seqs) {
    return ffi::Error::InvalidArgument("query_start_loc [S+1], seq_lens [S], block_tables [S, B]");
  }
  const int32_t l = *layer.typed_data();
  if (l < 0 || l >= cd[0]) return ffi::Error::InvalidArgument("layer out of range");

  const int32_t* qsl = query_start_loc.typed_data();
  const int32_t* lens = seq_lens.typed_data();
  const int32_t* tables = block_tables.typed_data();
  const int32_t decodes = *num_decodes.typed_data();
  const int64_t tile_tokens = std::max<int64_t>(1, kTileRows / g.group);
  std::vector<int64_t> rows;
  std::vector<Tile> tiles;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    if (q_len <= 0) continue;
    if (qsl[i] < 0) return ffi::Error::InvalidArgument("negative query_start_loc");
    if (qsl[i] >= num_tokens) continue;  // tokens past q: dropped, as the pure-JAX path does
    const bool decode = decode_only || i < decodes;
    if (lens[i] < (decode ? 0 : q_len) || lens[i] > g.max_blocks * g.block_size) {
      return ffi::Error::InvalidArgument("seq_lens[" + std::to_string(i) + "] out of range");
    }
    for (int64_t b = 0; b * g.block_size < lens[i]; ++b) {
      const int32_t id = tables[i * g.max_blocks + b];
      if (id < 0 || id >= cd[1]) {
        return ffi::Error::InvalidArgument("block id out of range in block_tables[" +
                                           std::to_string(i) + "]");
      }
    }
    if (decode) {
      if (lens[i] > 0) rows.push_back(i);
      continue;
    }
    const int64_t count = std::min(q_len, num_tokens - qsl[i]);
    for (int64_t j = 0; j < count; j += tile_tokens) {
      tiles.push_back({i, qsl[i] + j, lens[i] - q_len + j, std::min(tile_tokens, count - j)});
    }
  }
  // Longest context first, so that the last items to start are short.
  std::stable_sort(tiles.begin(), tiles.end(), [](const Tile& a, const Tile& b) {
    return a.pos0 + a.count > b.pos0 + b.count;
  });

  float* o = out->typed_data();
  std::fill(o, o + out->element_count(), 0.f);
  if (rows.empty() && tiles.empty()) return ffi::Error::Success();
  const int64_t layer_elems = cd[1] * cd[2] * cd[3] * cd[4];
  if (dtype == ffi::DataType::F32) {
    const float* k = static_cast<const float*>(k_cache.untyped_data()) + l * layer_elems;
    const float* v = static_cast<const float*>(v_cache.untyped_data()) + l * layer_elems;
    Run(pool, q.typed_data(), k, v, tiles, rows, qsl, lens, tables, num_heads, sm_scale, g, o);
  } else {
    const uint16_t* k = static_cast<const uint16_t*>(k_cache.untyped_data()) + l * layer_elems;
    const uint16_t* v = static_cast<const uint16_t*>(v_cache.untyped_data()) + l * layer_elems;
    Run(pool, q.typed_data(), k, v, tiles, rows, qsl, lens, tables, num_heads, sm_scale, g, o);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LlmjaxPagedDecode, PagedAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<F32R3>()           // q
                                  .Arg<ffi::AnyBuffer>()  // k_cache
                                  .Arg<ffi::AnyBuffer>()  // v_cache
                                  .Arg<S32R0>()           // layer
                                  .Arg<S32R1>()           // query_start_loc
                                  .Arg<S32R1>()           // seq_lens
                                  .Arg<S32R2>()           // block_tables
                                  .Arg<S32R0>()           // num_decodes
                                  .Attr<float>("sm_scale")
                                  .Attr<bool>("decode_only")
                                  .Ret<F32R3>());         // out
