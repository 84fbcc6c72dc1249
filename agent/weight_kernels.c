/* Weight kernels: int8 weights times a few activation rows (the output layer in decode), and below, int4
 * weights times activations quantized per group (every int4 layer, a decoder layer in two calls).
 *
 * int8 weights: int8 codes [n_out][k] with one float scale per group of 32 inputs ([n_out][k / 32]), i.e.
 * GGUF Q8_0's layout; w[n][k] = codes[n][k] * scales[n][k / 32]. Activations and outputs are float32 and
 * the sums are float32, so the result equals a float32 matmul with the dequantized weights up to the
 * order of the additions. Each group of codes is widened once into registers and used for every row.
 * Built by cache/native.py with the KV kernels. The vector code (kernel_math.h: AVX-512, or AVX2 with
 * FMA and F16C) reads a quarter of a float32 matmul's bytes and beats it; callers ask `q8_fast` first, and
 * the scalar code elsewhere keeps the result defined for the tests. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../cache/kernel_math.h"
#include "../cache/attention_kernels.h"

#define GROUP 32
#define MAX_ROWS 8

#define CHUNKS (GROUP / VLEN) /* vectors a group */

#ifdef PALACE_VECTOR
/* One row of activations against four outputs at a time (four independent sums: one output's adds do not
 * wait on each other's). Outputs [first, last) of n_out, last - first a multiple of 4. Each group's products are
 * summed, then scaled. */
static void q8_row4(const float *x, int k, const int8_t *codes, const float *scales, int first, int last, int n_out,
                    float *out) {
    const int groups = k / GROUP;
    for (int n = first; n < last; n += 4) {
        /* four short rows are four streams too short for the hardware prefetcher to learn: fetch the rows
         * two steps ahead (their lines are contiguous) while these are summed */
        const char *ahead = (const char *)(codes + (int64_t)(n + 8) * k);
        for (int line = 0; line < 4 * k && n + 12 <= n_out; line += 64) __builtin_prefetch(ahead + line);
        vfloat acc[4];
        for (int j = 0; j < 4; j++) acc[j] = vzero();
        for (int g = 0; g < groups; g++) {
            vfloat xs[CHUNKS];
            for (int c = 0; c < CHUNKS; c++) xs[c] = vload(x + g * GROUP + c * VLEN);
            for (int j = 0; j < 4; j++) {
                const int8_t *w = codes + (int64_t)(n + j) * k + g * GROUP;
                vfloat part = vmul(xs[0], vfrom_i8(w));
                for (int c = 1; c < CHUNKS; c++) part = vfma(xs[c], vfrom_i8(w + c * VLEN), part);
                acc[j] = vfma(part, vset1(scales[(int64_t)(n + j) * groups + g]), acc[j]);
            }
        }
        for (int j = 0; j < 4; j++) out[n + j] = vsum(acc[j]);
    }
}
#endif

/* out[m][n] for rows m < rows (at most MAX_ROWS) and outputs n in [first, last). */
static void q8_block(const float *x, int rows, int k, const int8_t *codes, const float *scales, int first, int last,
                     float *out, int n_out) {
    const int groups = k / GROUP;
    for (int n = first; n < last; n++) {
        const int8_t *row = codes + (int64_t)n * k;
        const float *scale = scales + (int64_t)n * groups;
#ifdef PALACE_VECTOR
        vfloat acc[MAX_ROWS];
        for (int m = 0; m < rows; m++) acc[m] = vzero();
        for (int g = 0; g < groups; g++) {
            const vfloat s = vset1(scale[g]);
            vfloat w[CHUNKS];
            for (int c = 0; c < CHUNKS; c++) w[c] = vmul(vfrom_i8(row + g * GROUP + c * VLEN), s);
            for (int m = 0; m < rows; m++) {
                const float *xm = x + (int64_t)m * k + g * GROUP;
                for (int c = 0; c < CHUNKS; c++) acc[m] = vfma(vload(xm + c * VLEN), w[c], acc[m]);
            }
        }
        for (int m = 0; m < rows; m++) out[(int64_t)m * n_out + n] = vsum(acc[m]);
#else
        for (int m = 0; m < rows; m++) {
            const float *xm = x + (int64_t)m * k;
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                float part = 0.0f;
                for (int i = 0; i < GROUP; i++) part += xm[g * GROUP + i] * (float)row[g * GROUP + i];
                total += part * scale[g];
            }
            out[(int64_t)m * n_out + n] = total;
        }
#endif
    }
}

