// One AdamW step for every compact state format, one pass over memory per 1024-element super-block.
//
// The eager step (lightning_baoc/formats/*.py) is the reference: this file computes the same
// float operations in the same order (fused multiply-adds where ATen's CPU kernels use them: lerp,
// addcmul), so results agree to the last bit except where a sum is ordered differently (the
// factored means) or a float function differs in its last ulp (log2 at an exact power of two);
// tests/kernels/test_cpu_step.py measures the distance per format.
//
// Per super-block (aligned to 1024 elements of its parameter): decode the moments, do AdamW in fp32,
// encode (group absmax, one shared exponent, fp16 scales, codes) and write once. On fp32 weights the
// bf16-momentum formats do it in one loop per element (bf16_pass) and the 8-bit formats in three loops
// (int8_pass: decode and AdamW group by group, the scales, the encodes), so that the divisions and
// square roots run beside the integer work; the other cases go through L1 buffers loop by loop
// (superblock). On AVX2 CPUs (without AVX-512) bf16_pass, int8_pass and the masters of bf16 weights with a
// correction run as hand-written vector loops of the same operations (bf16_pass_avx2, int8_pass_avx2,
// load_master_bf16_avx2, store_master_bf16_avx2). The super-blocks of every tensor of a call are
// one index range that at::parallel_for divides among the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#ifdef __F16C__
#include <immintrin.h>
#endif

// Hand-written AVX2 loops (below) where the CPU has AVX2, FMA and F16C but not AVX-512 (which keeps the compiler's
// 512-bit loops, not measured against these).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define BAOC_AVX2_LOOPS 1
#endif

#include <algorithm>
#include <limits>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <utility>
#include <vector>

namespace {

constexpr int64_t GROUP = 32;
constexpr int64_t SUPER = 1024;
constexpr int64_t SUPER_GROUPS = SUPER / GROUP;
constexpr float TOP_EXPONENT = 14.0f;
constexpr float EXP_MIN = -126.0f;
constexpr float EXP_MAX = 126.0f;
constexpr float SCALE_MIN = 1.17549435082228750797e-38f;  // fp32's smallest normal number
constexpr float BF16_MAX = 3.38953138925153547590e38f;
constexpr float INV_127 = static_cast<float>(1.0 / 127.0);
constexpr float INV_255 = static_cast<float>(1.0 / 255.0);

enum MKind : int64_t { M_NONE = 0, M_FP32 = 1, M_BF16 = 2, M_INT8 = 3 };
// The dtype of a parameter or gradient: fp32, or a 16-bit weight (with an optional master-weight
// correction: lightning_baoc/formats/correction.py).
enum WKind : int8_t { W_FP32 = 0, W_BF16 = 1, W_FP16 = 2 };
enum VKind : int64_t { V_FP32 = 0, V_BF16 = 1, V_UINT8 = 2, V_FACTORED = 3 };

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float float_of(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

// The counter-based hash of the stochastic rounding (lightning_baoc/formats/quant.py,
// `rounding_bits`): 32 random bits for element `index` under a 32-bit key, the top 16 for the
// momentum, the bottom 16 for the second moment. The index enters as `index + key`, so the shard of a
// sharded parameter that starts at element `offset` of the whole draws the whole's bits under the key
// `key + offset` (the kernels' `offsets`; 0 for a parameter held whole).
inline uint32_t mix_bits(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  x ^= x >> 15;
  return x;
}

inline uint32_t rounding_bits(int64_t index, uint32_t key) { return mix_bits(static_cast<uint32_t>(index) + key); }

// Stochastic rounding to bf16 (quant.py `bf16_stochastic`): add the noise below the bf16 mantissa,
// truncate; magnitudes past bf16's largest finite value (inf included) saturate, NaN stays NaN (0x7FC0).
// The saturation and the NaN test act on the 16-bit result, where a vector holds twice the lanes: the
// same value as testing the 32-bit sum (whose low half the truncation drops; tests/kernels/
// test_cpu_step.py compares the two). Integer operations only, so that the loops calling it vectorize.
inline uint16_t bf16_stochastic(float x, uint32_t noise) {
  const uint16_t h = static_cast<uint16_t>((bits_of(x) + noise) >> 16);
  const uint16_t magnitude = h & 0x7FFFu;
  const uint16_t saturated = static_cast<uint16_t>((h & 0x8000u) | std::min<uint16_t>(magnitude, 0x7F7Fu));
  return magnitude > 0x7F80u ? static_cast<uint16_t>(0x7FC0u) : saturated;
}

inline float bf16_load(uint16_t raw) { return float_of(static_cast<uint32_t>(raw) << 16); }

inline float half_to_float(at::Half h) {
#ifdef __F16C__
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

inline at::Half float_to_half(float f) {  // round to nearest even, as torch's .to(float16)
#ifdef __F16C__
  return at::Half(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT), at::Half::from_bits());
#else
  return static_cast<at::Half>(f);
#endif
}

// 2**e for an integral e in [-126, 127]: exact, a normal number.
inline float pow2(float e) { return float_of(static_cast<uint32_t>(static_cast<int32_t>(e) + 127) << 23); }

// The super-block's stored group scales (fp16 * 2**exp, as fp32).
inline void load_scales(const at::Half* scales, int8_t exponent, int64_t groups, float* out) {
  const float unit = pow2(static_cast<float>(exponent));
  for (int64_t k = 0; k < groups; ++k) out[k] = half_to_float(scales[k]) * unit;
}

// The super-block's exponent from its largest group maximum (quant.py `_store_scales`).
inline float super_exponent(float top) {
  float e = (top > 0.0f) ? std::floor(std::log2(top)) - TOP_EXPONENT : EXP_MIN;
  return std::min(std::max(e, EXP_MIN), EXP_MAX);
}

// Group maxima -> fp16 scales and one exponent; per-group reciprocals of the stored scales
// (quant.py `_store_scales`). `absmax` holds SUPER_GROUPS entries, zero past `groups`.
inline void store_scales(float* absmax, int64_t groups, float limit, at::Half* scales_out, int8_t* exp_out,
                         float* inv) {
#if defined(__AVX2__) && defined(__F16C__)
  const __m256 lim = _mm256_set1_ps(limit);
  __m256 top8 = _mm256_setzero_ps();
  for (int q = 0; q < SUPER_GROUPS; q += 8) {
    const __m256 x = _mm256_min_ps(lim, _mm256_loadu_ps(absmax + q));  // NaN stays NaN
    _mm256_storeu_ps(absmax + q, x);
    top8 = _mm256_max_ps(top8, x);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, top8);
  float top = 0.0f;
  for (float x : lanes) top = std::max(top, x);
  const float e = super_exponent(top);
  *exp_out = static_cast<int8_t>(e);
  const __m256 unit = _mm256_set1_ps(pow2(e)), down = _mm256_set1_ps(pow2(-e));
  const __m256 smin = _mm256_set1_ps(SCALE_MIN), zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  alignas(32) uint16_t halves[SUPER_GROUPS];
  for (int q = 0; q < SUPER_GROUPS; q += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(absmax + q), down);  // exact: a power of two
    const __m256 stored = _mm256_mul_ps(_mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)), unit);
    const __m256 flushed = _mm256_cmp_ps(stored, smin, _CMP_LT_OQ);
    _mm_store_si128(reinterpret_cast<__m128i*>(halves + q),
                    _mm256_cvtps_ph(_mm256_blendv_ps(x, zero, flushed), _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_ps(inv + q, _mm256_blendv_ps(_mm256_div_ps(one, stored), zero, flushed));
  }
  std::memcpy(scales_out, halves, static_cast<size_t>(groups) * sizeof(uint16_t));
#else
  float top = 0.0f;
  for (int64_t k = 0; k < groups; ++k) {
    float a = absmax[k];
    a = std::isnan(a) ? a : std::min(a, limit);
    absmax[k] = a;
    top = (std::isnan(a) || a > top) ? a : top;
  }
  const float e = super_exponent(top);
  *exp_out = static_cast<int8_t>(e);
  const float unit = pow2(e), down = pow2(-e);
  for (int64_t k = 0; k < groups; ++k) {
    const at::Half h = float_to_half(absmax[k] * down);  // exact: a power of two
    const float stored = half_to_float(h) * unit;
    if (stored < SCALE_MIN) {
      scales_out[k] = float_to_half(0.0f);
      inv[k] = 0.0f;
    } else {
      scales_out[k] = h;
      inv[k] = 1.0f / stored;
    }
  }
#endif
}

inline void group_absmax(const float* x, int64_t n, float* out) {
  for (int64_t k = (n + GROUP - 1) / GROUP; k < SUPER_GROUPS; ++k) out[k] = 0.0f;  // past the tail
  for (int64_t a = 0, k = 0; a < n; a += GROUP, ++k) {
    const int64_t b = std::min(n, a + GROUP);
    float m = 0.0f;
#pragma omp simd reduction(max : m)
    for (int64_t j = a; j < b; ++j) m = std::max(m, std::fabs(x[j]));
    out[k] = m;
  }
}

// Decoding and encoding of the 8-bit moments (quant.py): the same fp32 operations as the eager
// code, in its order. The group scales are first spread to one per element, so that each element
// loop is one long vectorizable loop (measured faster than a loop per group of 32).
inline void spread(const float* per_group, int64_t n, float* out) {
  for (int64_t a = 0, k = 0; a < n; a += GROUP, ++k) {
    const float sc = per_group[k];
#pragma omp simd
    for (int64_t j = 0; j < GROUP; ++j) out[a + j] = sc;
  }
}

// One code each (the element loops below and int8_pass call these): the companded momentum code and
// the linear code of sqrt(v), decoded with their group's scale or encoded with its reciprocal.
inline float momentum_value(int8_t code, float scale) {
  const float y = static_cast<float>(code) * INV_127;
  return (y / (-std::fabs(y) + 2.0f)) * scale;
}
inline float root_value(uint8_t code, float scale) {  // sqrt(v); a code 0 decodes as half a step
  return (std::max(static_cast<float>(code), 0.5f) * INV_255) * scale;
}
inline int8_t momentum_code(float x, float inv) {
  const float u = std::min(std::max(x * inv, -1.0f), 1.0f);
  return static_cast<int8_t>(static_cast<int32_t>(std::rint((u / (std::fabs(u) + 1.0f)) * 254.0f)));
}
inline uint8_t root_code(float root, float inv) {
  const float u = std::min(std::max(root * inv, 0.0f), 1.0f);
  return static_cast<uint8_t>(static_cast<int32_t>(std::rint(u * 255.0f)));
}

inline void decode_momentum(const int8_t* codes, const float* scale, int64_t n, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = momentum_value(codes[j], scale[j]);
}

inline void decode_sqrt(const uint8_t* codes, const float* scale, int64_t n, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float x = root_value(codes[j], scale[j]);
    out[j] = x * x;
  }
}

inline void encode_momentum(const float* x, const float* inv, int64_t n, int8_t* codes) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) codes[j] = momentum_code(x[j], inv[j]);
}

inline void encode_sqrt(const float* s, const float* inv, int64_t n, uint8_t* codes) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) codes[j] = root_code(s[j], inv[j]);
}

struct Scalars {
  float lr_step;      // -lr / bias_correction1 (momentum) or -lr
  float decay;        // 1 - lr * weight_decay (decoupled decay)
  float l2;           // weight_decay (Adam's L2 decay)
  float beta2;
  float one_minus_beta2;
  float lerp_coeff;   // 1 - beta1, or 1 - beta1 - 1 for weights >= 0.5 (ATen's lerp)
  bool lerp_small;
  float inv_sqrt_bc2;  // 1 / sqrt(bias_correction2)
  float eps;
  bool decoupled_decay;
  bool l2_decay;
  bool maximize;
};

// AdamW's arithmetic per element in fp32, in the eager step's order (adam_math.chunk_adamw): the one
// definition every super-block loop uses. The loop's constants, taken from a tensor's Scalars once per
// super-block; branch-free on the group's options (sign, decay and L2 factors are 1, 1 and 0 when off),
// so that the loops vectorize whatever the options. `l2` and `small` (the group's Adam L2 decay and
// ATen's lerp branch) are template constants of the loops that mix 16- and 32-bit lanes (a select on a
// loop-invariant bool keeps GCC from vectorizing those) and runtime flags elsewhere.
struct Adam {
  float gsign, decay, l2_factor, beta2, one_minus_beta2, inv_sqrt_bc2, eps, lr_step, lerp_coeff;

