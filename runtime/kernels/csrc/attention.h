// Attention over the paged KV cache: what the decode step and the ragged kernel share (header only).
//
// What it is: one sequence's queries against its context, read straight from the cache's
// blocks through its block table: attend() for one decode row (any head_dim, float32, int8 or
// bfloat16 cache; head_dim 64 and 128 unrolled), attend_rows_f32 / attend_tile_f32 for a tile of
// rows (prefill). attention.cpp builds the C calls on them; decode_step.cpp calls attend() inside
// the fused step.
// What it is not: the work split over threads (attention.cpp and decode_step.cpp do that).
//
// Layouts (row-major, contiguous):
//   q            [B, H, D]
//   k/v_cache    [num_blocks, block_size, Hkv, D] float32, or [.., Hkv, D + 4] int8 (kv_int8.py)
//   block_tables [B, max_blocks] int32 (entries past a context are never read)
//   context_lens [B] int32
//   out          [B, H, D]
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace plimsoll {

template <typename T>
struct Args {
  const float* q;
  const T* k_cache;
  const T* v_cache;
  const int32_t* block_tables;
  const int32_t* context_lens;
  float* out;
  int64_t num_heads, num_kv_heads, head_dim, block_size, max_blocks;
  float scale;
};

// Calls visit(t, row) for tokens t = 0 .. ctx-1 of one sequence, in order, where row
// points at that token's [Hkv, row_len] slice of the cache: blocks are walked through the
// block table, each one read front to back.
template <typename T, typename Visit>
void for_each_token(const T* cache, const int32_t* table, int64_t ctx, int64_t bs, int64_t token_stride,
                    Visit visit) {
  for (int64_t start = 0; start < ctx; start += bs) {
    const T* block = cache + static_cast<int64_t>(table[start / bs]) * bs * token_stride;
    const int64_t n = std::min(bs, ctx - start);
    for (int64_t o = 0; o < n; ++o) visit(start + o, block + o * token_stride);
  }
}

// s[0..n) <- softmax(s[0..n)), in place.
inline void softmax(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  float sum = 0.f;
  int64_t t = 0;
  for (; t + kExpLanes <= n; t += kExpLanes) exp_store(s + t, mx, sum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - mx);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// One sequence, all heads: its blocks are walked in order and each token's K (then
// V) row of Hkv x D values is read once, contiguously, for every head. Splitting the
// work by (sequence, KV head) instead reads each row in three strided pieces, which
// the hardware prefetcher turns into three full reads (measured ~3x slower).
template <typename T>
void attend_seq(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  const int64_t heads = a.num_heads;
  const int64_t group = heads / a.num_kv_heads;
  const int64_t d_len = a.head_dim;
  const int64_t row_len = Cache<T>::row_len(d_len);
  const int64_t ctx = a.context_lens[seq];
  const int64_t bs = a.block_size;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  const float* q = a.q + seq * heads * d_len;  // [H, D]
  float* out = a.out + seq * heads * d_len;    // [H, D]
  const int64_t token_stride = a.num_kv_heads * row_len;
  scores.resize(static_cast<size_t>(heads * ctx));
  float* s = scores.data();  // [H, ctx]

  for_each_token(a.k_cache, table, ctx, bs, token_stride, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* k = row + (h / group) * row_len;
      const float* qh = q + h * d_len;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < d_len; ++d) dot += qh[d] * static_cast<float>(k[d]);
      s[h * ctx + t] = dot * Cache<T>::scale(k, d_len) * a.scale;
    }
  });
  for (int64_t h = 0; h < heads; ++h) softmax(s + h * ctx, ctx);
  std::fill(out, out + heads * d_len, 0.f);
  for_each_token(a.v_cache, table, ctx, bs, token_stride, [&](int64_t t, const T* row) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* v = row + (h / group) * row_len;
      const float w = s[h * ctx + t] * Cache<T>::scale(v, d_len);
      float* oh = out + h * d_len;
#pragma omp simd
      for (int64_t d = 0; d < d_len; ++d) oh[d] += w * static_cast<float>(v[d]);
    }
  });
}