/* out [rows][n_out] = x [rows][k] @ dequantized weights^T; k a multiple of 32. */
void q8_matmul(const float *x, int rows, int k, const int8_t *codes, const float *scales, int n_out, float *out,
               int threads) {
    for (int m0 = 0; m0 < rows; m0 += MAX_ROWS) {
        const int count = rows - m0 < MAX_ROWS ? rows - m0 : MAX_ROWS;
        const int blocks = (n_out + 63) / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int b = 0; b < blocks; b++) {
            const int first = b * 64, last = first + 64 < n_out ? first + 64 : n_out;
#ifdef PALACE_VECTOR
            if (count == 1 && last - first == 64) {
                q8_row4(x + (int64_t)m0 * k, k, codes, scales, first, last, n_out, out + (int64_t)m0 * n_out);
                continue;
            }
#endif
            q8_block(x + (int64_t)m0 * k, count, k, codes, scales, first, last, out + (int64_t)m0 * n_out, n_out);
        }
    }
}



/* ---- Float32 rows times weights read narrow and widened in registers, float32 sums: bfloat16 weights (the
 * sentence embedder's layers on a CPU without bfloat16 arithmetic) and Q4_1 codes (the embedded model's own
 * weights, exactly) ----
 *
 * Why: at a few dozen rows a float32 product is bound by reading its weights (24 products of the embedder, 16
 * rows: 5.9 ms with MKL on a 2-core AVX2 EPYC, about 55 GFLOP/s). Read as bfloat16 they are half the bytes,
 * widened by a shift; as Q4_1 codes an eighth, widened by code * scale + minimum, which gives back the
 * embedded model's float32 weights bit for bit (the GGUF's scales and minimums are float16, and code * scale is
 * exact in float32). The sums are float32: a float32 product of the weights as widened, up to the order of
 * the additions.
 *
 * Layout (w16_pack, q4f_pack in cache/native.py): blocks of W16_OUT outputs, each by input: bfloat16
 * [k][W16_OUT]; Q4_1 codes [k][W16_OUT / 2] (byte j: output j in the low nibble, output j + W16_OUT / 2 in the
 * high one) with float32 scales and minimums [k / 32][2][W16_OUT]. A tile is W16_OUT outputs by W16_ROWS rows,
 * its sums in 2 x W16_ROWS registers: per input, two widened weight vectors and one broadcast of each row's
 * activation feed 2 x W16_ROWS multiply-adds, and no sum is reduced across lanes. Q4_1 blocks are widened once
 * into a float32 buffer when more than one tile of rows reads them. */
#define W16_ROWS 6
#ifdef PALACE_VECTOR
#define W16_OUT (2 * VLEN)
#else
#define W16_OUT 16
#endif
#define Q4F_GROUP 32
enum widen { WIDEN_BF16, WIDEN_F32, WIDEN_Q4 };

#ifdef PALACE_VECTOR
/* Input i's weights for the block's W16_OUT outputs, as two vectors. */
static inline __attribute__((always_inline)) void widen_at(const enum widen kind, const void *w, const float *params,
                                                           int i, vfloat *first, vfloat *second) {
    if (kind == WIDEN_BF16) {
        const uint16_t *p = (const uint16_t *)w + (int64_t)i * W16_OUT;
        *first = vfrom_bf16(p);
        *second = vfrom_bf16(p + VLEN);
    } else if (kind == WIDEN_F32) {
        const float *p = (const float *)w + (int64_t)i * W16_OUT;
        *first = vload(p);
        *second = vload(p + VLEN);
    } else {
        const uint8_t *p = (const uint8_t *)w + (int64_t)i * (W16_OUT / 2);
        const float *scale = params + (int64_t)(i / Q4F_GROUP) * 2 * W16_OUT, *low = scale + W16_OUT;
#if VLEN == 16
        const __m128i bytes = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
        const vint lo = _mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask));
        const vint hi = _mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
#else
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
        const vint lo = _mm256_cvtepu8_epi32(_mm_and_si128(bytes, mask));
        const vint hi = _mm256_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask));
#endif
        *first = vfma(vfrom_i32(lo), vload(scale), vload(low));
        *second = vfma(vfrom_i32(hi), vload(scale + VLEN), vload(low + VLEN));
    }
}
#endif

/* One weight of the block, one at a time (the scalar code's reading of the same layouts). */
static inline float widen_one(const enum widen kind, const void *w, const float *params, int i, int o) {
    if (kind == WIDEN_BF16) return bf16_to_float(((const uint16_t *)w)[(int64_t)i * W16_OUT + o]);
    if (kind == WIDEN_F32) return ((const float *)w)[(int64_t)i * W16_OUT + o];
    const uint8_t byte = ((const uint8_t *)w)[(int64_t)i * (W16_OUT / 2) + o % (W16_OUT / 2)];
    const float *scale = params + (int64_t)(i / Q4F_GROUP) * 2 * W16_OUT;
    return fmaf((float)(o < W16_OUT / 2 ? byte & 15 : byte >> 4), scale[o], scale[W16_OUT + o]);
}