  explicit Adam(const Scalars& s)
      : gsign(s.maximize ? -1.0f : 1.0f), decay(s.decoupled_decay ? s.decay : 1.0f), l2_factor(s.l2),
        beta2(s.beta2), one_minus_beta2(s.one_minus_beta2), inv_sqrt_bc2(s.inv_sqrt_bc2), eps(s.eps),
        lr_step(s.lr_step), lerp_coeff(s.lerp_coeff) {}

  // The gradient the moments see: negated under maximize, plus Adam's L2 decay of the parameter p.
  float grad(float g, float p, bool l2) const {
    g = g * gsign;
    return l2 ? std::fma(p, l2_factor, g) : g;
  }
  float decayed(float p) const { return p * decay; }  // the decoupled decay
  float second_moment(float g, float v0) const { return std::fma(one_minus_beta2 * g, g, v0 * beta2); }
  // A factored denominator, or inf where AdamW's own second moment of g, (1 - beta2) g g, overflows fp32: its
  // update there is 0, as torch's AdamW's (factored_math.overflowed)
  float unless_overflowed(float g, float d) const {
    return std::isinf(one_minus_beta2 * g * g) ? std::numeric_limits<float>::infinity() : d;
  }
  float denominator(float root) const { return root * inv_sqrt_bc2 + eps; }
  // ATen's lerp: m0 + w (g - m0) for w < 0.5, else g + (w - 1)(g - m0)
  float momentum(float m0, float g, bool small) const { return std::fma(lerp_coeff, g - m0, small ? m0 : g); }
  // the decayed parameter p moved by the momentum (or, without one, the gradient) over the denominator
  float update(float p, float direction, float d) const { return p + (lr_step * direction) / d; }
};

struct Tensors {
  float* p;          // fp32 parameters, or nullptr: 16-bit ones in p16
  const float* g;    // fp32 gradients, or nullptr: 16-bit ones in g16
  uint16_t* p16;
  const uint16_t* g16;
  void* corr;        // int8 or int16 master-weight correction of p16, or nullptr
  int8_t p_kind;
  int8_t g_kind;
  int8_t corr_bits;  // 0, 8 or 16
  void* m;
  at::Half* m_scale;
  int8_t* m_exp;
  void* v;
  at::Half* v_scale;
  int8_t* v_exp;
  const float* row_factor;
  const float* col_factor;
  int64_t numel;
  int64_t cols;
  uint32_t key;
  Scalars s;
};

// ---- 16-bit weights and their master-weight corrections (formats/correction.py, the reference)

inline float half_bits_to_float(uint16_t raw) { return half_to_float(at::Half(raw, at::Half::from_bits())); }

// Round to nearest even, as torch's .to(bfloat16) (NaN -> 0x7FC0): integer operations only.
inline uint16_t bf16_rne(float x) {
  const uint32_t u = bits_of(x);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// 2**e for an integral e in [-149, 127] (subnormal below -126): exact, branch-free.
inline float exp2i(int32_t e) {
  const uint32_t normal = static_cast<uint32_t>(std::max(e, -126) + 127) << 23;
  const uint32_t subnormal = 1u << std::min(std::max(e + 149, 0), 22);
  return float_of(e >= -126 ? normal : subnormal);
}

// The exponent of the correction's unit divided by 2**bits (correction.py `_unit`): the spacing of
// the weight's dtype next to |w| on the residual's side, half of it below a power of two.
// Branch-free, so that the loops calling it vectorize: e = max(exponent of |w|, the smallest normal's).
template <int8_t KIND, int BITS>
inline int32_t unit_exponent(float w, bool toward_zero) {
  constexpr int P = KIND == W_BF16 ? 7 : 10;
  constexpr int EMIN = KIND == W_BF16 ? -126 : -14;
  constexpr uint32_t SMALLEST_NORMAL_BITS = static_cast<uint32_t>(EMIN + 127) << 23;
  const uint32_t b = bits_of(w) & 0x7FFFFFFFu;
  const int32_t e = std::max(static_cast<int32_t>(b >> 23) - 127, EMIN);
  const bool finer = toward_zero && (b & 0x7FFFFFu) == 0 && b > SMALLEST_NORMAL_BITS;
  return e - P - BITS - (finer ? 1 : 0);
}

template <int8_t KIND, int BITS>
inline float scaled_unit(float w, bool toward_zero) { return exp2i(unit_exponent<KIND, BITS>(w, toward_zero)); }

// x / 2**e for e in [-149, 127], exact (two multiplications by powers of two, neither of which
// overflows: a division by the unit, without the cost of one).
inline float div_pow2(float x, int32_t e) {
  const int32_t first = std::min(-e, 127);
  return (x * exp2i(first)) * exp2i(-e - first);
}

inline bool points_to_zero(float residual, float w) { return residual != 0.0f && ((residual < 0.0f) != (w < 0.0f)); }

template <int8_t KIND>
inline float load_weight(uint16_t raw) { return KIND == W_BF16 ? bf16_load(raw) : half_bits_to_float(raw); }

template <int8_t KIND>
inline uint16_t store_weight(float x) { return KIND == W_BF16 ? bf16_rne(x) : float_to_half(x).x; }

#ifdef BAOC_AVX2_LOOPS
// std::max(a, b) and std::min(a, b) of the scalar code, NaN in `a` kept: maxps/minps return their second
// operand when either is NaN.
inline __m256 max_keep(__m256 a, __m256 b) { return _mm256_max_ps(b, a); }
inline __m256 min_keep(__m256 a, __m256 b) { return _mm256_min_ps(b, a); }

// load_master_kind and store_master_kind for bf16 weights with a correction, 8 lanes at a time: the same
// operations (the unit's power of two built from its exponent, as exp2i; its subnormal case only where a
// weight's unit needs it, which div_pow2's two factors never do for bf16).
inline __m256 exp2i8(__m256i e) {
  const __m256i normal = _mm256_slli_epi32(_mm256_add_epi32(_mm256_max_epi32(e, _mm256_set1_epi32(-126)), _mm256_set1_epi32(127)), 23);
  const __m256i shift = _mm256_min_epi32(_mm256_max_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(149)), _mm256_setzero_si256()), _mm256_set1_epi32(22));
  const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(1), shift);
  return _mm256_castsi256_ps(_mm256_blendv_epi8(subnormal, normal, _mm256_cmpgt_epi32(e, _mm256_set1_epi32(-127))));
}

// unit_exponent<W_BF16, BITS> of 8 weights; `toward`: the points_to_zero mask.
template <int BITS>
inline __m256i bf16_unit_exponent8(__m256 w, __m256 toward) {
  const __m256i b = _mm256_and_si256(_mm256_castps_si256(w), _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i e = _mm256_max_epi32(_mm256_sub_epi32(_mm256_srli_epi32(b, 23), _mm256_set1_epi32(127)), _mm256_set1_epi32(-126));
  const __m256i power = _mm256_cmpeq_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFF)), _mm256_setzero_si256());
  const __m256i finer = _mm256_and_si256(_mm256_and_si256(_mm256_castps_si256(toward), power),
                                         _mm256_cmpgt_epi32(b, _mm256_set1_epi32(0x00800000)));
  return _mm256_add_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(7 + BITS)), finer);  // finer: -1 where set
}

// points_to_zero(residual, w) of 8 lanes, as a mask.
inline __m256 toward_zero8(__m256 residual, __m256 w) {
  const __m256 zero = _mm256_setzero_ps();
  return _mm256_and_ps(_mm256_cmp_ps(residual, zero, _CMP_NEQ_UQ),
                       _mm256_xor_ps(_mm256_cmp_ps(residual, zero, _CMP_LT_OQ), _mm256_cmp_ps(w, zero, _CMP_LT_OQ)));
}

// The masters of the first n / 8 * 8 bf16 weights (load_master_kind's operations); how many it read.
template <int BITS, typename C>
int64_t load_master_bf16_avx2(const uint16_t* p16, const C* corr, int64_t n, float* out) {
  const int64_t count = n / 8 * 8;
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p16 + j))), 16));
    __m256i ci;
    if constexpr (BITS == 8) {
      ci = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(corr + j)));
    } else {
      ci = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(corr + j)));
    }
    const __m256 c = _mm256_cvtepi32_ps(ci);
    const __m256 unit = exp2i8(bf16_unit_exponent8<BITS>(w, toward_zero8(c, w)));
    const __m256 x = _mm256_add_ps(w, _mm256_mul_ps(c, unit));
    _mm256_storeu_ps(out + j, _mm256_blendv_ps(x, w, _mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_EQ_OQ)));
  }
  return count;
}

// 8 masters split into bf16 words (in 32-bit lanes) and corrections (int32 lanes): store_master_kind's operations.
template <int BITS>
inline void split_bf16_8(__m256 x, __m256i& h, __m256i& code) {
  constexpr float LIMIT = static_cast<float>((1 << (BITS - 1)) - 1);
  constexpr float MAGIC = 12582912.0f;
  const __m256 clamped = min_keep(max_keep(x, _mm256_set1_ps(-BF16_MAX)), _mm256_set1_ps(BF16_MAX));
  const __m256i u = _mm256_castps_si256(clamped);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)), _mm256_set1_epi32(0x7F800000));
  h = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
  const __m256 w = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  const __m256 r = _mm256_sub_ps(x, w);
  const __m256i minus = _mm256_sub_epi32(_mm256_setzero_si256(), bf16_unit_exponent8<BITS>(w, toward_zero8(r, w)));
  const __m256i first = _mm256_min_epi32(minus, _mm256_set1_epi32(127));  // div_pow2: both factors normal for bf16
  const __m256i second = _mm256_sub_epi32(minus, first);
  const __m256 f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(first, _mm256_set1_epi32(127)), 23));
  const __m256 f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(second, _mm256_set1_epi32(127)), 23));
  __m256 s = _mm256_mul_ps(_mm256_mul_ps(r, f1), f2);
  s = min_keep(max_keep(s, _mm256_set1_ps(-40000.0f)), _mm256_set1_ps(40000.0f));
  s = _mm256_sub_ps(_mm256_add_ps(s, _mm256_set1_ps(MAGIC)), _mm256_set1_ps(MAGIC));
  s = min_keep(max_keep(s, _mm256_set1_ps(-LIMIT)), _mm256_set1_ps(LIMIT));
  s = _mm256_and_ps(s, _mm256_cmp_ps(s, s, _CMP_ORD_Q));  // NaN -> 0
  code = _mm256_cvttps_epi32(s);
}

// The first n / 16 * 16 masters split into bf16 weights and corrections; how many it wrote.
template <int BITS, typename C>
int64_t store_master_bf16_avx2(const float* master, int64_t n, uint16_t* p16, C* corr) {
  const int64_t count = n / 16 * 16;
  for (int64_t j = 0; j < count; j += 16) {
    __m256i h0, h1, c0, c1;
    split_bf16_8<BITS>(_mm256_loadu_ps(master + j), h0, c0);
    split_bf16_8<BITS>(_mm256_loadu_ps(master + j + 8), h1, c1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p16 + j), _mm256_permute4x64_epi64(_mm256_packus_epi32(h0, h1), 0xD8));
    const __m256i c16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c0, c1), 0xD8);  // in range: no saturation
    if constexpr (BITS == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(corr + j),
                       _mm_packs_epi16(_mm256_castsi256_si128(c16), _mm256_extracti128_si256(c16, 1)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(corr + j), c16);
    }
  }
  return count;
}
#endif

