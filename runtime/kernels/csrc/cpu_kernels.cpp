// CPU kernels for float32 that torch's CPU ops run poorly at serving shapes.
//
// What it is: three functions compiled at first use by cpu_kernels.py (c++ -O3
// -march=native -fopenmp-simd) and called through ctypes, each splitting its work
// over std::threads:
// - plimsoll_paged_decode_attention_f32: the decode half of
//   attention_torch.paged_attention's contract, one query per sequence against its
//   context read straight from the paged KV cache (no gather copy). Work is split by
//   sequence; each reads its K rows once to score every query head (GQA: query head
//   h reads KV head h / (H / Hkv)) and its V rows once to sum them.
// - plimsoll_small_batch_linear_f32: x @ W.T + bias for a few rows of x (decode at
//   low concurrency), split by output rows so each thread streams its part of W
//   from memory once; at these shapes the matmul is bound by reading W.
// What it is not: prefill attention, large matmuls (oneDNN does those) or GPU
// kernels (Triton).
//
// Layouts (row-major, contiguous):
//   q            [B, H, D]
//   k/v_cache    [num_blocks, block_size, Hkv, D] float32, or [.., Hkv, D + 4] int8 (kv_int8.py)
//   block_tables [B, max_blocks] int32 (entries past a context are never read)
//   context_lens [B] int32
//   out          [B, H, D]
//   x [M, K], W [N, K], bias [N] or null, y [M, N]
#include <algorithm>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <thread>
#include <vector>

namespace {

// The element a cache holds: float32 rows of D values, or int8 rows of D values followed
// by their float32 scale (attention/kv_int8.py: a row is D + 4 bytes).
template <typename T>
struct Cache;

template <>
struct Cache<float> {
  static int64_t row_len(int64_t d) { return d; }
  static float scale(const float*, int64_t) { return 1.f; }
};

template <>
struct Cache<int8_t> {
  static int64_t row_len(int64_t d) { return d + 4; }
  static float scale(const int8_t* row, int64_t d) {
    float s;
    std::memcpy(&s, row + d, sizeof s);
    return s;
  }
};

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
  for (int64_t h = 0; h < heads; ++h) {
    float* sh = s + h * ctx;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < ctx; ++t) mx = std::max(mx, sh[t]);
    float sum = 0.f;
    for (int64_t t = 0; t < ctx; ++t) {
      sh[t] = std::exp(sh[t] - mx);
      sum += sh[t];
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < ctx; ++t) sh[t] *= inv;
  }
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
  auto run = [&a, num_seqs, workers](int64_t w) {
    std::vector<float> scores;
    // Interleaved sequences: neighbours in a batch tend to have similar context lengths.
    for (int64_t b = w; b < num_seqs; b += workers) attend_seq(a, b, scores);
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) pool.emplace_back(run, w);
  run(0);
  for (auto& th : pool) th.join();
  return 0;
}

}  // namespace

extern "C" int plimsoll_paged_decode_attention_f32(
    const float* q, const float* k_cache, const float* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads);
}

// The same over an int8 cache (--kv-cache-dtype int8): rows of head_dim int8 values and
// their float32 scale; head_dim is the values' count, not the row's.
extern "C" int plimsoll_paged_decode_attention_kv_int8(
    const float* q, const int8_t* k_cache, const int8_t* v_cache, const int32_t* block_tables,
    const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, int64_t num_threads) {
  return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, out, num_seqs, num_heads,
                                num_kv_heads, head_dim, block_size, max_blocks, scale, num_threads);
}

namespace {

void linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
                 int64_t n_end, int64_t n_len, int64_t k_len) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * k_len;
    for (int64_t m = 0; m < m_len; ++m) {
      const float* xm = x + m * k_len;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < k_len; ++k) dot += xm[k] * wn[k];
      y[m * n_len + n] = bias != nullptr ? dot + bias[n] : dot;
    }
  }
}

}  // namespace

extern "C" int plimsoll_small_batch_linear_f32(const float* x, const float* w, const float* bias, float* y,
                                               int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0) return 1;
  // A thread is worth starting only for a few hundred KB of W.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 65536));
  const int64_t chunk = (n_len + workers - 1) / workers;
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < workers; ++i) {
    const int64_t begin = std::min(n_len, i * chunk), end = std::min(n_len, (i + 1) * chunk);
    pool.emplace_back(linear_rows, x, w, bias, y, m_len, begin, end, n_len, k_len);
  }
  linear_rows(x, w, bias, y, m_len, 0, std::min(n_len, chunk), n_len, k_len);
  for (auto& t : pool) t.join();
  return 0;
}