static inline __attribute__((always_inline)) void widened_tile(const enum widen kind, const float *x, const int rows,
                                                               int k, const void *w, const float *params,
                                                               const float *bias, const float *residual, float *out,
                                                               int n_out) {
#ifdef PALACE_VECTOR
    vfloat low[W16_ROWS], high[W16_ROWS];
    for (int m = 0; m < rows; m++) {
        low[m] = residual ? vload(residual + (int64_t)m * n_out) : vzero();
        high[m] = residual ? vload(residual + (int64_t)m * n_out + VLEN) : vzero();
        if (bias) {
            low[m] = vadd(low[m], vload(bias));
            high[m] = vadd(high[m], vload(bias + VLEN));
        }
    }
    for (int i = 0; i < k; i++) {
        vfloat u, v;
        widen_at(kind, w, params, i, &u, &v);
        for (int m = 0; m < rows; m++) {
            const vfloat xm = vset1(x[(int64_t)m * k + i]);
            low[m] = vfma(xm, u, low[m]);
            high[m] = vfma(xm, v, high[m]);
        }
    }
    for (int m = 0; m < rows; m++) {
        vstore(out + (int64_t)m * n_out, low[m]);
        vstore(out + (int64_t)m * n_out + VLEN, high[m]);
    }
#else
    for (int m = 0; m < rows; m++)
        for (int o = 0; o < W16_OUT; o++) {
            float total = (residual ? residual[(int64_t)m * n_out + o] : 0.0f) + (bias ? bias[o] : 0.0f);
            for (int i = 0; i < k; i++) total += x[(int64_t)m * k + i] * widen_one(kind, w, params, i, o);
            out[(int64_t)m * n_out + o] = total;
        }
#endif
}

/* The row tiles of one block over its weights; constant row counts, so each tile's sums stay in registers. */
static inline __attribute__((always_inline)) void widened_block(const enum widen kind, const float *x, int rows, int k,
                                                                const void *w, const float *params, const float *bias,
                                                                const float *residual, float *out, int n_out) {
    for (int m0 = 0; m0 < rows; m0 += W16_ROWS) {
        const float *tile = x + (int64_t)m0 * k, *added = residual ? residual + (int64_t)m0 * n_out : NULL;
        float *target = out + (int64_t)m0 * n_out;
        switch (rows - m0 < W16_ROWS ? rows - m0 : W16_ROWS) {
        case 6: widened_tile(kind, tile, 6, k, w, params, bias, added, target, n_out); break;
        case 5: widened_tile(kind, tile, 5, k, w, params, bias, added, target, n_out); break;
        case 4: widened_tile(kind, tile, 4, k, w, params, bias, added, target, n_out); break;
        case 3: widened_tile(kind, tile, 3, k, w, params, bias, added, target, n_out); break;
        case 2: widened_tile(kind, tile, 2, k, w, params, bias, added, target, n_out); break;
        default: widened_tile(kind, tile, 1, k, w, params, bias, added, target, n_out);
        }
    }
}

/* out [rows][n_out] = x [rows][k] @ w^T (+ bias [n_out]), w bfloat16 in the layout above; n_out a multiple of
 * W16_OUT. A block's weights stay in L1/L2 while its row tiles pass. */
void w16_matmul(const float *x, int rows, int k, const uint16_t *w, const float *bias, int n_out, float *out,
                int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < n_out / W16_OUT; b++)
        widened_block(WIDEN_BF16, x, rows, k, w + (int64_t)b * k * W16_OUT, NULL, bias ? bias + b * W16_OUT : NULL,
                      NULL, out + b * W16_OUT, n_out);
}

/* The same for Q4_1 codes and their float32 scales and minimums (layout above; k a multiple of 32), plus
 * `residual` [rows][n_out] where given (a layer's residual stream). Returns 0, or -1 when a buffer could not be
 * allocated. */
int q4f_matmul(const float *x, int rows, int k, const uint8_t *codes, const float *params, const float *bias,
               const float *residual, int n_out, float *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        float *widened = rows > W16_ROWS ? aligned_alloc(64, (size_t)k * W16_OUT * sizeof(float)) : NULL;
        failed = rows > W16_ROWS && !widened;
#pragma omp for schedule(static)
        for (int b = 0; b < n_out / W16_OUT; b++) {
            const uint8_t *block = codes + (int64_t)b * k * (W16_OUT / 2);
            const float *scales = params + (int64_t)b * (k / Q4F_GROUP) * 2 * W16_OUT;
            const float *shift = bias ? bias + b * W16_OUT : NULL, *added = residual ? residual + b * W16_OUT : NULL;
            if (failed) continue;
            if (!widened) {
                widened_block(WIDEN_Q4, x, rows, k, block, scales, shift, added, out + b * W16_OUT, n_out);
                continue;
            }
            for (int i = 0; i < k; i++) {
#ifdef PALACE_VECTOR
                vfloat u, v;
                widen_at(WIDEN_Q4, block, scales, i, &u, &v);
                vstore(widened + (int64_t)i * W16_OUT, u);
                vstore(widened + (int64_t)i * W16_OUT + VLEN, v);
#else
                for (int o = 0; o < W16_OUT; o++) widened[(int64_t)i * W16_OUT + o] = widen_one(WIDEN_Q4, block, scales, i, o);
#endif
            }
            widened_block(WIDEN_F32, x, rows, k, widened, NULL, shift, added, out + b * W16_OUT, n_out);
        }
        free(widened);
    }
    return failed ? -1 : 0;
}