// The fp32 masters of n 16-bit weights from `start` (correction.py `reconstruct`).
template <int8_t KIND, int BITS, typename C>
void load_master_kind(const uint16_t* p16, const C* corr, int64_t n, float* out) {
  int64_t first = 0;
#ifdef BAOC_AVX2_LOOPS
  if constexpr (KIND == W_BF16 && BITS != 0) first = load_master_bf16_avx2<BITS>(p16, corr, n, out);
#endif
#pragma omp simd
  for (int64_t j = first; j < n; ++j) {
    const float w = load_weight<KIND>(p16[j]);
    if constexpr (BITS == 0) {
      out[j] = w;
    } else {
      const float c = static_cast<float>(corr[j]);
      const float x = w + c * scaled_unit<KIND, BITS>(w, points_to_zero(c, w));
      out[j] = c == 0.0f ? w : x;
    }
  }
}

// Split n fp32 masters into 16-bit weights and corrections (correction.py `split_into`).
template <int8_t KIND, int BITS, typename C>
void store_master_kind(const float* master, int64_t n, uint16_t* p16, C* corr) {
  constexpr float MAX_VALUE = KIND == W_BF16 ? BF16_MAX : 65504.0f;
  constexpr float LIMIT = BITS ? static_cast<float>((1 << (BITS > 0 ? BITS - 1 : 0)) - 1) : 0.0f;
  constexpr float MAGIC = 12582912.0f;  // 1.5 * 2**23: adding and subtracting it rounds to nearest even
  int64_t first = 0;
#ifdef BAOC_AVX2_LOOPS
  if constexpr (KIND == W_BF16 && BITS != 0) first = store_master_bf16_avx2<BITS>(master, n, p16, corr);
#endif
#pragma omp simd
  for (int64_t j = first; j < n; ++j) {
    const float x = master[j];
    const uint16_t h = store_weight<KIND>(std::min(std::max(x, -MAX_VALUE), MAX_VALUE));  // NaN stays NaN
    p16[j] = h;
    if constexpr (BITS != 0) {
      const float w = load_weight<KIND>(h);
      const float r = x - w;
      float s = div_pow2(r, unit_exponent<KIND, BITS>(w, points_to_zero(r, w)));
      s = std::min(std::max(s, -40000.0f), 40000.0f);  // past the limit either way; NaN stays NaN
      s = (s + MAGIC) - MAGIC;
      s = std::min(std::max(s, -LIMIT), LIMIT);
      corr[j] = static_cast<C>(s == s ? s : 0.0f);
    }
  }
}

template <int8_t KIND>
void load_grad_kind(const uint16_t* g16, int64_t n, float* out) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = load_weight<KIND>(g16[j]);
}

inline void load_master(const Tensors& t, int64_t start, int64_t n, float* out) {
  const uint16_t* p16 = t.p16 + start;
  const int8_t* c8 = static_cast<const int8_t*>(t.corr) + (t.corr_bits == 8 ? start : 0);
  const int16_t* c16 = static_cast<const int16_t*>(t.corr) + (t.corr_bits == 16 ? start : 0);
  if (t.p_kind == W_BF16) {
    if (t.corr_bits == 8) return load_master_kind<W_BF16, 8>(p16, c8, n, out);
    if (t.corr_bits == 16) return load_master_kind<W_BF16, 16>(p16, c16, n, out);
    return load_master_kind<W_BF16, 0, int8_t>(p16, nullptr, n, out);
  }
  if (t.corr_bits == 8) return load_master_kind<W_FP16, 8>(p16, c8, n, out);
  if (t.corr_bits == 16) return load_master_kind<W_FP16, 16>(p16, c16, n, out);
  return load_master_kind<W_FP16, 0, int8_t>(p16, nullptr, n, out);
}

inline void store_master(const Tensors& t, int64_t start, int64_t n, const float* master) {
  uint16_t* p16 = t.p16 + start;
  int8_t* c8 = static_cast<int8_t*>(t.corr) + (t.corr_bits == 8 ? start : 0);
  int16_t* c16 = static_cast<int16_t*>(t.corr) + (t.corr_bits == 16 ? start : 0);
  if (t.p_kind == W_BF16) {
    if (t.corr_bits == 8) return store_master_kind<W_BF16, 8>(master, n, p16, c8);
    if (t.corr_bits == 16) return store_master_kind<W_BF16, 16>(master, n, p16, c16);
    return store_master_kind<W_BF16, 0, int8_t>(master, n, p16, nullptr);
  }
  if (t.corr_bits == 8) return store_master_kind<W_FP16, 8>(master, n, p16, c8);
  if (t.corr_bits == 16) return store_master_kind<W_FP16, 16>(master, n, p16, c16);
  return store_master_kind<W_FP16, 0, int8_t>(master, n, p16, nullptr);
}

inline void load_grad16(const Tensors& t, int64_t start, int64_t n, float* out) {
  if (t.g_kind == W_BF16) return load_grad_kind<W_BF16>(t.g16 + start, n, out);
  return load_grad_kind<W_FP16>(t.g16 + start, n, out);
}

// The parameters and gradients of a super-block in fp32: the stored fp32 tensors themselves, or the
// masters rebuilt from 16-bit weights (and their corrections) and the 16-bit gradients widened.
inline float* load_params(const Tensors& t, int64_t start, int64_t n, float* pbuf) {
  if (t.p_kind == W_FP32) return t.p + start;
  load_master(t, start, n, pbuf);
  return pbuf;
}

inline const float* load_grads(const Tensors& t, int64_t start, int64_t n, float* gbuf) {
  if (t.g_kind == W_FP32) return t.g + start;
  load_grad16(t, start, n, gbuf);
  return gbuf;
}

// The momentum of a super-block in fp32: the stored fp32 tensor itself, or decoded into mbuf.
template <int64_t M>
inline float* load_momentum(const Tensors& t, int64_t sb, int64_t start, int64_t n, float* mbuf, float* scl,
                            float* spread_scale) {
  if constexpr (M == M_FP32) {
    return static_cast<float*>(t.m) + start;
  } else if constexpr (M == M_BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(t.m) + start;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) mbuf[j] = bf16_load(src[j]);
  } else if constexpr (M == M_INT8) {
    load_scales(t.m_scale + start / GROUP, t.m_exp[sb], (n + GROUP - 1) / GROUP, scl);
    spread(scl, n, spread_scale);
    decode_momentum(static_cast<const int8_t*>(t.m) + start, spread_scale, n, mbuf);
  }
  return mbuf;
}

// Store a super-block's momentum from mbuf (bf16: stochastically rounded; int8: encoded; fp32 was
// updated in place).
template <int64_t M>
inline void store_momentum(const Tensors& t, int64_t sb, int64_t start, int64_t n, const float* mbuf, float limit_m,
                           float* scl, float* spread_scale) {
  if constexpr (M == M_BF16) {
    uint16_t* dst = static_cast<uint16_t*>(t.m) + start;
    const uint32_t key = t.key;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_stochastic(mbuf[j], rounding_bits(start + j, key) >> 16);
  } else if constexpr (M == M_INT8) {
    float absmax[SUPER_GROUPS];
    group_absmax(mbuf, n, absmax);
    store_scales(absmax, (n + GROUP - 1) / GROUP, limit_m, t.m_scale + start / GROUP, t.m_exp + sb, scl);
    spread(scl, n, spread_scale);
    encode_momentum(mbuf, spread_scale, n, static_cast<int8_t*>(t.m) + start);
  }
}

// A super-block's weights, gradients, codes and decoded group scales: what the 8-bit loops read.
template <bool HAS_M, bool CODED_V>
struct CodedBlock {
  float* P;
  const float* G;
  const int8_t* mc;
  const uint8_t* vc;
  float sm[SUPER_GROUPS], sv[SUPER_GROUPS];
  CodedBlock(const Tensors& t, int64_t sb, int64_t start, int64_t groups)
      : P(t.p + start), G(t.g + start), mc(static_cast<const int8_t*>(t.m) + start),
        vc(static_cast<const uint8_t*>(t.v) + start) {
    if constexpr (HAS_M) load_scales(t.m_scale + start / GROUP, t.m_exp[sb], groups, sm);
    if constexpr (CODED_V) load_scales(t.v_scale + start / GROUP, t.v_exp[sb], groups, sv);
  }
};

// ---- Hand-written AVX2 loops (bf16_pass_avx2, int8_pass_avx2): the same float operations in the same
// order as the loops they stand for, so the same bits, without what the compiler adds around them
// (masks before each narrowing, constants spilled to the stack, a round and a truncation where one
// conversion rounds to nearest even as std::rint does). Measured side by side on the 2-core AMD EPYC test
// machine at one thread (docs/benchmarks/step-time.md, benchmarks/kernel_ab.py): bf16 1.65x -> 1.37x fused
// AdamW's step, int8 2.64x -> 2.28x; int8 on bf16 weights with ecc8 5.26x -> 2.74x. CPUs with AVX-512 keep
// the compiler's 512-bit loops, which these were not measured against.
#ifdef BAOC_AVX2_LOOPS
// Adam's per-element arithmetic (struct Adam's, operation for operation) on 8 lanes: the one definition the
// AVX2 loops use.
struct Lanes8 {
  __m256 gsign, decay, l2, beta2, omb2, isbc2, eps, lr_step, lerp;
  explicit Lanes8(const Adam& a)
      : gsign(_mm256_set1_ps(a.gsign)), decay(_mm256_set1_ps(a.decay)), l2(_mm256_set1_ps(a.l2_factor)),
        beta2(_mm256_set1_ps(a.beta2)), omb2(_mm256_set1_ps(a.one_minus_beta2)), isbc2(_mm256_set1_ps(a.inv_sqrt_bc2)),
        eps(_mm256_set1_ps(a.eps)), lr_step(_mm256_set1_ps(a.lr_step)), lerp(_mm256_set1_ps(a.lerp_coeff)) {}

  template <bool L2>
  __m256 grad(const float* G, __m256 p) const {
    const __m256 g = _mm256_mul_ps(_mm256_loadu_ps(G), gsign);
    return L2 ? _mm256_fmadd_ps(p, l2, g) : g;
  }
  __m256 decayed(__m256 p) const { return _mm256_mul_ps(p, decay); }
  __m256 second_moment(__m256 g, __m256 v0) const { return _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g, _mm256_mul_ps(v0, beta2)); }
  __m256 denominator(__m256 root) const { return _mm256_add_ps(_mm256_mul_ps(root, isbc2), eps); }
  __m256 unless_overflowed(__m256 g, __m256 d) const {  // Adam::unless_overflowed
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256 sq = _mm256_mul_ps(_mm256_mul_ps(omb2, g), g);
    return _mm256_blendv_ps(d, inf, _mm256_cmp_ps(sq, inf, _CMP_EQ_OQ));
  }
  template <bool SMALL>
  __m256 momentum(__m256 m0, __m256 g) const { return _mm256_fmadd_ps(lerp, _mm256_sub_ps(g, m0), SMALL ? m0 : g); }
  __m256 update(__m256 p, __m256 direction, __m256 d) const {
    return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(lr_step, direction), d));
  }
};

// mix_bits of 8 counters.
inline __m256i mix_bits8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x21f0aaad));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x735a2d97));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

// 16 bf16 values as fp32 (elements 0-7 in lo, 8-15 in hi): each word into the high half of a 32-bit lane.
inline void bf16_widen16(const uint16_t* src, __m256& lo, __m256& hi) {
  const __m256i x = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)), 0xD8);
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
}

// The rounded upper words of two halves (values < 2**16 in 32-bit lanes) as 16 lanes in order.
inline __m256i bf16_pack16(__m256i lo, __m256i hi) { return _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8); }

// bf16_stochastic's saturation and NaN on 16 rounded lanes.
inline __m256i bf16_saturate16(__m256i h) {
  const __m256i magnitude = _mm256_and_si256(h, _mm256_set1_epi16(0x7FFF));
  const __m256i saturated = _mm256_or_si256(_mm256_xor_si256(h, magnitude), _mm256_min_epu16(magnitude, _mm256_set1_epi16(0x7F7F)));
  const __m256i nan = _mm256_cmpgt_epi16(magnitude, _mm256_set1_epi16(0x7F80));
  return _mm256_blendv_epi8(saturated, _mm256_set1_epi16(0x7FC0), nan);
}

