// The glue between a layer's matmuls as C calls, float32 and bfloat16.
//
// What it is: the calls a step run layer by layer with oneDNN's (or the packed) matmuls makes
// (models/fused_decode.GluedLayers, for steps the fused step does not take): each is every op of
// a Llama layer between two projections, over all the step's rows; and plimsoll_to_bf16.
// What it is not: the ops themselves (glue.h).
//
// x, h [M, dim]; qkv [M, (H + 2 Hkv) D]; q_out [M, H, D]; gate_up [M, 2 I]; act [M, I];
// slots [M] int64 (-1: do not store).
#include <algorithm>
#include <cstdint>

#include "glue.h"
#include "plimsoll_kernels.h"
#include "simd.h"

namespace plimsoll {
namespace {

template <typename T>
int add_rms_norm_glue(float* x, const T* delta, const float* weight, T* h, int64_t m_len, int64_t dim, float eps,
                      int64_t num_threads) {
  if (m_len <= 0 || dim <= 0) return 1;
  over_rows(m_len, 16, num_threads,
            [=](int64_t m0, int64_t m1) { add_rms_norm_rows(x, delta, weight, h, m0, m1, dim, eps); });
  return 0;
}

template <typename T>
int rope_store_glue(const T* qkv, float* q_out, T* k_cache, T* v_cache, const float* cos, const float* sin,
                    const int64_t* slots, int64_t m_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t num_slots, int64_t num_threads) {
  if (m_len <= 0 || num_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0 || head_dim % 2 != 0) return 1;
  for (int64_t m = 0; m < m_len; ++m) {
    if (slots[m] >= num_slots) return 3;
  }
  const int64_t stride = (num_heads + 2 * num_kv_heads) * head_dim;
  over_rows(m_len, 32, num_threads, [=](int64_t m0, int64_t m1) {
    rope_store_rows(qkv, stride, q_out, k_cache, v_cache, cos, sin, slots, m0, m1, num_heads, num_kv_heads,
                    head_dim);
  });
  return 0;
}

template <typename T>
int silu_mul_glue(const T* gate_up, T* act, int64_t m_len, int64_t inter, int64_t num_threads) {
  if (m_len <= 0 || inter <= 0) return 1;
  over_rows(m_len, std::max<int64_t>(1, 16384 / inter), num_threads,
            [=](int64_t m0, int64_t m1) { silu_mul(gate_up, act, m0, m1, 0, inter, inter); });
  return 0;
}

const Bf16* as_bf16(const uint16_t* p) { return reinterpret_cast<const Bf16*>(p); }
Bf16* as_bf16(uint16_t* p) { return reinterpret_cast<Bf16*>(p); }

}  // namespace
}  // namespace plimsoll

using namespace plimsoll;

extern "C" int plimsoll_add_rms_norm_f32(float* x, const float* delta, const float* weight, float* h, int64_t m_len,
                                         int64_t dim, float eps, int64_t num_threads) {
  return add_rms_norm_glue(x, delta, weight, h, m_len, dim, eps, num_threads);
}

extern "C" int plimsoll_rope_store_f32(const float* qkv, float* q_out, float* k_cache, float* v_cache,
                                       const float* cos, const float* sin, const int64_t* slots, int64_t m_len,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                       int64_t num_threads) {
  return rope_store_glue(qkv, q_out, k_cache, v_cache, cos, sin, slots, m_len, num_heads, num_kv_heads, head_dim,
                         num_slots, num_threads);
}

extern "C" int plimsoll_silu_mul_f32(const float* gate_up, float* act, int64_t m_len, int64_t inter,
                                     int64_t num_threads) {
  return silu_mul_glue(gate_up, act, m_len, inter, num_threads);
}

// The same glue for a bfloat16 model (oneDNN's bf16 matmuls between, AMX where the CPU has it):
// the residual x, the norm weights, cos/sin and q_out stay float32; delta, h, qkv, the caches,
// gate_up and act are bfloat16, each value rounded to the nearest even once where it is stored.
extern "C" int plimsoll_add_rms_norm_bf16(float* x, const uint16_t* delta, const float* weight, uint16_t* h,
                                          int64_t m_len, int64_t dim, float eps, int64_t num_threads) {
  return add_rms_norm_glue(x, as_bf16(delta), weight, as_bf16(h), m_len, dim, eps, num_threads);
}

extern "C" int plimsoll_rope_store_bf16(const uint16_t* qkv, float* q_out, uint16_t* k_cache, uint16_t* v_cache,
                                        const float* cos, const float* sin, const int64_t* slots, int64_t m_len,
                                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                        int64_t num_threads) {
  return rope_store_glue(as_bf16(qkv), q_out, as_bf16(k_cache), as_bf16(v_cache), cos, sin, slots, m_len, num_heads,
                         num_kv_heads, head_dim, num_slots, num_threads);
}

extern "C" int plimsoll_silu_mul_bf16(const uint16_t* gate_up, uint16_t* act, int64_t m_len, int64_t inter,
                                      int64_t num_threads) {
  return silu_mul_glue(as_bf16(gate_up), as_bf16(act), m_len, inter, num_threads);
}

// float32 [n] to bfloat16 (rounded to the nearest even): attention's output into o_proj's input.
extern "C" int plimsoll_to_bf16(const float* x, uint16_t* y, int64_t n, int64_t num_threads) {
  if (n < 0) return 1;
  Bf16* out = as_bf16(y);
  over_rows(n / kLanes, 1024, num_threads, [=](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) store_row(out + b * kLanes, load_f32(x + b * kLanes));
  });
  for (int64_t i = n / kLanes * kLanes; i < n; ++i) put(out + i, x[i]);
  return 0;
}
