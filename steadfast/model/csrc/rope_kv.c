/* RoPE of a layer's Q and K heads, in place in the fused QKV rows, and the roped K and the V of each token
 * written to its slot of the layer's paged K/V: one call instead of the ~20 torch ops (slices, a concat,
 * a negation, products, sums, two index copies) a layer spends on them. Rounds where the torch path does
 * (the model's `_rope`: x * cos and rotate_half(x) * sin each rounded to the model dtype, then their sum),
 * with no fused multiply-add, so either path gives the same bits and a token's K/V never depends on which
 * computed it or on the tokens beside it. dim must be a multiple of 32 (half a head, whole vectors). */
#include "bf16.h"
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define RN (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

static inline __m512 neg(__m512 v) {  /* exact, as torch negates (-0 from 0) */
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32((int)0x80000000)));
}

static inline __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

int rope_kv_supported(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

/* One head of `dim`, in place: lo' = x_lo * c_lo - x_hi * s_lo, hi' = x_hi * c_hi + x_lo * s_hi. The
 * explicitly rounded intrinsics keep the compiler from contracting a product and a sum into an FMA. */
static void rope_f32(float *x, const float *c, const float *s, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i += 16) {
        __m512 lo = _mm512_loadu_ps(x + i), hi = _mm512_loadu_ps(x + half + i);
        __m512 nhi = neg(hi);
        __m512 a = _mm512_add_round_ps(_mm512_mul_round_ps(lo, _mm512_loadu_ps(c + i), RN),
                                       _mm512_mul_round_ps(nhi, _mm512_loadu_ps(s + i), RN), RN);
        __m512 b = _mm512_add_round_ps(_mm512_mul_round_ps(hi, _mm512_loadu_ps(c + half + i), RN),
                                       _mm512_mul_round_ps(lo, _mm512_loadu_ps(s + half + i), RN), RN);
        _mm512_storeu_ps(x + i, a);
        _mm512_storeu_ps(x + half + i, b);
    }
}

static void rope_bf16(uint16_t *x, const uint16_t *c, const uint16_t *s, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i += 16) {
        __m512 lo = load_bf16(x + i), hi = load_bf16(x + half + i);
        __m512 nhi = neg(hi);
        __m512 a = _mm512_add_round_ps(round_bf16(_mm512_mul_round_ps(lo, load_bf16(c + i), RN)),
                                       round_bf16(_mm512_mul_round_ps(nhi, load_bf16(s + i), RN)), RN);
        __m512 b = _mm512_add_round_ps(round_bf16(_mm512_mul_round_ps(hi, load_bf16(c + half + i), RN)),
                                       round_bf16(_mm512_mul_round_ps(lo, load_bf16(s + half + i), RN)), RN);
        _mm256_storeu_si256((__m256i *)(x + i), to_bf16(a));
        _mm256_storeu_si256((__m256i *)(x + half + i), to_bf16(b));
    }
}

/* qkv: [n, (heads + 2 * kv_heads) * dim] rows of stride ld (Q heads, K heads, V heads); cos, sin: tables
 * [positions, dim]; pos, slots: int64 [n]; kv: one layer [2, kv_heads, total_slots, dim]. Returns -2 for a
 * position or slot out of range (nothing is written for that token), -1 for a bad shape. */
int rope_kv_store(void *qkv, long ld, const void *cos, const void *sin, long positions, const int64_t *pos,
                  const int64_t *slots, void *kv, long total_slots, long n, int heads, int kv_heads, int dim,
                  int bf16, int threads) {
    if (n < 0 || heads < 1 || kv_heads < 1 || dim < 32 || dim % 32) return -1;
    size_t es = bf16 ? 2 : 4;
    int bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (n >= 16) reduction(| : bad)
    for (long t = 0; t < n; t++) {
        int64_t p = pos[t], slot = slots[t];
        if (p < 0 || p >= positions || slot < 0 || slot >= total_slots) {
            bad = 1;
            continue;
        }
        char *row = (char *)qkv + (size_t)t * ld * es;
        const char *c = (const char *)cos + (size_t)p * dim * es, *s = (const char *)sin + (size_t)p * dim * es;
        for (int h = 0; h < heads + kv_heads; h++) {
            char *x = row + (size_t)h * dim * es;
            if (bf16)
                rope_bf16((uint16_t *)x, (const uint16_t *)c, (const uint16_t *)s, dim);
            else
                rope_f32((float *)x, (const float *)c, (const float *)s, dim);
        }
        for (int j = 0; j < kv_heads; j++) {
            const char *k = row + (size_t)(heads + j) * dim * es, *v = row + (size_t)(heads + kv_heads + j) * dim * es;
            char *kd = (char *)kv + (((size_t)j * total_slots) + slot) * dim * es;
            char *vd = (char *)kv + (((size_t)(kv_heads + j) * total_slots) + slot) * dim * es;
            memcpy(kd, k, dim * es);
            memcpy(vd, v, dim * es);
        }
    }
    return bad ? -2 : 0;
}