// bf16_pass's arithmetic on 8 elements (momentum m0 and, for bf16, second moment v0 already widened):
// the parameters written, the fp32 second moment stored (bf16_momentum); the rounded upper words of the
// new moments returned (m in .first, v in .second).
template <int64_t V, bool L2, bool SMALL>
inline std::pair<__m256i, __m256i> bf16_lanes(const Lanes8& c, float* P, const float* G, __m256 m0, __m256 v0,
                                              float* V32, __m256i counter) {
  const __m256 p = _mm256_loadu_ps(P);
  const __m256 g = c.grad<L2>(G, p);
  if constexpr (V != V_BF16) v0 = _mm256_loadu_ps(V32);
  const __m256 v = c.second_moment(g, v0);
  const __m256 m = c.momentum<SMALL>(m0, g);
  _mm256_storeu_ps(P, c.update(c.decayed(p), m, c.denominator(_mm256_sqrt_ps(v))));
  if constexpr (V != V_BF16) _mm256_storeu_ps(V32, v);
  const __m256i h = mix_bits8(counter);
  const __m256i rm = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(m), _mm256_srli_epi32(h, 16)), 16);
  const __m256i noise_v = _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF));
  const __m256i rv = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), noise_v), 16);
  return {rm, rv};
}

// bf16_pass on the first n / 16 * 16 elements, 16 at a time; returns how many it stepped. The saturation
// runs only where a lane of the 16 reaches bf16's largest magnitude or passes it (inf, NaN): the same
// result, tested once per 16 lanes.
template <int64_t V, bool L2, bool SMALL>
int32_t bf16_pass_avx2(const Tensors& t, int64_t start, int64_t n) {
  constexpr int32_t PREFETCH = 512;  // elements: measured against 256 and 1024 and none (bf16_momentum -5%)
  float* P = t.p + start;
  const float* G = t.g + start;
  uint16_t* M16 = static_cast<uint16_t*>(t.m) + start;
  uint16_t* V16 = static_cast<uint16_t*>(t.v) + start;
  float* V32 = static_cast<float*>(t.v) + start;
  const Lanes8 c{Adam(t.s)};
  const int32_t count = static_cast<int32_t>(n / 16 * 16);
  const __m256i eight = _mm256_set1_epi32(8), low15 = _mm256_set1_epi16(0x7FFF), top = _mm256_set1_epi16(0x7F7F);
  __m256i counter = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(static_cast<uint32_t>(start) + t.key)),
                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int32_t j = 0; j < count; j += 16) {
    // the streams PREFETCH elements ahead, a cache line of each per 16 elements (the loop's division and square
    // root leave too few loads in flight for this CPU's own prefetch; past the tensor's end a prefetch is a no-op)
    _mm_prefetch(reinterpret_cast<const char*>(P + j + PREFETCH), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(G + j + PREFETCH), _MM_HINT_T0);
    if (j % 32 == 0) {
      _mm_prefetch(reinterpret_cast<const char*>(M16 + j + PREFETCH), _MM_HINT_T0);
      if constexpr (V == V_BF16) _mm_prefetch(reinterpret_cast<const char*>(V16 + j + PREFETCH), _MM_HINT_T0);
    }
    if constexpr (V != V_BF16) _mm_prefetch(reinterpret_cast<const char*>(V32 + j + PREFETCH), _MM_HINT_T0);
    __m256 m_lo, m_hi, v_lo = _mm256_setzero_ps(), v_hi = _mm256_setzero_ps();
    bf16_widen16(M16 + j, m_lo, m_hi);
    if constexpr (V == V_BF16) bf16_widen16(V16 + j, v_lo, v_hi);
    const auto a = bf16_lanes<V, L2, SMALL>(c, P + j, G + j, m_lo, v_lo, V32 + j, counter);
    counter = _mm256_add_epi32(counter, eight);
    const auto b = bf16_lanes<V, L2, SMALL>(c, P + j + 8, G + j + 8, m_hi, v_hi, V32 + j + 8, counter);
    counter = _mm256_add_epi32(counter, eight);
    __m256i hm = bf16_pack16(a.first, b.first), hv = _mm256_setzero_si256();
    __m256i largest = _mm256_and_si256(hm, low15);
    if constexpr (V == V_BF16) {
      hv = bf16_pack16(a.second, b.second);
      largest = _mm256_max_epu16(largest, _mm256_and_si256(hv, low15));
    }
    if (_mm256_movemask_epi8(_mm256_cmpgt_epi16(largest, top)) != 0) {
      hm = bf16_saturate16(hm);
      if constexpr (V == V_BF16) hv = bf16_saturate16(hv);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(M16 + j), hm);
    if constexpr (V == V_BF16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(V16 + j), hv);
  }
  return count;
}
#endif

// The bf16-momentum formats (bf16: both moments bf16; bf16_momentum: the second moment fp32) on fp32
// weights: decode, AdamW, and the stochastic rounding in one loop per element, so that the rounding's
// integer work runs beside the division and the square root (a loop of its own waited on them).
// L2 and SMALL: the group's Adam L2 decay and ATen's lerp branch, fixed per instantiation (a select on
// a loop-invariant bool keeps GCC from vectorizing a loop that mixes 16- and 32-bit lanes).
template <int64_t V, bool L2, bool SMALL>
void bf16_pass(const Tensors& t, int64_t start, int64_t n) {
  float* P = t.p + start;
  const float* G = t.g + start;
  uint16_t* M16 = static_cast<uint16_t*>(t.m) + start;
  uint16_t* V16 = static_cast<uint16_t*>(t.v) + start;
  float* V32 = static_cast<float*>(t.v) + start;
  const uint32_t base = static_cast<uint32_t>(start) + t.key;  // the hash's counter, modulo 2**32
  const Adam a(t.s);
  const int32_t count = static_cast<int32_t>(n);
  int32_t first = 0;  // elements stepped by the AVX2 loop
#ifdef BAOC_AVX2_LOOPS
  first = bf16_pass_avx2<V, L2, SMALL>(t, start, n);
#endif
#pragma omp simd
  for (int32_t j = first; j < count; ++j) {
    const float g = a.grad(G[j], P[j], L2);
    const float v = a.second_moment(g, V == V_BF16 ? bf16_load(V16[j]) : V32[j]);
    const float m = a.momentum(bf16_load(M16[j]), g, SMALL);
    P[j] = a.update(a.decayed(P[j]), m, a.denominator(std::sqrt(v)));
    const uint32_t h = mix_bits(base + static_cast<uint32_t>(j));
    M16[j] = bf16_stochastic(m, h >> 16);
    if constexpr (V == V_BF16) {
      V16[j] = bf16_stochastic(v, h & 0xFFFFu);
    } else {
      V32[j] = v;
    }
  }
}

// The factored formats' denominators of n elements from `start`: row factor x column factor + eps
// (factored_math.factored_update), row by row.
inline void factored_denominators(const Tensors& t, int64_t start, int64_t n, float* denom) {
  const float eps = t.s.eps;
  int64_t r = start / t.cols, c = start % t.cols, j = 0;
  while (j < n) {
    const int64_t len = std::min(n - j, t.cols - c);
    const float rf = t.row_factor[r];
    const float* cf = t.col_factor + c;
#pragma omp simd
    for (int64_t k = 0; k < len; ++k) denom[j + k] = rf * cf[k] + eps;
    j += len;
    c = 0;
    ++r;
  }
}

#ifdef BAOC_AVX2_LOOPS
// Horizontal maximum of 8 non-NaN lanes.
inline float hmax8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// 32 int32 lanes (4 vectors) truncated to their low bytes, in order (static_cast<int8_t> of each).
inline __m256i low_bytes32(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i mask = _mm256_set1_epi32(0xFF);
  const __m256i ab = _mm256_packus_epi32(_mm256_and_si256(a, mask), _mm256_and_si256(b, mask));
  const __m256i cd = _mm256_packus_epi32(_mm256_and_si256(c, mask), _mm256_and_si256(d, mask));
  return _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// int8_pass of a whole super-block by hand in AVX2: the same operations in the same order, 8 lanes at a
// time, the group maxima taken in the AdamW loop (the maximum of the non-NaN magnitudes, as group_absmax's),
// the codes converted by cvtps2dq (to nearest even, as std::rint) and truncated to their low byte (as the
// static_cast, so that a NaN's code is 0 as there).
// How far ahead int8_pass_avx2 prefetches, in elements: side by side on the 2-core Zen 4 test machine, every
// version stepping the same optimizer (benchmarks/kernel_ab.py), int8 took 1.69x-2.14x fused AdamW's step at 1
// thread against 1.88x-2.26x without, in three runs (512 elements: within noise of 1024). Past the tensor's end
// a prefetch is a no-op.
constexpr int64_t PREFETCH_8BIT = 1024;

template <int64_t M, int64_t V, bool L2, bool SMALL>
void int8_pass_avx2(const Tensors& t, int64_t sb, int64_t start, float limit_m, float limit_v) {
  constexpr bool HAS_M = M == M_INT8, CODED_V = V == V_UINT8;
  const CodedBlock<HAS_M, CODED_V> in(t, sb, start, SUPER_GROUPS);
  alignas(64) float mbuf[SUPER];
  alignas(64) float vbuf[SUPER];
  // the factored denominators: computed in the loop 8 at a time where no 8 straddle a row, else beforehand
  const bool in_rows = !CODED_V && t.cols % 8 == 0;
  if (!CODED_V && !in_rows) factored_denominators(t, start, SUPER, vbuf);
  int64_t row = CODED_V ? 0 : start / t.cols, col = CODED_V ? 0 : start % t.cols;
  const Lanes8 c{Adam(t.s)};
  const __m256 inv127 = _mm256_set1_ps(INV_127), inv255 = _mm256_set1_ps(INV_255), two = _mm256_set1_ps(2.0f);
  const __m256 half = _mm256_set1_ps(0.5f), absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // the old momentum m0 of 8 elements from j (scale: their group's)
  const auto momentum0 = [&](int64_t j, __m256 scale) {
    const __m256 y = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.mc + j)))), inv127);
    return _mm256_mul_ps(_mm256_div_ps(y, _mm256_sub_ps(two, _mm256_and_ps(y, absmask))), scale);
  };
  // With a coded second moment, the moments are decoded in a loop of their own first, into the buffers the
  // AdamW loop then overwrites element for element: short independent chains, the momentum's division no
  // longer ahead of the update's in one long chain. Bit-equal; side by side with the version before
  // (benchmarks/kernel_ab.py --kernel-only, 1 thread, median ratio to fused AdamW's call over 31 rounds): int8
  // 2.92x -> 2.68x at 65K weights (in L2), 2.51x -> 2.22x at 1M, 2.21x -> 2.07x at 21M; nomomentum_int8
  // unchanged. int8_factored keeps its decode in the AdamW loop (split, it lost: 1.50x -> 1.59x at 21M).
  if constexpr (CODED_V) {
    for (int64_t k = 0; k < SUPER_GROUPS; ++k) {
      const __m256 scale_m = _mm256_set1_ps(HAS_M ? in.sm[k] : 0.0f), scale_v = _mm256_set1_ps(in.sv[k]);
      for (int64_t j = k * GROUP; j < (k + 1) * GROUP; j += 8) {
        // the square of the old root of v
        const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in.vc + j))));
        const __m256 root0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_max_ps(code, half), inv255), scale_v);
        _mm256_store_ps(vbuf + j, _mm256_mul_ps(root0, root0));
        if constexpr (HAS_M) _mm256_store_ps(mbuf + j, momentum0(j, scale_m));
      }
    }
  }
  float max_m[SUPER_GROUPS], max_v[SUPER_GROUPS];
  for (int64_t k = 0; k < SUPER_GROUPS; ++k) {
    const __m256 scale_m = _mm256_set1_ps(HAS_M && !CODED_V ? in.sm[k] : 0.0f);
    __m256 top_m = _mm256_setzero_ps(), top_v = _mm256_setzero_ps();
    for (int64_t q = 0; q < GROUP; q += 8) {
      const int64_t j = k * GROUP + q;
      // the streams PREFETCH_8BIT elements ahead, a cache line of each as it starts (as bf16_pass_avx2's)
      if (q % 16 == 0) {
        _mm_prefetch(reinterpret_cast<const char*>(in.P + j + PREFETCH_8BIT), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(in.G + j + PREFETCH_8BIT), _MM_HINT_T0);
      }
      if (q == 0 && k % 2 == 0) {
        if constexpr (HAS_M) _mm_prefetch(reinterpret_cast<const char*>(in.mc + j + PREFETCH_8BIT), _MM_HINT_T0);
        if constexpr (CODED_V) _mm_prefetch(reinterpret_cast<const char*>(in.vc + j + PREFETCH_8BIT), _MM_HINT_T0);
      }
      __m256 p = _mm256_loadu_ps(in.P + j);
      const __m256 g = c.grad<L2>(in.G + j, p);
      p = c.decayed(p);
      __m256 d;
      if constexpr (CODED_V) {
        const __m256 root = _mm256_sqrt_ps(c.second_moment(g, _mm256_load_ps(vbuf + j)));
        _mm256_store_ps(vbuf + j, root);
        top_v = _mm256_max_ps(root, top_v);  // a root is +0 or more, or NaN (which max_ps passes over)
        d = c.denominator(root);
      } else if (in_rows) {  // factored_denominators' operations
        d = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(t.row_factor[row]), _mm256_loadu_ps(t.col_factor + col)), c.eps);
        col += 8;
        if (col == t.cols) {
          col = 0;
          ++row;
        }
      } else {
        d = _mm256_load_ps(vbuf + j);
      }
      if constexpr (!CODED_V) d = c.unless_overflowed(g, d);
      if constexpr (HAS_M) {
        const __m256 m = c.momentum<SMALL>(CODED_V ? _mm256_load_ps(mbuf + j) : momentum0(j, scale_m), g);
        _mm256_store_ps(mbuf + j, m);
        top_m = _mm256_max_ps(_mm256_and_ps(m, absmask), top_m);
        p = c.update(p, m, d);
      } else {
        p = c.update(p, g, d);
      }
      _mm256_storeu_ps(in.P + j, p);
    }
    max_m[k] = HAS_M ? hmax8(top_m) : 0.0f;
    max_v[k] = CODED_V ? hmax8(top_v) : 0.0f;
  }
  float inv_m[SUPER_GROUPS], inv_v[SUPER_GROUPS];
  if constexpr (HAS_M) store_scales(max_m, SUPER_GROUPS, limit_m, t.m_scale + start / GROUP, t.m_exp + sb, inv_m);
  if constexpr (CODED_V) store_scales(max_v, SUPER_GROUPS, limit_v, t.v_scale + start / GROUP, t.v_exp + sb, inv_v);
  int8_t* mo = static_cast<int8_t*>(t.m) + start;
  uint8_t* vo = static_cast<uint8_t*>(t.v) + start;
  const __m256 one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f), zero = _mm256_setzero_ps();
  const __m256 c254 = _mm256_set1_ps(254.0f), c255 = _mm256_set1_ps(255.0f);
  for (int64_t k = 0; k < SUPER_GROUPS; ++k) {
    const int64_t a = k * GROUP;
    if constexpr (HAS_M) {
      const __m256 im = _mm256_set1_ps(inv_m[k]);
      __m256i q[4];
      for (int r = 0; r < 4; ++r) {
        const __m256 u = min_keep(max_keep(_mm256_mul_ps(_mm256_load_ps(mbuf + a + 8 * r), im), minus_one), one);
        const __m256 w = _mm256_mul_ps(_mm256_div_ps(u, _mm256_add_ps(_mm256_and_ps(u, absmask), one)), c254);
        q[r] = _mm256_cvtps_epi32(w);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(mo + a), low_bytes32(q[0], q[1], q[2], q[3]));
    }
    if constexpr (CODED_V) {
      const __m256 iv = _mm256_set1_ps(inv_v[k]);
      __m256i q[4];
      for (int r = 0; r < 4; ++r) {
        const __m256 u = min_keep(max_keep(_mm256_mul_ps(_mm256_load_ps(vbuf + a + 8 * r), iv), zero), one);
        q[r] = _mm256_cvtps_epi32(_mm256_mul_ps(u, c255));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vo + a), low_bytes32(q[0], q[1], q[2], q[3]));
    }
  }
}
#endif

