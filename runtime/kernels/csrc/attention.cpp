// Paged attention on the CPU: one decode row per sequence, and the ragged contract.
//
// What it is: plimsoll_paged_decode_attention (float32, bfloat16 or int8 cache), the decode half of
// attention/reference.paged_attention's contract: one query per sequence against its context
// read straight from the paged KV cache (no gather copy). Work is split by sequence; each reads
// its K rows once to score every query head (GQA: query head h reads KV head h / (H / Hkv)) and
// its V rows once to sum them (head_dim 64 or 128: unrolled, each row in registers for its group
// of heads, the next block prefetched; an int8 row's scale folded into its score or weight). And
// plimsoll_paged_attention (float32 or bfloat16 cache), the ragged contract (prefill, later chunks,
// prefix-cache hits and decode rows in one call), below.
// What it is not: the fused decode step's attention (decode_step.cpp calls attend() itself).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "plimsoll_kernels.h"
#include "pool.h"

namespace plimsoll {
namespace {

template <typename T>
int paged_decode_attention(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                           const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                           float scale, int64_t num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (context_lens[b] <= 0 || context_lens[b] > max_blocks * block_size) return 2;
  }
  const Args<T> a{q, k_cache, v_cache, block_tables, context_lens, out,
                  num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, num_seqs));
  pool::parallel(workers, [&a, num_seqs, workers](int64_t w) {
    thread_local std::vector<float> scores;
    // Interleaved sequences: neighbours in a batch tend to have similar context lengths.
    for (int64_t b = w; b < num_seqs; b += workers) attend(a, b, scores);
  });
  return 0;
}

// Ragged attention (prefill, chunked prefill, prefix-cache hits and decode rows in one call):
// sequence b's q_len = cu_q[b + 1] - cu_q[b] queries (rows cu_q[b] .. of q and out, [N, H, D])
// are the last q_len positions of its context_lens[b] tokens, all already in the cache; query i
// sees tokens 0 .. ctx - q_len + i. Float32 or bfloat16 cache, head_dim 64 or 128. Work goes out in tiles
// of up to kTileRows queries of one sequence (each K and V row is read once per tile) to threads
// as they finish, sequence by sequence (a causal prefill's last tiles cost the most).
// Returns 0, or a code: 1 heads, 2 a context length, 3 head_dim.
constexpr int64_t kTileRows = 8;

// One tile: the AVX-512 tile kernel for several rows where it is built, else row by row.
template <int64_t NV, typename T>
void attend_tile(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                 const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                 float scale, std::vector<float>& scores) {
#if defined(__AVX512F__)
  if (rows > 1) return attend_tile_f32<NV, T>(q, out, rows, first, k_cache, v_cache, table, heads, kv_heads, bs, scale, scores);
#endif
  attend_rows_f32<NV, T>(q, out, rows, first, k_cache, v_cache, table, heads, kv_heads, bs, scale, scores);
}

