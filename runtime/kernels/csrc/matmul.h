// Matmuls for the rows of a decode or prefill step: what the C calls and the fused step share (header only).
//
// What it is: x @ W.T over W's plain float32 rows for a few rows of x (matmul_rows: one row of W
// at a time; blocked_rows: register blocks of W rows by x rows, matmul.cpp), over int8 rows with
// group scales (int8_linear_rows, matmul.cpp), and over W packed once in column panels
// (packed_panels, packed_linear, below). matmul.cpp builds the C calls on them; decode_step.cpp
// runs the fused step's projections through them.
// What it is not: large matmuls over plain weights (oneDNN's) or bfloat16 ones (oneDNN's, or
// matmul.cpp's bf16_linear for a row or two).
//
// Layouts: x [M, K], W [N, K], bias [N] or null, y [M, N] (row-major).
#pragma once

#include <algorithm>
#include <cstdint>

#include "pool.h"
#include "simd.h"

namespace plimsoll {

// One row: one row of W at a time (matmul_rows); more: register blocks of both (blocked_rows),
// which stream W 1.5-2x faster from 2 rows on (SmolLM2's projections and head, 2-4 rows: 23-28
// GB/s against matmul_rows' 15-17; at one row the two are even).
constexpr int64_t kSmallLinearRows = 1;


// dot[j] = x[j] . w for J rows of x (row stride k_len) and one row w: each element of w is
// loaded once for all J rows (measured ~15% faster at 4 rows than a dot product per row).
template <int J>
inline void dots(const float* x, const float* w, int64_t k_len, float* dot) {
  const float *x0 = x, *x1 = x + k_len, *x2 = x + 2 * k_len, *x3 = x + 3 * k_len;
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  if constexpr (J == 4) {
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[k];
      s0 += x0[k] * wk;
      s1 += x1[k] * wk;
      s2 += x2[k] * wk;
      s3 += x3[k] * wk;
    }
  } else if constexpr (J == 2) {
#pragma omp simd reduction(+ : s0, s1)
    for (int64_t k = 0; k < k_len; ++k) {
      const float wk = w[k];
      s0 += x0[k] * wk;
      s1 += x1[k] * wk;
    }
  } else {
#pragma omp simd reduction(+ : s0)
    for (int64_t k = 0; k < k_len; ++k) s0 += x0[k] * w[k];
  }
  const float all[4] = {s0, s1, s2, s3};
  for (int j = 0; j < J; ++j) dot[j] = all[j];
}

// y[m, n] (=, or += with Accumulate) x[m] . w[n] + bias[n] for output rows n_begin .. n_end - 1.
template <bool Accumulate>
void matmul_rows(const float* x, const float* w, const float* bias, float* y, int64_t m_len, int64_t n_begin,
                 int64_t n_end, int64_t n_len, int64_t k_len) {
  float d[4];
  for (int64_t n = n_begin; n < n_end; ++n) {
    const float* wn = w + n * k_len;
    const float b = bias != nullptr ? bias[n] : 0.f;
    auto put = [&](int64_t m0, int j_len) {
      for (int j = 0; j < j_len; ++j) {
        float& out = y[(m0 + j) * n_len + n];
        out = Accumulate ? out + d[j] + b : d[j] + b;
      }
    };
    int64_t m = 0;
    for (; m + 4 <= m_len; m += 4) {
      dots<4>(x + m * k_len, wn, k_len, d);
      put(m, 4);
    }
    for (; m + 2 <= m_len; m += 2) {
      dots<2>(x + m * k_len, wn, k_len, d);
      put(m, 2);
    }
    for (; m < m_len; ++m) {
      dots<1>(x + m * k_len, wn, k_len, d);
      put(m, 1);
    }
  }
}

// y[:, n_begin..n_end) = x @ W[n_begin..n_end).T in register blocks (matmul.cpp).
void blocked_rows(const float* x, const float* w, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                  int64_t n_len, int64_t k_len);

// y[:, n_begin..n_end) = x @ dequant(W).T + bias for int8 W with a scale (and an offset, when not
// null) per group of `group` inputs of a row (matmul.cpp).
void int8_linear_rows(const float* x, const int8_t* w, const float* scale, const float* offset,
                      const float* bias, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len, int64_t group);

// plimsoll_packed_linear_f32: y (=, or += with accumulate) x @ W.T + bias for float32 x [M, K]
// and W [N, K] packed once into column panels (plimsoll_pack_f32): panel p holds W's rows
// p*C .. p*C+C-1 as K rows of C floats (C = kPanelCols; the last panel zero-padded), so one
// step of k reads C consecutive weights, each x[m, k] is broadcast once for them, and a block
// of up to kPanelRows rows of x keeps its C outputs a row in registers for the whole of K:
// outer products, no horizontal sums, every multiply-add useful. A panel (K * C * 4 bytes,
// 110-295 KB for SmolLM2) is read from memory by the first block of rows and from L2 by the
// others. Packed with `parts` > 1, W's rows are that many equal parts each packed on its own
// (gate_up: gate's panels, then up's), so a column range of one part is whole panels.
// Figures against the plain-row kernel (blocked_rows) and oneDNN: docs/runtime.md
// ("Weights in column panels").

#if defined(__AVX512F__)
constexpr int64_t kPanelCols = 48;  // three vectors: 8 rows x 3 = 24 accumulators of 32 registers
constexpr int64_t kPanelRows = 8;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kPanelCols = 16;  // one F16, two registers: 6 rows x 2 = 12 accumulators of 16
constexpr int64_t kPanelRows = 6;
#else
constexpr int64_t kPanelCols = 16;
constexpr int64_t kPanelRows = 4;
#endif
constexpr int64_t kPanelVecs = kPanelCols / kLanes;