// The 8-bit formats on fp32 weights (int8, nomomentum_int8, int8_factored) in three loops over the
// super-block instead of up to nine: decode and AdamW group by group (each group's scales broadcast,
// not spread to every element), the group maxima and scales, then the encodes in one loop. The same
// operations in the same order as the loops of `superblock` (decode_momentum, decode_sqrt, the
// update, encode_momentum, encode_sqrt): the divisions and square roots of one loop run beside the
// conversions and roundings of the other moment.
template <int64_t M, int64_t V, bool L2, bool SMALL, bool FULL>
void int8_pass(const Tensors& t, int64_t sb, int64_t start, int64_t n, float limit_m, float limit_v) {
  constexpr bool HAS_M = M == M_INT8, CODED_V = V == V_UINT8;
#ifdef BAOC_AVX2_LOOPS
  if constexpr (FULL) return int8_pass_avx2<M, V, L2, SMALL>(t, sb, start, limit_m, limit_v);
#endif
  const int64_t groups = FULL ? SUPER_GROUPS : (n + GROUP - 1) / GROUP;
  const CodedBlock<HAS_M, CODED_V> in(t, sb, start, groups);
  alignas(64) float mbuf[SUPER];
  alignas(64) float vbuf[SUPER];  // the new sqrt(v), or (factored) the denominators
  if constexpr (!CODED_V) factored_denominators(t, start, n, vbuf);
  const Adam ad(t.s);
  for (int64_t k = 0; k < groups; ++k) {
    const int64_t a = k * GROUP, b = FULL ? a + GROUP : std::min(n, a + GROUP);
    const float scale_m = HAS_M ? in.sm[k] : 0.0f, scale_v = CODED_V ? in.sv[k] : 0.0f;
#pragma omp simd
    for (int64_t j = a; j < b; ++j) {
      const float g = ad.grad(in.G[j], in.P[j], L2);
      const float p = ad.decayed(in.P[j]);
      float d;
      if constexpr (CODED_V) {
        const float x = root_value(in.vc[j], scale_v);
        const float root = std::sqrt(ad.second_moment(g, x * x));
        vbuf[j] = root;
        d = ad.denominator(root);
      } else {
        d = ad.unless_overflowed(g, vbuf[j]);
      }
      if constexpr (HAS_M) {
        const float m = ad.momentum(momentum_value(in.mc[j], scale_m), g, SMALL);
        mbuf[j] = m;
        in.P[j] = ad.update(p, m, d);
      } else {
        in.P[j] = ad.update(p, g, d);
      }
    }
  }
  float absmax[SUPER_GROUPS];
  float inv_m[SUPER_GROUPS], inv_v[SUPER_GROUPS];
  if constexpr (HAS_M) {
    group_absmax(mbuf, n, absmax);
    store_scales(absmax, groups, limit_m, t.m_scale + start / GROUP, t.m_exp + sb, inv_m);
  }
  if constexpr (CODED_V) {
    group_absmax(vbuf, n, absmax);
    store_scales(absmax, groups, limit_v, t.v_scale + start / GROUP, t.v_exp + sb, inv_v);
  }
  int8_t* mo = static_cast<int8_t*>(t.m) + start;
  uint8_t* vo = static_cast<uint8_t*>(t.v) + start;
  for (int64_t k = 0; k < groups; ++k) {
    const int64_t a = k * GROUP, b = FULL ? a + GROUP : std::min(n, a + GROUP);
    const float im = HAS_M ? inv_m[k] : 0.0f, iv = CODED_V ? inv_v[k] : 0.0f;
#pragma omp simd
    for (int64_t j = a; j < b; ++j) {
      if constexpr (HAS_M) mo[j] = momentum_code(mbuf[j], im);
      if constexpr (CODED_V) vo[j] = root_code(vbuf[j], iv);
    }
  }
}

// FULL: a whole super-block (1024 elements), so that every loop has a constant trip count; the
// last super-block of a tensor may be shorter.
template <int64_t M, int64_t V, bool FULL>
void superblock(const Tensors& t, int64_t sb, float limit_m, float limit_v) {
  const int64_t start = sb * SUPER;
  const int64_t n = FULL ? SUPER : std::min(SUPER, t.numel - start);
  if constexpr (M == M_BF16 && (V == V_BF16 || V == V_FP32)) {
    if (t.p_kind == W_FP32 && t.g_kind == W_FP32) {
      if (t.s.l2_decay) {
        return t.s.lerp_small ? bf16_pass<V, true, true>(t, start, n) : bf16_pass<V, true, false>(t, start, n);
      }
      return t.s.lerp_small ? bf16_pass<V, false, true>(t, start, n) : bf16_pass<V, false, false>(t, start, n);
    }
  }
  if constexpr (((M == M_INT8 || M == M_NONE) && V == V_UINT8) || (M == M_INT8 && V == V_FACTORED)) {
    if (t.p_kind == W_FP32 && t.g_kind == W_FP32) {
      if (t.s.l2_decay) {
        return t.s.lerp_small ? int8_pass<M, V, true, true, FULL>(t, sb, start, n, limit_m, limit_v)
                              : int8_pass<M, V, true, false, FULL>(t, sb, start, n, limit_m, limit_v);
      }
      return t.s.lerp_small ? int8_pass<M, V, false, true, FULL>(t, sb, start, n, limit_m, limit_v)
                            : int8_pass<M, V, false, false, FULL>(t, sb, start, n, limit_m, limit_v);
    }
  }
  const int64_t groups = (n + GROUP - 1) / GROUP;
  const Scalars& s = t.s;
  alignas(64) float mbuf[SUPER];
  alignas(64) float vbuf[SUPER];
  alignas(64) float denom[SUPER];
  float scl[SUPER_GROUPS];
  alignas(64) float spread_scale[SUPER];
  alignas(64) float pbuf[SUPER];
  alignas(64) float gbuf[SUPER];
  float* P = load_params(t, start, n, pbuf);
  const float* G = load_grads(t, start, n, gbuf);

  // moments in fp32: the stored fp32 tensors themselves, or decoded into the buffers
  float* mm = load_momentum<M>(t, sb, start, n, mbuf, scl, spread_scale);
  float* vv = vbuf;
  if constexpr (V == V_FP32) {
    vv = static_cast<float*>(t.v) + start;
  } else if constexpr (V == V_BF16) {
    const uint16_t* src = static_cast<const uint16_t*>(t.v) + start;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) vbuf[j] = bf16_load(src[j]);
  } else if constexpr (V == V_UINT8) {
    load_scales(t.v_scale + start / GROUP, t.v_exp[sb], groups, scl);
    spread(scl, n, spread_scale);
    decode_sqrt(static_cast<const uint8_t*>(t.v) + start, spread_scale, n, vbuf);
  }

  // AdamW in fp32, in the eager step's order (adam_math.chunk_adamw, factored_math.factored_update)
  if constexpr (V == V_FACTORED) factored_denominators(t, start, n, denom);
  const Adam a(s);
  const bool l2 = s.l2_decay, lerp_small = s.lerp_small;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = a.grad(G[j], P[j], l2);
    const float p = a.decayed(P[j]);
    float d;
    if constexpr (V == V_FACTORED) {
      d = a.unless_overflowed(g, denom[j]);
    } else {
      const float v = a.second_moment(g, vv[j]);
      const float root = std::sqrt(v);
      // the 8-bit second moment is encoded from sqrt(v) (v >= 0): keep the root, not v
      vv[j] = (V == V_UINT8) ? root : v;
      d = a.denominator(root);
    }
    if constexpr (M == M_NONE) {
      P[j] = a.update(p, g, d);
    } else {
      const float m = a.momentum(mm[j], g, lerp_small);
      mm[j] = m;
      P[j] = a.update(p, m, d);
    }
  }
  if (t.p_kind != W_FP32) store_master(t, start, n, pbuf);

  // store the moments
  if constexpr (M == M_BF16 && V == V_BF16) {  // one hash per element rounds both moments
    uint16_t* dm = static_cast<uint16_t*>(t.m) + start;
    uint16_t* dv = static_cast<uint16_t*>(t.v) + start;
    const uint32_t key = t.key;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t h = rounding_bits(start + j, key);
      dm[j] = bf16_stochastic(mbuf[j], h >> 16);
      dv[j] = bf16_stochastic(vbuf[j], h & 0xFFFFu);
    }
  } else {
    store_momentum<M>(t, sb, start, n, mbuf, limit_m, scl, spread_scale);
  }
  if constexpr (V == V_BF16 && M != M_BF16) {
    uint16_t* dst = static_cast<uint16_t*>(t.v) + start;
    const uint32_t key = t.key;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_stochastic(vbuf[j], rounding_bits(start + j, key) & 0xFFFFu);
  } else if constexpr (V == V_UINT8) {
    float absmax[SUPER_GROUPS];
    group_absmax(vbuf, n, absmax);
    store_scales(absmax, groups, limit_v, t.v_scale + start / GROUP, t.v_exp + sb, scl);
    spread(scl, n, spread_scale);
    encode_sqrt(vbuf, spread_scale, n, static_cast<uint8_t*>(t.v) + start);
  }
}

