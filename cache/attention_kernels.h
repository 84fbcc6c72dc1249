/* One new token's attention (attention_kernels.c) as a step of a larger parallel region: agent/weight_kernels.c
 * runs it between a decoder layer's products. */
#ifndef PALACE_ATTENTION_KERNELS_H
#define PALACE_ATTENTION_KERNELS_H
#include <stdint.h>

#define MAX_GROUP 16 /* query heads per KV head */
#define MAX_DIM 128  /* head dimension */
#define MAX_PARTS 64 /* key ranges computed apart (one per thread) */

/* Scratch for one call: every head's scores, and per part and head its peak, sum and unnormalized output. */
typedef struct { int parts; float *scores, *partial; } attend_scratch;

int attend_scratch_alloc(attend_scratch *s, int heads, int kv_heads, int dim, int length, int threads);
void attend_scratch_free(attend_scratch *s);
void attend_team(const float *query, int heads, int kv_heads, int dim, const float *keys, const float *values,
                 int64_t head_stride, int length, float scale, float *out, float *mass, int accumulate,
                 const attend_scratch *s);
#endif
