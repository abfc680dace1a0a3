// The ops of a Llama layer between its matmuls, over a step's rows (header only).
//
// What it is: RMSNorm (and the residual add before it), RoPE on q and k with k and v stored in
// their cache slots, SiLU(gate) * up, in float32 or for a bfloat16 model (bfloat16 matmul inputs,
// outputs and cache, a float32 residual); over_rows splits rows over the pool. glue.cpp builds
// the C calls the glued layers make (models/fused_decode.GluedLayers); decode_step.cpp calls the
// same code inside the fused step.
// What it is not: the matmuls between (matmul.h, or oneDNN's).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "pool.h"
#include "simd.h"

namespace plimsoll {

template <typename O>
void rms_norm(const float* x, const float* weight, O* out, int64_t m_len, int64_t dim, float eps) {
  for (int64_t m = 0; m < m_len; ++m) {
    const float* xm = x + m * dim;
    // Two vector accumulators (the adds' latency, not their rate, bounds one), then the tail.
    F16 acc0 = zero16(), acc1 = zero16();
    int64_t d = 0;
    for (; d + 2 * kLanes <= dim; d += 2 * kLanes) {
      const F16 a = load_f32(xm + d), b = load_f32(xm + d + kLanes);
      acc0 = fma16(a, a, acc0);
      acc1 = fma16(b, b, acc1);
    }
    for (; d + kLanes <= dim; d += kLanes) {
      const F16 a = load_f32(xm + d);
      acc0 = fma16(a, a, acc0);
    }
    float sq = sum16(add16(acc0, acc1));
    for (; d < dim; ++d) sq += xm[d] * xm[d];
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(dim) + eps);
    O* om = out + m * dim;
    const F16 vinv = set16(inv);
    d = 0;
    for (; d + kLanes <= dim; d += kLanes)
      store_row(om + d, fma16(fma16(load_f32(xm + d), vinv, zero16()), load_f32(weight + d), zero16()));
    for (; d < dim; ++d) put(om + d, xm[d] * inv * weight[d]);
  }
}

// x * cos + rotate_half(x) * sin for one head of D values (models/llama.apply_rope).
template <typename I, typename O>
void rope(const I* x, const float* cos, const float* sin, O* out, int64_t d_len) {
  const int64_t half = d_len / 2;
  auto at = [x](int64_t d) { return static_cast<float>(x[d]); };
  for (int64_t d = 0; d < half; ++d) put(out + d, at(d) * cos[d] - at(d + half) * sin[d]);
  for (int64_t d = half; d < d_len; ++d) put(out + d, at(d) * cos[d] + at(d - half) * sin[d]);
}

// Rows [m0, m1) of a qkv projection's output (row stride qkv_stride: q heads, k heads, v heads):
// RoPE on q into q_out [M, H, D], and, for rows whose slot is >= 0, RoPE'd k and plain v into
// that slot of the caches ([slots, Hkv, D]). The caller checks slots against the cache's size.
// T: the projection's output and the cache, float32 or bfloat16 (q_out stays float32).
template <typename T>
void rope_store_rows(const T* qkv, int64_t qkv_stride, float* q_out, T* k_cache, T* v_cache,
                     const float* cos, const float* sin, const int64_t* slots, int64_t m0, int64_t m1,
                     int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  for (int64_t m = m0; m < m1; ++m) {
    const T* row = qkv + m * qkv_stride;
    const float* c = cos + m * head_dim;
    const float* s = sin + m * head_dim;
    for (int64_t hh = 0; hh < num_heads; ++hh)
      rope(row + hh * head_dim, c, s, q_out + (m * num_heads + hh) * head_dim, head_dim);
    if (slots[m] < 0) continue;
    T* k_dst = k_cache + slots[m] * kv_size;
    for (int64_t hh = 0; hh < num_kv_heads; ++hh)
      rope(row + q_size + hh * head_dim, c, s, k_dst + hh * head_dim, head_dim);
    std::memcpy(v_cache + slots[m] * kv_size, row + q_size + kv_size, sizeof(T) * kv_size);
  }
}

// act[m, i] = SiLU(gate[m, i]) * up[m, i] for rows [m0, m1) and columns [i0, i1), where row m of
// gate_up holds `inter` gate values then `inter` up values (models/llama.MLP). SiLU(g) =
// g / (1 + exp(-g)) with exp_vec on whole vectors (its argument capped at 88, where exp is
// still finite; SiLU there is -0 to float32 either way).
template <typename T>
void silu_mul(const T* gate_up, T* act, int64_t m0, int64_t m1, int64_t i0, int64_t i1, int64_t inter) {
  for (int64_t m = m0; m < m1; ++m) {
    const T* g = gate_up + m * 2 * inter;
    const T* u = g + inter;
    T* o = act + m * inter;
    int64_t i = i0;
    if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
      for (; i + 16 <= i1; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g + i);
        const __m512 e = exp_vec(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f)));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        _mm512_storeu_ps(o + i, _mm512_mul_ps(silu, _mm512_loadu_ps(u + i)));
      }
#elif defined(__AVX2__) && defined(__FMA__)
      for (; i + 8 <= i1; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp_vec(_mm256_min_ps(_mm256_sub_ps(_mm256_setzero_ps(), gv), _mm256_set1_ps(88.f)));
        const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
#endif
    } else {
#if defined(__AVX512F__)
      // bfloat16 in and out: widened to float32 lanes, rounded back once.
      for (; i + kLanes <= i1; i += kLanes) {
        const __m512 gv = load_row(g + i).v;
        const __m512 e = exp_vec(_mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gv), _mm512_set1_ps(88.f)));
        const __m512 silu = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), e));
        store_row(o + i, F16{_mm512_mul_ps(silu, load_row(u + i).v)});
      }
#endif
    }
    for (; i < i1; ++i) {
      const float gi = static_cast<float>(g[i]);
      put(o + i, gi / (1.f + std::exp(-gi)) * static_cast<float>(u[i]));
    }
  }
}

// Rows [m0, m1): x[m] += delta[m] (delta null: nothing added), then h[m] = RMSNorm(x[m]) * weight.
// T: delta's and h's type, float32 or bfloat16 (the float32 residual x of a bfloat16 model's glue).
template <typename T>
void add_rms_norm_rows(float* x, const T* delta, const float* weight, T* h, int64_t m0, int64_t m1,
                       int64_t dim, float eps) {
  for (int64_t m = m0; m < m1; ++m) {
    float* xm = x + m * dim;
    if (delta != nullptr) {
      const T* dm = delta + m * dim;
      int64_t d = 0;
      for (; d + kLanes <= dim; d += kLanes) store16(xm + d, add16(load_f32(xm + d), load_row(dm + d)));
      for (; d < dim; ++d) xm[d] += static_cast<float>(dm[d]);
    }
    rms_norm(xm, weight, h + m * dim, 1, dim, eps);
  }
}

// Splits rows [0, m_len) over the pool in runs of at least `min_rows`.
template <typename F>
void over_rows(int64_t m_len, int64_t min_rows, int64_t num_threads, const F& f) {
  const int64_t workers = std::max<int64_t>(1, std::min(num_threads, m_len / std::max<int64_t>(1, min_rows)));
  const int64_t chunk = (m_len + workers - 1) / workers;
  pool::parallel(workers, [&](int64_t w) { f(std::min(m_len, w * chunk), std::min(m_len, (w + 1) * chunk)); });
}

}  // namespace plimsoll
