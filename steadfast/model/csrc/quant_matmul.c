/* y = x @ W^T with W kept in its GGUF block format (Q4_1 or Q8_0) and dequantized on the fly.
 *
 * W is given as one pointer per output row (`rows[n]`: K / 32 blocks of that row), so a fused
 * projection (Q|K|V, gate|up) and llama.cpp's Q/K row permutation are lists of pointers into the
 * mapped GGUF file. The integer (bf16) path computes on a copy packed from those rows once at load
 * (`quant_pack`: 5 bits a Q4_1 weight, 8.5 a Q8_0 one).
 *
 * fp32 x: each weight row is dequantized once per call into a buffer (the same fp32 values gguf's numpy
 * dequantization gives: d * q + m, rounded in that order), then dotted with every row of x, its products
 * summed in one fixed order (16 lanes over k, then a fixed pairwise reduction). bf16 x, where the CPU
 * has AVX512-VNNI: integer dot products over a packed copy of the blocks (`quant_matmul_packed`,
 * below); elsewhere as fp32.
 *
 * Either way a row's result does not depend on the number of rows of x, their grouping or the thread
 * count (batch-invariant by construction). y is written in x's type (bf16 rounded to nearest even, as
 * torch does). K must be a multiple of 32. */
#include "bf16.h"
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

/* --- bf16 x, with AVX512-VNNI: integer dot products over weights packed once into panels.
 *
 * Each 32-value block of an x row is scaled by its largest magnitude and written as two int8 digits,
 * x = dx * (256 a + b) (|a| <= 127, b the rounded rest): ~15 bits against the block's largest value, near
 * the bf16 input's own precision (one digit, llama.cpp's Q8_1, lost ~1 % of a projection and flipped greedy
 * tokens). A weight block's products with it are exact int32 sums (vpdpbusd), scaled after:
 * Q4_1: d_w dx (256 sum q a + sum q b) + m_w sum x; Q8_0 (its q + 128 stored unsigned; the 128 taken off
 * exactly with the digits' sums): d_w dx (256 sum q a + sum q b).
 *
 * `quant_pack` lays a weight out in panels of 16 output rows, block after block: per block the 32 x 16
 * values as 8 vectors of 4 consecutive k for each of the 16 rows (Q4_1 two such vectors in one, as low
 * and high nibbles), then the 16 rows' fp16 scales (and minimums). A vector lane is then one output, so
 * a panel's block against one x row is 16 vpdpbusd with x's 4 bytes broadcast, no reduction across
 * lanes: each output sums its blocks in order, whatever the number of rows or their grouping. */
#if defined(__AVX512VNNI__)
#define VNNI 1
#define INLINE static inline __attribute__((always_inline))
enum { PANEL = 16, P4 = 320, P8 = 544 }; /* outputs a panel; bytes of a panel's block: Q4_1, Q8_0 */
enum { XB = 80, TILE = 8 };             /* bytes of a prepared x block; x rows a tile */

static long panel_block_bytes(int type) { return type == TYPE_Q4_1 ? P4 : P8; }

long quant_pack_bytes(int type, long K, long N) { return (N + PANEL - 1) / PANEL * (K / BLOCK) * panel_block_bytes(type); }

/* N weight rows (GGUF blocks of `type`, K values each) into `out` (quant_pack_bytes); rows past N zero. */
int quant_pack(const uint8_t *const *rows, int type, long K, long N, uint8_t *out, int threads) {
    if (K < BLOCK || K % BLOCK || N < 1 || (type != TYPE_Q4_1 && type != TYPE_Q8_0)) return -1;
    long nb = K / BLOCK, P = panel_block_bytes(type), panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long p = 0; p < panels; p++)
        for (long b = 0; b < nb; b++) {
            uint8_t *o = out + (p * nb + b) * P;
            memset(o, 0, P);
            for (int c = 0; c < PANEL && p * PANEL + c < N; c++) {
                const uint8_t *blk = rows[p * PANEL + c] + b * (type == TYPE_Q4_1 ? 20 : 34);
                if (type == TYPE_Q4_1) { /* GGUF: a byte's low nibble is value j, its high one j + 16 */
                    uint8_t q[BLOCK];
                    for (int j = 0; j < 16; j++) q[j] = blk[4 + j] & 0xF, q[j + 16] = blk[4 + j] >> 4;
                    for (int v = 0; v < 4; v++)
                        for (int j = 0; j < 4; j++) o[64 * v + 4 * c + j] = (uint8_t)(q[4 * v + j] | q[4 * v + 16 + j] << 4);
                    memcpy(o + 256 + 2 * c, blk, 2);
                    memcpy(o + 288 + 2 * c, blk + 2, 2);
                } else {
                    for (int t = 0; t < 8; t++)
                        for (int j = 0; j < 4; j++) o[64 * t + 4 * c + j] = (uint8_t)((int8_t)blk[2 + 4 * t + j] + 128);
                    memcpy(o + 512 + 2 * c, blk, 2);
                }
            }
        }
    return 0;
}