// plimsoll_int8_linear_f32: y = x @ dequant(W_int8).T + bias, W int8 [N, K] with a float
// scale (and, when `offset` is not null, a float offset) per group of `group` consecutive
// inputs of a row: w = scale * q + offset (scale [N, K / group]; group = K is one per output
// row). Same split as the float32 kernel: each thread streams its rows of W once (about a
// quarter of the float32 bytes). Each 16 weights are converted to float and dequantised in
// registers (one multiply-add, shared by a block of rows of x) and then meet x in plain float
// multiply-adds; the accumulators stay vectors across groups, so a group costs no horizontal
// reduction (a per-group reduction measured 3-9x slower than one scale per row).
namespace {

// 16 float lanes: one AVX-512 register, two AVX2 ones, or a plain array elsewhere (GCC 12
// turns vector-extension int8 -> float conversions into scalar ones, hence intrinsics).
constexpr int64_t kLanes = 16;
#if defined(__AVX512F__)
struct F16 {
  __m512 v;
};
inline F16 zero16() { return {_mm512_setzero_ps()}; }
inline F16 load_f32(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load_i8(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 affine16(F16 q, float s, float z) { return {_mm512_fmadd_ps(q.v, _mm512_set1_ps(s), _mm512_set1_ps(z))}; }
inline F16 add16(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline float sum16(F16 a) { return _mm512_reduce_add_ps(a.v); }
#elif defined(__AVX2__) && defined(__FMA__)
struct F16 {
  __m256 lo, hi;
};
inline F16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 load_f32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load_i8(const int8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 affine16(F16 q, float s, float z) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z);
  return {_mm256_fmadd_ps(q.lo, vs, vz), _mm256_fmadd_ps(q.hi, vs, vz)};
}
inline F16 add16(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline float sum16(F16 a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(a.lo, a.hi));
  return ((t[0] + t[1]) + (t[2] + t[3])) + ((t[4] + t[5]) + (t[6] + t[7]));
}
#else
struct F16 {
  float v[kLanes];
};
inline F16 zero16() { return {}; }
inline F16 load_f32(const float* p) {
  F16 r;
  std::memcpy(r.v, p, sizeof(r.v));
  return r;
}
inline F16 load_i8(const int8_t* p) {
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
}
inline F16 fma16(F16 a, F16 b, F16 c) {
  for (int64_t l = 0; l < kLanes; ++l) c.v[l] += a.v[l] * b.v[l];
  return c;
}
inline F16 affine16(F16 q, float s, float z) {
  for (int64_t l = 0; l < kLanes; ++l) q.v[l] = q.v[l] * s + z;
  return q;
}
inline F16 add16(F16 a, F16 b) {
  for (int64_t l = 0; l < kLanes; ++l) a.v[l] += b.v[l];
  return a;
}
inline float sum16(F16 a) {
  float t = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) t += a.v[l];
  return t;
}
#endif

// MB rows of x against NB rows of W: each 16 weights are dequantised once and meet MB rows,
// and each 16 values of x meet NB weight rows (NB x MB accumulators: 2 x 8 where 32 vector
// registers hold them, else 1 x 4).
template <int64_t MB, int64_t NB, int64_t G>
inline void int8_rows_block(const float* xm, const int8_t* wn, const float* sn, const float* zn, const float* bias,
                            float* ym, int64_t n_len, int64_t k_len, int64_t gs, int64_t groups) {
  F16 acc[NB][MB];
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) acc[j][i] = zero16();
  const int64_t size = G > 0 ? G : gs;
  for (int64_t g = 0; g < groups; ++g) {
    float s[NB], z[NB];
    for (int64_t j = 0; j < NB; ++j) {
      s[j] = sn[j * groups + g];
      z[j] = zn != nullptr ? zn[j * groups + g] : 0.f;
    }
    for (int64_t k = g * size; k < (g + 1) * size; k += kLanes) {
      F16 wk[NB];
      for (int64_t j = 0; j < NB; ++j) wk[j] = affine16(load_i8(wn + j * k_len + k), s[j], z[j]);
      for (int64_t i = 0; i < MB; ++i) {
        const F16 xv = load_f32(xm + i * k_len + k);
        for (int64_t j = 0; j < NB; ++j) acc[j][i] = fma16(xv, wk[j], acc[j][i]);
      }
    }
  }
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) ym[i * n_len + j] = sum16(acc[j][i]) + (bias != nullptr ? bias[j] : 0.f);
}

