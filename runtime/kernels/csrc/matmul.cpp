// Matmuls on the CPU: the C calls for a few rows against float32, bfloat16 or int8 weights, and
// for any number of rows against float32 weights packed in column panels.
//
// What it is: plimsoll_small_batch_linear_f32 (x @ W.T + bias for a few rows of x, decode at low
// concurrency, split by output rows so each thread streams its part of W from memory once; at
// these shapes the matmul is bound by reading W), plimsoll_bf16_linear_f32, plimsoll_int8_linear_f32,
// plimsoll_pack_f32 and plimsoll_packed_linear_f32 (each described where it is defined), and
// plimsoll_fma_peak (the multiply-add ceiling bench/hostprobe.py reports).
// What it is not: the fused decode step's use of the same matmuls (decode_step.cpp).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

#include "matmul.h"
#include "plimsoll_kernels.h"
#include "pool.h"
#include "simd.h"

namespace plimsoll {
namespace {

void linear_rows(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
                 int64_t n_end, int64_t n_len, int64_t k_len) {
  matmul_rows<false>(x, w, bias, y, m_len, n_begin, n_end, n_len, k_len);
}

// y[m, n0..n0+NB) for MB rows of x: NB rows of W against MB rows of x, 16 inputs at a time, so
// each load of W serves MB rows and each load of x serves NB (register blocking).
// With `ahead` (not null), the line of the next W block that matches each line read is
// prefetched: the block after this one, read while this one's rows of x are worked through.
template <int64_t MB, int64_t NB>
inline void f32_rows_block(const float* xm, const float* wn, float* ym, int64_t n_len, int64_t k_len,
                           const float* ahead = nullptr) {
  F16 acc[NB][MB];
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) acc[j][i] = zero16();
  int64_t k = 0;
  for (; k + kLanes <= k_len; k += kLanes) {
#if defined(__AVX2__) || defined(__AVX512F__)
    if (ahead != nullptr) {
      for (int64_t j = 0; j < NB; ++j) _mm_prefetch(reinterpret_cast<const char*>(ahead + j * k_len + k), _MM_HINT_T1);
    }
#endif
    F16 wk[NB];
    for (int64_t j = 0; j < NB; ++j) wk[j] = load_f32(wn + j * k_len + k);
    for (int64_t i = 0; i < MB; ++i) {
      const F16 xv = load_f32(xm + i * k_len + k);
      for (int64_t j = 0; j < NB; ++j) acc[j][i] = fma16(xv, wk[j], acc[j][i]);
    }
  }
  for (int64_t j = 0; j < NB; ++j)
    for (int64_t i = 0; i < MB; ++i) {
      float v = sum16(acc[j][i]);
      for (int64_t t = k; t < k_len; ++t) v += xm[i * k_len + t] * wn[j * k_len + t];
      ym[i * n_len + j] = v;
    }
}

#if defined(__AVX512F__)
constexpr int64_t kBlockM = 4, kBlockN = 4;  // 16 accumulators of 32 registers
#else
constexpr int64_t kBlockM = 2, kBlockN = 2;  // AVX2: a 16-float vector is two of its 16 registers
#endif

// y[:, n_begin..n_end) = x @ W[n_begin..n_end).T for a decode batch of more than a few rows: each
// block of W rows is read from memory once and kept in L1 while every row of x meets it.
// NB rows of W from row n against every row of x: whole blocks of kBlockM rows, then one at a time.
constexpr int64_t kAheadBlocks = 3;
// The first block of rows of x prefetches the next NB rows of W (`ahead`, null for the last).
template <int64_t NB>
void blocked_column(const float* x, const float* w, float* y, int64_t m_len, int64_t n, int64_t n_len,
                    int64_t k_len, const float* ahead) {
  int64_t m = 0;
  for (; m + kBlockM <= m_len; m += kBlockM, ahead = nullptr)
    f32_rows_block<kBlockM, NB>(x + m * k_len, w + n * k_len, y + m * n_len + n, n_len, k_len, ahead);
  for (; m < m_len; ++m, ahead = nullptr)
    f32_rows_block<1, NB>(x + m * k_len, w + n * k_len, y + m * n_len + n, n_len, k_len, ahead);
}

}  // namespace

void blocked_rows(const float* x, const float* w, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                  int64_t n_len, int64_t k_len) {
  int64_t n = n_begin;
  for (; n + kBlockN <= n_end; n += kBlockN) {
    const float* ahead = n + (kAheadBlocks + 1) * kBlockN <= n_end ? w + (n + kAheadBlocks * kBlockN) * k_len : nullptr;
    blocked_column<kBlockN>(x, w, y, m_len, n, n_len, k_len, ahead);
  }
  for (; n < n_end; ++n) blocked_column<1>(x, w, y, m_len, n, n_len, k_len, nullptr);
}

