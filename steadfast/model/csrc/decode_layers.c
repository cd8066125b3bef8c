/* A decode step's layers in one call: for bf16 rows that each decode one token, every layer's residual add
 * and RMSNorm, Q|K|V projection, RoPE and K/V store, paged attention, output projection, add and norm,
 * gate|up projection, SwiGLU and down projection, calling the same kernels the model's Python loop calls
 * one by one (linked into this library from their own sources), in the same order on the same buffers: the
 * result is the loop's, bit for bit, without its ~12 Python calls a layer (~1.5 ms of a ~8 ms step).
 *
 * Also the SwiGLU of bf16 rows alone (`silu_mul_bf16`), which the Python loop calls: silu(g) rounded to
 * bf16, then times u rounded to bf16, the rounding points of torch's `F.silu(g) * u`; silu in fp32 as
 * g / (1 + exp(-g)) with a polynomial exp (relative error ~1e-7, so a value can round to the bf16 next
 * to torch's where it lies within that of a rounding boundary). */
#include "bf16.h"
#include "exp16.h"
#include <immintrin.h>
#include <stdint.h>

int add_rms_norm_bf16(uint16_t *x, long ldx, const uint16_t *delta, long ldd, const uint16_t *w, uint16_t *out,
                      long rows, long dim, float eps, int threads);
int quant_matmul_packed(const uint16_t *x, long ldx, const uint8_t *packed, int type, void *y, long m, long K,
                        long N, int f32, int threads);
int rope_kv_store(void *qkv, long ld, const void *cos, const void *sin, long positions, const int64_t *pos,
                  const int64_t *slots, void *kv, long total_slots, long n, int heads, int kv_heads, int dim,
                  int bf16, int threads);
int paged_decode_attention(const void *q, long q_stride, const void *kv, void *out, const int32_t *tables,
                           const int32_t *lens, int n, int max_blocks, int heads, int kv_heads, int num_blocks,
                           int block_size, int dim, float scale, int bf16, int threads);

int decode_layers_supported(void) { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw"); }

static inline __m512 widen(__m256i b) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16)); }

/* gu: [m, 2 * inter] (row stride ld; g then u), out: [m, inter] contiguous; inter a multiple of 16. */
int silu_mul_bf16(const uint16_t *gu, long ld, long m, long inter, uint16_t *out, int threads) {
    if (m < 0 || inter < 16 || inter % 16 || ld < 2 * inter) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (m >= 16)
    for (long i = 0; i < m; i++) {
        const uint16_t *g = gu + i * ld, *u = g + inter;
        for (long k = 0; k < inter; k += 16) {
            __m512 v = load_bf16(g + k);
            __m512 s = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), v))));
            _mm256_storeu_si256((__m256i *)(out + i * inter + k), to_bf16(_mm512_mul_ps(widen(to_bf16(s)), load_bf16(u + k))));
        }
    }
    return 0;
}

/* The model's shape and where its weights lie; the per-layer arrays have `layers` entries (`weights`
 * 4 a layer: Q|K|V, output, gate|up, down, each packed by `quant_pack`; `types` their GGML types). */
struct model {
    int layers, hidden, heads, kv_heads, dim, inter;
    float eps, scale;
    const uint16_t *const *attn_norm, *const *ffn_norm;
    const uint8_t *const *weights;
    const int32_t *types;
    const void *cos, *sin;
    long positions;
};

/* This step: m rows, one token each. kv: layer 0's K/V, `layer_bytes` apart, [2, kv_heads, num_blocks,
 * 16, dim] each. x [m, hidden]: the residual stream, updated; delta [m, hidden]: the last layer's down
 * projection (not yet added to x), written. scratch: bf16, m * (hidden + (heads + 2 kv_heads) dim +
 * heads dim + 3 inter) values. Returns 0; -1 a shape a kernel refuses; -2 out of memory; -3 a position
 * or slot out of range. */
int decode_layers(const struct model *md, long m, const int64_t *pos, const int64_t *slots, const int32_t *tables,
                  const int32_t *lens, int max_blocks, void *kv, long layer_bytes, int num_blocks, uint16_t *x,
                  uint16_t *delta, uint16_t *scratch, int threads) {
    const long hidden = md->hidden, qkv_n = (long)(md->heads + 2 * md->kv_heads) * md->dim;
    const long q_n = (long)md->heads * md->dim, inter = md->inter;
    uint16_t *h = scratch, *qkv = h + m * hidden, *attn = qkv + m * qkv_n, *gu = attn + m * q_n, *act = gu + m * 2 * inter;
    for (int l = 0; l < md->layers; l++) {
        const uint8_t *const *w = md->weights + 4 * l;
        const int32_t *t = md->types + 4 * l;
        void *kv_l = (char *)kv + l * layer_bytes;
        int rc = add_rms_norm_bf16(x, hidden, l ? delta : 0, hidden, md->attn_norm[l], h, m, hidden, md->eps, threads);
        if (!rc) rc = quant_matmul_packed(h, hidden, w[0], t[0], qkv, m, hidden, qkv_n, 0, threads);
        if (!rc) {
            rc = rope_kv_store(qkv, qkv_n, md->cos, md->sin, md->positions, pos, slots, kv_l, (long)num_blocks * 16, m,
                               md->heads, md->kv_heads, md->dim, 1, threads);
            if (rc == -2) return -3;
        }
        if (!rc)
            rc = paged_decode_attention(qkv, qkv_n, kv_l, attn, tables, lens, (int)m, max_blocks, md->heads,
                                        md->kv_heads, num_blocks, 16, md->dim, md->scale, 1, threads);
        if (!rc) rc = quant_matmul_packed(attn, q_n, w[1], t[1], delta, m, q_n, hidden, 0, threads);
        if (!rc) rc = add_rms_norm_bf16(x, hidden, delta, hidden, md->ffn_norm[l], h, m, hidden, md->eps, threads);
        if (!rc) rc = quant_matmul_packed(h, hidden, w[2], t[2], gu, m, hidden, 2 * inter, 0, threads);
        if (!rc) rc = silu_mul_bf16(gu, 2 * inter, m, inter, act, threads);
        if (!rc) rc = quant_matmul_packed(act, inter, w[3], t[3], delta, m, inter, hidden, 0, threads);
        if (rc) return rc;
    }
    return 0;
}