/* One x row (K bf16) as blocks of XB bytes: digits a[32], b[32]; dx, sum x (fp32); sum a, sum b (int32). */
static void prepare(const uint16_t *x, long K, uint8_t *out) {
    for (long blk = 0; blk < K / BLOCK; blk++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + blk * BLOCK + 16 * h)));
            v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
        }
        float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
        uint8_t *o = out + blk * XB;
        __m512i sa = _mm512_setzero_si512(), sb = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512 scaled = _mm512_mul_ps(v[h], inv), hi = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT);
            __m512i a = _mm512_cvtps_epi32(hi);
            __m512i b = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(scaled, hi), _mm512_set1_ps(256.0f)));
            b = _mm512_min_epi32(_mm512_max_epi32(b, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127)); /* as stored */
            _mm_storeu_si128((__m128i *)(o + 16 * h), _mm512_cvtsepi32_epi8(a));
            _mm_storeu_si128((__m128i *)(o + 32 + 16 * h), _mm512_cvtsepi32_epi8(b));
            sa = _mm512_add_epi32(sa, a), sb = _mm512_add_epi32(sb, b);
        }
        float dx = amax / (127.0f * 256.0f), sum = _mm512_reduce_add_ps(_mm512_add_ps(v[0], v[1]));
        int32_t suma = _mm512_reduce_add_epi32(sa), sumb = _mm512_reduce_add_epi32(sb);
        memcpy(o + 64, &dx, 4), memcpy(o + 68, &sum, 4), memcpy(o + 72, &suma, 4), memcpy(o + 76, &sumb, 4);
    }
}

INLINE __m512i bcast(const uint8_t *p) { return _mm512_set1_epi32(*(const int32_t *)p); }
INLINE __m512 bcastf(const uint8_t *p) { return _mm512_set1_ps(*(const float *)p); }

/* The two digits' integer sums of one prepared x block against a block's 8 vectors of weights. */
INLINE __m512i block_sum(const __m512i *w, const uint8_t *xr) {
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (int t = 0; t < 8; t++) {
        a = _mm512_dpbusd_epi32(a, w[t], bcast(xr + 4 * t));
        b = _mm512_dpbusd_epi32(b, w[t], bcast(xr + 32 + 4 * t));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(a, 8), b);
}

/* R prepared x rows (stride `per`) against one panel: y[r * ldy + c] for the panel's `cols` outputs, in
fp32 where `f32`, else bf16. */
INLINE void tile(const uint8_t *w, int type, long nb, const uint8_t *px, long per, int R, void *y, long ldy,
                 __mmask16 cols, int f32) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    __m512 acc[TILE], macc[TILE];
    for (int r = 0; r < R; r++) acc[r] = macc[r] = _mm512_setzero_ps();
    for (long blk = 0; blk < nb; blk++) {
        __m512i q[8];
        __m512 d, m = _mm512_setzero_ps();
        if (type == TYPE_Q4_1) {
            const uint8_t *o = w + blk * P4;
            for (int v = 0; v < 4; v++) {
                __m512i packed = _mm512_loadu_si512(o + 64 * v);
                q[v] = _mm512_and_si512(packed, low), q[v + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            }
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 256)));
            m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 288)));
        } else {
            const uint8_t *o = w + blk * P8;
            for (int t = 0; t < 8; t++) q[t] = _mm512_loadu_si512(o + 64 * t);
            d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(o + 512)));
        }
        for (int r = 0; r < R; r++) {
            const uint8_t *xr = px + r * per + blk * XB;
            __m512i s = block_sum(q, xr);
            if (type == TYPE_Q8_0) { /* the stored q + 128: 128 (256 sum a + sum b) off */
                int32_t off = 128 * (256 * *(const int32_t *)(xr + 72) + *(const int32_t *)(xr + 76));
                s = _mm512_sub_epi32(s, _mm512_set1_epi32(off));
            }
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, bcastf(xr + 64)), acc[r]);
            if (type == TYPE_Q4_1) macc[r] = _mm512_fmadd_ps(m, bcastf(xr + 68), macc[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        __m512 out = _mm512_add_ps(acc[r], macc[r]);
        if (f32) _mm512_mask_storeu_ps((float *)y + r * ldy, cols, out);
        else _mm256_mask_storeu_epi16((uint16_t *)y + r * ldy, cols, to_bf16(out));
    }
}

