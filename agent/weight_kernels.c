/* Weight-only int8 matrix-vector products for a few activation rows (decode), reading each weight once.
 *
 * Weights: int8 codes [n_out][k] with one float scale per group of 32 inputs ([n_out][k / 32]), i.e.
 * GGUF Q8_0's layout; w[n][k] = codes[n][k] * scales[n][k / 32]. Activations and outputs are float32 and
 * the sums are float32, so the result equals a float32 matmul with the dequantized weights up to the
 * order of the additions. Each group of codes is widened once into registers and used for every row.
 * Built by cache/native.py with the KV kernels. Only the AVX-512 code beats a float32 matmul (an AVX2
 * version measured 1.4x slower: widening int8 is the bound), so callers ask `q8_fast` first; the
 * scalar code elsewhere keeps the result defined for the tests. */
#include <stdint.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#define GROUP 32
#define MAX_ROWS 8

#if defined(__AVX512F__)
/* One row of activations against four outputs at a time: eight independent sums, so the adds of one
 * output do not wait on each other. Outputs [first, last), last - first a multiple of 4. */
static void q8_row4(const float *x, int k, const int8_t *codes, const float *scales, int first, int last, float *out) {
    const int groups = k / GROUP;
    for (int n = first; n < last; n += 4) {
        __m512 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            const __m512 x0 = _mm512_loadu_ps(x + g * GROUP), x1 = _mm512_loadu_ps(x + g * GROUP + 16);
            for (int j = 0; j < 4; j++) {
                const int8_t *c = codes + (int64_t)(n + j) * k + g * GROUP;
                const __m512 s = _mm512_set1_ps(scales[(int64_t)(n + j) * groups + g]);
                const __m512 x0s = _mm512_mul_ps(x0, s), x1s = _mm512_mul_ps(x1, s);
                acc[2 * j] = _mm512_fmadd_ps(x0s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))), acc[2 * j]);
                acc[2 * j + 1] = _mm512_fmadd_ps(x1s, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)))), acc[2 * j + 1]);
            }
        }
        for (int j = 0; j < 4; j++) out[n + j] = _mm512_reduce_add_ps(_mm512_add_ps(acc[2 * j], acc[2 * j + 1]));
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
#if defined(__AVX512F__)
        __m512 acc[MAX_ROWS];
        for (int m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g++) {
            const int8_t *c = row + g * GROUP;
            const __m512 s = _mm512_set1_ps(scale[g]);
            const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)c))), s);
            const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(c + 16)))), s);
            for (int m = 0; m < rows; m++) {
                const float *xm = x + (int64_t)m * k + g * GROUP;
                acc[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), w1, _mm512_fmadd_ps(_mm512_loadu_ps(xm), w0, acc[m]));
            }
        }
        for (int m = 0; m < rows; m++) out[(int64_t)m * n_out + n] = _mm512_reduce_add_ps(acc[m]);
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
#if defined(__AVX512F__)
            if (count == 1 && last - first == 64) {
                q8_row4(x + (int64_t)m0 * k, k, codes, scales, first, last, out + (int64_t)m0 * n_out);
                continue;
            }
#endif
            q8_block(x + (int64_t)m0 * k, count, k, codes, scales, first, last, out + (int64_t)m0 * n_out, n_out);
        }
    }
}


/* 1 where the kernel above is faster than a float32 matmul of the same weights (built with AVX-512). */
int q8_fast(void) {
#if defined(__AVX512F__)
    return 1;
#else
    return 0;
#endif
}
