// The vector vocabulary every kernel family is written in (header only).
//
// What it is: 16 float lanes (`F16`: one AVX-512 register, two AVX2 ones, or a plain array in
// the plain build) and their loads, stores and multiply-adds; the elements a cache holds
// (float32, int8 blocks of values then scales, bfloat16) and their widening and rounding; exp on whole
// vectors. Which of these is compiled is the build variant's: the same source is built for
// AVX-512, AVX2 and plain x86-64 (setup.py; cpu_variants.py names the flags).
// What it is not: a kernel; the kernels are in attention, matmul, glue and decode_step.
#pragma once

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace plimsoll {

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
inline F16 set16(float x) { return {_mm512_set1_ps(x)}; }
inline void store16(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
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
inline F16 set16(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline void store16(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
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
inline F16 set16(float x) {
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = x;
  return r;
}
inline void store16(float* p, F16 a) { std::memcpy(p, a.v, sizeof(a.v)); }
#endif

// How a paged cache of T lays out one block of block_size tokens x Hkv heads x D values.
// float32 and bfloat16: the values only, row-major. int8 (attention/kv_int8.py's block
// layout): the block's int8 values first, row-major [bs, Hkv, D] (each row D bytes after the
// previous one), then its float32 scales [bs, Hkv], one per (token, KV head).
template <typename T>
struct Cache {
  static constexpr bool kScaled = false;
  static int64_t block_elems(int64_t bs, int64_t kv_heads, int64_t d) { return bs * kv_heads * d; }
  static const float* scales(const T*, int64_t, int64_t, int64_t) { return nullptr; }
};

template <>
struct Cache<int8_t> {
  static constexpr bool kScaled = true;
  static int64_t block_elems(int64_t bs, int64_t kv_heads, int64_t d) { return bs * kv_heads * (d + 4); }
  // The block's scales, after its bs * Hkv * D values (4-byte aligned: D is a multiple of 4).
  static const float* scales(const int8_t* block, int64_t bs, int64_t kv_heads, int64_t d) {
    return reinterpret_cast<const float*>(block + bs * kv_heads * d);
  }
};

// Token o's scale for KV head g within a block's scales (1 for a cache without scales; the
// compiler drops the multiply there).
template <typename T>
inline float row_scale(const float* block_scales, int64_t i) {  // i = o * Hkv + g
  if constexpr (Cache<T>::kScaled) return block_scales[i];
  return 1.f;
}

// A bfloat16 value (the cache of a --dtype bfloat16 engine): float32's upper 16 bits.
struct Bf16 {
  uint16_t bits;
  explicit operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
};



// exp(x) for 16 (AVX-512) or 8 (AVX2) floats: 2^n * p(r) with n = round(x log2 e), r = x - n ln 2
// (ln 2 in two parts) and p the degree-6 Taylor polynomial on |r| <= ln 2 / 2 (relative error
// ~2e-7, against std::exp's 1 ulp). Inputs below -87.3 give exp(-87.3) ~ 1e-38, not 0: only
// softmax uses it, where such a weight is 0 to float32 after the sum.
// The algorithm is written once for both widths: EXP_PS(op) names the width's _mm512_op_ps or
// _mm256_op_ps; how n is rounded, how 2^n is applied and how lanes are summed differ per width.
#if defined(__AVX512F__)
using ExpVec = __m512;
#define EXP_PS(op) _mm512_##op##_ps
constexpr int64_t kExpLanes = 16;
inline __m512 round_nearest(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 times_pow2(__m512 p, __m512 n) { return _mm512_scalef_ps(p, n); }
inline void add_lanes(__m512 e, float& sum) { sum += _mm512_reduce_add_ps(e); }
#elif defined(__AVX2__) && defined(__FMA__)
using ExpVec = __m256;
#define EXP_PS(op) _mm256_##op##_ps
constexpr int64_t kExpLanes = 8;
inline __m256 round_nearest(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256 times_pow2(__m256 p, __m256 n) {  // AVX2 has no scalef: 2^n built in the exponent bits
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
inline void add_lanes(__m256 e, float& sum) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, e);
  for (const float l : lanes) sum += l;
}
#endif

#if defined(EXP_PS)
inline ExpVec exp_vec(ExpVec x) {
  x = EXP_PS(max)(x, EXP_PS(set1)(-87.3f));
  const ExpVec n = round_nearest(EXP_PS(mul)(x, EXP_PS(set1)(1.44269504088896341f)));
  ExpVec r = EXP_PS(fnmadd)(n, EXP_PS(set1)(0.693145751953125f), x);
  r = EXP_PS(fnmadd)(n, EXP_PS(set1)(1.428606765330187045e-06f), r);
  ExpVec p = EXP_PS(set1)(1.f / 720.f);
  for (const float c : {1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f}) p = EXP_PS(fmadd)(p, r, EXP_PS(set1)(c));
  return times_pow2(p, n);
}
inline void exp_store(float* p, float mx, float& sum) {
  const ExpVec e = exp_vec(EXP_PS(sub)(EXP_PS(loadu)(p), EXP_PS(set1)(mx)));
  EXP_PS(storeu)(p, e);
  add_lanes(e, sum);
}
#undef EXP_PS
#else
constexpr int64_t kExpLanes = 1;
inline void exp_store(float* p, float mx, float& sum) {
  *p = std::exp(*p - mx);
  sum += *p;
}
#endif

// 16 cache values as float32 lanes: float32 as they are, int8 converted (its scale applied by the
// caller), bfloat16 widened (its bits shifted up).
inline F16 load_row(const float* p) { return load_f32(p); }
inline F16 load_row(const int8_t* p) { return load_i8(p); }
inline F16 load_row(const Bf16* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16))};
#elif defined(__AVX2__) && defined(__FMA__)
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16)),
          _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16))};
#else
  F16 r;
  for (int64_t l = 0; l < kLanes; ++l) r.v[l] = static_cast<float>(p[l]);
  return r;
#endif
}

// bfloat16 from float32 rounded to the nearest even (as torch converts); a NaN stays a quiet NaN.
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One value, and 16 float32 lanes, stored as float32 or rounded to bfloat16.
inline void put(float* p, float v) { *p = v; }
inline void put(Bf16* p, float v) { p->bits = to_bf16_bits(v); }
inline void store_row(float* p, F16 a) { store16(p, a); }
inline void store_row(Bf16* p, F16 a) {
#if defined(__AVX512F__)
  const __m512i u = _mm512_castps_si512(a.v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
  const __mmask16 nan = _mm512_cmp_ps_mask(a.v, a.v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(u, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
#else
  alignas(64) float t[kLanes];
  store16(t, a);
  for (int64_t l = 0; l < kLanes; ++l) put(p + l, t[l]);
#endif
}

}  // namespace plimsoll