// The rounding key of one parameter at one step (quant.py `stream_key`): the hash of the seed, the
// step count and a hash of the parameter's name.
inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

inline uint32_t stream_key(int64_t seed, int64_t step, int64_t salt) {
  return mix32(mix32(mix32(static_cast<uint32_t>(seed)) ^ static_cast<uint32_t>(step)) ^ static_cast<uint32_t>(salt));
}

// Whether any of n fp32 values is inf or NaN (all exponent bits set): integer operations, one
// vectorized pass.
inline bool any_nonfinite(const float* g, int64_t n) {
  uint32_t hits = 0;
#pragma omp simd reduction(| : hits)
  for (int64_t j = 0; j < n; ++j) hits |= static_cast<uint32_t>((bits_of(g[j]) & 0x7F800000u) == 0x7F800000u);
  return hits != 0;
}

// The same for 16-bit values whose exponent field is `mask` (bf16 0x7F80, fp16 0x7C00).
inline bool any_nonfinite16(const uint16_t* g, int64_t n, uint16_t mask) {
  uint32_t hits = 0;
#pragma omp simd reduction(| : hits)
  for (int64_t j = 0; j < n; ++j) hits |= static_cast<uint32_t>((g[j] & mask) == mask);
  return hits != 0;
}

inline int64_t superblocks(int64_t numel) { return (numel + SUPER - 1) / SUPER; }

// f(i, sb, full) for every super-block sb of every tensor items[i], the whole range divided among the
// threads by at::parallel_for; full: a whole 1024-element super-block.
template <typename F>
void over_superblocks(const std::vector<Tensors>& items, F&& f) {
  std::vector<int64_t> offsets(items.size() + 1, 0);
  for (size_t i = 0; i < items.size(); ++i) offsets[i + 1] = offsets[i] + superblocks(items[i].numel);
  at::parallel_for(0, offsets.back(), 8, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (int64_t k = begin; k < end; ++k) {
      while (k >= offsets[i + 1]) ++i;
      f(i, k - offsets[i], (k - offsets[i] + 1) * SUPER <= items[i].numel);
    }
  });
}

// The arithmetic of one super-block in the kinds (M, V): of a whole 1024-element super-block, or of a tensor's
// last, partial one. adamw_step chooses the pair once per call (the kinds are the call's) and steps every
// super-block of its tensors with it: the operator -> superblock, one call.
using SuperblockStep = void (*)(const Tensors&, int64_t, float, float);
struct SuperblockSteps {
  SuperblockStep full, partial;
};

template <int64_t M, int64_t V>
SuperblockSteps superblock_steps() {
  return {&superblock<M, V, true>, &superblock<M, V, false>};
}

SuperblockSteps superblock_steps_for(int64_t m_kind, int64_t v_kind) {
  switch (m_kind * 4 + v_kind) {
    case M_NONE * 4 + V_FP32: return superblock_steps<M_NONE, V_FP32>();
    case M_NONE * 4 + V_UINT8: return superblock_steps<M_NONE, V_UINT8>();
    case M_NONE * 4 + V_FACTORED: return superblock_steps<M_NONE, V_FACTORED>();
    case M_FP32 * 4 + V_FP32: return superblock_steps<M_FP32, V_FP32>();
    case M_BF16 * 4 + V_FP32: return superblock_steps<M_BF16, V_FP32>();
    case M_BF16 * 4 + V_BF16: return superblock_steps<M_BF16, V_BF16>();
    case M_INT8 * 4 + V_UINT8: return superblock_steps<M_INT8, V_UINT8>();
    case M_INT8 * 4 + V_FACTORED: return superblock_steps<M_INT8, V_FACTORED>();
    default: TORCH_CHECK(false, "lightning_baoc step: no kernel for momentum kind ", m_kind, " and second-moment kind ", v_kind);
  }
}

// Whether any of the n values from g is inf or NaN (`test` of a part), read as SCAN_STREAMS parts
// side by side, 16 KiB of each in turn: a single sequential read leaves memory idle between its
// requests (one thread, 84 MB of gradients on the 2-core test machine: 8.5 ms read in one stream,
// 5.0 ms in eight), and a test of a few hundred bytes spends more on its reduction than on the read
// (a 32 MB gradient, one thread on the 2-core AMD EPYC: 15 GB/s in parts of 256 bytes, 29 GB/s in
// 16 KiB; 2 threads 31 and 60 GB/s).
constexpr int64_t SCAN_STREAMS = 8;
template <typename T, typename F>
inline bool scan_streams(const T* g, int64_t n, F&& test) {
  constexpr int64_t width = 16384 / sizeof(T);
  const int64_t part = n / SCAN_STREAMS / width * width;
  bool hit = false;
  for (int64_t j = 0; j < part && !hit; j += width) {
    for (int64_t s = 0; s < SCAN_STREAMS; ++s) hit |= test(g + s * part + j, width);
  }
  return hit || test(g + SCAN_STREAMS * part, n - SCAN_STREAMS * part);
}

// Whether any of n fp32 gradients is inf or NaN, read in streams.
inline bool fp32_nonfinite(const float* g, int64_t n) {
  return scan_streams(g, n, [](const float* x, int64_t len) { return any_nonfinite(x, len); });
}

// Which tensors of items[i0, i1) hold an inf or a NaN in their gradient: one parallel pass over
// their super-blocks, each thread's share of a tensor read in streams (a tensor found bad is not
// read further).
std::vector<uint8_t> nonfinite_flags(const std::vector<Tensors>& items, size_t i0, size_t i1) {
  const size_t count = i1 - i0;
  std::unique_ptr<std::atomic<uint8_t>[]> bad(new std::atomic<uint8_t>[count]);
  for (size_t i = 0; i < count; ++i) bad[i].store(0, std::memory_order_relaxed);
  std::vector<int64_t> offsets(count + 1, 0);
  for (size_t i = 0; i < count; ++i) offsets[i + 1] = offsets[i] + superblocks(items[i0 + i].numel);
  at::parallel_for(0, offsets.back(), 16, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(offsets.begin(), offsets.end(), begin) - offsets.begin() - 1;
    for (; i < count && offsets[i] < end; ++i) {
      if (bad[i].load(std::memory_order_relaxed)) continue;
      const Tensors& t = items[i0 + i];
      const int64_t first = (std::max(begin, offsets[i]) - offsets[i]) * SUPER;
      const int64_t last = std::min((std::min(end, offsets[i + 1]) - offsets[i]) * SUPER, t.numel);
      bool found;
      if (t.g_kind == W_FP32) {
        found = fp32_nonfinite(t.g + first, last - first);
      } else {
        const uint16_t mask = t.g_kind == W_BF16 ? 0x7F80 : 0x7C00;
        found = scan_streams(t.g16 + first, last - first,
                             [mask](const uint16_t* x, int64_t len) { return any_nonfinite16(x, len, mask); });
      }
      if (found) bad[i].store(1, std::memory_order_relaxed);
    }
  });
  std::vector<uint8_t> out(count);
  for (size_t i = 0; i < count; ++i) out[i] = bad[i].load(std::memory_order_relaxed);
  return out;
}

// Adafactor's moments of one tensor (factored_math._update_moments and sqrt_factors), in two parts:
// factored_sums reads the gradient once for the row and column sums of (g k)**2; factored_finish
// updates the state vectors from them and gives the step's factors sqrt(row / mean(row) / bc2) and
// sqrt(col). Between the two, nothing is written: the sums also test the gradient (sums_finite).
constexpr int64_t FACTORED_PARTS = 16;  // the column sums' partial sums, fixed (factored_sums)
struct FactoredSums {
  std::vector<float> row_sum;   // rows
  std::vector<float> col_part;  // parts x cols partial column sums, added in a fixed order
  int64_t parts = 1;
};

// One row's sum of (g k)**2, each square also added to its column's sum in `cs`: one pass over the row.
// ROW_LANES partial sums (element c in part[c % ROW_LANES]), added pairwise at the end: a single running
// sum waited on its own addition at every element.
constexpr int64_t ROW_LANES = 32;
inline float row_squares(const float* gr, const float* pr, int64_t cols, float gsign, bool l2, float wd, float k,
                         float* cs) {
  const auto square = [=](int64_t c) {  // (g k)**2 of element c, the gradient as the moments see it
    float x = gr[c] * gsign;
    x = l2 ? std::fma(pr[c], wd, x) : x;
    x = x * k;
    return x * x;
  };
  alignas(64) float part[ROW_LANES] = {};
  const int64_t whole = cols / ROW_LANES * ROW_LANES;
  for (int64_t c0 = 0; c0 < whole; c0 += ROW_LANES) {
#pragma omp simd
    for (int64_t j = 0; j < ROW_LANES; ++j) {
      const float sq = square(c0 + j);
      cs[c0 + j] += sq;
      part[j] += sq;
    }
  }
  for (int64_t j = 0; whole + j < cols; ++j) {
    const float sq = square(whole + j);
    cs[whole + j] += sq;
    part[j] += sq;
  }
  for (int64_t width = ROW_LANES / 2; width >= 1; width /= 2) {
    for (int64_t j = 0; j < width; ++j) part[j] += part[j + width];
  }
  return part[0];
}

FactoredSums factored_sums(const Tensors& t, int64_t rows, int64_t cols, double beta2, double weight_decay,
                           bool decoupled, bool maximize) {
  const float k = static_cast<float>(std::sqrt((1.0 - beta2) / static_cast<double>(std::max(rows, cols))));
  const bool l2 = weight_decay != 0.0 && !decoupled;
  const float wd = static_cast<float>(weight_decay);
  const float gsign = maximize ? -1.0f : 1.0f;
  // the rows in FACTORED_PARTS parts whatever the thread count, so that the sums, and the step, are the same
  // on every machine (a resume on another core count is bit-equal); the threads share the parts
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(FACTORED_PARTS, rows));
  FactoredSums sums{std::vector<float>(rows, 0.0f), std::vector<float>(static_cast<size_t>(parts * cols), 0.0f),
                    parts};
  // 16-bit weights and gradients are widened a row at a time (the master rebuilt from its correction, as
  // load_params does): the same fp32 values as an fp32 working copy's, without one
  at::parallel_for(0, parts, 1, [&](int64_t part0, int64_t part1) {
    std::vector<float> gbuf(t.g_kind == W_FP32 ? 0 : cols), pbuf(t.p_kind == W_FP32 || !l2 ? 0 : cols);
    for (int64_t part = part0; part < part1; ++part) {
      const int64_t r0 = rows * part / parts, r1 = rows * (part + 1) / parts;
      float* cs = sums.col_part.data() + part * cols;
      for (int64_t r = r0; r < r1; ++r) {
        const float* gr = load_grads(t, r * cols, cols, gbuf.data());
        const float* pr = l2 ? load_params(t, r * cols, cols, pbuf.data()) : gr;  // read only under l2
        sums.row_sum[r] = row_squares(gr, pr, cols, gsign, l2, wd, k, cs);
      }
    }
  });
  return sums;
}

