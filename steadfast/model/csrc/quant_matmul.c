/* y = x @ W^T with W kept in its GGUF block format (Q4_1 or Q8_0) and dequantized on the fly.
 *
 * W is given as one pointer per output row (`rows[n]`: K / 32 blocks of that row), so a fused
 * projection (Q|K|V, gate|up) and llama.cpp's Q/K row permutation are lists of pointers into the
 * mapped GGUF file: no copy of the weights, and every worker of a host reads the same page-cache pages.
 *
 * Each weight row is dequantized once per call into a buffer (the same fp32 values gguf's numpy
 * dequantization gives: d * q + m, rounded in that order), then dotted with every row of x. A dot sums
 * its products in one fixed order (16 lanes over k, then a fixed pairwise reduction) whatever the
 * number of rows of x, their grouping or the thread count: a row's result does not depend on the rows
 * computed with it (batch-invariant by construction).
 *
 * x is fp32 or bf16 (converted to fp32 once per call), y is written in x's type (bf16 rounded to
 * nearest even, as torch does). K must be a multiple of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

enum { TYPE_Q4_1 = 3, TYPE_Q8_0 = 8 }; /* GGML's type ids */
enum { BLOCK = 32 };

static inline float half_to_float(const uint8_t *p) {
    uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
    return _cvtsh_ss(h);
}

/* One weight row of K values into `out` (fp32). */
static void dequant_q4_1(const uint8_t *row, long K, float *out) {
    const __m128i low = _mm_set1_epi8(0x0F);
    for (long b = 0; b < K / BLOCK; b++) {
        const uint8_t *blk = row + b * 20; /* fp16 d, fp16 m, 16 bytes of nibbles */
        __m512 d = _mm512_set1_ps(half_to_float(blk)), m = _mm512_set1_ps(half_to_float(blk + 2));
        __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
        __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
        __m512 flo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)); /* values 0..15: the first 16 */
        __m512 fhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)); /* the next 16 */
        _mm512_storeu_ps(out + b * BLOCK, _mm512_add_ps(_mm512_mul_ps(flo, d), m));
        _mm512_storeu_ps(out + b * BLOCK + 16, _mm512_add_ps(_mm512_mul_ps(fhi, d), m));
    }
}

static void dequant_q8_0(const uint8_t *row, long K, float *out) {
    for (long b = 0; b < K / BLOCK; b++) {
        const uint8_t *blk = row + b * 34; /* fp16 d, 32 signed bytes */
        __m512 d = _mm512_set1_ps(half_to_float(blk));
        __m128i q0 = _mm_loadu_si128((const __m128i *)(blk + 2));
        __m128i q1 = _mm_loadu_si128((const __m128i *)(blk + 18));
        _mm512_storeu_ps(out + b * BLOCK, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d));
        _mm512_storeu_ps(out + b * BLOCK + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d));
    }
}

static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = {f};
    if (f != f) return (uint16_t)((v.u >> 16) | 0x40); /* a NaN stays a (quiet) NaN */
    v.u += 0x7FFF + ((v.u >> 16) & 1);
    return (uint16_t)(v.u >> 16);
}

/* Dots of `w` (K fp32) with `r` rows of x (fp32, row stride K), into y[i * ldy] (fp32 or bf16). */
#define DEF_DOTS(R)                                                                                  \
    static inline void dots_##R(const float *w, const float *x, long K, void *y, long ldy, int bf16) { \
        __m512 acc[R];                                                                               \
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();                                    \
        for (long k = 0; k < K; k += 16) {                                                           \
            __m512 wv = _mm512_loadu_ps(w + k);                                                      \
            for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * K + k), wv, acc[r]); \
        }                                                                                            \
        for (int r = 0; r < R; r++) {                                                                \
            float s = _mm512_reduce_add_ps(acc[r]);                                                  \
            if (bf16) ((uint16_t *)y)[r * ldy] = float_to_bf16(s);                                   \
            else ((float *)y)[r * ldy] = s;                                                          \
        }                                                                                            \
    }
