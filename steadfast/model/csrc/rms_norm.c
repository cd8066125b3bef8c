/* RMSNorm of bf16 rows with the residual add before it, one row at a time: x += delta (rounded to bf16,
 * as torch adds bf16 tensors), then out = w * bf16(x * rsqrt(mean(x^2) + eps)) with the normalising in
 * fp32 and the scaling rounded to bf16 (the model's torch path rounds at the same points). A row's result
 * never depends on the other rows. One call instead of the seven torch ops of the unfused path.
 * dim must be a multiple of 16. */
#include "bf16.h"
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

int rms_norm_supported(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

static void row(uint16_t *x, const uint16_t *delta, const uint16_t *w, uint16_t *out, long dim, float eps) {
    __m512 sq = _mm512_setzero_ps();
    for (long k = 0; k < dim; k += 16) {
        __m512 v = load_bf16(x + k);
        if (delta != NULL) {
            __m256i sum = to_bf16(_mm512_add_ps(v, load_bf16(delta + k)));
            _mm256_storeu_si256((__m256i *)(x + k), sum);
            v = load_bf16(x + k);
        }
        sq = _mm512_fmadd_ps(v, v, sq);
    }
    float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(sq) / (float)dim + eps);
    __m512 s = _mm512_set1_ps(inv);
    for (long k = 0; k < dim; k += 16) {
        __m512 h = load_bf16(x + k);
        __m256i hb = to_bf16(_mm512_mul_ps(h, s));
        __m512 hr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(hb), 16));
        _mm256_storeu_si256((__m256i *)(out + k), to_bf16(_mm512_mul_ps(load_bf16(w + k), hr)));
    }
}

/* x: [rows, dim] (row stride ldx), updated in place when delta (row stride ldd) is given; out: [rows, dim]. */
int add_rms_norm_bf16(uint16_t *x, long ldx, const uint16_t *delta, long ldd, const uint16_t *w, uint16_t *out,
                      long rows, long dim, float eps, int threads) {
    if (rows < 0 || dim < 16 || dim % 16) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 16)
    for (long i = 0; i < rows; i++)
        row(x + i * ldx, delta != NULL ? delta + i * ldd : NULL, w, out + i * dim, dim, eps);
    return 0;
}