/* Outputs a block of the widened kernels' layouts (w16_pack and q4f_pack lay the weights out by it). */
int w16_block(void) { return W16_OUT; }

/* 1 where the kernel above is faster than a float32 matmul of the same weights (built with vector code). */
int q8_fast(void) {
#ifdef PALACE_VECTOR
    return 1;
#else
    return 0;
#endif
}

/* ---- int4 weights times activations quantized per group: integer dot products (decode and prefill) ----
 *
 * Weights: 4-bit codes c with one scale s and one minimum m per output and group of 32 inputs (GGUF Q4_1:
 * w = c * s + m), in a layout made for VNNI's dot product of unsigned by signed bytes (vpdpbusd): for each
 * block of 16 outputs and each group, four 64-byte vectors; byte 4 * o + j of vector v holds output o's
 * code for input 4 * v + j in its low nibble and for input 16 + 4 * v + j in its high nibble, so one
 * vpdpbusd against 4 broadcast activation bytes adds 4 products into each output's lane (AVX2 reads each
 * 64 bytes as two vectors of 8 outputs and does the same with vpmaddubsw and vpmaddwd). Scales and
 * minimums are float16: [blocks][groups][2][16] (16 scales, then 16 minimums).
 *
 * Activations: each group of 32 is quantized twice to int8 (llama.cpp's Q8 with a second pass over the
 * rest): x ~ d1 * q1 + d2 * q2, the second level carrying what the first rounded away, so the error is
 * about 1/127^2 of the group's largest value (one level alone moved 2.4 % of this model's top-1 tokens).
 * Per output and group: s * (d1 * sum(c * q1) + d2 * sum(c * q2)) + m * sum(x), summed in float32. */
#define Q4_BLOCK 16            /* outputs per block */
#define Q4_GROUP_BYTES 256     /* one block's codes for one group: 16 outputs x 32 inputs x 4 bits */
#define Q4_TILE 4              /* activation rows that share one unpacking of a group's codes */

/* One row's groups as two int8 levels (q1 then q2, k bytes each) and per group d1, d2 and the sum. */
static void q4_quantize_row(const float *x, int k, int8_t *q, float *stats) {
    for (int g = 0; g < k / GROUP; g++) {
        const float *xg = x + g * GROUP;
        float rest[GROUP], top = 0.0f, sum = 0.0f;
        for (int i = 0; i < GROUP; i++) { top = fmaxf(top, fabsf(xg[i])); sum += xg[i]; }
        const float d1 = top / 127.0f, inv1 = top > 0.0f ? 127.0f / top : 0.0f;
        float top2 = 0.0f;
        for (int i = 0; i < GROUP; i++) {
            const float level = rintf(xg[i] * inv1);
            q[g * GROUP + i] = (int8_t)level;
            rest[i] = xg[i] - level * d1;
            top2 = fmaxf(top2, fabsf(rest[i]));
        }
        const float d2 = top2 / 127.0f, inv2 = top2 > 0.0f ? 127.0f / top2 : 0.0f;
        for (int i = 0; i < GROUP; i++) q[k + g * GROUP + i] = (int8_t)fmaxf(-127.0f, fminf(127.0f, rintf(rest[i] * inv2)));
        stats[3 * g] = d1, stats[3 * g + 1] = d2, stats[3 * g + 2] = sum;
    }
}

/* Each lane's dot product of its 32 codes (w: 8 vectors holding 4 codes a lane, in the layout above) with
 * one group's 32 activations q, as int32: one instruction a vector with VNNI, two without. */
#if defined(PALACE_VECTOR) && defined(__AVX512VNNI__)
#define Q4_DOT 1
static inline vint q4_bcast(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
static inline vint q4_load(const uint8_t *p) { return _mm512_loadu_si512(p); }
static inline vint q4_low(vint v) { return _mm512_and_si512(v, _mm512_set1_epi8(0x0f)); }
static inline vint q4_high(vint v) { return q4_low(_mm512_srli_epi16(v, 4)); }
static inline vint q4_group_dot(const vint w[8], const int8_t *q) {
    vint a = _mm512_setzero_si512(), b = a;
    for (int v = 0; v < 4; v++) {
        a = _mm512_dpbusd_epi32(a, w[v], q4_bcast(q + 4 * v));
        b = _mm512_dpbusd_epi32(b, w[4 + v], q4_bcast(q + 16 + 4 * v));
    }
    return _mm512_add_epi32(a, b);
}
#elif defined(PALACE_VECTOR) && !defined(__AVX512F__)
#define Q4_DOT 1
static inline vint q4_bcast(const int8_t *p) { int32_t v; memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline vint q4_load(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vint q4_low(vint v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0f)); }
static inline vint q4_high(vint v) { return q4_low(_mm256_srli_epi16(v, 4)); }
static inline vint q4_group_dot(const vint w[8], const int8_t *q) {
    /* AVX2: pairs of products summed as int16 (each at most 2 * 15 * 127, so eight such sums still fit),
     * then widened to int32 pairwise once */
    vint sum = _mm256_setzero_si256();
    for (int v = 0; v < 4; v++) {
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[v], q4_bcast(q + 4 * v)));
        sum = _mm256_add_epi16(sum, _mm256_maddubs_epi16(w[4 + v], q4_bcast(q + 16 + 4 * v)));
    }
    return _mm256_madd_epi16(sum, _mm256_set1_epi16(1));
}
#endif