DEF_DOTS(1) DEF_DOTS(2) DEF_DOTS(3) DEF_DOTS(4) DEF_DOTS(5) DEF_DOTS(6) DEF_DOTS(7) DEF_DOTS(8)

static void dots(int rows, const float *w, const float *x, long K, void *y, long ldy, int bf16) {
    switch (rows) {
    case 1: dots_1(w, x, K, y, ldy, bf16); break;
    case 2: dots_2(w, x, K, y, ldy, bf16); break;
    case 3: dots_3(w, x, K, y, ldy, bf16); break;
    case 4: dots_4(w, x, K, y, ldy, bf16); break;
    case 5: dots_5(w, x, K, y, ldy, bf16); break;
    case 6: dots_6(w, x, K, y, ldy, bf16); break;
    case 7: dots_7(w, x, K, y, ldy, bf16); break;
    default: dots_8(w, x, K, y, ldy, bf16); break;
    }
}

/* --- bf16 x: sum_i x_i (d q_i + m) = d * sum_i x_i q_i + m * sum_i x_i per block, the first sum with
 * AVX512-BF16 dot products (q is exact in bf16: 0..15, or -128..127 for Q8_0; products exact in fp32,
 * summed in fp32): more precise than a matmul over bf16-rounded dequantized weights, and it reads each
 * weight's 4.5 bits once. */
#ifdef __AVX512BF16__
/* The 32 q values of a block as bf16, in element order (pairs for the dot product). */
static inline __m512i q4_1_bf16(const uint8_t *blk) {
    static const uint16_t table[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                       0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
    const __m512i lut = _mm512_loadu_si512(table);
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i q = _mm_loadu_si128((const __m128i *)(blk + 4));
    __m128i lo = _mm_and_si128(q, low), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low);
    __m512i idx = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    return _mm512_permutexvar_epi16(idx, lut);
}

static inline __m512i q8_0_bf16(const uint8_t *blk) {
    __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 2))));
    __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 18))));
    return (__m512i)_mm512_cvtne2ps_pbh(b, a); /* a: elements 0..15, b: 16..31 */
}

/* Output n of `R` rows of x (bf16, row stride ldx; their per-block sums in sx, row stride nb). */
#define DEF_BF16(R)                                                                                  \
    static inline void bf16_##R(const uint8_t *w, int type, const uint16_t *x, long ldx, const float *sx, \
                                long nb, uint16_t *y, long ldy) {                                     \
        __m512 acc[R];                                                                               \
        float macc[R];                                                                               \
        for (int r = 0; r < R; r++) { acc[r] = _mm512_setzero_ps(); macc[r] = 0.0f; }               \
        long size = type == TYPE_Q4_1 ? 20 : 34;                                                     \
        for (long b = 0; b < nb; b++) {                                                              \
            const uint8_t *blk = w + b * size;                                                       \
            __m512i q = type == TYPE_Q4_1 ? q4_1_bf16(blk) : q8_0_bf16(blk);                         \
            __m512 d = _mm512_set1_ps(half_to_float(blk));                                           \
            float m = type == TYPE_Q4_1 ? half_to_float(blk + 2) : 0.0f;                             \
            for (int r = 0; r < R; r++) {                                                            \
                __m512i xv = _mm512_loadu_si512(x + r * ldx + b * BLOCK);                            \
                __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)q, (__m512bh)xv);       \
                acc[r] = _mm512_fmadd_ps(dot, d, acc[r]);                                            \
                macc[r] += m * sx[r * nb + b];                                                       \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++) y[r * ldy] = float_to_bf16(_mm512_reduce_add_ps(acc[r]) + macc[r]); \
    }
DEF_BF16(1) DEF_BF16(2) DEF_BF16(3) DEF_BF16(4) DEF_BF16(5) DEF_BF16(6) DEF_BF16(7) DEF_BF16(8)

