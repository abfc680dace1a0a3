// The C interface of the CPU kernels: every function the Python side calls.
//
// What it is: the one list of exported functions and their parameter types. Each family's
// .cpp includes it, so a definition that drifts from its declaration here does not compile
// (C linkage allows no overloads), and runtime/kernels/cpu_library.py builds its ctypes
// binding by reading this file, so Python and C++ cannot disagree on a signature. Keep each
// declaration in the form `PLIMSOLL_API <type> plimsoll_<name>(<type> <name>, ...);`, with
// the types the binding knows (cpu_library.C_TYPES): void, int, int64_t, float, double,
// const char*, and pointers.
// What it is not: documentation of each kernel (that is beside its definition, in
// pool.cpp, attention.cpp, matmul.cpp, glue.cpp and decode_step.cpp).
#pragma once

#include <cstdint>

#define PLIMSOLL_API extern "C" __attribute__((visibility("default")))

// The build: the hash of its sources and flags (cpu_variants.build_hash) and its variant.
PLIMSOLL_API const char* plimsoll_kernels_build_hash();
PLIMSOLL_API const char* plimsoll_kernels_variant();

// How calls split their work over threads (pool.cpp).
PLIMSOLL_API int64_t plimsoll_pool_threads();
PLIMSOLL_API void plimsoll_pool_enable(int64_t on);
PLIMSOLL_API int64_t plimsoll_parallel_mode(int64_t mode);
PLIMSOLL_API int64_t plimsoll_parallel_mode_get();
PLIMSOLL_API int64_t plimsoll_pool_noop(int64_t n, int64_t use_pool);
PLIMSOLL_API void plimsoll_set_openmp_region(void* region);

// Attention over the paged cache (attention.cpp).
// cache_dtype: 0 float32, 1 bfloat16, 2 int8 (cpu_kernels.CACHE_DTYPES).
PLIMSOLL_API int plimsoll_paged_decode_attention(const float* q, const void* k_cache, const void* v_cache,
                                                 const int32_t* block_tables, const int32_t* context_lens,
                                                 float* out, int64_t num_seqs, int64_t num_heads,
                                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                                 int64_t max_blocks, float scale, int64_t cache_dtype,
                                                 int64_t num_threads);
PLIMSOLL_API int plimsoll_paged_attention(const float* q, const void* k_cache, const void* v_cache,
                                          const int32_t* block_tables, const int32_t* cu_q,
                                          const int32_t* context_lens, float* out, int64_t num_seqs,
                                          int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                          int64_t block_size, int64_t max_blocks, float scale, int64_t cache_dtype,
                                          int64_t num_threads);

// Matmuls (matmul.cpp).
PLIMSOLL_API int plimsoll_small_batch_linear_f32(const float* x, const float* w, const float* bias, float* y,
                                                 int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads);
PLIMSOLL_API int plimsoll_bf16_linear_f32(const float* x, const uint16_t* w, const float* bias, float* y,
                                          int64_t m_len, int64_t n_len, int64_t k_len, int64_t num_threads);
PLIMSOLL_API int plimsoll_int8_linear_f32(const float* x, const int8_t* w, const float* scale, const float* offset,
                                          const float* bias, float* y, int64_t m_len, int64_t n_len, int64_t k_len,
                                          int64_t group, int64_t num_threads);
PLIMSOLL_API double plimsoll_fma_peak(int64_t iters, int64_t num_threads);
PLIMSOLL_API int64_t plimsoll_packed_f32_floats(int64_t n_len, int64_t k_len, int64_t parts);
PLIMSOLL_API int64_t plimsoll_packed_f32_panel_cols();
PLIMSOLL_API int plimsoll_pack_f32(const float* w, float* out, int64_t n_len, int64_t k_len, int64_t parts,
                                   int64_t num_threads);
PLIMSOLL_API int plimsoll_packed_linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias,
                                            float* y, int64_t ldy, int64_t m_len, int64_t n_len, int64_t k_len,
                                            int64_t parts, int64_t accumulate, int64_t num_threads);

// The ops between a layer's matmuls, float32 and bfloat16 (glue.cpp).
PLIMSOLL_API int plimsoll_add_rms_norm_f32(float* x, const float* delta, const float* weight, float* h,
                                           int64_t m_len, int64_t dim, float eps, int64_t num_threads);
PLIMSOLL_API int plimsoll_rope_store_f32(const float* qkv, float* q_out, float* k_cache, float* v_cache,
                                         const float* cos, const float* sin, const int64_t* slots, int64_t m_len,
                                         int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                                         int64_t num_slots, int64_t num_threads);
PLIMSOLL_API int plimsoll_silu_mul_f32(const float* gate_up, float* act, int64_t m_len, int64_t inter,
                                       int64_t num_threads);
PLIMSOLL_API int plimsoll_add_rms_norm_bf16(float* x, const uint16_t* delta, const float* weight, uint16_t* h,
                                            int64_t m_len, int64_t dim, float eps, int64_t num_threads);
PLIMSOLL_API int plimsoll_rope_store_bf16(const uint16_t* qkv, float* q_out, uint16_t* k_cache,
                                          uint16_t* v_cache, const float* cos, const float* sin,
                                          const int64_t* slots, int64_t m_len, int64_t num_heads,
                                          int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                                          int64_t num_threads);
PLIMSOLL_API int plimsoll_silu_mul_bf16(const uint16_t* gate_up, uint16_t* act, int64_t m_len, int64_t inter,
                                        int64_t num_threads);
PLIMSOLL_API int plimsoll_to_bf16(const float* x, uint16_t* y, int64_t n, int64_t num_threads);

// Every layer of a decode step in one call (decode_step.cpp).
PLIMSOLL_API void plimsoll_fused_decode_timing(int64_t on, double* out);
// weights: 0 float32, 1 float32 packed in panels, 2 int8 (decode_step.cpp says how layers holds each).
PLIMSOLL_API int plimsoll_fused_decode(float* x, const int64_t* layers, const float* cos, const float* sin,
                                       const int64_t* slots, const int32_t* block_tables, const int32_t* context_lens,
                                       int64_t m_len, int64_t num_layers, int64_t hidden, int64_t num_heads,
                                       int64_t num_kv_heads, int64_t head_dim, int64_t inter, int64_t block_size,
                                       int64_t max_blocks, int64_t num_slots, float eps, float scale,
                                       int64_t weights, int64_t num_threads);
