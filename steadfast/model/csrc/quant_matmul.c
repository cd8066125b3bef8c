/* y = x @ W^T with W kept in its GGUF block format (Q4_1 or Q8_0) and dequantized on the fly.
 *
 * W is given as one pointer per output row (`rows[n]`: K / 32 blocks of that row), so a fused
 * projection (Q|K|V, gate|up) and llama.cpp's Q/K row permutation are lists of pointers into the
 * mapped GGUF file: no copy of the weights, and every worker of a host reads the same page-cache pages.
 *
 * fp32 x: each weight row is dequantized once per call into a buffer (the same fp32 values gguf's numpy
 * dequantization gives: d * q + m, rounded in that order), then dotted with every row of x, its products
 * summed in one fixed order (16 lanes over k, then a fixed pairwise reduction). bf16 x: integer dot
 * products over the blocks (below); where the CPU lacks AVX512-VNNI/VBMI, as fp32.
 *
 * Either way a row's result does not depend on the number of rows of x, their grouping or the thread
 * count (batch-invariant by construction). y is written in x's type (bf16 rounded to nearest even, as
 * torch does). K must be a multiple of 32. */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* --- bf16 x, with AVX512-VNNI and VBMI: integer dot products, as llama.cpp does on the CPU, but with x
 * kept to 16 bits. Each 32-value block of an x row is scaled by its largest magnitude and written as two
 * int8 digits, x = dx * (256 a + b) (|a| <= 127, b the rounded rest), ~15 bits relative to the block's
 * largest value: near the bf16 input's own precision, where one int8 digit (llama.cpp's Q8_1) loses ~1 %
 * of a projection and flipped greedy tokens in the checks. Per weight block, d_w dx (256 sum q a + sum q b)
 * in exact int32 sums (vpdpbusd), + m_w sum x for Q4_1 (the sum of the bf16 values, in fp32).
 *
 * The blocks are read where the GGUF keeps them (20 bytes a Q4_1 block, 34 a Q8_0 one): two overlapping
 * 64-byte loads and one byte permutation gather four Q4_1 blocks' nibbles (two Q8_0 blocks' bytes), one
 * word permutation their fp16 scales. */
#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__)
#define VNNI 1
#define INLINE static inline __attribute__((always_inline))
enum { ROWS = 4 };            /* x rows sharing one pass over a weight row */
enum { G4 = 384, G8 = 192 }; /* bytes of prepared x per 4 Q4_1 blocks / 2 Q8_0 blocks */

/* Byte and word permutations picking blocks out of [w[0..63], w[16..79]] (Q4_1) or [w[0..63], w[4..67]]
 * (Q8_0). Filled once when the library loads. */
static int8_t NIB_IDX[64], Q8_IDX[64];
static int16_t Q4_SCALE_IDX[32], Q8_SCALE_IDX[32];

__attribute__((constructor)) static void init_tables(void) {
    for (int b = 0; b < 4; b++) {
        for (int j = 0; j < 16; j++) {
            int at = 20 * b + 4 + j;
            NIB_IDX[16 * b + j] = (int8_t)(at < 64 ? at : 64 + at - 16);
        }
        Q4_SCALE_IDX[b] = (int16_t)(10 * b);         /* d of block b */
        Q4_SCALE_IDX[4 + b] = (int16_t)(10 * b + 1); /* m of block b */
    }
    for (int b = 0; b < 2; b++)
        for (int j = 0; j < 32; j++) {
            int at = 34 * b + 2 + j;
            Q8_IDX[32 * b + j] = (int8_t)(at < 64 ? at : 64 + at - 4);
        }
    Q8_SCALE_IDX[1] = 17;
}

/* One block of 32 x values: its two int8 digits (q[0..31] a, q[32..63] b), dx and the values' sum. */
static void split_block(const float *x, int8_t *q, float *dx, float *sum) {
    __m512 v[2] = {_mm512_loadu_ps(x), _mm512_loadu_ps(x + 16)};
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
    for (int h = 0; h < 2; h++) {
        __m512 scaled = _mm512_mul_ps(v[h], inv), hi = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT);
        __m512i lo = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, hi), _mm512_set1_ps(256.0f)));
        _mm_storeu_si128((__m128i *)(q + 16 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(hi)));
        _mm_storeu_si128((__m128i *)(q + 32 + 16 * h), _mm512_cvtsepi32_epi8(_mm512_max_epi32(lo, _mm512_set1_epi32(-127))));
    }
    *dx = amax / (127.0f * 256.0f);
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
}