#ifdef Q4_DOT
/* `tile` rows (1..Q4_TILE, a constant where inlined) against one block of 16 outputs, VLEN outputs at a time. */
static inline __attribute__((always_inline)) void q4_tile(const int8_t *q, const float *stats, int k, const uint8_t *codes,
                                                            const uint16_t *scales, const float *residual, float *out,
                                                            int n_out, const int tile) {
    const int groups = k / GROUP;
    for (int h = 0; h < Q4_BLOCK / VLEN; h++) {
        vfloat y[Q4_TILE];
        for (int r = 0; r < tile; r++) y[r] = vzero();
        for (int g = 0; g < groups; g++) {
            vint w[8];
            for (int v = 0; v < 4; v++) {
                const vint packed = q4_load(codes + (int64_t)g * Q4_GROUP_BYTES + 64 * v + 4 * VLEN * h);
                w[v] = q4_low(packed);
                w[4 + v] = q4_high(packed);
            }
            const vfloat s = vfrom_half(scales + 32 * g + VLEN * h), m = vfrom_half(scales + 32 * g + 16 + VLEN * h);
            for (int r = 0; r < tile; r++) {
                const int8_t *q1 = q + (int64_t)r * 2 * k + g * GROUP, *q2 = q1 + k;
                const float *st = stats + ((int64_t)r * groups + g) * 3;
                const vfloat dot = vfma(vfrom_i32(q4_group_dot(w, q1)), vset1(st[0]), vmul(vfrom_i32(q4_group_dot(w, q2)), vset1(st[1])));
                y[r] = vfma(m, vset1(st[2]), vfma(dot, s, y[r]));
            }
        }
        for (int r = 0; r < tile; r++) {
            float *o = out + (int64_t)r * n_out + VLEN * h;
            vstore(o, residual ? vadd(y[r], vload(residual + (int64_t)r * n_out + VLEN * h)) : y[r]);
        }
    }
}
#endif

/* Rows [0, rows) of quantized activations against one block of 16 outputs, written at out[row][0..16)
 * (plus residual[row][0..16) where given). */
static void q4_block(const int8_t *q, const float *stats, int rows, int k, const uint8_t *codes, const uint16_t *scales,
                     const float *residual, float *out, int n_out) {
    const int groups = k / GROUP;
#ifdef Q4_DOT
    int r = 0;
    for (; r + Q4_TILE <= rows; r += Q4_TILE)
        q4_tile(q + (int64_t)r * 2 * k, stats + (int64_t)r * groups * 3, k, codes, scales,
                residual ? residual + (int64_t)r * n_out : NULL, out + (int64_t)r * n_out, n_out, Q4_TILE);
    for (; r < rows; r++)
        q4_tile(q + (int64_t)r * 2 * k, stats + (int64_t)r * groups * 3, k, codes, scales,
                residual ? residual + (int64_t)r * n_out : NULL, out + (int64_t)r * n_out, n_out, 1);
#else
    for (int r = 0; r < rows; r++) {
        const int8_t *q1 = q + (int64_t)r * 2 * k, *q2 = q1 + k;
        const float *st = stats + (int64_t)r * groups * 3;
        for (int o = 0; o < Q4_BLOCK; o++) {
            float total = 0.0f;
            for (int g = 0; g < groups; g++) {
                int32_t dot1 = 0, dot2 = 0;
                for (int i = 0; i < GROUP; i++) {
                    const int v = (i % 16) / 4, j = i % 4;
                    const uint8_t byte = codes[(int64_t)g * Q4_GROUP_BYTES + 64 * v + 4 * o + j];
                    const int code = i < 16 ? byte & 0x0f : byte >> 4;
                    dot1 += code * q1[g * GROUP + i], dot2 += code * q2[g * GROUP + i];
                }
                const float s = half_to_float(scales[32 * g + o]), m = half_to_float(scales[32 * g + 16 + o]);
                total += s * (st[3 * g] * (float)dot1 + st[3 * g + 1] * (float)dot2) + m * st[3 * g + 2];
            }
            out[(int64_t)r * n_out + o] = residual ? residual[(int64_t)r * n_out + o] + total : total;
        }
    }
#endif
}

