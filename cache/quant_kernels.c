/* Quantized KV attention for a few queries (decode), reading the codes once: each row of codes is
 * decoded into registers-sized float runs and consumed at once, so no float copy of the chunk is ever
 * written (torch's ops need one pass per step: widen, shift, mask, convert, multiply).
 *
 * Codes: kind 8 = uint8 levels, 4 = two uint8 levels per byte (low nibble first), 0 = float8 e4m3fn,
 * decoded as value / 256 (its bits moved into a float16; the caller's `unit` restores the scale).
 * Scales and zero points are float16 bit patterns. Built by cache/native.py; scalar code wherever
 * AVX2 + F16C are missing, so any C compiler builds it. */
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "kernel_math.h"

static inline float decode_one(const uint8_t *codes, int i, int kind) {
    if (kind == 8) return (float)codes[i];
    if (kind == 4) return (float)((codes[i / 2] >> (4 * (i & 1))) & 0x0F);
    /* e4m3 byte -> float16 bits: sign to bit 15, exponent and mantissa to bits 7-13 */
    int16_t widened = (int8_t)codes[i];
    return half_to_float((uint16_t)((widened * 128) & 0xBFFF));
}

/* Channels [0, n) of one row of codes as floats. */
static void decode_row(const uint8_t *codes, int n, int kind, float *out) {
    int i = 0;
#if defined(__AVX2__) && defined(__F16C__)
    if (kind == 8) {
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + i)))));
    } else if (kind == 0) {
        const __m128i keep = _mm_set1_epi16((short)0xBFFF);
        for (; i + 8 <= n; i += 8) {
            __m128i bits = _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(codes + i)));
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(bits, 7), keep)));
        }
    } else {
        const __m128i nibble = _mm_set1_epi8(0x0F);
        for (; i + 16 <= n; i += 16) {
            __m128i packed = _mm_loadl_epi64((const __m128i *)(codes + i / 2));
            __m128i levels = _mm_unpacklo_epi8(_mm_and_si128(packed, nibble), _mm_and_si128(_mm_srli_epi16(packed, 4), nibble));
            _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(levels)));
            _mm256_storeu_ps(out + i + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(levels, 8))));
        }
    }
#endif
    for (; i < n; i++) out[i] = decode_one(codes, i, kind);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* The dot products of one query row with 8 rows of `block` ([8][dim], dim a multiple of 8), as one vector. */
static inline __m256 dot8(const float *query, const float *block, int dim) {
    __m256 acc[8];
    for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
    for (int d = 0; d < dim; d += 8) {
        const __m256 q = _mm256_loadu_ps(query + d);
        for (int i = 0; i < 8; i++) acc[i] = _mm256_fmadd_ps(q, _mm256_loadu_ps(block + i * dim + d), acc[i]);
    }
    const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
    const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
    const __m256 low = _mm256_hadd_ps(s01, s23), high = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}
#endif

/* Keys quantized per channel over groups of tokens, a row of codes per token, read in runs of rows that
 * share a group and the shift they owe (see cache/quant.py, QuantRows and KeyShifts).
 * query [heads][rows][dim] float32; codes: head h, token t at codes + h*code_head + t*row_bytes; run i
 * covers tokens [run_start[i], run_start[i+1]) of group run_group[i] and shift run_shift[i];
 * scale/zero [heads][groups][dim] with head stride scale_head (zero may be NULL); shift_cos/shift_sin
 * [shifts][dim/2], shift 0 none. out [heads][rows][tokens]: query . R(shift)(levels * scale * unit + zero)
 * = R(-shift) query . (...), the rotation and the scale folded into the query once per run. */
void key_scores(const float *query, int heads, int rows, int dim, const uint8_t *codes, int64_t code_head,
                int runs, const int32_t *run_start, const int32_t *run_group, const int32_t *run_shift, int kind,
                const uint16_t *scale, const uint16_t *zero, int64_t scale_head, const float *shift_cos,
                const float *shift_sin, float unit, float *out, int threads) {
    const int row_bytes = kind == 4 ? dim / 2 : dim, half = dim / 2;
    const int64_t tokens = run_start[runs];
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int h = 0; h < heads; h++) {
        for (int i = 0; i < runs; i++) {
            float folded[rows * dim], offset[rows], levels[dim], turned[dim];
            const int g = run_group[i], u = run_shift[i], first = run_start[i], stop = run_start[i + 1];
            const uint16_t *s = scale + h * scale_head + (int64_t)g * dim;
            const uint16_t *z = zero ? zero + h * scale_head + (int64_t)g * dim : NULL;
            const float *c = shift_cos + (int64_t)u * half, *sn = shift_sin + (int64_t)u * half;
            for (int r = 0; r < rows; r++) {
                const float *q = query + ((int64_t)h * rows + r) * dim;
                if (u) { /* R(-shift) q: each channel pair (d, d + half) turned back by its angle */
                    for (int d = 0; d < half; d++) {
                        turned[d] = q[d] * c[d] + q[d + half] * sn[d];
                        turned[d + half] = q[d + half] * c[d] - q[d] * sn[d];
                    }
                    q = turned;
                }
                float sum = 0.0f;
                for (int d = 0; d < dim; d++) {
                    folded[r * dim + d] = q[d] * half_to_float(s[d]) * unit;
                    if (z) sum += q[d] * half_to_float(z[d]);
                }
                offset[r] = sum;
            }
            int t = first;
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
            if (dim % 8 == 0) {
                for (; t + 8 <= stop; t += 8) {
                    float block[8 * dim];
                    for (int k = 0; k < 8; k++)
                        decode_row(codes + h * code_head + (int64_t)(t + k) * row_bytes, dim, kind, block + k * dim);
                    for (int r = 0; r < rows; r++) {
                        __m256 sums = dot8(folded + r * dim, block, dim);
                        sums = _mm256_add_ps(sums, _mm256_set1_ps(offset[r]));
                        _mm256_storeu_ps(out + ((int64_t)h * rows + r) * tokens + t, sums);
                    }
                }
            }
#endif
            for (; t < stop; t++) {
                decode_row(codes + h * code_head + (int64_t)t * row_bytes, dim, kind, levels);
                for (int r = 0; r < rows; r++) {
                    const float *f = folded + r * dim;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int d = 0; d < dim; d++) acc += f[d] * levels[d];
                    out[((int64_t)h * rows + r) * tokens + t] = acc + offset[r];
                }
            }
        }
    }
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
/* `value_weighted` for query rows [first, first + count), count <= 3, 32 channels: the 3 x 4 accumulators
 * stay in registers. */
