/* The bfloat16 glue of a decoder layer, around its products: the RMS norms, the rotation of queries and keys,
 * and SwiGLU, each one pass over its rows instead of five to eight torch ops, each a pass over memory of its
 * own (at a 3,000-token prefill on the README's AMX Xeon the glue took a fifth of the forward). Every torch
 * op rounds its result to bfloat16; these kernels round the same values at the same points, so they agree
 * with the module path bit for bit (a mean summed in aten's order, exp to its last float bit where the
 * rounding to bfloat16 hides it). Built by cache/native.py with the other kernels. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "../cache/kernel_math.h"

#define SUM_LANES 8 /* aten's float32 sum kernel's width: measured on an AVX-512 CPU (16 lanes did not give its
                          * sums, 8 gave every one), and torch's vectors are 8 floats wide on AVX2 */

/* The sum of a row's squares as aten sums a contiguous float32 row: vectors of SUM_LANES in four interleaved
 * accumulators, cascaded in levels of 16 steps, then the leftover vectors and values, then the lanes in
 * order. Summed so, the norm rounds bit for bit as the module path's `pow(2).mean(-1)`. Each lane's adds keep
 * their order, so the compiler may vectorize across lanes. */
static float square_sum(const uint16_t *row, int k) {
    const int vectors = k / SUM_LANES, steps = vectors / 4;
    int level_power = 4;
    while (4 * level_power + 4 < 31 && (1 << (4 * level_power + 4)) < steps) level_power++;  /* max(4, ceil(log2(steps)) / 4) */
    const int level_step = 1 << level_power, level_mask = level_step - 1;
    float acc[4][4][SUM_LANES] = {{{0}}};
#define ADD_SQUARES(into, v)                                                       \
    for (int l = 0; l < SUM_LANES; l++) {                                          \
        const float x_ = bf16_to_float(row[(int64_t)(v) * SUM_LANES + l]);        \
        (into)[l] += x_ * x_;                                                      \
    }
    int i = 0;
    while (i + level_step <= steps) {
        for (int j = 0; j < level_step; j++, i++)
            for (int r = 0; r < 4; r++) { ADD_SQUARES(acc[0][r], 4 * i + r) }
        for (int j = 1; j < 4; j++) {
            for (int r = 0; r < 4; r++)
                for (int l = 0; l < SUM_LANES; l++) {
                    acc[j][r][l] += acc[j - 1][r][l];
                    acc[j - 1][r][l] = 0.0f;
                }
            if (i & (level_mask << (j * level_power))) break;
        }
    }
    for (; i < steps; i++)
        for (int r = 0; r < 4; r++) { ADD_SQUARES(acc[0][r], 4 * i + r) }
    for (int j = 1; j < 4; j++)
        for (int r = 0; r < 4; r++)
            for (int l = 0; l < SUM_LANES; l++) acc[0][r][l] += acc[j][r][l];
    for (int v = 4 * steps; v < vectors; v++) { ADD_SQUARES(acc[0][0], v) }
#undef ADD_SQUARES
    for (int r = 1; r < 4; r++)
        for (int l = 0; l < SUM_LANES; l++) acc[0][0][l] += acc[0][r][l];
    float total = 0.0f;
    for (int t = vectors * SUM_LANES; t < k; t++) total += bf16_to_float(row[t]) * bf16_to_float(row[t]);
    for (int l = 0; l < SUM_LANES; l++) total += acc[0][0][l];
    return total;
}

/* out[r] = weight * bf16(x[r] * (1 / sqrt(mean(x[r]^2) + eps))): LlamaRMSNorm over rows [rows][k] */
void bf16_rms_norm(const uint16_t *x, int rows, int k, const uint16_t *weight, float eps, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t *row = x + (int64_t)r * k;
        uint16_t *dst = out + (int64_t)r * k;
        const float inverse = 1.0f / sqrtf(square_sum(row, k) / (float)k + eps);
        int i = 0;
#ifdef PALACE_VECTOR
        for (; i + VLEN <= k; i += VLEN) {
            const vfloat normed = vround_bf16(vmul(vfrom_bf16(row + i), vset1(inverse)));
            vstore_bf16(dst + i, vround_bf16(vmul(vfrom_bf16(weight + i), normed)));
        }
#endif
        for (; i < k; i++) dst[i] = bf16_bits(round_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(row[i]) * inverse)));
    }
}

/* out[r] = bf16(silu(gate)) * up, rounded, for rows [rows][2k] holding gate then up */
void bf16_swiglu(const uint16_t *x, int rows, int k, uint16_t *out, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const uint16_t *gate = x + (int64_t)r * 2 * k, *up = gate + k;
        uint16_t *dst = out + (int64_t)r * k;
        int i = 0;
#ifdef PALACE_VECTOR
        for (; i + VLEN <= k; i += VLEN) {
            const vfloat g = vfrom_bf16(gate + i);
            const vfloat silu = vround_bf16(vdiv(g, vadd(vset1(1.0f), vexp(vsub(vzero(), g)))));
            vstore_bf16(dst + i, vround_bf16(vmul(silu, vfrom_bf16(up + i))));
        }
#endif
        for (; i < k; i++) {
            const float g = bf16_to_float(gate[i]);
            dst[i] = bf16_bits(round_bf16(round_bf16(g / (1.0f + expf(-g))) * bf16_to_float(up[i])));
        }
    }
}

/* In place: the first `rotated` columns of x [rows][n] turned head by head (Llama's rotate_half: x * cos +
 * (-x[i + half] or x[i - half]) * sin), cos and sin [rows][head_dim] float32 holding bfloat16 values; each
 * product and the sum rounded as torch rounds them. */
void bf16_rotate(uint16_t *x, int rows, int n, int rotated, int head_dim, const float *cos, const float *sin, int threads) {
    const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 8)
    for (int r = 0; r < rows; r++) {
        const float *c = cos + (int64_t)r * head_dim, *s = sin + (int64_t)r * head_dim;
        for (int h = 0; h < rotated; h += head_dim) {
            uint16_t *head = x + (int64_t)r * n + h;
            int i = 0;
#ifdef PALACE_VECTOR
            for (; i + VLEN <= half; i += VLEN) {
                const vfloat a = vfrom_bf16(head + i), b = vfrom_bf16(head + half + i);
                const vfloat first = vadd(vround_bf16(vmul(a, vload(c + i))), vround_bf16(vmul(vsub(vzero(), b), vload(s + i))));
                const vfloat second = vadd(vround_bf16(vmul(b, vload(c + half + i))), vround_bf16(vmul(a, vload(s + half + i))));
                vstore_bf16(head + i, vround_bf16(first));
                vstore_bf16(head + half + i, vround_bf16(second));
            }
#endif
            for (; i < half; i++) {
                const float a = bf16_to_float(head[i]), b = bf16_to_float(head[half + i]);
                head[i] = bf16_bits(round_bf16(round_bf16(a * c[i]) + round_bf16(-b * s[i])));
                head[half + i] = bf16_bits(round_bf16(round_bf16(b * c[half + i]) + round_bf16(a * s[half + i])));
            }
        }
    }
}
