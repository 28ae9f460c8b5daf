/* A decode step's linear products: y (rows, n) = x (rows, k) . W^T (+ bias) for the few rows
 * of a decode step, reading each weight once at the memory's speed.
 *
 * Built with decode_attention.c into one library by engine/models/decode_kernels.py, which
 * says why and what calls it. Float32 throughout, no Python or torch headers.
 *
 *   panels  W packed once (ap_linear_pack): panel p holds output columns 16p..16p+15, its
 *           element (t, j) = W[16p + j][t] at p*k*16 + t*16 + j; the columns padded with
 *           zeros up to a whole group of GROUP panels
 *   x       (rows, k), row stride ldx (elements)
 *   bias    NULL, or the bias padded as the columns are
 *   y       (rows, n), row stride ldy: only the n real columns are written
 *
 * A group of GROUP panels (48 output columns) is read as GROUP streams, side by side, while
 * up to 8 rows' accumulators (24 vectors of 16 floats) take one broadcast x value each per
 * step: per 192 bytes of weights, 24 multiply-adds and 11 loads, so a core streams the
 * weights as fast as it reads memory. Each stream is prefetched PREFETCH floats ahead (the
 * hardware's own prefetchers alone left a step of 8 rows at 10 GB/s where a plain read runs
 * at 13-14). A group's weights (k * 192 bytes) stay in the core's L2 while the next 8 rows
 * go through them.
 *
 * Each output is one chain of multiply-adds over t = 0..k-1 in order, then the bias: the
 * same operations whatever the number of rows and whichever row chunk it falls in, so a
 * row's result never depends on its batch-mates.
 *
 * Groups are split over `threads` OpenMP threads.
 */
#include <stddef.h>
#include <stdlib.h>

#define GROUP 3
#define PANEL 16
#define PREFETCH 512

#include "vec.h"

long ap_linear_group_columns(void) { return GROUP * PANEL; }

/* W (n, k) row-major into panels (see above); panels holds padded_n * k floats */
void ap_linear_pack(const float *w, long n, long k, float *panels, long padded_n) {
    for (long c = 0; c < padded_n; c++) {
        float *dst = panels + (c / PANEL) * k * PANEL + c % PANEL;
        if (c < n)
            for (long t = 0; t < k; t++)
                dst[t * PANEL] = w[c * k + t];
        else
            for (long t = 0; t < k; t++)
                dst[t * PANEL] = 0.0f;
    }
}

/* MB rows from row m0 against one group of panels starting at p (output column col) */
#define ROWS(MB)                                                                             \
    static void rows_##MB(const float *x, long ldx, long k, const float *p,                  \
                          const float *bias, float *y, long ldy, long col, long n) {         \
        v16 a[GROUP][MB];                                                                    \
        for (int b = 0; b < GROUP; b++)                                                      \
            for (int r = 0; r < (MB); r++)                                                   \
                a[b][r] = (v16){0};                                                          \
        for (long t = 0; t < k; t++) {                                                       \
            for (int b = 0; b < GROUP; b++)                                                  \
                __builtin_prefetch(p + b * k * PANEL + t * PANEL + PREFETCH, 0, 3);          \
            v16 w[GROUP];                                                                    \
            for (int b = 0; b < GROUP; b++)                                                  \
                w[b] = *(const v16 *)(p + b * k * PANEL + t * PANEL);                        \
            for (int r = 0; r < (MB); r++) {                                                 \
                float s = x[r * ldx + t];                                                    \
                for (int b = 0; b < GROUP; b++)                                              \
                    a[b][r] += s * w[b];                                                     \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < (MB); r++)                                                       \
            for (int b = 0; b < GROUP; b++) {                                                \
                long c = col + b * PANEL, left = n - c;                                      \
                if (left <= 0)                                                               \
                    break;                                                                   \
                v16 out = a[b][r];                                                           \
                if (bias)                                                                    \
                    out += *(const v16 *)(bias + c);                                         \
                __builtin_memcpy(y + r * ldy + c, &out,                                      \
                                 sizeof(float) * (left < PANEL ? left : PANEL));             \
            }                                                                                \
    }

ROWS(8)
ROWS(4)
ROWS(2)
ROWS(1)

void ap_linear(const float *x, long rows, long ldx, long k, const float *panels,
               const float *bias, long n, float *y, long ldy, int threads) {
    long width = GROUP * PANEL, groups = (n + width - 1) / width;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long g = 0; g < groups; g++) {
        const float *p = panels + g * GROUP * k * PANEL;
        long col = g * width, m0 = 0;
        for (; m0 + 8 <= rows; m0 += 8)
            rows_8(x + m0 * ldx, ldx, k, p, bias, y + m0 * ldy, ldy, col, n);
        if (m0 + 4 <= rows) {
            rows_4(x + m0 * ldx, ldx, k, p, bias, y + m0 * ldy, ldy, col, n);
            m0 += 4;
        }
        if (m0 + 2 <= rows) {
            rows_2(x + m0 * ldx, ldx, k, p, bias, y + m0 * ldy, ldy, col, n);
            m0 += 2;
        }
        if (m0 < rows)
            rows_1(x + m0 * ldx, ldx, k, p, bias, y + m0 * ldy, ldy, col, n);
    }
}