static inline void value_rows32(const float *weights, int rows, int tokens, int first, const int count,
                                const uint8_t *codes, int64_t stride, int kind, const uint16_t *scale,
                                const uint16_t *zero, int64_t scale_stride, float unit, float *out, int width) {
    __m256 acc[3][4];
    float offset[3] = {0.0f, 0.0f, 0.0f}, levels[32];
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < 4; k++) acc[i][k] = _mm256_setzero_ps();
    for (int n = 0; n < tokens; n++) {
        decode_row(codes + n * stride, 32, kind, levels);
        const float s = half_to_float(scale[n * scale_stride]) * unit, z = zero ? half_to_float(zero[n * scale_stride]) : 0.0f;
        for (int i = 0; i < count; i++) {
            const float w = weights[(int64_t)(first + i) * tokens + n];
            const __m256 ws = _mm256_set1_ps(w * s);
            offset[i] += w * z;
            for (int k = 0; k < 4; k++) acc[i][k] = _mm256_fmadd_ps(ws, _mm256_loadu_ps(levels + 8 * k), acc[i][k]);
        }
    }
    for (int i = 0; i < count; i++)
        for (int k = 0; k < 4; k++)
            _mm256_storeu_ps(out + (int64_t)(first + i) * width + 8 * k, _mm256_add_ps(acc[i][k], _mm256_set1_ps(offset[i])));
}
#endif

/* Values quantized per token over groups of `channels` channels.
 * weights [heads][rows][tokens] float32; codes: head h, token n, channel group j at codes + h*code_head +
 * (n*channel_groups + j)*group_bytes; scale/zero [heads][tokens][channel_groups] with head stride
 * scale_head (zero may be NULL). out [heads][rows][channel_groups*channels]: weights @ dequantized values. */
void value_weighted(const float *weights, int heads, int rows, int tokens, const uint8_t *codes, int64_t code_head,
                    int channel_groups, int channels, int kind, const uint16_t *scale, const uint16_t *zero,
                    int64_t scale_head, float unit, float *out, int threads) {
    const int group_bytes = kind == 4 ? channels / 2 : channels;
    const int width = channel_groups * channels;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int h = 0; h < heads; h++) {
        for (int j = 0; j < channel_groups; j++) {
#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
            if (channels == 32) {
                const float *w = weights + (int64_t)h * rows * tokens;
                const uint8_t *c = codes + h * code_head + (int64_t)j * group_bytes;
                const uint16_t *s = scale + h * scale_head + j, *z = zero ? zero + h * scale_head + j : NULL;
                float *o = out + (int64_t)h * rows * width + (int64_t)j * channels;
                int r = 0;
                for (; r + 3 <= rows; r += 3)
                    value_rows32(w, rows, tokens, r, 3, c, (int64_t)channel_groups * group_bytes, kind, s, z,
                                 channel_groups, unit, o, width);
                for (; r < rows; r++)
                    value_rows32(w, rows, tokens, r, 1, c, (int64_t)channel_groups * group_bytes, kind, s, z,
                                 channel_groups, unit, o, width);
                continue;
            }
#endif
            float acc[rows * channels], offset[rows], levels[channels];
            memset(acc, 0, sizeof(acc));
            memset(offset, 0, sizeof(offset));
            for (int n = 0; n < tokens; n++) {
                const int64_t at = h * scale_head + (int64_t)n * channel_groups + j;
                decode_row(codes + h * code_head + ((int64_t)n * channel_groups + j) * group_bytes, channels, kind, levels);
                const float s = half_to_float(scale[at]) * unit, z = zero ? half_to_float(zero[at]) : 0.0f;
                for (int r = 0; r < rows; r++) {  /* w . (levels * s + z) = (w * s) . levels + w * z */
                    const float w = weights[((int64_t)h * rows + r) * tokens + n];
                    const float ws = w * s;
                    float *a = acc + r * channels;
                    offset[r] += w * z;
#pragma omp simd
                    for (int c = 0; c < channels; c++) a[c] += ws * levels[c];
                }
            }
            for (int r = 0; r < rows; r++)
                for (int c = 0; c < channels; c++) acc[r * channels + c] += offset[r];
            for (int r = 0; r < rows; r++)
                memcpy(out + ((int64_t)h * rows + r) * width + (int64_t)j * channels, acc + r * channels, channels * sizeof(float));
        }
    }
}