static void bf16_rows(int rows, const uint8_t *w, int type, const uint16_t *x, long ldx, const float *sx, long nb,
                      uint16_t *y, long ldy) {
    switch (rows) {
    case 1: bf16_1(w, type, x, ldx, sx, nb, y, ldy); break;
    case 2: bf16_2(w, type, x, ldx, sx, nb, y, ldy); break;
    case 3: bf16_3(w, type, x, ldx, sx, nb, y, ldy); break;
    case 4: bf16_4(w, type, x, ldx, sx, nb, y, ldy); break;
    case 5: bf16_5(w, type, x, ldx, sx, nb, y, ldy); break;
    case 6: bf16_6(w, type, x, ldx, sx, nb, y, ldy); break;
    case 7: bf16_7(w, type, x, ldx, sx, nb, y, ldy); break;
    default: bf16_8(w, type, x, ldx, sx, nb, y, ldy); break;
    }
}

static int matmul_bf16(const uint16_t *x, long ldx, const uint8_t *const *rows, int type, uint16_t *y, long m,
                       long K, long N, int threads) {
    long nb = K / BLOCK;
    float *sx = malloc(sizeof(float) * m * nb); /* each row's sum over each block, for the m term */
    if (sx == NULL) return -2;
    for (long i = 0; i < m; i++)
        for (long b = 0; b < nb; b++) {
            const uint16_t *src = x + i * ldx + b * BLOCK;
            __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)src)), 16));
            __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + 16))), 16));
            sx[i * nb + b] = _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
        }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++)
        for (long i = 0; i < m; i += 8) {
            int r = m - i < 8 ? (int)(m - i) : 8;
            bf16_rows(r, rows[n], type, x + i * ldx, ldx, sx + i * nb, nb, y + i * N + n, N);
        }
    free(sx);
    return 0;
}
#endif

int quant_matmul_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c");
}

/* x: [m, K] (row stride ldx elements; fp32, or bf16 when `bf16`), rows: N weight-row pointers of type
 * `type`, y: [m, N] contiguous, in x's type. Returns 0, or -1 for arguments it does not handle. */
int quant_matmul(const void *x, long ldx, const uint8_t *const *rows, int type, void *y, long m, long K, long N,
                 int bf16, int threads) {
    if (m < 1 || K < BLOCK || K % BLOCK || N < 1 || (type != TYPE_Q4_1 && type != TYPE_Q8_0)) return -1;
#ifdef __AVX512BF16__
    if (bf16) return matmul_bf16((const uint16_t *)x, ldx, rows, type, (uint16_t *)y, m, K, N, threads);
#endif
    float *xf = malloc(sizeof(float) * m * K);
    if (xf == NULL) return -2;
    for (long i = 0; i < m; i++) {
        if (bf16) {
            const uint16_t *src = (const uint16_t *)x + i * ldx;
            for (long k = 0; k < K; k += 16) {
                __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + k)));
                _mm512_storeu_ps(xf + i * K + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
        } else {
            const float *src = (const float *)x + i * ldx;
            for (long k = 0; k < K; k++) xf[i * K + k] = src[k];
        }
    }
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *w = aligned_alloc(64, sizeof(float) * K);
        if (w == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            if (w == NULL) continue;
            if (type == TYPE_Q4_1) dequant_q4_1(rows[n], K, w);
            else dequant_q8_0(rows[n], K, w);
            for (long i = 0; i < m; i += 8) {
                int r = m - i < 8 ? (int)(m - i) : 8;
                void *out = bf16 ? (void *)((uint16_t *)y + i * N + n) : (void *)((float *)y + i * N + n);
                dots(r, w, xf + i * K, K, out, N, bf16);
            }
        }
        free(w);
    }
    free(xf);
    return failed ? -2 : 0;
}