/* An x row (K fp32 values) laid out for `type`'s groups of blocks. Q4_1, per 4 blocks: a of the first
 * 16 values of each block [64], a of the last 16 [64], b likewise [64][64] (a byte's low nibble is a
 * block's value j, its high one value j + 16), dx 4x per block [16 fp32], the sums in lanes 4..7 [16 fp32]
 * (beside m_w in the scale vector). Q8_0, per 2 blocks: a [64], b [64], dx 8x per block [16 fp32]. */
static void prepare(const float *x, long K, int type, uint8_t *out) {
    long nb = K / BLOCK, per = type == TYPE_Q4_1 ? G4 : G8, width = type == TYPE_Q4_1 ? 4 : 2;
    memset(out, 0, ((nb + width - 1) / width) * per);
    for (long b = 0; b < nb; b++) {
        uint8_t *g = out + (b / width) * per;
        int j = (int)(b % width);
        int8_t q[64];
        float dx, sum;
        split_block(x + b * BLOCK, q, &dx, &sum);
        if (type == TYPE_Q4_1) {
            for (int part = 0; part < 4; part++) memcpy(g + 64 * part + 16 * j, q + 16 * part, 16);
            for (int l = 0; l < 4; l++) ((float *)(g + 256))[4 * j + l] = dx;
            ((float *)(g + 320))[4 + j] = sum;
        } else {
            memcpy(g + 32 * j, q, 32);
            memcpy(g + 64 + 32 * j, q + 32, 32);
            for (int l = 0; l < 8; l++) ((float *)(g + 128))[8 * j + l] = dx;
        }
    }
}

static inline __mmask64 first_bytes(long n) { return n >= 64 ? ~0ULL : n <= 0 ? 0 : (1ULL << n) - 1; }

/* R prepared x rows (stride `per`) against one Q4_1 weight row of nb blocks: out[r]. */
INLINE void dot_q4_1(const uint8_t *w, long nb, const uint8_t *px, long per, int R, float *out) {
    const __m512i nidx = _mm512_loadu_si512(NIB_IDX), sidx = _mm512_loadu_si512(Q4_SCALE_IDX);
    const __m512i lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[ROWS], macc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (long g = 0; g < (nb + 3) / 4; g++) {
        const uint8_t *blk = w + g * 80;
        long bytes = 20 * (nb - 4 * g); /* the last group may hold fewer than 4 blocks: masked */
        __m512i A = _mm512_maskz_loadu_epi8(first_bytes(bytes), blk);
        __m512i B = _mm512_maskz_loadu_epi8(first_bytes(bytes - 16), blk + 16);
        __m512i q = _mm512_permutex2var_epi8(A, nidx, B);
        __m512 dm = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(sidx, A)));
        __m512 dw = _mm512_permutexvar_ps(lanes, dm);
        __m512i lo = _mm512_and_si512(q, low), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), low);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = px + r * per + g * G4;
            __m512i a = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(p));
            a = _mm512_dpbusd_epi32(a, hi, _mm512_loadu_si512(p + 64));
            __m512i b = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(p + 128));
            b = _mm512_dpbusd_epi32(b, hi, _mm512_loadu_si512(p + 192));
            __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a, 8), b));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dw, _mm512_loadu_ps((const float *)(p + 256))), acc[r]);
            macc[r] = _mm512_fmadd_ps(dm, _mm512_loadu_ps((const float *)(p + 320)), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(macc[r]);
}