// Queries rows 0 .. rows - 1 of one sequence over its float32 (or bfloat16) cache, head_dim NV x 16: query i
// sits at position first + i and sees tokens 0 .. first + i (causal; a decode row is rows = 1,
// first = ctx - 1). q and out are [rows, H, D]. Each token's K and V row of a KV head is
// loaded into registers once for every query row and head that reads it, the loops over D
// are unrolled, and the next block's row at the same offset is prefetched (blocks lie
// anywhere in the cache, so the hardware prefetcher stops at each block's end).
template <int64_t NV, typename T = float>
void attend_rows_f32(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                     const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                     float scale, std::vector<float>& scores) {
  constexpr int64_t D = NV * kLanes;
  const int64_t group = heads / kv_heads, token_stride = kv_heads * D;
  const int64_t span = first + rows;  // tokens the last row sees
  scores.resize(static_cast<size_t>(rows * heads * span));
  float* s = scores.data();  // [rows, H, span]
  const int64_t lines = (token_stride * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  auto walk = [&](const T* cache, auto&& visit) {
    for (int64_t start = 0; start < span; start += bs) {
      const T* block = cache + static_cast<int64_t>(table[start / bs]) * bs * token_stride;
      const bool more = start + bs < span;
      const T* next = more ? cache + static_cast<int64_t>(table[start / bs + 1]) * bs * token_stride : block;
      const int64_t n = std::min(bs, span - start);
      for (int64_t o = 0; o < n; ++o) {
#if defined(__AVX2__) || defined(__AVX512F__)
        if (more) {
          const char* line = reinterpret_cast<const char*>(next + o * token_stride);
          for (int64_t l = 0; l < lines; ++l) _mm_prefetch(line + 64 * l, _MM_HINT_T0);
        }
#endif
        const int64_t t = start + o;
        visit(t, std::max<int64_t>(0, t - first), block + o * token_stride);  // rows i >= t - first see t
      }
    }
  };
  walk(k_cache, [&](int64_t t, int64_t i0, const T* row) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      F16 k[NV];
      for (int64_t j = 0; j < NV; ++j) k[j] = load_row(row + g * D + j * kLanes);
      for (int64_t i = i0; i < rows; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q + (i * heads + h) * D;
          F16 acc = zero16();
          for (int64_t j = 0; j < NV; ++j) acc = fma16(load_f32(qh + j * kLanes), k[j], acc);
          s[(i * heads + h) * span + t] = sum16(acc) * scale;
        }
      }
    }
  });
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) softmax(s + (i * heads + h) * span, first + i + 1);
  }
  std::fill(out, out + rows * heads * D, 0.f);
  walk(v_cache, [&](int64_t t, int64_t i0, const T* row) {
    for (int64_t g = 0; g < kv_heads; ++g) {
      F16 v[NV];
      for (int64_t j = 0; j < NV; ++j) v[j] = load_row(row + g * D + j * kLanes);
      for (int64_t i = i0; i < rows; ++i) {
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const F16 w = set16(s[(i * heads + h) * span + t]);
          float* oh = out + (i * heads + h) * D;
          for (int64_t j = 0; j < NV; ++j) store16(oh + j * kLanes, fma16(w, v[j], load_f32(oh + j * kLanes)));
        }
      }
    }
  });
}

#if defined(__AVX512F__)
// The 16 lanes' sums of 16 vectors, lane t of the result holding acc[t]'s sum: a tree of
// 128-bit-lane shuffles and adds (~3 ops a vector, against ~8 for one horizontal sum each).
inline __m512 sum16x16(const __m512* acc) {
  __m512 x[8], y[4];
  for (int k = 0; k < 8; ++k) {  // lanes 0-7: acc[2k]'s 8 partial sums, lanes 8-15: acc[2k + 1]'s
    x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(acc[2 * k], acc[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // 128-bit lane m: token 4k + m's 4 partial sums
    y[k] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * k], x[2 * k + 1], 0xDD));
  }
  const __m512 z0 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 z1 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(z0, z1, _MM_SHUFFLE(3, 2, 3, 2)));
  // w's element 4m + k holds token 4k + m.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, w);
}