inline int64_t panels_of(int64_t n_len) { return (n_len + kPanelCols - 1) / kPanelCols; }

// MR rows of x (row stride ldx) against one panel: y[r, 0..cols) for r < MR (row stride ldy).
template <int64_t MR, bool Accumulate>
inline void panel_block(const float* x, int64_t ldx, const float* panel, const float* bias, float* y, int64_t ldy,
                        int64_t cols, int64_t k_len) {
  // Few rows make few chains of multiply-adds, each waiting on its last: S sets of accumulators
  // take every S-th k (one row: 4 sets, 12 chains), summed once at the end.
  constexpr int64_t S = MR == 1 ? 4 : MR == 2 ? 2 : 1;
  F16 acc[S][MR][kPanelVecs];
  for (int64_t s = 0; s < S; ++s)
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[s][r][v] = zero16();
  auto step = [&](int64_t s, int64_t k) {
    const float* pk = panel + k * kPanelCols;
    F16 w[kPanelVecs];
    for (int64_t v = 0; v < kPanelVecs; ++v) w[v] = load_f32(pk + v * kLanes);
    for (int64_t r = 0; r < MR; ++r) {
      const F16 b = set16(x[r * ldx + k]);
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[s][r][v] = fma16(b, w[v], acc[s][r][v]);
    }
  };
  int64_t k = 0;
  for (; k + S <= k_len; k += S)
    for (int64_t s = 0; s < S; ++s) step(s, k + s);
  for (; k < k_len; ++k) step(0, k);
  for (int64_t s = 1; s < S; ++s)
    for (int64_t r = 0; r < MR; ++r)
      for (int64_t v = 0; v < kPanelVecs; ++v) acc[0][r][v] = add16(acc[0][r][v], acc[s][r][v]);
  for (int64_t r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    if (cols == kPanelCols) {
      for (int64_t v = 0; v < kPanelVecs; ++v) {
        F16 out = acc[0][r][v];
        if (bias != nullptr) out = add16(out, load_f32(bias + v * kLanes));
        if constexpr (Accumulate) out = add16(load_f32(yr + v * kLanes), out);
        store16(yr + v * kLanes, out);
      }
    } else {
      alignas(64) float t[kPanelCols];
      for (int64_t v = 0; v < kPanelVecs; ++v) store16(t + v * kLanes, acc[0][r][v]);
      for (int64_t c = 0; c < cols; ++c) {
        const float out = bias != nullptr ? t[c] + bias[c] : t[c];
        yr[c] = Accumulate ? yr[c] + out : out;
      }
    }
  }
}

template <bool Accumulate, int64_t MR = kPanelRows>
inline void panel_block_of(int64_t rows, const float* x, int64_t ldx, const float* panel, const float* bias, float* y,
                           int64_t ldy, int64_t cols, int64_t k_len) {
  if (rows == MR) {
    panel_block<MR, Accumulate>(x, ldx, panel, bias, y, ldy, cols, k_len);
  } else if constexpr (MR > 1) {
    panel_block_of<Accumulate, MR - 1>(rows, x, ldx, panel, bias, y, ldy, cols, k_len);
  }
}

// Panels [p0, p1) of one packed part (n_len columns) for all m_len rows, in blocks of rows as even
// as kPanelRows allows (12 rows: 6 + 6, not 8 + 4).
template <bool Accumulate>
void packed_panels(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                   int64_t m_len, int64_t n_len, int64_t k_len, int64_t p0, int64_t p1) {
  const int64_t blocks = (m_len + kPanelRows - 1) / kPanelRows;
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t n0 = p * kPanelCols, cols = std::min(kPanelCols, n_len - n0);
    const float* panel = packed + p * k_len * kPanelCols;
    const float* b = bias != nullptr ? bias + n0 : nullptr;
    for (int64_t blk = 0, m = 0; blk < blocks; ++blk) {
      const int64_t rows = (m_len - m + (blocks - blk) - 1) / (blocks - blk);
      panel_block_of<Accumulate>(rows, x + m * ldx, ldx, panel, b, y + m * ldy + n0, ldy, cols, k_len);
      m += rows;
    }
  }
}

// Threads for a packed matmul: one per 256 KB of W (streaming it is the work at a few rows) or per
// ~1 MFLOP, at most num_threads.
inline int64_t packed_workers(int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads) {
  const int64_t work = std::max(n_len * k_len / 65536, m_len * n_len * k_len / (1 << 19));
  return std::max<int64_t>(1, std::min(num_threads, work));
}

// The panels of `parts` equal parts dealt out in contiguous runs (each thread streams its own).
template <bool Accumulate>
void packed_linear(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t ldy,
                   int64_t m_len, int64_t n_len, int64_t k_len, int64_t parts, int64_t num_threads) {
  const int64_t part_n = n_len / parts, part_panels = panels_of(part_n), total = parts * part_panels;
  const int64_t workers = std::min(total, packed_workers(m_len, n_len, k_len, num_threads));
  const int64_t chunk = (total + workers - 1) / workers;
  pool::parallel(workers, [=](int64_t t) {
    for (int64_t u = t * chunk, end = std::min(total, (t + 1) * chunk); u < end;) {
      const int64_t part = u / part_panels, p0 = u % part_panels;
      const int64_t p1 = std::min(part_panels, p0 + (end - u));
      const float* part_packed = packed + part * part_panels * k_len * kPanelCols;
      const float* part_bias = bias != nullptr ? bias + part * part_n : nullptr;
      packed_panels<Accumulate>(x, ldx, part_packed, part_bias, y + part * part_n, ldy, m_len, part_n, k_len, p0, p1);
      u += p1 - p0;
    }
  });
}

}  // namespace plimsoll
