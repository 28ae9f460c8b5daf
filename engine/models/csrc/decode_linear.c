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
 * weights as fast as it reads memory. Each stream is prefetched 2 KB ahead (the
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
/* bytes prefetched ahead of each stream: 512 floats (2 KB) */
#define PREFETCH_BYTES 2048

#include "vec.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* int8 weights (--quantization int8): the same panels of 16 columns, an element a byte,
 * each column's scale and bias applied once its sum is done */
void ap_linear_pack_i8(const signed char *w, long n, long k, signed char *panels,
                       long padded_n) {
    for (long c = 0; c < padded_n; c++) {
        signed char *dst = panels + (c / PANEL) * k * PANEL + c % PANEL;
        for (long t = 0; t < k; t++)
            dst[t * PANEL] = c < n ? w[c * k + t] : 0;
    }
}

static inline v16 load_f32(const float *p) { return *(const v16 *)p; }

/* 16 int8 lanes as floats (exact: every int8 is a float). GCC 12 turns the vector
 * extensions' conversion of 16 bytes to 16 floats into 16 scalar conversions, so on x86
 * the sign extension is spelt out; elsewhere a loop the compiler vectorizes. */
static inline v16 load_i8(const signed char *p) {
#if defined(__AVX512F__)
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    v16 out;
    __builtin_memcpy(&out, &f, sizeof out);
    return out;
#elif defined(__AVX2__)
    __m128i b = _mm_loadu_si128((const __m128i *)p);
    __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
    v16 out;
    __builtin_memcpy(&out, &lo, sizeof lo);
    __builtin_memcpy((char *)&out + sizeof lo, &hi, sizeof hi);
    return out;
#else
    v16 out;
    for (int i = 0; i < 16; i++)
        out[i] = (float)p[i];
    return out;
#endif
}

/* MB rows against one group of panels starting at p (output column col); T the weights'
 * element type, LOAD its 16 lanes as floats, STEP the bytes prefetched ahead per stream.
 * scale: NULL, or each padded column's scale (the sum times it, before the bias) */
#define ROWS(NAME, T, LOAD, MB)                                                              \
    static void NAME##_##MB(const float *x, long ldx, long k, const T *p,                    \
                            const float *scale, const float *bias, float *y, long ldy,       \
                            long col, long n) {                                              \
        v16 a[GROUP][MB];                                                                    \
        for (int b = 0; b < GROUP; b++)                                                      \
            for (int r = 0; r < (MB); r++)                                                   \
                a[b][r] = (v16){0};                                                          \
        for (long t = 0; t < k; t++) {                                                       \
            for (int b = 0; b < GROUP; b++)                                                  \
                __builtin_prefetch((const char *)(p + b * k * PANEL + t * PANEL) +           \
                                   PREFETCH_BYTES, 0, 3);                                    \
            v16 w[GROUP];                                                                    \
            for (int b = 0; b < GROUP; b++)                                                  \
                w[b] = LOAD(p + b * k * PANEL + t * PANEL);                                  \
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
                if (scale)                                                                   \
                    out *= *(const v16 *)(scale + c);                                        \
                if (bias)                                                                    \
                    out += *(const v16 *)(bias + c);                                         \
                __builtin_memcpy(y + r * ldy + c, &out,                                      \
                                 sizeof(float) * (left < PANEL ? left : PANEL));             \
            }                                                                                \
    }

#define KERNEL(NAME, T, LOAD)                                                                \
    ROWS(NAME, T, LOAD, 8)                                                                   \
    ROWS(NAME, T, LOAD, 4)                                                                   \
    ROWS(NAME, T, LOAD, 2)                                                                   \
    ROWS(NAME, T, LOAD, 1)                                                                   \
    static void NAME(const float *x, long rows, long ldx, long k, const T *panels,           \
                     const float *scale, const float *bias, long n, float *y, long ldy,      \
                     int threads) {                                                          \
        long width = GROUP * PANEL, groups = (n + width - 1) / width;                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")   \
        for (long g = 0; g < groups; g++) {                                                  \
            const T *p = panels + g * GROUP * k * PANEL;                                     \
            long col = g * width, m0 = 0;                                                    \
            for (; m0 + 8 <= rows; m0 += 8)                                                  \
                NAME##_8(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);   \
            if (m0 + 4 <= rows) {                                                            \
                NAME##_4(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);   \
                m0 += 4;                                                                     \
            }                                                                                \
            if (m0 + 2 <= rows) {                                                            \
                NAME##_2(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);   \
                m0 += 2;                                                                     \
            }                                                                                \
            if (m0 < rows)                                                                   \
                NAME##_1(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);   \
        }                                                                                    \
    }

KERNEL(linear_f32, float, load_f32)
KERNEL(linear_i8, signed char, load_i8)

void ap_linear(const float *x, long rows, long ldx, long k, const float *panels,
               const float *bias, long n, float *y, long ldy, int threads) {
    linear_f32(x, rows, ldx, k, panels, NULL, bias, n, y, ldy, threads);
}

/* y = (x . Q^T) * scale + bias for int8 panels Q (ap_linear_pack_i8); scale and bias (NULL:
 * none) padded as the columns are */
void ap_linear_i8(const float *x, long rows, long ldx, long k, const signed char *panels,
                  const float *scale, const float *bias, long n, float *y, long ldy,
                  int threads) {
    linear_i8(x, rows, ldx, k, panels, scale, bias, n, y, ldy, threads);
}