#define DEF_TILE(R)                                                                                  \
    static void tile_##R(const uint8_t *w, int type, long nb, const uint8_t *px, long per, void *y, long ldy, \
                         __mmask16 cols, int f32) {                                                  \
        if (type == TYPE_Q4_1) tile(w, TYPE_Q4_1, nb, px, per, R, y, ldy, cols, f32);                \
        else tile(w, TYPE_Q8_0, nb, px, per, R, y, ldy, cols, f32);                                  \
    }
DEF_TILE(1) DEF_TILE(2) DEF_TILE(3) DEF_TILE(4) DEF_TILE(5) DEF_TILE(6) DEF_TILE(7) DEF_TILE(8)
typedef void (*tile_fn)(const uint8_t *, int, long, const uint8_t *, long, void *, long, __mmask16, int);
static const tile_fn TILES[TILE + 1] = {0, tile_1, tile_2, tile_3, tile_4, tile_5, tile_6, tile_7, tile_8};
#endif

/* y [m, N] (contiguous; fp32 where `f32` (logits: not rounded to bf16's 8 bits, which would tie the top
 * tokens of a prompt whose best two differ by less than a step of 0.125 at 16-32), else bf16) = x [m, K]
 * (bf16, row stride ldx) @ W^T, W packed by quant_pack. Returns 0, -1 for arguments it does not handle
 * (or a CPU without VNNI), -2 out of memory. */
int quant_matmul_packed(const uint16_t *x, long ldx, const uint8_t *packed, int type, void *y, long m, long K,
                        long N, int f32, int threads) {
#ifdef VNNI
    if (m < 1 || K < BLOCK || K % BLOCK || N < 1 || (type != TYPE_Q4_1 && type != TYPE_Q8_0)) return -1;
    long nb = K / BLOCK, per = nb * XB, P = panel_block_bytes(type);
    uint8_t *px = aligned_alloc(64, (per * m + 63) / 64 * 64); /* C11: a multiple of the alignment */
    if (px == NULL) return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (m >= 16)
    for (long i = 0; i < m; i++) prepare(x + i * ldx, K, px + i * per);
    long panels = (N + PANEL - 1) / PANEL, groups = (m + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) num_threads(threads) collapse(2)
    for (long p = 0; p < panels; p++)
        for (long g = 0; g < groups; g++) {
            long i = g * TILE, left = N - p * PANEL;
            int rows = m - i < TILE ? (int)(m - i) : TILE;
            __mmask16 cols = left >= PANEL ? 0xFFFF : (__mmask16)((1u << left) - 1);
            long at = i * N + p * PANEL;
            void *out = f32 ? (void *)((float *)y + at) : (void *)((uint16_t *)y + at);
            TILES[rows](packed + p * nb * P, type, nb, px + i * per, per, out, N, cols, f32);
        }
    free(px);
    return 0;
#else
    (void)x, (void)ldx, (void)packed, (void)type, (void)y, (void)m, (void)K, (void)N, (void)f32, (void)threads;
    return -1;
#endif
}

/* Whether bf16 x takes the integer path, `quant_matmul_packed` (else `quant_matmul` computes it as fp32). */
int quant_matmul_int8(void) {
#ifdef VNNI
    return __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

int quant_matmul_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c");
}

/* x: [m, K] (row stride ldx elements; fp32, or bf16 when `bf16`: then as fp32), rows: N weight-row
 * pointers of type `type`, y: [m, N] contiguous, in x's type. Returns 0, or -1 for arguments it does not handle. */
int quant_matmul(const void *x, long ldx, const uint8_t *const *rows, int type, void *y, long m, long K, long N,
                 int bf16, int threads) {
    if (m < 1 || K < BLOCK || K % BLOCK || N < 1 || (type != TYPE_Q4_1 && type != TYPE_Q8_0)) return -1;
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
