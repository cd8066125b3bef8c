/* Decode attention read in place from the paged KV arena, for CPUs with AVX-512.
 *
 * One query token per request; its K/V rows are found through the request's block table, so nothing
 * is gathered or padded first (the torch path copies every attended row once per layer, then reads it
 * twice more in two batched matmuls).
 *
 * Layout of one layer (steadfast/kv/arena.py): [2 (K, V), kv_heads, num_blocks, 16, dim].
 * Work item = (request, kv head): the group's query heads share every K/V row loaded.
 * Elements are fp32 or bf16; products, scores, softmax and the weighted sum of V are fp32.
 * Built by steadfast/model/paged_attention.py with -march=native for the machine it runs on.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define BLOCK 16
#define MAX_CHUNKS 16 /* dim <= 256 */
#define MAX_GROUP 16

#ifdef __AVX512F__
#include <immintrin.h>
#include "exp16.h"

int paged_attention_supported(void) { return 1; }

#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

/* 16 elements from p as fp32; bf16 is the upper half of an fp32, so widening is a shift. */
INLINE __m512 load16(const void *p, int bf16) {
    if (!bf16) return _mm512_loadu_ps(p);
    __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

INLINE void store16(void *p, __m512 v, int bf16) {
    if (!bf16) {
        _mm512_storeu_ps(p, v);
        return;
    }
    /* Round to nearest even, as torch's fp32 -> bf16 conversion does. */
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

/* Lane t of the result = the sum of the 16 lanes of v[t]: a transpose-and-add tree, ~3 ops per
 * vector instead of a full horizontal reduction each. */
INLINE __m512 sum_lanes16(const __m512 *v) {
    __m512 pairs[8], quads[4], octs[2];
    for (int i = 0; i < 8; i++)
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    /* quads[i]: in each 128-bit lane, that lane's partial sums of vectors 4i .. 4i+3. */
    for (int i = 0; i < 2; i++)
        octs[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(octs[0], octs[1], 0x88),
                         _mm512_shuffle_f32x4(octs[0], octs[1], 0xDD));
}

/* exp16: exp16.h (the scores minus their maximum are <= 0). */

INLINE void attend_one(const char *q, const char *k_head, const char *v_head, char *out,
                       const int32_t *table, int ctx, int group, int dim, long block_bytes, float scale,
                       float *scores, int bf16) {
    const int esize = bf16 ? 2 : 4, chunks = dim / 16, blocks = (ctx + BLOCK - 1) / BLOCK;
    __m512 qf[MAX_GROUP][MAX_CHUNKS], acc[MAX_GROUP][MAX_CHUNKS], row[MAX_CHUNKS];
    __m512 best[MAX_GROUP], total[MAX_GROUP];
    UNROLL for (int g = 0; g < group; g++) {
        UNROLL for (int c = 0; c < chunks; c++) {
            qf[g][c] = load16(q + ((long)g * dim + 16 * c) * esize, bf16);
            acc[g][c] = _mm512_setzero_ps();
        }
        best[g] = _mm512_set1_ps(-INFINITY);
        total[g] = _mm512_setzero_ps();
    }
    /* Scores, a block (16 tokens) at a time, one query head after another (16 partial sums live, not
     * 16 per head: the block's K rows are read again from L1 instead); lanes past the context are -inf. */
    for (int b = 0; b < blocks; b++) {
        const char *kb = k_head + table[b] * block_bytes;
        const int m = ctx - b * BLOCK < BLOCK ? ctx - b * BLOCK : BLOCK;
        const __mmask16 live = (__mmask16)((1u << m) - 1u);
        UNROLL for (int g = 0; g < group; g++) {
            __m512 part[BLOCK];
            for (int t = 0; t < BLOCK; t++) {
                __m512 s = _mm512_setzero_ps();
                if (t < m)
                    UNROLL for (int c = 0; c < chunks; c++)
                        s = _mm512_fmadd_ps(qf[g][c], load16(kb + ((long)t * dim + 16 * c) * esize, bf16), s);
                part[t] = s;
            }
            __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), live,
                                          _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale)));
            _mm512_storeu_ps(scores + (long)g * blocks * BLOCK + b * BLOCK, s);
            best[g] = _mm512_max_ps(best[g], s);
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(best[g]));
        float *sg = scores + (long)g * blocks * BLOCK;
        for (int b = 0; b < blocks; b++) {
            __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + b * BLOCK), top));
            _mm512_storeu_ps(sg + b * BLOCK, e);
            total[g] = _mm512_add_ps(total[g], e);
        }
    }
    /* Weighted sum of V rows, normalised once at the end. */
    for (int b = 0; b < blocks; b++) {
        const char *vb = v_head + table[b] * block_bytes;
        const int m = ctx - b * BLOCK < BLOCK ? ctx - b * BLOCK : BLOCK;
        for (int t = 0; t < m; t++) {
            UNROLL for (int c = 0; c < chunks; c++) row[c] = load16(vb + ((long)t * dim + 16 * c) * esize, bf16);
            UNROLL for (int g = 0; g < group; g++) {
                const __m512 p = _mm512_set1_ps(scores[(long)g * blocks * BLOCK + b * BLOCK + t]);
                UNROLL for (int c = 0; c < chunks; c++) acc[g][c] = _mm512_fmadd_ps(p, row[c], acc[g][c]);
            }
        }
    }
    for (int g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(total[g]));
        for (int c = 0; c < chunks; c++)
            store16(out + ((long)g * dim + 16 * c) * esize, _mm512_mul_ps(acc[g][c], inv), bf16);
    }
}

