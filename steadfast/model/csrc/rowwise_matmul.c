/* y = x @ w in fp32 for every row count, each output element one FMA chain over k = 0..K-1 in order.
 *
 * x: [m, K] (row stride ldx), w: [K, N] row-major (the compute layout's transposed weight), y: [m, N].
 * The work is cut into groups of at most 8 rows and strips of columns; a (group, strip) pair is one
 * task, and within it each output sums its K products in the same order whatever the group, the
 * strip width or the thread: a row's result does not depend on how many rows are computed with it,
 * which rows they are, or on the thread count (batch-invariant by construction). A group of r rows
 * reads its strip of w once, so a few rows (decodes, speculative verification) cost about what one does.
 * N must be a multiple of 16 (one AVX-512 vector). */
#include <immintrin.h>
#include <stddef.h>

#define DEF_STRIP(R, V)                                                                              \
    static inline void strip_##R##_##V(const float *x, long ldx, const float *w, float *y, long K,   \
                                       long N, long j) {                                             \
        __m512 acc[R][V];                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();                             \
        for (long k = 0; k < K; k++) {                                                               \
            const float *wr = w + k * N + j;                                                         \
            __m512 wv[V];                                                                            \
            for (int v = 0; v < V; v++) wv[v] = _mm512_loadu_ps(wr + 16 * v);                        \
            for (int r = 0; r < R; r++) {                                                            \
                __m512 xv = _mm512_set1_ps(x[r * ldx + k]);                                          \
                for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(xv, wv[v], acc[r][v]);       \
            }                                                                                        \
        }                                                                                            \
        for (int r = 0; r < R; r++)                                                                  \
            for (int v = 0; v < V; v++) _mm512_storeu_ps(y + r * N + j + 16 * v, acc[r][v]);         \
    }

/* Strip widths: few rows get wide strips (more independent loads in flight per k), more rows narrower
 * ones, so that a task's accumulators stay within the 32 vector registers. */
DEF_STRIP(1, 8) DEF_STRIP(2, 8) DEF_STRIP(3, 4) DEF_STRIP(4, 4)
DEF_STRIP(5, 2) DEF_STRIP(6, 2) DEF_STRIP(7, 2) DEF_STRIP(8, 2)
DEF_STRIP(1, 1) DEF_STRIP(2, 1) DEF_STRIP(3, 1) DEF_STRIP(4, 1)
DEF_STRIP(5, 1) DEF_STRIP(6, 1) DEF_STRIP(7, 1) DEF_STRIP(8, 1)

static int width(int rows) { return rows <= 2 ? 8 : rows <= 4 ? 4 : 2; }

static void strip(int rows, int wide, const float *x, long ldx, const float *w, float *y, long K, long N,
                  long j) {
#define CASE(R, V)                                                                                   \
    case R: if (wide) strip_##R##_##V(x, ldx, w, y, K, N, j); else strip_##R##_1(x, ldx, w, y, K, N, j); break;
    switch (rows) {
        CASE(1, 8) CASE(2, 8) CASE(3, 4) CASE(4, 4) CASE(5, 2) CASE(6, 2) CASE(7, 2) CASE(8, 2)
    }
#undef CASE
}

int rowwise_matmul_supported(void) { return __builtin_cpu_supports("avx512f"); }

int rowwise_matmul_f32(const float *x, long ldx, const float *w, float *y, long m, long K, long N,
                       int threads) {
    if (m < 1 || K < 1 || N < 16 || N % 16) return -1;
    long groups = (m + 7) / 8;
    long main_strips[8], tail_strips[8];
    /* Every group has 8 rows but the last; strips depend on the group's row count. */
    for (int r = 1; r <= 8; r++) {
        long wide = 16L * width(r);
        main_strips[r - 1] = N / wide;
        tail_strips[r - 1] = (N - main_strips[r - 1] * wide) / 16;
    }
    long full = m / 8 * 8 == m ? groups : groups - 1; /* groups of exactly 8 rows */
    long s8 = main_strips[7] + tail_strips[7];
    int last = (int)(m - full * 8); /* rows of the last, smaller group (0: none) */
    long slast = last ? main_strips[last - 1] + tail_strips[last - 1] : 0;
    long tasks = full * s8 + slast;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < tasks; t++) {
        long g, s;
        int rows;
        if (t < full * s8) { g = t / s8; s = t % s8; rows = 8; }
        else { g = full; s = t - full * s8; rows = last; }
        long nmain = main_strips[rows - 1], wide = 16L * width(rows);
        long j = s < nmain ? s * wide : nmain * wide + (s - nmain) * 16;
        strip(rows, s < nmain, x + g * 8 * ldx, ldx, w, y + g * 8 * N, K, N, j);
    }
    return 0;
}