/* The same for Q8_0: signed weights, so |q| (unsigned) against x with q's sign. */
INLINE void dot_q8_0(const uint8_t *w, long nb, const uint8_t *px, long per, int R, float *out) {
    const __m512i qidx = _mm512_loadu_si512(Q8_IDX), sidx = _mm512_loadu_si512(Q8_SCALE_IDX);
    const __m512i lanes = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i zero = _mm512_setzero_si512();
    __m512 acc[ROWS];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (long g = 0; g < (nb + 1) / 2; g++) {
        const uint8_t *blk = w + g * 68;
        long bytes = 34 * (nb - 2 * g);
        __m512i A = _mm512_maskz_loadu_epi8(first_bytes(bytes), blk);
        __m512i B = _mm512_maskz_loadu_epi8(first_bytes(bytes - 4), blk + 4);
        __m512i q = _mm512_permutex2var_epi8(A, qidx, B);
        __m512 dw = _mm512_permutexvar_ps(lanes, _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(sidx, A))));
        __mmask64 neg = _mm512_movepi8_mask(q);
        __m512i mag = _mm512_abs_epi8(q);
        for (int r = 0; r < R; r++) {
            const uint8_t *p = px + r * per + g * G8;
            __m512i xa = _mm512_loadu_si512(p), xb = _mm512_loadu_si512(p + 64);
            __m512i a = _mm512_dpbusd_epi32(zero, mag, _mm512_mask_sub_epi8(xa, neg, zero, xa));
            __m512i b = _mm512_dpbusd_epi32(zero, mag, _mm512_mask_sub_epi8(xb, neg, zero, xb));
            __m512 sum = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(a, 8), b));
            acc[r] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dw, _mm512_loadu_ps((const float *)(p + 128))), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(acc[r]);
}

#define DEF_INT8(R)                                                                                  \
    static void int8_##R(const uint8_t *w, int type, long nb, const uint8_t *px, long per, float *out) { \
        if (type == TYPE_Q4_1) dot_q4_1(w, nb, px, per, R, out);                                     \
        else dot_q8_0(w, nb, px, per, R, out);                                                       \
    }
DEF_INT8(1) DEF_INT8(2) DEF_INT8(3) DEF_INT8(4)

static void int8_rows(int rows, const uint8_t *w, int type, long nb, const uint8_t *px, long per, float *out) {
    switch (rows) {
    case 1: int8_1(w, type, nb, px, per, out); break;
    case 2: int8_2(w, type, nb, px, per, out); break;
    case 3: int8_3(w, type, nb, px, per, out); break;
    default: int8_4(w, type, nb, px, per, out); break;
    }
}

static int matmul_int8(const uint16_t *x, long ldx, const uint8_t *const *rows, int type, uint16_t *y, long m,
                       long K, long N, int threads) {
    long nb = K / BLOCK;
    long per = type == TYPE_Q4_1 ? (nb + 3) / 4 * G4 : (nb + 1) / 2 * G8;
    uint8_t *px = aligned_alloc(64, per * m);
    float *xf = malloc(sizeof(float) * K);
    if (px == NULL || xf == NULL) {
        free(px);
        free(xf);
        return -2;
    }
    for (long i = 0; i < m; i++) {
        for (long k = 0; k < K; k += 16) {
            __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i * ldx + k)));
            _mm512_storeu_ps(xf + k, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
        }
        prepare(xf, K, type, px + i * per);
    }
    free(xf);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++)
        for (long i = 0; i < m; i += ROWS) {
            int r = m - i < ROWS ? (int)(m - i) : ROWS;
            float out[ROWS];
            int8_rows(r, rows[n], type, nb, px + i * per, per, out);
            for (int j = 0; j < r; j++) y[(i + j) * N + n] = float_to_bf16(out[j]);
        }
    free(px);
    return 0;
}
#endif

/* Whether bf16 x takes the integer path (else it is computed as fp32). */
int quant_matmul_int8(void) {
#ifdef VNNI
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
#else
    return 0;
#endif
}

int quant_matmul_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c");
}

/* x: [m, K] (row stride ldx elements; fp32, or bf16 when `bf16`), rows: N weight-row pointers of type
 * `type`, y: [m, N] contiguous, in x's type. Returns 0, or -1 for arguments it does not handle. */
int quant_matmul(const void *x, long ldx, const uint8_t *const *rows, int type, void *y, long m, long K, long N,
                 int bf16, int threads) {
    if (m < 1 || K < BLOCK || K % BLOCK || N < 1 || (type != TYPE_Q4_1 && type != TYPE_Q8_0)) return -1;
#ifdef VNNI
    if (bf16) return matmul_int8((const uint16_t *)x, ldx, rows, type, (uint16_t *)y, m, K, N, threads);
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