/* The row a layer multiplies: x's k values, or with `swiglu` silu(gate) * up of x's 2k values (gate first), then
 * with `norm` RMS-normalized and scaled by it (Llama's RMSNorm: x * rsqrt(mean(x^2) + eps) * weight). */
static void prepare_row(const float *x, int k, int swiglu, const float *norm, float eps, float *row) {
    int i = 0;
    if (swiglu) {
#ifdef PALACE_VECTOR
        for (; i + VLEN <= k; i += VLEN) {  /* gate / (1 + exp(-gate)) * up, a vector at a time */
            const vfloat gate = vload(x + i);
            const vfloat sigmoid = vadd(vset1(1.0f), vexp(vsub(vzero(), gate)));
            vstore(row + i, vmul(vdiv(gate, sigmoid), vload(x + k + i)));
        }
#endif
        for (; i < k; i++) row[i] = x[i] / (1.0f + expf(-x[i])) * x[k + i];
    } else {
        memcpy(row, x, (size_t)k * sizeof(float));
    }
    if (!norm) return;
    float lanes[16] = {0}, squares = 0.0f;  /* sixteen partial sums: the compiler vectorizes them */
    for (i = 0; i + 16 <= k; i += 16)
        for (int j = 0; j < 16; j++) lanes[j] += row[i + j] * row[i + j];
    for (; i < k; i++) squares += row[i] * row[i];
    for (int j = 0; j < 16; j++) squares += lanes[j];
    const float inverse = 1.0f / sqrtf(squares / (float)k + eps);
    for (i = 0; i < k; i++) row[i] = norm[i] * (row[i] * inverse);
}

/* Scratch for one product's quantized activations, sized for `rows` rows of up to `k` inputs. */
typedef struct { int8_t *q; float *stats, *prepared; } q4_scratch;

static int q4_scratch_alloc(q4_scratch *s, int rows, int k) {
    s->q = malloc((size_t)rows * 2 * k);
    s->stats = malloc((size_t)rows * (k / GROUP) * 3 * sizeof(float));
    s->prepared = malloc((size_t)rows * k * sizeof(float));
    return s->q && s->stats && s->prepared ? 0 : -1;
}

static void q4_scratch_free(q4_scratch *s) { free(s->q); free(s->stats); free(s->prepared); }

/* out [rows][n_out] = residual + prepared(x) [rows][k] @ the int4 weights^T (layout above), x being
 * [rows][swiglu ? 2k : k]; norm and residual may be NULL. Called by every thread of a parallel region
 * (its loops are shared out among them and end on a barrier). */
static void q4_product(const float *x, int rows, int k, int swiglu, const float *norm, float eps, const uint8_t *codes,
                       const uint16_t *scales, int n_out, const float *residual, float *out, const q4_scratch *s) {
    const int groups = k / GROUP, width = swiglu ? 2 * k : k;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        float *row = s->prepared + (int64_t)r * k;
        prepare_row(x + (int64_t)r * width, k, swiglu, norm, eps, row);
        q4_quantize_row(row, k, s->q + (int64_t)r * 2 * k, s->stats + (int64_t)r * groups * 3);
    }
#pragma omp for schedule(static)
    for (int b = 0; b < n_out / Q4_BLOCK; b++)
        q4_block(s->q, s->stats, rows, k, codes + (int64_t)b * groups * Q4_GROUP_BYTES, scales + (int64_t)b * groups * 32,
                 residual ? residual + b * Q4_BLOCK : NULL, out + b * Q4_BLOCK, n_out);
}

/* Rotary embedding of the first `rotated` outputs of each row, head by head (Llama's rotate_half:
 * x * cos + (-x[i + half] or x[i - half]) * sin), with cos and sin [rows][head_dim] of each row's position.
 * The same products and sum as transformers' apply_rotary_pos_emb (ISO C: no fused multiply-adds). */
static void rotate_heads(float *out, int rows, int n_out, int rotated, int head_dim, const float *cos, const float *sin) {
    const int half = head_dim / 2;
#pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        for (int h = 0; h < rotated; h += head_dim) {
            float *x = out + (int64_t)r * n_out + h, turned[head_dim];
            for (int i = 0; i < head_dim; i++) {
                const float other = i < half ? -x[i + half] : x[i - half];
                turned[i] = x[i] * c[i] + other * s[i];
            }
            memcpy(x, turned, (size_t)head_dim * sizeof(float));
        }
    }
}

/* One product (see q4_product), then with cos (and sin) given the rotation of its first `rotated` outputs:
 * a decoder layer's norm, queries, keys and values and their rotation in one call, or any single product.
 * Returns 0, or -1 when the scratch buffers cannot be allocated (out is then untouched). */
