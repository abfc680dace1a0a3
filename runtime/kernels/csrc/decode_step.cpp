// The fused decode step: every decoder layer of a decode step for a few sequences in one call.
//
// plimsoll_fused_decode, one call a step. Per layer: RMSNorm -> qkv matmul -> RoPE on q and
// k -> k and v stored in their slots of the paged cache -> paged decode attention -> o_proj added
// to the residual -> RMSNorm -> gate_up matmul with SiLU(gate) * up -> down added to the residual.
// What it is: the plain Llama/SmolLM2 layer (no biases, no q/k norm, SiLU MLP) in float32,
// with a float32 cache, for rows that are one decode token each (models/fused_decode.py
// decides); the matmuls split by output rows over the pool as small_batch_linear does,
// the norms, RoPE and stores run on the calling thread (microseconds at these sizes).
// What it is not: prefill, LoRA, int8 weights or KV, biases, tensor parallelism.
//
// layers [L, 8] int64: addresses of input_layernorm.weight [hidden], qkv_proj.weight
// [(H + 2 Hkv) D, hidden], o_proj.weight [hidden, H D], post_attention_layernorm.weight,
// gate_up_proj.weight [2 I, hidden], down_proj.weight [hidden, I], k_cache, v_cache.
// x [M, hidden] (in: embeddings, out: the last layer's output), cos/sin [M, D] (the
// attention scaling already in), slots [M] int64 (-1: do not store), block_tables
// [M, max_blocks] int32, context_lens [M] int32 (the new token included).
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "attention.h"
#include "glue.h"
#include "matmul.h"
#include "plimsoll_kernels.h"
#include "pool.h"
#include "simd.h"

