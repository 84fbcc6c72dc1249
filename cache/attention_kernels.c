/* Attention of one new token per head over a float32 layer (decode), in one pass per KV head.
 *
 * Why: for a single query, torch's SDPA (flash attention on CPU) costs 60 us a layer at a few hundred cached
 * tokens, mostly set-up; this model's 30 layers made that a fifth of an int4 token's time. Here the query
 * heads that share a KV head (GQA) read its keys and values together: one sweep of the keys for their
 * scores, a softmax, one sweep of the values. With `mass`, the attention each key receives (summed over
 * the group's heads: what H2O and the hybrid record) comes out of the same softmax.
 *
 * Layout: keys and values [kv_heads][capacity][dim], `head_stride` floats apart, tokens `dim` floats
 * apart; query and out [heads][dim], query head h reading KV head h / (heads / kv_heads). Float32 sums;
 * exp by kernel_math.h's polynomial (relative error ~1e-7). Built by cache/native.py; the vector code
 * (AVX-512 or AVX2, kernel_math.h) is faster than SDPA, the scalar loops are not, so callers ask
 * `attend_fast` first. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "kernel_math.h"
#include "attention_kernels.h"



/* exp(scores - peak) in place over n values; returns their sum. */
static float softmax_weights(float *scores, int n, float peak) {
    int j = 0;
    float total = 0.0f;
#ifdef PALACE_VECTOR
    vfloat sum = vzero();
    const vfloat shift = vset1(peak);
    for (; j + VLEN <= n; j += VLEN) {
        const vfloat e = vexp(vsub(vload(scores + j), shift));
        vstore(scores + j, e);
        sum = vadd(sum, e);
    }
    total = vsum(sum);
#endif
    for (; j < n; j++) total += scores[j] = expf(scores[j] - peak);
    return total;
}

/* Keys [first, last) of one KV head for its `group` query heads: scores into scores[i * stride + j], then
 * with the part's own peak per head, exp(score - peak) in place, their sums and the unnormalized weighted
 * values (out [group][dim]). Dense vector code for head_dim 64, the scalar loops otherwise. */
static void attend_part(const float *query, int group, int dim, const float *keys, const float *values, int first,
                        int last, float scale, float *scores, int64_t stride, float *peak, float *sum, float *out) {
    for (int i = 0; i < group; i++) peak[i] = -INFINITY;
#ifdef PALACE_VECTOR
    if (dim == 64 && group <= MAX_GROUP) {
        enum { PIECES = 64 / VLEN };  /* vectors a head */
        for (int j = first; j < last; j++) {
            vfloat k[PIECES];
            for (int d = 0; d < PIECES; d++) k[d] = vload(keys + (int64_t)j * 64 + d * VLEN);
            for (int i = 0; i < group; i++) {
                const float *q = query + i * 64;
                vfloat a = vmul(vload(q), k[0]), b = vmul(vload(q + VLEN), k[1]);  /* two chains of sums */
                for (int d = 2; d < PIECES; d += 2) {
                    a = vfma(vload(q + d * VLEN), k[d], a);
                    b = vfma(vload(q + (d + 1) * VLEN), k[d + 1], b);
                }
                const float score = vsum(vadd(a, b)) * scale;
                scores[i * stride + j] = score;
                peak[i] = score > peak[i] ? score : peak[i];
            }
        }
        for (int i = 0; i < group; i++) sum[i] = softmax_weights(scores + i * stride + first, last - first, peak[i]);
        for (int i = 0; i < group; i++) {
            const float *w = scores + i * stride;
            vfloat o[PIECES];
            for (int d = 0; d < PIECES; d++) o[d] = vzero();
            for (int j = first; j < last; j++) {
                const vfloat weight = vset1(w[j]);
                for (int d = 0; d < PIECES; d++) o[d] = vfma(weight, vload(values + (int64_t)j * 64 + d * VLEN), o[d]);
            }
            for (int d = 0; d < PIECES; d++) vstore(out + i * 64 + d * VLEN, o[d]);
        }
        return;
    }
#endif
    for (int j = first; j < last; j++)
        for (int i = 0; i < group; i++) {
            float dot = 0.0f;
            for (int d = 0; d < dim; d++) dot += query[i * dim + d] * keys[(int64_t)j * dim + d];
            const float score = dot * scale;
            scores[i * stride + j] = score;
            peak[i] = score > peak[i] ? score : peak[i];
        }
    for (int i = 0; i < group; i++) {
        sum[i] = softmax_weights(scores + i * stride + first, last - first, peak[i]);
        for (int d = 0; d < dim; d++) out[i * dim + d] = 0.0f;
        for (int j = first; j < last; j++)
            for (int d = 0; d < dim; d++) out[i * dim + d] += scores[i * stride + j] * values[(int64_t)j * dim + d];
    }
}

/* The parts the keys are split in: one per thread, none shorter than 32 keys. 0 where the shapes are beyond
 * MAX_GROUP / MAX_DIM or no memory is left for the scratch (nothing is left allocated then). */