int q4_matmul(const float *x, int rows, int k, int swiglu, const float *norm, float eps, const uint8_t *codes,
              const uint16_t *scales, int n_out, const float *residual, const float *cos, const float *sin, int rotated,
              int head_dim, float *out, int threads) {
    q4_scratch s;
    if (q4_scratch_alloc(&s, rows, k)) { q4_scratch_free(&s); return -1; }
#pragma omp parallel num_threads(threads)
    {
        q4_product(x, rows, k, swiglu, norm, eps, codes, scales, n_out, residual, out, &s);
        if (cos) rotate_heads(out, rows, n_out, rotated, head_dim, cos, sin);
    }
    q4_scratch_free(&s);
    return 0;
}

/* A decoder layer's steps after attention, by every thread of a parallel region: mid = stream + attended @ o^T,
 * gated = its RMS norm through gate and up, out = mid + SwiGLU(gated) @ down^T (mid [rows][d] and gated
 * [rows][2 ff] are the caller's scratch). */
static void q4_after_attention(const float *attended, const float *stream, int rows, int d, int ff,
                               const uint8_t *o_codes, const uint16_t *o_scales, const float *norm, float eps,
                               const uint8_t *gate_up_codes, const uint16_t *gate_up_scales, const uint8_t *down_codes,
                               const uint16_t *down_scales, float *mid, float *gated, float *out, const q4_scratch *s) {
    q4_product(attended, rows, d, 0, NULL, 0.0f, o_codes, o_scales, d, stream, mid, s);
    q4_product(mid, rows, d, 0, norm, eps, gate_up_codes, gate_up_scales, 2 * ff, NULL, gated, s);
    q4_product(gated, rows, ff, 1, NULL, 0.0f, down_codes, down_scales, d, mid, out, s);
}

/* A Llama decoder layer after attention, in one call: stream + attended @ o^T, then its RMS norm through the
 * gate and up projections (gate_up: 2 * ff outputs, gate first), SwiGLU, the down projection and the
 * residual add. attended and stream are [rows][d]; the new stream is written to out [rows][d]. */
int q4_mlp(const float *attended, const float *stream, int rows, int d, int ff, const uint8_t *o_codes,
           const uint16_t *o_scales, const float *norm, float eps, const uint8_t *gate_up_codes,
           const uint16_t *gate_up_scales, const uint8_t *down_codes, const uint16_t *down_scales, float *out, int threads) {
    q4_scratch s;
    float *mid = malloc((size_t)rows * d * sizeof(float)), *gated = malloc((size_t)rows * 2 * ff * sizeof(float));
    if (q4_scratch_alloc(&s, rows, d > ff ? d : ff) || !mid || !gated) { q4_scratch_free(&s); free(mid); free(gated); return -1; }
#pragma omp parallel num_threads(threads)
    q4_after_attention(attended, stream, rows, d, ff, o_codes, o_scales, norm, eps, gate_up_codes, gate_up_scales,
                       down_codes, down_scales, mid, gated, out, &s);
    q4_scratch_free(&s);
    free(mid);
    free(gated);
    return 0;
}

/* The float32 weights [n_out][k] of int4 codes in the layout above (c * s + m, rounded as GGUF's own
 * dequantization rounds it): many rows (prefill) multiply faster through a float matmul of these than through
 * the integer dots, whose two activation levels cost about twice a float multiply-add per weight. */
void q4_dense(const uint8_t *codes, const uint16_t *scales, int n_out, int k, float *out, int threads) {
    const int groups = k / GROUP;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int b = 0; b < n_out / Q4_BLOCK; b++)
        for (int g = 0; g < groups; g++) {
            const uint8_t *c = codes + ((int64_t)b * groups + g) * Q4_GROUP_BYTES;
            const uint16_t *sc = scales + ((int64_t)b * groups + g) * 32;
            for (int o = 0; o < Q4_BLOCK; o++) {
                const float s = half_to_float(sc[o]), m = half_to_float(sc[16 + o]);
                float *row = out + (int64_t)(b * Q4_BLOCK + o) * k + g * GROUP;
#ifdef __AVX2__
                /* the output's 16 bytes (4 from each vector v): low nibbles are inputs 0..15, high ones 16..31 */
                int32_t word[4];
                for (int v = 0; v < 4; v++) memcpy(word + v, c + 64 * v + 4 * o, 4);
                const __m128i bytes = _mm_loadu_si128((const __m128i *)word), nibble = _mm_set1_epi8(0x0f);
                const __m128i halves[2] = {_mm_and_si128(bytes, nibble), _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)};
                const __m256 scale = _mm256_set1_ps(s), low = _mm256_set1_ps(m);
                for (int i = 0; i < 4; i++) {  /* products then sums, as GGUF rounds them (no fused multiply-add) */
                    const __m128i part = i & 1 ? _mm_srli_si128(halves[i / 2], 8) : halves[i / 2];
                    const __m256 code = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(part));
                    _mm256_storeu_ps(row + 8 * i, _mm256_add_ps(_mm256_mul_ps(code, scale), low));
                }
                continue;