namespace plimsoll {
namespace {

int64_t split_for(int64_t n_len, int64_t k_len, int64_t num_threads) {
  return std::max<int64_t>(1, std::min<int64_t>(num_threads, n_len * k_len / 65536));
}

// Time per part of the fused step, summed over calls while on (benchmarks/step_profile.py):
// norms + RoPE + KV store, qkv, attention, o_proj, gate_up + SiLU, down; nanoseconds.
constexpr int FUSED_PARTS = 6;
std::atomic<bool> g_fused_timing{false};
double g_fused_ns[FUSED_PARTS] = {};

struct PartClock {
  bool on = g_fused_timing.load(std::memory_order_relaxed);
  std::chrono::steady_clock::time_point last = on ? std::chrono::steady_clock::now() : std::chrono::steady_clock::time_point{};
  void lap(int part) {
    if (!on) return;
    const auto now = std::chrono::steady_clock::now();
    g_fused_ns[part] += std::chrono::duration<double, std::nano>(now - last).count();
    last = now;
  }
};



// A projection's weight as the fused step reads it: float32 rows, or int8 rows in groups of
// `group` inputs with a float32 scale and offset (null: symmetric) per group (models/quant.py).
struct F32Proj {
  const float* w;
};
struct Int8Proj {
  const int8_t* q;
  const float* scale;
  const float* offset;
  int64_t group;
};
// float32 W in column panels (plimsoll_pack_f32; gate_up in two parts, gate's then up's).
struct PackedProj {
  const float* panels;
};

// One row: one row of W at a time (matmul_rows); more: register blocks of both (blocked_rows),
// which stream W 1.5-2x faster from 2 rows on (SmolLM2's projections and head, 2-4 rows: 23-28
// GB/s against matmul_rows' 15-17; at one row the two are even).
constexpr int64_t kSmallRows = kSmallLinearRows;

inline void proj_rows(const F32Proj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len) {
  if (m_len <= kSmallRows)
    matmul_rows<false>(x, p.w, nullptr, y, m_len, n_begin, n_end, n_len, k_len);
  else
    blocked_rows(x, p.w, y, m_len, n_begin, n_end, n_len, k_len);
}
inline void proj_rows(const Int8Proj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                      int64_t n_len, int64_t k_len) {
  int8_linear_rows(x, p.q, p.scale, p.offset, nullptr, y, m_len, n_begin, n_end, n_len, k_len, p.group);
}
// Columns [n_begin, n_end) of a packed part whose last column is n_end or past it; n_begin on a panel edge.
template <bool Accumulate = false>
inline void packed_rows(const PackedProj& p, const float* x, float* y, int64_t m_len, int64_t n_begin, int64_t n_end,
                        int64_t ldy, int64_t k_len) {
  packed_panels<Accumulate>(x, k_len, p.panels, nullptr, y, ldy, m_len, n_end, k_len, n_begin / kPanelCols,
                            panels_of(n_end));
}

// y = x @ W.T, or y += x @ W.T (Accumulate; all but float32's few rows go through `tmp` [M, N] first),
// over the pool.
template <bool Accumulate, typename P>
void project_rows(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
                  int64_t num_threads);

template <bool Accumulate, typename P>
void project(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
             int64_t num_threads) {
  if constexpr (std::is_same_v<P, PackedProj>) {  // panels write (or add) their outputs in place
    packed_linear<Accumulate>(x, k_len, p.panels, nullptr, y, n_len, m_len, n_len, k_len, 1, num_threads);
  } else {
    project_rows<Accumulate>(p, x, y, tmp, m_len, n_len, k_len, num_threads);
  }
}

// project() for plain float32 or int8 rows: output columns split over the pool.
template <bool Accumulate, typename P>
void project_rows(const P& p, const float* x, float* y, float* tmp, int64_t m_len, int64_t n_len, int64_t k_len,
                  int64_t num_threads) {
  const int64_t workers = split_for(n_len, k_len, num_threads);
  const int64_t chunk = (n_len + workers - 1) / workers;
  pool::parallel(workers, [=, &p](int64_t i) {
    const int64_t n0 = std::min(n_len, i * chunk), n1 = std::min(n_len, (i + 1) * chunk);
    if constexpr (std::is_same_v<P, F32Proj>) {
      if (m_len <= kSmallRows) {
        matmul_rows<Accumulate>(x, p.w, nullptr, y, m_len, n0, n1, n_len, k_len);
        return;
      }
    }
    if constexpr (Accumulate) {
      proj_rows(p, x, tmp, m_len, n0, n1, n_len, k_len);
      for (int64_t m = 0; m < m_len; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * n_len + n] += tmp[m * n_len + n];
    } else {
      proj_rows(p, x, y, m_len, n0, n1, n_len, k_len);
    }
  });
}

template <typename P>
struct FusedLayer {
  const float* in_norm;
  const float* post_norm;
  float* k_cache;
  float* v_cache;
  P qkv, o, gate_up, down;
};

template <typename P>
int fused_decode(float* x, const std::vector<FusedLayer<P>>& layers, const float* cos, const float* sin,
                 const int64_t* slots, const int32_t* block_tables, const int32_t* context_lens, int64_t m_len,
                 int64_t hidden, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t inter,
                 int64_t block_size, int64_t max_blocks, int64_t num_slots, float eps, float scale,
                 int64_t num_threads) {
  if (m_len <= 0 || layers.empty() || num_kv_heads <= 0 || num_heads % num_kv_heads != 0 || head_dim % 2 != 0 ||
      block_size <= 0)
    return 1;
  for (int64_t m = 0; m < m_len; ++m) {
    if (context_lens[m] <= 0 || context_lens[m] > max_blocks * block_size) return 2;
    if (slots[m] >= num_slots) return 3;
  }
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const int64_t qkv_size = q_size + 2 * kv_size;
  thread_local std::vector<float> scratch;
  scratch.resize(static_cast<size_t>(m_len * (2 * hidden + qkv_size + 2 * q_size + 3 * inter)));
  float* h = scratch.data();        // [M, hidden]  normed input of a block
  float* qkv = h + m_len * hidden;  // [M, qkv_size]
  float* q = qkv + m_len * qkv_size;  // [M, H, D]  after RoPE
  float* attn = q + m_len * q_size;   // [M, H, D]
  float* gate_up = attn + m_len * q_size;  // [M, 2 I]
  float* act = gate_up + m_len * 2 * inter;  // [M, I]
  float* tmp = act + m_len * inter;  // [M, hidden]  an int8 projection's output before it is added
  const int64_t attn_workers = std::max<int64_t>(1, std::min(num_threads, m_len));
  const int64_t mlp_workers = split_for(2 * inter, hidden, num_threads);
  int64_t mlp_chunk = (inter + mlp_workers - 1) / mlp_workers;
  if constexpr (std::is_same_v<P, PackedProj>) mlp_chunk = panels_of(mlp_chunk) * kPanelCols;  // whole panels

  for (const FusedLayer<P>& layer : layers) {
    const float* in_norm = layer.in_norm;
    const float* post_norm = layer.post_norm;
    float* k_cache = layer.k_cache;
    float* v_cache = layer.v_cache;

    PartClock clock;
    rms_norm(x, in_norm, h, m_len, hidden, eps);
    clock.lap(0);
    project<false>(layer.qkv, h, qkv, tmp, m_len, qkv_size, hidden, num_threads);
    clock.lap(1);
    // Every row's KV is stored before any row attends (a sequence may read a block
    // another one fills in this step), as the module path does.
    rope_store_rows(qkv, qkv_size, q, k_cache, v_cache, cos, sin, slots, 0, m_len, num_heads, num_kv_heads,
                    head_dim);
    clock.lap(0);
    const Args<float> a{q, k_cache, v_cache, block_tables, context_lens, attn,
                        num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale};
    pool::parallel(attn_workers, [&a, m_len, attn_workers](int64_t w) {
      thread_local std::vector<float> scores;
      for (int64_t b = w; b < m_len; b += attn_workers) attend(a, b, scores);
    });
    clock.lap(2);
    project<true>(layer.o, attn, x, tmp, m_len, hidden, q_size, num_threads);
    clock.lap(3);
    rms_norm(x, post_norm, h, m_len, hidden, eps);
    clock.lap(0);
    // gate rows [i0, i1) and the same up rows in one task, then SiLU(gate) * up on them.
    const P& w_gate_up = layer.gate_up;
    pool::parallel(mlp_workers, [=, &w_gate_up](int64_t t) {
      const int64_t i0 = std::min(inter, t * mlp_chunk), i1 = std::min(inter, (t + 1) * mlp_chunk);
      if (i0 >= i1) return;
      if constexpr (std::is_same_v<P, PackedProj>) {
        const PackedProj up{w_gate_up.panels + panels_of(inter) * hidden * kPanelCols};
        packed_rows(w_gate_up, h, gate_up, m_len, i0, i1, 2 * inter, hidden);
        packed_rows(up, h, gate_up + inter, m_len, i0, i1, 2 * inter, hidden);
      } else {
        proj_rows(w_gate_up, h, gate_up, m_len, i0, i1, 2 * inter, hidden);
        proj_rows(w_gate_up, h, gate_up, m_len, inter + i0, inter + i1, 2 * inter, hidden);
      }
      silu_mul(gate_up, act, 0, m_len, i0, i1, inter);
    });
    clock.lap(4);
    project<true>(layer.down, act, x, tmp, m_len, hidden, inter, num_threads);
    clock.lap(5);
  }
  return 0;
}

// layers [L, 8] of addresses (see above) as FusedLayer records over float projections P.
template <typename P>
std::vector<FusedLayer<P>> float_layers(const int64_t* layers, int64_t num_layers) {
  std::vector<FusedLayer<P>> parsed(static_cast<size_t>(std::max<int64_t>(0, num_layers)));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * 8;
    auto f = [p](int i) { return reinterpret_cast<const float*>(p[i]); };
    parsed[l] = {f(0), f(3), reinterpret_cast<float*>(p[6]), reinterpret_cast<float*>(p[7]),
                 {f(1)}, {f(2)}, {f(4)}, {f(5)}};
  }
  return parsed;
}

}  // namespace
}  // namespace plimsoll

