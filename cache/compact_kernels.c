/* Moving rows of a layer's contiguous keys and values in one pass, each key turned on the way (re-rotation
 * to its new position): a compaction in place and a splice from a span (move_rows), what a compaction evicts
 * read out of every layer (gather_layer_rows), and a recall's interleaved spans put in order (gather_tokens).
 * torch needs a gather into new tensors, a rotation over them and a copy back, op by op and layer by layer.
 * Built by cache/native.py with the quantized attention kernels. */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof(f));
    return f;
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, as torch's conversion */
    uint32_t bits;
    memcpy(&bits, &f, sizeof(bits));
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* quiet NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline float load(const char *row, int i, int bf16) {
    return bf16 ? bf16_to_float(((const uint16_t *)row)[i]) : ((const float *)row)[i];
}

static inline void store(char *row, int i, float x, int bf16) {
    if (bf16)
        ((uint16_t *)row)[i] = float_to_bf16(x);
    else
        ((float *)row)[i] = x;
}

#define MAX_HALF 256 /* head_dim / 2 up to which a row is turned through float buffers the compiler vectorizes */

/* Row `from` to row `to` (dim elements), the key turned by cos/sin c/s [dim/2] where `rotate` (its two halves
 * by the same angles, in float32: a' = a cos - b sin, b' = b cos + a sin); both halves are read before either
 * is written, so `from` may be `to`. `fused`: as torch's out-of-place rotation rounds it (cache/rope.py's
 * `shift`, which the splice replaces: a' = fma(a, cos, -(b sin)), b' = fma(b, cos, a sin)), else each product
 * rounded before the sum, as the compaction kernel always has: each kernel keeps the figures of the path it
 * replaced to the bit in bfloat16 (a rounding apart, one key in 100,000 comes out one bfloat16 step away).
 * Each step is its own loop over the row, so each vectorizes (one loop with the dtype's branch inside did not). */
static inline void turn_row(char *to, const char *from, int rotate, const float *c, const float *s, int half, int bf16,
                            size_t row_bytes, int fused) {
    if (!rotate || half > MAX_HALF) {
        if (to != from) memcpy(to, from, row_bytes);
        if (rotate) /* a head too wide for the buffers: element by element, in place */
            for (int i = 0; i < half; i++) {
                const float a = load(to, i, bf16), b = load(to, i + half, bf16);
                store(to, i, fused ? fmaf(a, c[i], -(b * s[i])) : a * c[i] - b * s[i], bf16);
                store(to, i + half, fused ? fmaf(b, c[i], a * s[i]) : b * c[i] + a * s[i], bf16);
            }
        return;
    }
    float a[MAX_HALF], b[MAX_HALF], x[MAX_HALF], y[MAX_HALF];
    if (bf16) {
        const uint16_t *in = (const uint16_t *)from;
        for (int i = 0; i < half; i++) a[i] = bf16_to_float(in[i]);
        for (int i = 0; i < half; i++) b[i] = bf16_to_float(in[i + half]);
    } else {
        memcpy(a, from, (size_t)half * sizeof(float));
        memcpy(b, from + (size_t)half * sizeof(float), (size_t)half * sizeof(float));
    }
    if (fused) {
        for (int i = 0; i < half; i++) x[i] = fmaf(a[i], c[i], -(b[i] * s[i]));
        for (int i = 0; i < half; i++) y[i] = fmaf(b[i], c[i], a[i] * s[i]);
    } else {
        for (int i = 0; i < half; i++) x[i] = a[i] * c[i] - b[i] * s[i];
        for (int i = 0; i < half; i++) y[i] = b[i] * c[i] + a[i] * s[i];
    }
    if (bf16) {
        uint16_t *out = (uint16_t *)to;
        for (int i = 0; i < half; i++) out[i] = float_to_bf16(x[i]);
        for (int i = 0; i < half; i++) out[i + half] = float_to_bf16(y[i]);
    } else {
        memcpy(to, x, (size_t)half * sizeof(float));
        memcpy(to + (size_t)half * sizeof(float), y, (size_t)half * sizeof(float));
    }
}