/* attend_one for one head shape: specialised below for the common ones (the group size and head width
 * known at compile time, the loops over them unrolled, a head's partial results kept in registers: 2-3x
 * faster than the generic loops, the same operations in the same order, so the same bits). */
typedef void (*attend_fn)(const char *q, const char *k_head, const char *v_head, char *out, const int32_t *table,
                          int ctx, int group, int dim, long block_bytes, float scale, float *scores);

#define DEF_ATTEND(NAME, G, D, B)                                                                          \
    static void NAME(const char *q, const char *k_head, const char *v_head, char *out, const int32_t *table, \
                     int ctx, int group, int dim, long block_bytes, float scale, float *scores) {          \
        (void)group, (void)dim;                                                                            \
        attend_one(q, k_head, v_head, out, table, ctx, G, D, block_bytes, scale, scores, B);               \
    }
#define DEF_SHAPE(G, D) DEF_ATTEND(attend_##G##_##D##_f32, G, D, 0) DEF_ATTEND(attend_##G##_##D##_bf16, G, D, 1)
DEF_SHAPE(1, 64) DEF_SHAPE(2, 64) DEF_SHAPE(3, 64) DEF_SHAPE(4, 64) DEF_SHAPE(8, 64)
DEF_SHAPE(1, 128) DEF_SHAPE(2, 128) DEF_SHAPE(4, 128) DEF_SHAPE(8, 128)

static void attend_any_f32(const char *q, const char *k_head, const char *v_head, char *out, const int32_t *table,
                           int ctx, int group, int dim, long block_bytes, float scale, float *scores) {
    attend_one(q, k_head, v_head, out, table, ctx, group, dim, block_bytes, scale, scores, 0);
}
static void attend_any_bf16(const char *q, const char *k_head, const char *v_head, char *out, const int32_t *table,
                            int ctx, int group, int dim, long block_bytes, float scale, float *scores) {
    attend_one(q, k_head, v_head, out, table, ctx, group, dim, block_bytes, scale, scores, 1);
}

static attend_fn attend_for(int group, int dim, int bf16) {
#define PICK(G, D) \
    if (group == G && dim == D) return bf16 ? attend_##G##_##D##_bf16 : attend_##G##_##D##_f32;
    PICK(1, 64) PICK(2, 64) PICK(3, 64) PICK(4, 64) PICK(8, 64)
    PICK(1, 128) PICK(2, 128) PICK(4, 128) PICK(8, 128)
#undef PICK
    return bf16 ? attend_any_bf16 : attend_any_f32;
}

/* q: request r's head j at q + (r * q_stride + j * dim) elements. out: [n, heads * dim] contiguous.
 * tables: [n, max_blocks] block ids; lens: [n] tokens attended (the new one included, >= 1).
 * Returns 0, or -1 for a shape it does not handle (the caller then uses the torch path). */
int paged_decode_attention(const void *q, long q_stride, const void *kv, void *out, const int32_t *tables,
                           const int32_t *lens, int n, int max_blocks, int heads, int kv_heads, int num_blocks,
                           int block_size, int dim, float scale, int bf16, int threads) {
    const int group = heads / kv_heads;
    if (block_size != BLOCK || dim % 16 || dim / 16 > MAX_CHUNKS || group > MAX_GROUP || group * kv_heads != heads)
        return -1;
    const int esize = bf16 ? 2 : 4;
    const long block_bytes = (long)BLOCK * dim * esize;
    const long head_bytes = (long)num_blocks * block_bytes;
    const attend_fn attend = attend_for(group, dim, bf16);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)group * max_blocks * BLOCK);
        if (!scores) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (long item = 0; item < (long)n * kv_heads; item++) {
            if (!scores) continue;
            const int r = (int)(item / kv_heads), h = (int)(item % kv_heads);
            const char *k_head = (const char *)kv + h * head_bytes;
            const char *v_head = (const char *)kv + (kv_heads + h) * head_bytes;
            const char *qr = (const char *)q + (r * q_stride + (long)h * group * dim) * esize;
            char *o = (char *)out + ((long)r * heads + (long)h * group) * dim * esize;
            const int32_t *table = tables + (long)r * max_blocks;
            attend(qr, k_head, v_head, o, table, lens[r], group, dim, block_bytes, scale, scores);
        }
        free(scores);
    }
    return failed ? -2 : 0;
}

#else /* no AVX-512: the engine keeps the torch path */

int paged_attention_supported(void) { return 0; }

int paged_decode_attention(const void *q, long q_stride, const void *kv, void *out, const int32_t *tables,
                           const int32_t *lens, int n, int max_blocks, int heads, int kv_heads, int num_blocks,
                           int block_size, int dim, float scale, int bf16, int threads) {
    (void)q, (void)q_stride, (void)kv, (void)out, (void)tables, (void)lens, (void)n, (void)max_blocks;
    (void)heads, (void)kv_heads, (void)num_blocks, (void)block_size, (void)dim, (void)scale, (void)bf16;
    (void)threads;
    return -1;
}

#endif