#endif
                for (int v = 0; v < 4; v++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t byte = c[64 * v + 4 * o + j];
                        row[4 * v + j] = (float)(byte & 0x0f) * s + m;
                        row[16 + 4 * v + j] = (float)(byte >> 4) * s + m;
                    }
            }
        }
}

/* A decoder layer's int4 weights (q4_matmul's layout; qkv and gate_up fused) and norms, built once a layer by
 * agent/lean.py (its ctypes twin is native.Q4Layer). */
typedef struct {
    const uint8_t *qkv_codes, *o_codes, *gate_up_codes, *down_codes;
    const uint16_t *qkv_scales, *o_scales, *gate_up_scales, *down_scales;
    const float *norm_in, *norm_post;
    float eps_in, eps_post;
    int d, ff, heads, kv_heads, head_dim;
} q4_layer;

/* One decode token through a decoder layer over its float32 KV buffers, in one parallel region: the input
 * norm, queries, keys and values and their rotation (cos, sin [head_dim] of the token's position); the new
 * key and value written at row `length` of keys and values ([kv_heads] heads head_stride floats apart, rows
 * head_dim apart); attention over rows [0, length]; then q4_mlp's steps. stream [d] in, the new stream to
 * out [d]; mass (may be NULL) [length + 1] gains the attention weights summed over heads. Returns 0, or -1
 * when the scratch cannot be allocated or the heads are beyond the attention kernel's limits (nothing
 * written then). */
int q4_decode_layer(const q4_layer *w, const float *stream, const float *cos, const float *sin, float *keys,
                    float *values, int64_t head_stride, int length, float scale, float *mass, float *out, int threads) {
    const int hd = w->head_dim, q_size = w->heads * hd, kv_size = w->kv_heads * hd, n_qkv = q_size + 2 * kv_size;
    q4_scratch s;
    attend_scratch a;
    float *qkv = malloc((size_t)n_qkv * sizeof(float)), *attended = malloc((size_t)q_size * sizeof(float));
    float *mid = malloc((size_t)w->d * sizeof(float)), *gated = malloc((size_t)2 * w->ff * sizeof(float));
    const int ready = !q4_scratch_alloc(&s, 1, w->d > w->ff ? w->d : w->ff) && qkv && attended && mid && gated;
    const int attending = ready && attend_scratch_alloc(&a, w->heads, w->kv_heads, hd, length + 1, threads);
    if (attending) {
#pragma omp parallel num_threads(threads)
        {
            q4_product(stream, 1, w->d, 0, w->norm_in, w->eps_in, w->qkv_codes, w->qkv_scales, n_qkv, NULL, qkv, &s);
            rotate_heads(qkv, 1, n_qkv, q_size + kv_size, hd, cos, sin);
#pragma omp for schedule(static)
            for (int h = 0; h < w->kv_heads; h++) {
                memcpy(keys + h * head_stride + (int64_t)length * hd, qkv + q_size + h * hd, (size_t)hd * sizeof(float));
                memcpy(values + h * head_stride + (int64_t)length * hd, qkv + q_size + kv_size + h * hd, (size_t)hd * sizeof(float));
            }
            attend_team(qkv, w->heads, w->kv_heads, hd, keys, values, head_stride, length + 1, scale, attended, mass, 1, &a);
            q4_after_attention(attended, stream, 1, w->d, w->ff, w->o_codes, w->o_scales, w->norm_post, w->eps_post,
                               w->gate_up_codes, w->gate_up_scales, w->down_codes, w->down_scales, mid, gated, out, &s);
        }
        attend_scratch_free(&a);
    }
    q4_scratch_free(&s);
    free(qkv);
    free(attended);
    free(mid);
    free(gated);
    return attending ? 0 : -1;
}

/* For float layers (their products stay torch's): prepare_row over rows [rows][swiglu ? 2k : k] into
 * out [rows][k] (a decoder layer's RMS norm, or its SwiGLU), and the rotation of queries and keys in place. */
void prepare_rows(const float *x, int rows, int k, int swiglu, const float *norm, float eps, float *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int r = 0; r < rows; r++) prepare_row(x + (int64_t)r * (swiglu ? 2 * k : k), k, swiglu, norm, eps, out + (int64_t)r * k);
}

void rotate_rows(float *x, int rows, int n, int rotated, int head_dim, const float *cos, const float *sin, int threads) {
#pragma omp parallel num_threads(threads) if (rows > 1)
    rotate_heads(x, rows, n, rotated, head_dim, cos, sin);
}

/* 1 where q4_matmul uses integer dot products (built with AVX-512 VNNI, or AVX2 without AVX-512), else its
 * scalar reference runs. */
int q4_fast(void) {
#ifdef Q4_DOT
    return 1;
#else
    return 0;
#endif
}