// G > 0: the group size as a compile-time constant (a multiple of 16); G = 0 takes it from
// `group` (any multiple of 16, e.g. a whole row).
template <int64_t G>
void int8_linear_rows_g(const float* x, const int8_t* w, const float* scale, const float* offset,
                        const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                        int64_t n_len, int64_t k_len, int64_t group) {
  const int64_t gs = G > 0 ? G : group;
  const int64_t groups = k_len / gs;
  // A shift for a compile-time group; a run-time one is a whole row in practice (no division).
  auto group_of = [gs, groups](int64_t k) -> int64_t { return G > 0 ? k / G : groups == 1 ? 0 : k / gs; };
#if defined(__AVX512F__)
  // Pairs of W rows over blocks of 8 rows of x; what is left goes row by row below.
  int64_t p = n_begin;
  const int64_t m8 = m_len / 8 * 8;
  if (m8 > 0) {
    for (; p + 2 <= n_end; p += 2) {
      const float* zn = offset != nullptr ? offset + p * groups : nullptr;
      const float* bn = bias != nullptr ? bias + p : nullptr;
      for (int64_t m = 0; m < m8; m += 8)
        int8_rows_block<8, 2, G>(x + m * k_len, w + p * k_len, scale + p * groups, zn, bn, y + m * n_len + p, n_len,
                                 k_len, gs, groups);
    }
    for (; p < n_end; ++p) {
      const float* zn = offset != nullptr ? offset + p * groups : nullptr;
      const float* bn = bias != nullptr ? bias + p : nullptr;
      for (int64_t m = 0; m < m8; m += 8)
        int8_rows_block<8, 1, G>(x + m * k_len, w + p * k_len, scale + p * groups, zn, bn, y + m * n_len + p, n_len,
                                 k_len, gs, groups);
    }
  }
#else
  const int64_t m8 = 0;
#endif
  for (int64_t n = n_begin; n < n_end; ++n) {
    const int8_t* wn = w + n * k_len;
    const float* sn = scale + n * groups;
    const float* zn = offset != nullptr ? offset + n * groups : nullptr;
    const float b = bias != nullptr ? bias[n] : 0.f;
    int64_t m = m8;
    for (; m + 4 <= m_len; m += 4)
      int8_rows_block<4, 1, G>(x + m * k_len, wn, sn, zn, bias != nullptr ? bias + n : nullptr, y + m * n_len + n,
                               n_len, k_len, gs, groups);
    for (; m < m_len; ++m) {
      // Four chains over the row (a group of 32 is only two blocks of 16): one chain would
      // wait on each multiply-add.
      const float* xm = x + m * k_len;
      F16 acc[4] = {zero16(), zero16(), zero16(), zero16()};
      int64_t k = 0;
      for (; k + 4 * kLanes <= k_len; k += 4 * kLanes) {
        for (int64_t j = 0; j < 4; ++j) {
          const int64_t kj = k + j * kLanes, g = group_of(kj);
          const F16 wk = affine16(load_i8(wn + kj), sn[g], zn != nullptr ? zn[g] : 0.f);
          acc[j] = fma16(load_f32(xm + kj), wk, acc[j]);
        }
      }
      for (; k < k_len; k += kLanes) {
        const int64_t g = group_of(k);
        acc[0] = fma16(load_f32(xm + k), affine16(load_i8(wn + k), sn[g], zn != nullptr ? zn[g] : 0.f), acc[0]);
      }
      y[m * n_len + n] = sum16(add16(add16(acc[0], acc[1]), add16(acc[2], acc[3]))) + b;
    }
  }
}

void int8_linear_rows(const float* x, const int8_t* w, const float* scale, const float* offset,
                      const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len, int64_t group) {
  if (group == 32)
    return int8_linear_rows_g<32>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  if (group == 64)
    return int8_linear_rows_g<64>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  int8_linear_rows_g<0>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
}

}  // namespace

extern "C" int plimsoll_int8_linear_f32(const float* x, const int8_t* w, const float* scale, const float* offset,
                                        const float* bias, float* y, int64_t m_len, int64_t n_len, int64_t k_len,
                                        int64_t group, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0 || group <= 0 || k_len % group != 0 || group % kLanes != 0) return 1;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 262144));
  const int64_t chunk = (n_len + workers - 1) / workers;
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < workers; ++i) {
    const int64_t begin = std::min(n_len, i * chunk), end = std::min(n_len, (i + 1) * chunk);
    pool.emplace_back(int8_linear_rows, x, w, scale, offset, bias, y, m_len, begin, end, n_len, k_len, group);
  }
  int8_linear_rows(x, w, scale, offset, bias, y, m_len, 0, std::min(n_len, chunk), n_len, k_len, group);
  for (auto& t : pool) t.join();
  return 0;
}