template <typename T>
int paged_attention(const float* q, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                    const int32_t* cu_q, const int32_t* context_lens, float* out, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                    int64_t max_blocks, float scale, int64_t num_threads) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || block_size <= 0) return 1;
  if (head_dim != 64 && head_dim != 128) return 3;
  struct Tile {
    int64_t seq, r0, rows, cost;
  };
  std::vector<Tile> tiles;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t q_len = cu_q[b + 1] - cu_q[b], ctx = context_lens[b];
    if (q_len < 0 || q_len > ctx || ctx > max_blocks * block_size) return 2;
    for (int64_t r0 = 0; r0 < q_len; r0 += kTileRows) {
      const int64_t rows = std::min(kTileRows, q_len - r0);
      tiles.push_back({b, r0, rows, rows * (ctx - q_len + r0 + rows)});
    }
  }
  // A sequence's tiles stay together (its K and V stay in cache while threads share them), the
  // costliest sequences and, within one, the costliest tiles first.
  std::vector<int64_t> seq_cost(static_cast<size_t>(num_seqs), 0);
  for (const Tile& t : tiles) seq_cost[static_cast<size_t>(t.seq)] += t.cost;
  std::sort(tiles.begin(), tiles.end(), [&seq_cost](const Tile& x, const Tile& y) {
    const int64_t cx = seq_cost[static_cast<size_t>(x.seq)], cy = seq_cost[static_cast<size_t>(y.seq)];
    if (cx != cy) return cx > cy;
    if (x.seq != y.seq) return x.seq < y.seq;
    return x.cost > y.cost;
  });
  const int64_t n_tiles = static_cast<int64_t>(tiles.size());
  const int64_t row_floats = num_heads * head_dim;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, n_tiles));
  pool::parallel(workers, [&](int64_t) {
    thread_local std::vector<float> scores;
    for (int64_t k = next.fetch_add(1); k < n_tiles; k = next.fetch_add(1)) {
      const Tile& tile = tiles[static_cast<size_t>(k)];
      const int64_t row = cu_q[tile.seq] + tile.r0;
      const int64_t first = context_lens[tile.seq] - (cu_q[tile.seq + 1] - cu_q[tile.seq]) + tile.r0;
      const int32_t* table = block_tables + tile.seq * max_blocks;
      const float* tq = q + row * row_floats;
      float* to = out + row * row_floats;
      if (head_dim == 64) {
        attend_tile<4>(tq, to, tile.rows, first, k_cache, v_cache, table, num_heads, num_kv_heads, block_size,
                       scale, scores);
      } else {
        attend_tile<8>(tq, to, tile.rows, first, k_cache, v_cache, table, num_heads, num_kv_heads, block_size,
                       scale, scores);
      }
    }
  });
  return 0;
}

// cache_dtype: what k_cache and v_cache hold, as cpu_kernels.CACHE_DTYPES numbers it. 0 float32; 1
// bfloat16 (a --dtype bfloat16 engine's); 2 int8 (--kv-cache-dtype int8) in attention/kv_int8.py's
// block layout: each block holds its [block_size, Hkv, head_dim] int8 values, then their
// [block_size, Hkv] float32 scales; head_dim is the values' count, not the cache's last dimension
// (head_dim + 4). The query and out are float32 whatever the cache. 5: another cache_dtype.
template <typename Fn>
int with_cache_type(int64_t cache_dtype, const void* k_cache, const void* v_cache, Fn fn) {
  switch (cache_dtype) {
    case 0:
      return fn(static_cast<const float*>(k_cache), static_cast<const float*>(v_cache));
    case 1:
      return fn(static_cast<const Bf16*>(k_cache), static_cast<const Bf16*>(v_cache));
    case 2:
      return fn(static_cast<const int8_t*>(k_cache), static_cast<const int8_t*>(v_cache));
    default:
      return 5;
  }
}

}  // namespace
}  // namespace plimsoll

using namespace plimsoll;

extern "C" int plimsoll_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache,
                                               const int32_t* block_tables, const int32_t* context_lens,
                                               float* out, int64_t num_seqs, int64_t num_heads,
                                               int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                               int64_t max_blocks, float scale, int64_t cache_dtype,
                                               int64_t num_threads) {
  return with_cache_type(cache_dtype, k_cache, v_cache, [&](auto k, auto v) {
    return paged_decode_attention(q, k, v, block_tables, context_lens, out, num_seqs, num_heads, num_kv_heads,
                                  head_dim, block_size, max_blocks, scale, num_threads);
  });
}

// The ragged contract over a float32 or bfloat16 cache (cache_dtype 0 or 1; an int8 one gives 5).
extern "C" int plimsoll_paged_attention(const float* q, const void* k_cache, const void* v_cache,
                                        const int32_t* block_tables, const int32_t* cu_q,
                                        const int32_t* context_lens, float* out, int64_t num_seqs,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                        int64_t block_size, int64_t max_blocks, float scale, int64_t cache_dtype,
                                        int64_t num_threads) {
  return with_cache_type(cache_dtype, k_cache, v_cache, [&](auto k, auto v) {
    if constexpr (std::is_same_v<decltype(k), const int8_t*>) {
      return 5;
    } else {
      return paged_attention(q, k, v, block_tables, cu_q, context_lens, out, num_seqs, num_heads, num_kv_heads,
                             head_dim, block_size, max_blocks, scale, num_threads);
    }
  });
}