/* Move rows into every layer's keys and values (layer l's [heads][head_strides[l]] buffers at keys[l] / values[l],
 * from the first row written), in one call for all layers (one per layer cost more in calls than in copying,
 * and 2 threads over a layer's 3 KV heads left one idle a third of the time): row j of every head takes row
 * index[j] (or row j where index is NULL) of layer l's source buffers, whose heads lie source_strides[l]
 * elements apart; where rotate[j], the key is turned by cos/sin [n][dim/2] on the way (turn_row, `fused` as it
 * says). Element size 4 (float32) or 2 (bfloat16, `bf16` set).
 * - A compaction, in place: the source is the layer itself, index ascending with index[j] >= j, so every read
 *   is ahead of every write before it (torch needs a gather into new tensors, a rotation over them and a copy
 *   back, op by op and layer by layer; at a 1K-token cache that is most of a splice's time).
 * - A splice at the end: the source is a span's [heads][n][dim] rows of each layer, no index: one pass over the
 *   span, not a rotation into temporaries and a copy. */
void move_rows(const int64_t *keys, const int64_t *values, const int64_t *head_strides, int layers, int heads, int dim,
               int bf16, const int64_t *source_keys, const int64_t *source_values, const int64_t *source_strides,
               const int64_t *index, int n, const float *cos, const float *sin, const uint8_t *rotate, int fused,
               int threads) {
    const int half = dim / 2;
    const size_t size = bf16 ? 2 : 4, row_bytes = (size_t)dim * size;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < layers * heads; r++) {
        const int l = r / heads, h = r % heads;
        char *kbase = (char *)(intptr_t)keys[l] + (size_t)h * head_strides[l] * size;
        char *vbase = (char *)(intptr_t)values[l] + (size_t)h * head_strides[l] * size;
        const char *kfrom = (const char *)(intptr_t)source_keys[l] + (size_t)h * source_strides[l] * size;
        const char *vfrom = (const char *)(intptr_t)source_values[l] + (size_t)h * source_strides[l] * size;
        for (int j = 0; j < n; j++) {
            const size_t to = (size_t)j * row_bytes, from = (size_t)(index ? index[j] : j) * row_bytes;
            if (vbase + to != vfrom + from) memcpy(vbase + to, vfrom + from, row_bytes);
            turn_row(kbase + to, kfrom + from, rotate[j], cos + (size_t)j * half, sin + (size_t)j * half, half, bf16,
                     row_bytes, fused);
        }
    }
}

/* Gather rows of several sources into one buffer: out holds `rows` (layers x heads) rows of n tokens of
 * `row_bytes` each; token j comes from source part[j] (whose buffer holds rows of lengths[part[j]] tokens),
 * token index[j]. One copy of every token, however scattered the sources (a recall's spans interleave). */
void gather_tokens(char *out, const int64_t *sources, const int64_t *lengths, int rows, int64_t row_bytes,
                   const int64_t *part, const int64_t *index, int n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < rows; r++) {
        char *to = out + (size_t)r * n * row_bytes;
        for (int j = 0; j < n; j++) {
            const int64_t p = part[j];
            const char *from = (const char *)(intptr_t)sources[p] + ((size_t)r * lengths[p] + index[j]) * row_bytes;
            memcpy(to + (size_t)j * row_bytes, from, row_bytes);
        }
    }
}

/* Gather the same rows of every layer into one buffer: out holds [layers][heads][n] rows of `row_bytes`;
 * row j of head h of layer l is row index[j] of sources[l] (a layer's buffers, heads strides[l] bytes
 * apart). What a compaction evicts, read out of all layers in one call instead of one gather a layer. */
void gather_layer_rows(char *out, const int64_t *sources, const int64_t *strides, int layers, int heads,
                       int64_t row_bytes, const int64_t *index, int n, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int r = 0; r < layers * heads; r++) {
        const int l = r / heads, h = r % heads;
        const char *from = (const char *)(intptr_t)sources[l] + (size_t)h * strides[l];
        char *to = out + (size_t)r * n * row_bytes;
        for (int j = 0; j < n; j++) memcpy(to + (size_t)j * row_bytes, from + (size_t)index[j] * row_bytes, row_bytes);
    }
}