// attend_rows_f32 for a tile of several query rows (prefill), AVX-512: per KV head, scores for
// 16 tokens at a time per (row, head) with one reduction tree instead of 16 horizontal sums,
// and the weighted sum of V kept in registers for a few (row, head) pairs at a time instead of
// read and written back for every token. Same contract and result (to rounding). A bfloat16
// cache's 16 K rows are widened once into a float32 buffer for all the tile's rows and heads,
// its V rows as they are read.
template <int64_t NV, typename T>
void attend_tile_f32(const float* q, float* out, int64_t rows, int64_t first, const T* k_cache,
                     const T* v_cache, const int32_t* table, int64_t heads, int64_t kv_heads, int64_t bs,
                     float scale, std::vector<float>& scores) {
  constexpr int64_t D = NV * kLanes;
  constexpr int64_t kPairs = 24 / NV;  // (row, head) pairs whose V sums stay in registers together
  const int64_t group = heads / kv_heads, token_stride = kv_heads * D;
  const int64_t span = first + rows;
  const int64_t padded = (span + 15) / 16 * 16;
  scores.resize(static_cast<size_t>(rows * heads * padded + D));
  float* s = scores.data();  // [rows, H, padded], then D zeros (the row read past the context)
  float* zero_row = s + rows * heads * padded;
  std::fill(zero_row, zero_row + D, 0.f);
  auto row_of = [&](const T* cache, int64_t t) {
    return cache + static_cast<int64_t>(table[t / bs]) * bs * token_stride + (t % bs) * token_stride;
  };
  alignas(64) float widened[std::is_same_v<T, float> ? 1 : 16 * D];
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < kv_heads; ++g) {
    for (int64_t t0 = 0; t0 < span; t0 += 16) {
      const float* k_rows[16];
      for (int64_t o = 0; o < 16; ++o) {
        if (t0 + o >= span) {
          k_rows[o] = zero_row;
          continue;
        }
        const T* kr = row_of(k_cache, t0 + o) + g * D;
        if constexpr (std::is_same_v<T, float>) {
          k_rows[o] = kr;
        } else {
          for (int64_t j = 0; j < NV; ++j) store16(widened + o * D + j * kLanes, load_row(kr + j * kLanes));
          k_rows[o] = widened + o * D;
        }
      }
      for (int64_t i = std::max<int64_t>(0, t0 - first); i < rows; ++i) {  // rows that see a token of the 16
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          const float* qh = q + (i * heads + h) * D;
          __m512 qv[NV];
          for (int64_t j = 0; j < NV; ++j) qv[j] = _mm512_loadu_ps(qh + j * kLanes);
          __m512 acc[16];
          for (int64_t o = 0; o < 16; ++o) {
            acc[o] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k_rows[o]));
            for (int64_t j = 1; j < NV; ++j) acc[o] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k_rows[o] + j * kLanes), acc[o]);
          }
          _mm512_storeu_ps(s + (i * heads + h) * padded + t0, _mm512_mul_ps(sum16x16(acc), vscale));
        }
      }
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t h = 0; h < heads; ++h) {
      float* sr = s + (i * heads + h) * padded;
      softmax(sr, first + i + 1);
      std::fill(sr + first + i + 1, sr + padded, 0.f);  // tokens after the row's own: weight 0
    }
  }
  for (int64_t g = 0; g < kv_heads; ++g) {
    const int64_t pairs = rows * group;  // pair p: row p / group, head g * group + p % group
    for (int64_t p0 = 0; p0 < pairs; p0 += kPairs) {
      const int64_t np = std::min(kPairs, pairs - p0);
      const float* w[kPairs];
      float* o_rows[kPairs];
      for (int64_t p = 0; p < np; ++p) {
        const int64_t i = (p0 + p) / group, h = g * group + (p0 + p) % group;
        w[p] = s + (i * heads + h) * padded;
        o_rows[p] = out + (i * heads + h) * D;
      }
      const int64_t last = first + (p0 + np - 1) / group + 1;  // tokens the batch's last row sees
      __m512 acc[kPairs][NV];
      for (int64_t p = 0; p < kPairs; ++p)
        for (int64_t j = 0; j < NV; ++j) acc[p][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < last; ++t) {
        const T* vr = row_of(v_cache, t) + g * D;
        __m512 v[NV];
        for (int64_t j = 0; j < NV; ++j) v[j] = load_row(vr + j * kLanes).v;
        for (int64_t p = 0; p < np; ++p) {
          const __m512 wt = _mm512_set1_ps(w[p][t]);
          for (int64_t j = 0; j < NV; ++j) acc[p][j] = _mm512_fmadd_ps(wt, v[j], acc[p][j]);
        }
      }
      for (int64_t p = 0; p < np; ++p)
        for (int64_t j = 0; j < NV; ++j) _mm512_storeu_ps(o_rows[p] + j * kLanes, acc[p][j]);
    }
  }
}
#endif

template <int64_t NV, typename T>
void attend_seq_f32(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  const int64_t offset = seq * a.num_heads * NV * kLanes;
  attend_rows_f32<NV, T>(a.q + offset, a.out + offset, 1, a.context_lens[seq] - 1, a.k_cache, a.v_cache,
                      a.block_tables + seq * a.max_blocks, a.num_heads, a.num_kv_heads, a.block_size, a.scale,
                      scores);
}

template <typename T>
void attend(const Args<T>& a, int64_t seq, std::vector<float>& scores) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, Bf16>) {
    if (a.head_dim == 64) return attend_seq_f32<4, T>(a, seq, scores);
    if (a.head_dim == 128) return attend_seq_f32<8, T>(a, seq, scores);
  }
  attend_seq(a, seq, scores);
}

}  // namespace plimsoll