// Whether every row sum is finite. Each gradient element adds its non-negative square to one row sum,
// so an inf or a NaN in the gradient makes its row's sum inf or NaN: finite sums mean a finite
// gradient, and the separate test's read of the gradient is saved. The converse does not hold (a
// finite gradient whose squares overflow): non-finite sums send the caller to the exact test.
inline bool sums_finite(const FactoredSums& sums) {
  return !any_nonfinite(sums.row_sum.data(), static_cast<int64_t>(sums.row_sum.size()));
}

void factored_finish(const FactoredSums& sums, float* row, float* col, int64_t rows, int64_t cols, float* rf,
                     float* cf, double bias_correction2, double beta2, double eps_square, double fp32_max) {
  const float b2 = static_cast<float>(beta2);
  const float floor_ = static_cast<float>((1.0 - beta2) * eps_square);
  const float alpha_r = static_cast<float>(static_cast<double>(std::max(rows, cols)) / cols);
  const float alpha_c = static_cast<float>(static_cast<double>(std::max(rows, cols)) / rows);
  const float top = static_cast<float>(fp32_max);
  for (int64_t r = 0; r < rows; ++r) row[r] = std::min(std::fma(sums.row_sum[r], alpha_r, row[r] * b2) + floor_, top);
  for (int64_t c = 0; c < cols; ++c) {
    float sum = 0.0f;
    for (int64_t t = 0; t < sums.parts; ++t) sum += sums.col_part[t * cols + c];
    col[c] = std::min(std::fma(sum, alpha_c, col[c] * b2) + floor_, top);
  }
  float mean = 0.0f;
  const float rows_f = static_cast<float>(rows);
  for (int64_t r = 0; r < rows; ++r) mean += row[r] / rows_f;
  const float bc2 = static_cast<float>(bias_correction2);
  // a moment saturated at fp32's maximum stands for one beyond it (AdamW's v is inf there): its factor is inf,
  // and the updates of its row or column 0 (factored_math.sqrt_factors)
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) rf[r] = row[r] >= top ? inf : std::sqrt((mean > 0.0f ? row[r] / mean : 0.0f) / bc2);
  for (int64_t c = 0; c < cols; ++c) cf[c] = col[c] >= top ? inf : std::sqrt(col[c]);
}

int8_t weight_kind(at::ScalarType t) {
  return t == at::kFloat ? W_FP32 : t == at::kBFloat16 ? W_BF16 : t == at::kHalf ? W_FP16 : -1;
}

void* data_or_null(const std::vector<at::Tensor>& list, size_t i) {
  return list.empty() ? nullptr : list[i].data_ptr();
}

void check_list(const std::vector<at::Tensor>& list, size_t n, const char* name, bool needed) {
  TORCH_CHECK(needed ? list.size() == n : list.empty(), "lightning_baoc step: ", name, " holds ", list.size(),
              " tensors, expected ", needed ? n : 0);
  for (const auto& t : list) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), "lightning_baoc step: ", name,
                " tensors must be contiguous CPU tensors");
  }
}

Scalars scalars_for(bool has_m, double bc1, double bc2, double lr, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, bool maximize) {
  Scalars s;
  s.lr_step = static_cast<float>(has_m ? -lr / bc1 : -lr);
  s.decoupled_decay = weight_decay != 0.0 && decoupled;
  s.l2_decay = weight_decay != 0.0 && !decoupled;
  s.decay = static_cast<float>(1.0 - lr * weight_decay);
  s.l2 = static_cast<float>(weight_decay);
  s.beta2 = static_cast<float>(beta2);
  s.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  const float w = static_cast<float>(1.0 - beta1);
  s.lerp_small = std::fabs(w) < 0.5f;
  s.lerp_coeff = s.lerp_small ? w : w - 1.0f;
  s.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  s.eps = static_cast<float>(eps);
  s.maximize = maximize;
  return s;
}

// One AdamW step of every tensor of a call, in batches of about `batch_elements` gradient elements
// (a larger tensor is a batch of its own), so that the gradients the non-finite test reads are
// still in the cache when the update reads them again.
//
// Per batch: the non-finite test (when `check_finite`); the step counts of each tensor
// (`counts[i]`: int64 [step, momentum step, skipped steps]) advance, or its skip is counted, its
// parameter and state untouched; the bias corrections and the rounding key follow from the new
// counts exactly as the optimizer computes them (optimizer.py `step`); then the factored moments
// and the update. Returns the indices of the tensors skipped, so that the caller reads no tensor to
// learn them.
// One parameter's tensors for a step, checked: its weights and gradient (fp32, or 16-bit with an
// optional int8/int16 correction), its counts and its momentum (kind m_kind). The second-moment and
// factored fields are left empty (adamw_step fills them).
Tensors item_tensors(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_scale,
                     const std::vector<at::Tensor>& m_exp, const std::vector<at::Tensor>& counts,
                     const std::vector<at::Tensor>& corrections, size_t i, int64_t m_kind) {
  static const at::ScalarType m_dtype[] = {at::kFloat, at::kFloat, at::kBFloat16, at::kChar};
  const int64_t numel = params[i].numel();
  const int8_t p_kind = weight_kind(params[i].scalar_type());
  const int8_t g_kind = weight_kind(grads[i].scalar_type());
  TORCH_CHECK(p_kind >= 0 && g_kind >= 0, "lightning_baoc step: parameters and gradients must be fp32, bf16 or fp16");
  const at::Tensor& corr = corrections[i];
  const int8_t corr_bits = corr.numel() == 0 ? 0 : corr.scalar_type() == at::kChar ? 8 : corr.scalar_type() == at::kShort ? 16 : -1;
  TORCH_CHECK(corr_bits >= 0 && (corr_bits == 0 || (p_kind != W_FP32 && corr.numel() == numel)),
              "lightning_baoc step: a correction is an int8 or int16 tensor of a 16-bit parameter's size");
  TORCH_CHECK(grads[i].numel() == numel, "lightning_baoc step: gradient size differs from its parameter");
  TORCH_CHECK(counts[i].scalar_type() == at::kLong && counts[i].numel() == 3, "lightning_baoc step: bad counts");
  if (m_kind != M_NONE) {
    TORCH_CHECK(m[i].numel() == numel && m[i].scalar_type() == m_dtype[m_kind], "lightning_baoc step: bad momentum");
  }
  if (m_kind == M_INT8) {
    TORCH_CHECK(m_scale[i].numel() == (numel + GROUP - 1) / GROUP && m_exp[i].numel() == superblocks(numel) &&
                    m_scale[i].scalar_type() == at::kHalf && m_exp[i].scalar_type() == at::kChar,
                "lightning_baoc step: bad momentum scales");
  }
  return Tensors{p_kind == W_FP32 ? params[i].data_ptr<float>() : nullptr,
                 g_kind == W_FP32 ? grads[i].data_ptr<float>() : nullptr,
                 p_kind == W_FP32 ? nullptr : static_cast<uint16_t*>(params[i].data_ptr()),
                 g_kind == W_FP32 ? nullptr : static_cast<const uint16_t*>(grads[i].data_ptr()),
                 corr_bits ? corr.data_ptr() : nullptr,
                 p_kind, g_kind, corr_bits,
                 data_or_null(m, i),
                 m_kind == M_INT8 ? m_scale[i].data_ptr<at::Half>() : nullptr,
                 m_kind == M_INT8 ? m_exp[i].data_ptr<int8_t>() : nullptr,
                 nullptr, nullptr, nullptr, nullptr, nullptr, numel, 1, 0u, Scalars{}};
}

// The indices [i0, i1) of the next batch from i0: consecutive tensors of at most batch_elements
// elements together (a larger tensor is a batch of its own).
inline size_t batch_end(const std::vector<Tensors>& items, size_t i0, int64_t batch_elements) {
  size_t i1 = i0 + 1;
  int64_t total = items[i0].numel;
  while (i1 < items.size() && total + items[i1].numel <= batch_elements) total += items[i1++].numel;
  return i1;
}

std::vector<int64_t> adamw_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                   const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_scale,
                   const std::vector<at::Tensor>& m_exp, const std::vector<at::Tensor>& v,
                   const std::vector<at::Tensor>& v_scale, const std::vector<at::Tensor>& v_exp,
                   const std::vector<at::Tensor>& rows_state, const std::vector<at::Tensor>& cols_state,
                   const std::vector<at::Tensor>& counts, const std::vector<at::Tensor>& corrections,
                   at::ArrayRef<int64_t> salts, at::ArrayRef<int64_t> offsets, int64_t seed, int64_t m_kind,
                   int64_t v_kind, double lr, double beta1, double beta2, double eps, double weight_decay,
                   bool decoupled, bool maximize, double limit_m, double limit_v, double eps_square, double fp32_max,
                   bool check_finite, int64_t batch_elements) {
  const size_t n = params.size();
  TORCH_CHECK(m_kind >= M_NONE && m_kind <= M_INT8 && v_kind >= V_FP32 && v_kind <= V_FACTORED,
              "lightning_baoc step: unknown kinds ", m_kind, ", ", v_kind);
  TORCH_CHECK(grads.size() == n && salts.size() == n && offsets.size() == n,
              "lightning_baoc step: lists of different lengths");
  check_list(params, n, "params", true);
  check_list(grads, n, "grads", true);
  check_list(m, n, "m", m_kind != M_NONE);
  check_list(m_scale, n, "m_scale", m_kind == M_INT8);
  check_list(m_exp, n, "m_exp", m_kind == M_INT8);
  check_list(v, n, "v", v_kind != V_FACTORED);
  check_list(v_scale, n, "v_scale", v_kind == V_UINT8);
  check_list(v_exp, n, "v_exp", v_kind == V_UINT8);
  check_list(rows_state, n, "rows", v_kind == V_FACTORED);
  check_list(cols_state, n, "cols", v_kind == V_FACTORED);
  check_list(counts, n, "counts", true);
  check_list(corrections, n, "corrections", true);
  const at::ScalarType v_dtype[] = {at::kFloat, at::kBFloat16, at::kByte, at::kFloat};
  const bool has_m = m_kind != M_NONE;
  std::vector<Tensors> items(n);
  for (size_t i = 0; i < n; ++i) {
    Tensors t = item_tensors(params, grads, m, m_scale, m_exp, counts, corrections, i, m_kind);
    const int64_t numel = t.numel;
    if (v_kind != V_FACTORED) {
      TORCH_CHECK(v[i].numel() == numel && v[i].scalar_type() == v_dtype[v_kind],
                  "lightning_baoc step: bad second moment");
    }
    if (v_kind == V_UINT8) {
      TORCH_CHECK(v_scale[i].numel() == (numel + GROUP - 1) / GROUP && v_exp[i].numel() == superblocks(numel) &&
                      v_scale[i].scalar_type() == at::kHalf && v_exp[i].scalar_type() == at::kChar,
                  "lightning_baoc step: bad second-moment scales");
    }
    if (v_kind == V_FACTORED) {
      t.cols = cols_state[i].numel();
      TORCH_CHECK(t.cols > 0 && rows_state[i].numel() * t.cols == numel && rows_state[i].scalar_type() == at::kFloat &&
                      cols_state[i].scalar_type() == at::kFloat,
                  "lightning_baoc step: bad factors");
    }
    t.v = data_or_null(v, i);
    t.v_scale = v_kind == V_UINT8 ? v_scale[i].data_ptr<at::Half>() : nullptr;
    t.v_exp = v_kind == V_UINT8 ? v_exp[i].data_ptr<int8_t>() : nullptr;
    items[i] = t;
  }
  const float lm = static_cast<float>(limit_m), lv = static_cast<float>(limit_v);
  std::vector<int64_t> skipped;
  size_t i0 = 0;
  while (i0 < n) {
    const size_t i1 = batch_end(items, i0, batch_elements);
    // the factored formats test their gradients through their sums (sums_finite), in the same read
    const bool test_apart = check_finite && v_kind != V_FACTORED;
    std::vector<uint8_t> bad = test_apart ? nonfinite_flags(items, i0, i1) : std::vector<uint8_t>(i1 - i0, 0);
    std::vector<Tensors> run;
    std::vector<std::vector<float>> factors;  // row and column factors of the factored tensors
    for (size_t i = i0; i < i1; ++i) {
      int64_t* c = counts[i].data_ptr<int64_t>();
      FactoredSums sums;
      if (v_kind == V_FACTORED) {
        sums = factored_sums(items[i], rows_state[i].numel(), cols_state[i].numel(), beta2, weight_decay,
                             decoupled, maximize);
        bad[i - i0] = check_finite && !sums_finite(sums) && nonfinite_flags(items, i, i + 1)[0];
      }
      if (bad[i - i0]) {
        c[2] += 1;
        skipped.push_back(static_cast<int64_t>(i));
        continue;
      }
      c[0] += 1;
      if (has_m) c[1] += 1;
      const int64_t step = c[0], m_step = c[1];
      const double bc1 = (has_m && m_step) ? 1.0 - std::pow(beta1, static_cast<double>(m_step)) : 1.0;
      const double bc2 = 1.0 - std::pow(beta2, static_cast<double>(step));
      Tensors t = items[i];
      t.key = stream_key(seed, step, salts[i]) + static_cast<uint32_t>(offsets[i]);  // see rounding_bits
      t.s = scalars_for(has_m, bc1, bc2, lr, beta1, beta2, eps, weight_decay, decoupled, maximize);
      if (v_kind == V_FACTORED) {
        const int64_t rows = rows_state[i].numel(), cols = cols_state[i].numel();
        factors.emplace_back(static_cast<size_t>(rows + cols));
        float* rf = factors.back().data();
        factored_finish(sums, rows_state[i].data_ptr<float>(), cols_state[i].data_ptr<float>(), rows, cols, rf,
                        rf + rows, bc2, beta2, eps_square, fp32_max);
        t.row_factor = rf;
        t.col_factor = rf + rows;
      }
      run.push_back(t);
    }
    if (!run.empty()) {
      const SuperblockSteps arithmetic = superblock_steps_for(m_kind, v_kind);
      over_superblocks(run, [&](size_t k, int64_t sb, bool full) {
        (full ? arithmetic.full : arithmetic.partial)(run[k], sb, lm, lv);
      });
    }
    i0 = i1;
  }
  return skipped;
}