using namespace plimsoll;


// on >= 0: switch the timing on (1) or off (0) and zero the sums; out (FUSED_PARTS doubles, or
// null): the sums so far in nanoseconds. Timing is for one caller at a time (a benchmark).
extern "C" void plimsoll_fused_decode_timing(int64_t on, double* out) {
  if (out != nullptr) std::memcpy(out, g_fused_ns, sizeof g_fused_ns);
  if (on >= 0) {
    std::fill(g_fused_ns, g_fused_ns + FUSED_PARTS, 0.0);
    g_fused_timing.store(on != 0);
  }
}

// weights: how layers holds the projections. 0: float32 weights, layers [L, 8] as above. 1: float32
// projections packed in column panels (plimsoll_pack_f32; gate_up in two parts), layers [L, 8] as
// above with the panels' addresses in place of the weights'. 2: int8 projections (--quantization
// int8), layers [L, 20] int64: input_layernorm.weight, post_attention_layernorm.weight, k_cache,
// v_cache, then for qkv_proj, o_proj, gate_up_proj and down_proj in turn: qweight [N, K] int8,
// scales [N, K / G] float32, offsets [N, K / G] float32 (0: none), G (a multiple of 16).
// 5: another weights.
extern "C" int plimsoll_fused_decode(float* x, const int64_t* layers, const float* cos, const float* sin,
                                     const int64_t* slots, const int32_t* block_tables, const int32_t* context_lens,
                                     int64_t m_len, int64_t num_layers, int64_t hidden, int64_t num_heads,
                                     int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size,
                                     int64_t max_blocks, int64_t num_slots, float eps, float scale, int64_t weights,
                                     int64_t num_threads) {
  auto run = [&](const auto& parsed) {
    return fused_decode(x, parsed, cos, sin, slots, block_tables, context_lens, m_len, hidden, num_heads,
                        num_kv_heads, head_dim, inter, block_size, max_blocks, num_slots, eps, scale, num_threads);
  };
  if (weights == 0) return run(float_layers<F32Proj>(layers, num_layers));
  if (weights == 1) return run(float_layers<PackedProj>(layers, num_layers));
  if (weights != 2) return 5;
  const int64_t q_size = num_heads * head_dim;
  const int64_t k_lens[4] = {hidden, q_size, hidden, inter};  // inputs of qkv, o, gate_up, down
  std::vector<FusedLayer<Int8Proj>> parsed(static_cast<size_t>(std::max<int64_t>(0, num_layers)));
  for (int64_t l = 0; l < num_layers; ++l) {
    const int64_t* p = layers + l * 20;
    Int8Proj proj[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t* e = p + 4 + 4 * i;
      const int64_t group = e[3];
      if (group <= 0 || group % kLanes != 0 || k_lens[i] % group != 0) return 4;
      proj[i] = {reinterpret_cast<const int8_t*>(e[0]), reinterpret_cast<const float*>(e[1]),
                 reinterpret_cast<const float*>(e[2]), group};
    }
    parsed[l] = {reinterpret_cast<const float*>(p[0]), reinterpret_cast<const float*>(p[1]),
                 reinterpret_cast<float*>(p[2]), reinterpret_cast<float*>(p[3]), proj[0], proj[1], proj[2], proj[3]};
  }
  return run(parsed);
}