// plimsoll_bf16_linear_f32: y = x @ W.T + bias for a few float32 rows of x and bfloat16 W
// [N, K] (K a multiple of 16; a --dtype bfloat16 engine's decode, where torch's bf16 matmul
// streams W at well under the memory bandwidth). Same split as the float32 kernel; each 16
// weights are widened in registers once for a block of up to 4 rows of x.
namespace {

// MB rows of x against one row of W, its 16-weight blocks dealt round-robin to C chains of
// multiply-adds (one chain would wait on each one). Rows of W are read one after another, so
// the hardware prefetcher sees one stream across them (4 rows at a time, each only ~1 KB of
// bf16 here, measured 3x slower from memory).
template <int64_t MB, int64_t C>
inline void bf16_row(const float* xm, const Bf16* wn, float bias, float* ym, int64_t n_len, int64_t k_len) {
  F16 acc[C][MB];
  for (int64_t c = 0; c < C; ++c)
    for (int64_t i = 0; i < MB; ++i) acc[c][i] = zero16();
  int64_t k = 0;
  for (; k + C * kLanes <= k_len; k += C * kLanes) {
    for (int64_t c = 0; c < C; ++c) {
      const F16 wk = load_row(wn + k + c * kLanes);
      for (int64_t i = 0; i < MB; ++i) acc[c][i] = fma16(load_f32(xm + i * k_len + k + c * kLanes), wk, acc[c][i]);
    }
  }
  for (; k < k_len; k += kLanes) {
    const F16 wk = load_row(wn + k);
    for (int64_t i = 0; i < MB; ++i) acc[0][i] = fma16(load_f32(xm + i * k_len + k), wk, acc[0][i]);
  }
  for (int64_t i = 0; i < MB; ++i) {
    F16 total = acc[0][i];
    for (int64_t c = 1; c < C; ++c) total = add16(total, acc[c][i]);
    ym[i * n_len] = sum16(total) + bias;
  }
}

void bf16_rows(const float* x, const Bf16* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
               int64_t n_end, int64_t n_len, int64_t k_len) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    const Bf16* wn = w + n * k_len;
    const float b = bias != nullptr ? bias[n] : 0.f;
    int64_t m = 0;
    for (; m + 4 <= m_len; m += 4) bf16_row<4, 2>(x + m * k_len, wn, b, y + m * n_len + n, n_len, k_len);
    for (; m < m_len; ++m) bf16_row<1, 4>(x + m * k_len, wn, b, y + m * n_len + n, n_len, k_len);
  }
}

}  // namespace

// plimsoll_int8_linear_f32: y = x @ dequant(W_int8).T + bias, W int8 [N, K] with a float
// scale (and, when `offset` is not null, a float offset) per group of `group` consecutive
// inputs of a row: w = scale * q + offset (scale [N, K / group]; group = K is one per output
// row). Same split as the float32 kernel: each thread streams its rows of W once (about a
// quarter of the float32 bytes). Each 16 weights are converted to float and dequantised in
// registers (one multiply-add, shared by a block of rows of x) and then meet x in plain float
// multiply-adds; the accumulators stay vectors across groups, so a group costs no horizontal
// reduction (a per-group reduction measured 3-9x slower than one scale per row).
namespace {


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

}  // namespace

void int8_linear_rows(const float* x, const int8_t* w, const float* scale, const float* offset,
                      const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len, int64_t group) {
  if (group == 32)
    return int8_linear_rows_g<32>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  if (group == 64)
    return int8_linear_rows_g<64>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
  int8_linear_rows_g<0>(x, w, scale, offset, bias, y, m_len, n_begin, n_end, n_len, k_len, group);
}

}  // namespace plimsoll

using namespace plimsoll;

extern "C" int plimsoll_small_batch_linear_f32(const float* x, const float* w, const float* bias, float* y,
                                               int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0) return 1;
  // A thread is worth starting only for a few hundred KB of W.
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 65536));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    const int64_t n0 = std::min(n_len, i * chunk), n1 = std::min(n_len, (i + 1) * chunk);
    if (m_len <= kSmallLinearRows || bias != nullptr) {
      linear_rows(x, w, bias, y, m_len, n0, n1, n_len, k_len);
    } else {
      blocked_rows(x, w, y, m_len, n0, n1, n_len, k_len);
    }
  });
  return 0;
}

extern "C" int plimsoll_bf16_linear_f32(const float* x, const uint16_t* w, const float* bias, float* y,
                                        int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0 || k_len % kLanes != 0) return 1;
  const Bf16* wb = reinterpret_cast<const Bf16*>(w);
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 131072));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    bf16_rows(x, wb, bias, y, m_len, std::min(n_len, i * chunk), std::min(n_len, (i + 1) * chunk), n_len, k_len);
  });
  return 0;
}