int attend_scratch_alloc(attend_scratch *s, int heads, int kv_heads, int dim, int length, int threads) {
    const int group = kv_heads > 0 ? heads / kv_heads : 0;
    if (group < 1 || group > MAX_GROUP || group * kv_heads != heads || length < 1 || dim > MAX_DIM) return 0;
    int parts = threads < 1 ? 1 : threads > MAX_PARTS ? MAX_PARTS : threads;
    if (parts > length / 32) parts = length / 32 > 0 ? length / 32 : 1;
    s->parts = parts;
    s->scores = malloc((size_t)heads * length * sizeof(float));
    s->partial = malloc((size_t)parts * heads * (dim + 2) * sizeof(float));
    if (s->scores && s->partial) return parts;
    free(s->scores);
    free(s->partial);
    return 0;
}

void attend_scratch_free(attend_scratch *s) { free(s->scores); free(s->partial); }

/* out [heads][dim] = softmax(query . keys^T * scale) . values for one query per head, by every thread of a
 * parallel region (its loops are shared out and end on barriers). The keys are split in the scratch's
 * parts, each part of every head computed with its own peak, then combined (flash-decoding's rescale), so
 * two threads share three KV heads evenly. mass (may be NULL): with `accumulate`, mass [length] gains the
 * weights summed over all heads; else mass [kv_heads][length] gets them summed over each KV head's query
 * heads. */
void attend_team(const float *query, int heads, int kv_heads, int dim, const float *keys, const float *values,
                 int64_t head_stride, int length, float scale, float *out, float *mass, int accumulate,
                 const attend_scratch *s) {
    const int group = heads / kv_heads, parts = s->parts;
    float *scores = s->scores, *partial = s->partial;
#pragma omp for schedule(static)
    for (int p = 0; p < parts; p++) {
        const int first = (int)((int64_t)length * p / parts), last = (int)((int64_t)length * (p + 1) / parts);
        for (int h = 0; h < kv_heads; h++) {
            float *mine = partial + ((int64_t)p * heads + h * group) * (dim + 2);
            float peak[MAX_GROUP], sum[MAX_GROUP], o[MAX_GROUP * MAX_DIM];
            attend_part(query + (int64_t)h * group * dim, group, dim, keys + h * head_stride, values + h * head_stride,
                        first, last, scale, scores + (int64_t)h * group * length, length, peak, sum, o);
            for (int i = 0; i < group; i++) {
                float *slot = mine + i * (dim + 2);
                slot[0] = peak[i], slot[1] = sum[i];
                memcpy(slot + 2, o + i * dim, (size_t)dim * sizeof(float));
            }
        }
    }
#pragma omp for schedule(static)
    for (int head = 0; head < heads; head++) {
        float peak = -INFINITY, total = 0.0f, factor[MAX_PARTS];
        for (int p = 0; p < parts; p++) {
            const float mine = partial[((int64_t)p * heads + head) * (dim + 2)];
            peak = mine > peak ? mine : peak;
        }
        for (int p = 0; p < parts; p++) {
            const float *slot = partial + ((int64_t)p * heads + head) * (dim + 2);
            factor[p] = expf(slot[0] - peak);
            total += slot[1] * factor[p];
        }
        for (int d = 0; d < dim; d++) {
            float value = 0.0f;
            for (int p = 0; p < parts; p++) value += partial[((int64_t)p * heads + head) * (dim + 2) + 2 + d] * factor[p];
            out[(int64_t)head * dim + d] = value / total;
        }
        for (int p = 0; p < parts; p++) {  /* the part's weights, normalized: the mass below sums them */
            const int first = (int)((int64_t)length * p / parts), last = (int)((int64_t)length * (p + 1) / parts);
            const float scaleby = factor[p] / total;
            for (int j = first; j < last; j++) scores[(int64_t)head * length + j] *= scaleby;
        }
    }
    if (mass && accumulate) {
#pragma omp for schedule(static)
        for (int j = 0; j < length; j++) {
            float total = 0.0f;
            for (int head = 0; head < heads; head++) total += scores[(int64_t)head * length + j];
            mass[j] += total;
        }
    } else if (mass) {
#pragma omp for schedule(static)
        for (int h = 0; h < kv_heads; h++)
            for (int j = 0; j < length; j++) {
                float total = 0.0f;
                for (int i = 0; i < group; i++) total += scores[((int64_t)h * group + i) * length + j];
                mass[(int64_t)h * length + j] = total;
            }
    }
}

/* attend_team in a region of its own, mass per KV head. Returns 0, or -1 when the scratch cannot be
 * allocated or the group or head dimension exceed MAX_GROUP / MAX_DIM (out is then untouched). */
int attend_one(const float *query, int heads, int kv_heads, int dim, const float *keys, const float *values,
               int64_t head_stride, int length, float scale, float *out, float *mass, int threads) {
    attend_scratch s;
    if (!attend_scratch_alloc(&s, heads, kv_heads, dim, length, threads)) return -1;
#pragma omp parallel num_threads(s.parts)
    attend_team(query, heads, kv_heads, dim, keys, values, head_stride, length, scale, out, mass, 0, &s);
    attend_scratch_free(&s);
    return 0;
}

/* 1 where attend_one beats SDPA (built with vector code: AVX-512, or AVX2 with FMA and F16C). */
int attend_fast(void) {
#ifdef PALACE_VECTOR
    return 1;
#else
    return 0;
#endif
}