// ---- SGD and Lion over one momentum buffer (formats/momentum.py, the reference: chunk_sgd, chunk_lion)

enum Rule : int64_t { RULE_SGD = 1, RULE_LION = 2 };

struct MomentumScalars {
  float gsign;      // -1 under maximize
  float wd;         // SGD: the L2 factor added to the gradient
  float decay;      // Lion: 1 - lr * weight_decay
  float momentum;   // SGD: the momentum; Lion: beta1
  float keep;       // SGD: 1 - dampening; Lion: 1 - beta1
  float beta2;      // Lion
  float one_minus_beta2;
  float neg_lr;
  bool l2;          // SGD: weight_decay != 0
  bool nesterov;
  bool first;       // SGD: the buffer's first step (it starts as the gradient)
};

template <int64_t RULE, int64_t M, bool FULL>
void momentum_superblock(const Tensors& t, const MomentumScalars& s, int64_t sb, float limit_m) {
  const int64_t start = sb * SUPER;
  const int64_t n = FULL ? SUPER : std::min(SUPER, t.numel - start);
  alignas(64) float mbuf[SUPER];
  float scl[SUPER_GROUPS];
  alignas(64) float spread_scale[SUPER];
  alignas(64) float pbuf[SUPER];
  alignas(64) float gbuf[SUPER];
  float* P = load_params(t, start, n, pbuf);
  const float* G = load_grads(t, start, n, gbuf);
  float* mm = load_momentum<M>(t, sb, start, n, mbuf, scl, spread_scale);
  const float gsign = s.gsign, wd = s.wd, decay = s.decay, mom = s.momentum, keep = s.keep, beta2 = s.beta2,
              one_minus_beta2 = s.one_minus_beta2, neg_lr = s.neg_lr;
  const bool l2 = s.l2, nesterov = s.nesterov, first = s.first;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const float g = G[j] * gsign;
    float p = P[j];
    if constexpr (RULE == RULE_SGD) {
      float d = l2 ? std::fma(p, wd, g) : g;
      if constexpr (M != M_NONE) {
        const float b = first ? d : std::fma(d, keep, mm[j] * mom);
        mm[j] = b;
        d = nesterov ? std::fma(b, mom, d) : b;
      }
      p = std::fma(d, neg_lr, p);
    } else {
      p = p * decay;
      if constexpr (M == M_NONE) {
        const float u = static_cast<float>((g > 0.0f) - (g < 0.0f));
        p = std::fma(u, neg_lr, p);
      } else {
        const float m0 = mm[j];
        const float c = std::fma(g, keep, m0 * mom);
        const float u = static_cast<float>((c > 0.0f) - (c < 0.0f));
        p = std::fma(u, neg_lr, p);
        mm[j] = std::fma(g, one_minus_beta2, m0 * beta2);
      }
    }
    P[j] = p;
  }
  if (t.p_kind != W_FP32) store_master(t, start, n, pbuf);
  store_momentum<M>(t, sb, start, n, mbuf, limit_m, scl, spread_scale);
}

// The SGD or Lion arithmetic of one super-block in momentum kind M (whole, or a tensor's last, partial one),
// chosen once per call by momentum_step, as superblock_steps_for is by adamw_step.
using MomentumSuperblockStep = void (*)(const Tensors&, const MomentumScalars&, int64_t, float);
struct MomentumSuperblockSteps {
  MomentumSuperblockStep full, partial;
};

template <int64_t RULE, int64_t M>
MomentumSuperblockSteps momentum_superblock_steps() {
  return {&momentum_superblock<RULE, M, true>, &momentum_superblock<RULE, M, false>};
}

MomentumSuperblockSteps momentum_superblock_steps_for(int64_t rule, int64_t m_kind) {
  switch (rule * 4 + m_kind) {
    case RULE_SGD * 4 + M_NONE: return momentum_superblock_steps<RULE_SGD, M_NONE>();
    case RULE_SGD * 4 + M_FP32: return momentum_superblock_steps<RULE_SGD, M_FP32>();
    case RULE_SGD * 4 + M_BF16: return momentum_superblock_steps<RULE_SGD, M_BF16>();
    case RULE_SGD * 4 + M_INT8: return momentum_superblock_steps<RULE_SGD, M_INT8>();
    case RULE_LION * 4 + M_NONE: return momentum_superblock_steps<RULE_LION, M_NONE>();
    case RULE_LION * 4 + M_FP32: return momentum_superblock_steps<RULE_LION, M_FP32>();
    case RULE_LION * 4 + M_BF16: return momentum_superblock_steps<RULE_LION, M_BF16>();
    case RULE_LION * 4 + M_INT8: return momentum_superblock_steps<RULE_LION, M_INT8>();
    default: TORCH_CHECK(false, "lightning_baoc momentum step: no kernel for rule ", rule, " and momentum kind ", m_kind);
  }
}

// One SGD or Lion step of every parameter (the formats of formats/momentum.py): the gradients tested
// for inf and NaN in batches, the counts advanced (or the skip counted), the skipped indices returned.
std::vector<int64_t> momentum_step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                                   const std::vector<at::Tensor>& m, const std::vector<at::Tensor>& m_scale,
                                   const std::vector<at::Tensor>& m_exp, const std::vector<at::Tensor>& counts,
                                   const std::vector<at::Tensor>& corrections, at::ArrayRef<int64_t> salts,
                                   at::ArrayRef<int64_t> offsets,
                                   int64_t seed, int64_t rule, int64_t m_kind, double lr, double momentum,
                                   double beta2, double weight_decay, double dampening, bool nesterov, bool maximize,
                                   double limit_m, bool check_finite, int64_t batch_elements) {
  const size_t n = params.size();
  TORCH_CHECK((rule == RULE_SGD || rule == RULE_LION) && m_kind >= M_NONE && m_kind <= M_INT8,
              "lightning_baoc momentum step: unknown rule ", rule, " or momentum kind ", m_kind);
  TORCH_CHECK(grads.size() == n && salts.size() == n && offsets.size() == n,
              "lightning_baoc momentum step: lists of different lengths");
  check_list(params, n, "params", true);
  check_list(grads, n, "grads", true);
  check_list(m, n, "m", m_kind != M_NONE);
  check_list(m_scale, n, "m_scale", m_kind == M_INT8);
  check_list(m_exp, n, "m_exp", m_kind == M_INT8);
  check_list(counts, n, "counts", true);
  check_list(corrections, n, "corrections", true);
  const bool has_m = m_kind != M_NONE;
  std::vector<Tensors> items(n);
  for (size_t i = 0; i < n; ++i) items[i] = item_tensors(params, grads, m, m_scale, m_exp, counts, corrections, i, m_kind);
  MomentumScalars base;
  base.gsign = maximize ? -1.0f : 1.0f;
  base.wd = static_cast<float>(weight_decay);
  base.l2 = weight_decay != 0.0;
  base.decay = rule == RULE_LION ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  base.momentum = static_cast<float>(momentum);
  base.keep = static_cast<float>(rule == RULE_SGD ? 1.0 - dampening : 1.0 - momentum);
  base.beta2 = static_cast<float>(beta2);
  base.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  base.neg_lr = static_cast<float>(-lr);
  base.nesterov = nesterov;
  // SGD without momentum keeps no buffer (the eager step's test `buf is not None and momentum != 0`)
  const int64_t kind = (rule == RULE_SGD && momentum == 0.0) ? M_NONE : m_kind;
  const float lm = static_cast<float>(limit_m);
  std::vector<int64_t> skipped;
  size_t i0 = 0;
  while (i0 < n) {
    const size_t i1 = batch_end(items, i0, batch_elements);
    std::vector<uint8_t> bad = check_finite ? nonfinite_flags(items, i0, i1) : std::vector<uint8_t>(i1 - i0, 0);
    std::vector<Tensors> run;
    std::vector<MomentumScalars> run_scalars;
    for (size_t i = i0; i < i1; ++i) {
      int64_t* c = counts[i].data_ptr<int64_t>();
      if (bad[i - i0]) {
        c[2] += 1;
        skipped.push_back(static_cast<int64_t>(i));
        continue;
      }
      c[0] += 1;
      if (has_m) c[1] += 1;
      Tensors t = items[i];
      t.key = stream_key(seed, c[0], salts[i]) + static_cast<uint32_t>(offsets[i]);
      MomentumScalars s = base;
      s.first = c[1] <= 1;
      run.push_back(t);
      run_scalars.push_back(s);
    }
    if (!run.empty()) {
      const MomentumSuperblockSteps arithmetic = momentum_superblock_steps_for(rule, kind);
      over_superblocks(run, [&](size_t k, int64_t sb, bool full) {
        (full ? arithmetic.full : arithmetic.partial)(run[k], run_scalars[k], sb, lm);
      });
    }
    i0 = i1;
  }
  return skipped;
}

}  // namespace

TORCH_LIBRARY(lightning_baoc, lib) {
  lib.def(
      "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m, Tensor(c!)[] m_scale, Tensor(d!)[] m_exp, "
      "Tensor(e!)[] v, Tensor(f!)[] v_scale, Tensor(g!)[] v_exp, Tensor(h!)[] rows, Tensor(i!)[] cols, "
      "Tensor(j!)[] counts, Tensor(k!)[] corrections, int[] salts, int[] offsets, int seed, int m_kind, int v_kind, float lr, float beta1, float beta2, "
      "float eps, float weight_decay, bool decoupled, bool maximize, float limit_m, float limit_v, "
      "float eps_square, float fp32_max, bool check_finite, int batch_elements) -> int[]");
  lib.def(
      "momentum_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] m, Tensor(c!)[] m_scale, Tensor(d!)[] m_exp, "
      "Tensor(e!)[] counts, Tensor(f!)[] corrections, int[] salts, int[] offsets, int seed, int rule, int m_kind, float lr, "
      "float momentum, float beta2, float weight_decay, float dampening, bool nesterov, bool maximize, "
      "float limit_m, bool check_finite, int batch_elements) -> int[]");
}

TORCH_LIBRARY_IMPL(lightning_baoc, CPU, lib) {
  lib.impl("adamw_step", &adamw_step);
  lib.impl("momentum_step", &momentum_step);
}