extern "C" int plimsoll_int8_linear_f32(const float* x, const int8_t* w, const float* scale, const float* offset,
                                        const float* bias, float* y, int64_t m_len, int64_t n_len, int64_t k_len,
                                        int64_t group, int64_t num_threads) {
  if (m_len <= 0 || n_len <= 0 || k_len <= 0 || group <= 0 || k_len % group != 0 || group % kLanes != 0) return 1;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 262144));
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t i) {
    int8_linear_rows(x, w, scale, offset, bias, y, m_len, std::min(n_len, i * chunk),
                     std::min(n_len, (i + 1) * chunk), n_len, k_len, group);
  });
  return 0;
}

// plimsoll_fma_peak: GFLOP/s of float32 multiply-adds over `num_threads` tasks of the pool, each
// `iters` rounds of independent vector chains (enough of them to hide an FMA's latency; no memory
// traffic): the most any float32 matmul can reach here (bench/hostprobe.py's ceiling).
extern "C" double plimsoll_fma_peak(int64_t iters, int64_t num_threads) {
#if defined(__AVX512F__)
  constexpr int kChains = 12;
#else
  constexpr int kChains = 6;  // two registers a chain with AVX2: 12 of 16
#endif
  std::atomic<int64_t> nonzero{0};
  const auto start = std::chrono::steady_clock::now();
  pool::parallel(num_threads, [&](int64_t t) {
    F16 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = set16(0.001f * static_cast<float>(c + t));
    const F16 a = set16(0.9999f), b = set16(1e-4f);
    for (int64_t i = 0; i < iters; ++i)
      for (int c = 0; c < kChains; ++c) acc[c] = fma16(acc[c], a, b);
    float total = 0.f;
    for (int c = 0; c < kChains; ++c) total += sum16(acc[c]);
    if (total != 0.f) nonzero.fetch_add(1);  // the sums are used: the loop cannot be dropped
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return nonzero.load() > 0 ? 2.0 * kLanes * kChains * static_cast<double>(iters * num_threads) / seconds / 1e9 : 0.0;
}

// Floats a weight of n_len x k_len packed in `parts` parts takes (0: parts does not divide n_len).
extern "C" int64_t plimsoll_packed_f32_floats(int64_t n_len, int64_t k_len, int64_t parts) {
  if (n_len <= 0 || k_len <= 0 || parts <= 0 || n_len % parts != 0) return 0;
  return parts * panels_of(n_len / parts) * k_len * kPanelCols;
}

extern "C" int64_t plimsoll_packed_f32_panel_cols() { return kPanelCols; }

// out (plimsoll_packed_f32_floats(n_len, k_len, parts) floats) = W [n_len, k_len] in panels.
extern "C" int plimsoll_pack_f32(const float* w, float* out, int64_t n_len, int64_t k_len, int64_t parts,
                                 int64_t num_threads) {
  if (plimsoll_packed_f32_floats(n_len, k_len, parts) == 0) return 1;
  const int64_t part_n = n_len / parts, part_panels = panels_of(part_n), total = parts * part_panels;
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, total));
  pool::parallel(workers, [=](int64_t t) {
    for (int64_t u = t; u < total; u += workers) {
      const int64_t part = u / part_panels, p = u % part_panels;
      float* panel = out + u * k_len * kPanelCols;
      for (int64_t j = 0; j < kPanelCols; ++j) {
        const int64_t n = p * kPanelCols + j;  // row of the part
        const float* row = n < part_n ? w + (part * part_n + n) * k_len : nullptr;
        for (int64_t k = 0; k < k_len; ++k) panel[k * kPanelCols + j] = row != nullptr ? row[k] : 0.f;
      }
    }
  });
  return 0;
}

// x [m_len rows, row stride ldx], y [m_len rows, row stride ldy]; bias [n_len] or null.
extern "C" int plimsoll_packed_linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y,
                                          int64_t ldy, int64_t m_len, int64_t n_len, int64_t k_len, int64_t parts,
                                          int64_t accumulate, int64_t num_threads) {
  if (m_len <= 0 || plimsoll_packed_f32_floats(n_len, k_len, parts) == 0 || ldx < k_len || ldy < n_len) return 1;
  if (accumulate != 0)
    packed_linear<true>(x, ldx, packed, bias, y, ldy, m_len, n_len, k_len, parts, num_threads);
  else
    packed_linear<false>(x, ldx, packed, bias, y, ldy, m_len, n_len, k_len, parts, num_threads);
  return 0;
}
