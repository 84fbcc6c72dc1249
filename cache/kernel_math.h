/* Small math shared by the native kernels: float16 bit patterns to float (F16C where the CPU has it), and a
 * float vector of VLEN lanes (AVX-512: 16, else AVX2 with FMA and F16C: 8) with exp, so the dense kernels
 * are written once for both instruction sets. PALACE_VECTOR is defined where one of them is present;
 * elsewhere the kernels keep their scalar loops. */
#ifndef PALACE_KERNEL_MATH_H
#define PALACE_KERNEL_MATH_H
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

static inline float half_to_float(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (!mantissa) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

#if defined(__AVX512F__)
#define PALACE_VECTOR 1
#define VLEN 16
typedef __m512 vfloat;
typedef __m512i vint;
static inline vfloat vload(const float *p) { return _mm512_loadu_ps(p); }
static inline void vstore(float *p, vfloat v) { _mm512_storeu_ps(p, v); }
static inline vfloat vset1(float x) { return _mm512_set1_ps(x); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
static inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm512_div_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm512_min_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm512_max_ps(a, b); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }   /* a * b + c */
static inline vfloat vfnma(vfloat a, vfloat b, vfloat c) { return _mm512_fnmadd_ps(a, b, c); } /* c - a * b */
static inline float vsum(vfloat v) { return _mm512_reduce_add_ps(v); }
static inline vfloat vfrom_i8(const int8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
static inline vfloat vfrom_i32(vint v) { return _mm512_cvtepi32_ps(v); }
static inline vfloat vfrom_half(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline vfloat vround(vfloat x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT); }
static inline vfloat vscale2(vfloat p, vfloat n) { return _mm512_scalef_ps(p, n); } /* p * 2^n */
#define EXP_FLOOR -103.0f /* scalef goes through the subnormals */
/* bfloat16 <-> float: a bfloat16 is a float's upper half. vround_bf16 rounds to the nearest bfloat16 (even on
 * ties, NaN to 0x7FC0: torch's rounding) and keeps it as a float; vstore_bf16 stores such values' upper halves. */
static inline vfloat vfrom_bf16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
static inline vfloat vround_bf16(vfloat v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)), _mm512_set1_epi32(0x7FFF));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32((int)0xFFFF0000u));
    return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000)));
}
static inline void vstore_bf16(uint16_t *p, vfloat rounded) {
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16)));
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PALACE_VECTOR 1
#define VLEN 8
typedef __m256 vfloat;
typedef __m256i vint;
static inline vfloat vload(const float *p) { return _mm256_loadu_ps(p); }
static inline void vstore(float *p, vfloat v) { _mm256_storeu_ps(p, v); }
static inline vfloat vset1(float x) { return _mm256_set1_ps(x); }
static inline vfloat vadd(vfloat a, vfloat b) { return _mm256_add_ps(a, b); }
static inline vfloat vsub(vfloat a, vfloat b) { return _mm256_sub_ps(a, b); }
static inline vfloat vmul(vfloat a, vfloat b) { return _mm256_mul_ps(a, b); }
static inline vfloat vdiv(vfloat a, vfloat b) { return _mm256_div_ps(a, b); }
static inline vfloat vmin(vfloat a, vfloat b) { return _mm256_min_ps(a, b); }
static inline vfloat vmax(vfloat a, vfloat b) { return _mm256_max_ps(a, b); }
static inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm256_fmadd_ps(a, b, c); }
static inline vfloat vfnma(vfloat a, vfloat b, vfloat c) { return _mm256_fnmadd_ps(a, b, c); }
static inline float vsum(vfloat v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline vfloat vfrom_i8(const int8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
static inline vfloat vfrom_i32(vint v) { return _mm256_cvtepi32_ps(v); }
static inline vfloat vfrom_half(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline vfloat vround(vfloat x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vfloat vscale2(vfloat p, vfloat n) { /* p * 2^n, n in [-126, 127]: n written into a float's exponent */
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23)));
}
#define EXP_FLOOR -87.0f /* keeps 2^n normal */
static inline vfloat vfrom_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
static inline vfloat vround_bf16(vfloat v) {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i bias = _mm256_add_epi32(_mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1)), _mm256_set1_epi32(0x7FFF));
    const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(bits, bias), _mm256_set1_epi32((int)0xFFFF0000u));
    return _mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
static inline void vstore_bf16(uint16_t *p, vfloat rounded) {
    const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(rounded), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(high), _mm256_extracti128_si256(high, 1)));
}
#endif

/* bfloat16 <-> float one at a time (round_bf16 as vround_bf16; a float so rounded is stored by its upper half) */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
static inline float round_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    bits = (bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC00000u : (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
    memcpy(&f, &bits, 4);
    return f;
}
static inline uint16_t bf16_bits(float rounded) {
    uint32_t bits;
    memcpy(&bits, &rounded, 4);
    return (uint16_t)(bits >> 16);
}

#ifdef PALACE_VECTOR
static inline vfloat vzero(void) { return vset1(0.0f); }

/* exp of VLEN floats: a degree-6 polynomial on x - n ln 2, scaled by 2^n (relative error ~1e-7; results under
 * exp(EXP_FLOOR) are that floor's value, which softmax weights and SiLU never notice). */
static inline vfloat vexp(vfloat x) {
    x = vmax(vmin(x, vset1(88.0f)), vset1(EXP_FLOOR));
    const vfloat n = vround(vmul(x, vset1(1.44269504f)));
    vfloat r = vfnma(n, vset1(0.693359375f), x);  /* ln 2 in two parts: r = x - n ln 2 */
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vfloat p = vset1(1.0f / 720);
    p = vfma(p, r, vset1(1.0f / 120));
    p = vfma(p, r, vset1(1.0f / 24));
    p = vfma(p, r, vset1(1.0f / 6));
    p = vfma(p, r, vset1(0.5f));
    p = vfma(p, r, vset1(1.0f));
    p = vfma(p, r, vset1(1.0f));
    return vscale2(p, n);
}
#endif

#endif
