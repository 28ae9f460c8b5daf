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
 * A group of GROUP panels (48 output columns) is read as streams side by side while the
 * rows' accumulators stay in registers, each taking one broadcast x value per step: on
 * AVX-512, 3 panels by 8 rows (24 registers of 16 floats: per 192 bytes of weights, 24
 * multiply-adds and 11 loads, so a core streams the weights as fast as it reads memory); on
 * AVX2, a panel at a time by 6 rows (12 of its 16 registers; see vf below). Each stream is
 * prefetched 2 KB ahead (the hardware's own prefetchers alone left a step of 8 rows at 10
 * GB/s where a plain read runs at 13-14). A group's weights (k * 192 bytes) stay in the
 * core's L2 while the next rows go through them.
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

/* The kernels run on the target's own vectors (vf of vec.h: VF floats, NV to a panel): 16
 * floats in one AVX-512 register, two AVX2 halves, four NEON or SSE quarters. A pass holds
 * NB panels' accumulators for up to MB_MAX rows in registers (NB * MB * NV vectors, beside
 * NB * NV weight vectors and a broadcast): AVX-512's 32 registers take a whole group (3
 * panels) of 8 rows; AVX2's 16, one panel of 6 rows (8 rows: 6, then 2 from the cache: see
 * TAIL). More would spill accumulators to memory on every multiply-add. */
#if VF == 16
#define NB 3
#define MB_MAX 8
#else /* AVX2: 12 of 16 registers; NEON: 24 of 32 (elsewhere a best effort) */
#define NB 1
#define MB_MAX 6
#endif
#define NV (PANEL / VF)
/* the last one or two rows' pass: a whole group where its 6 or 12 accumulators fit beside
 * the weights (see TAIL); on 4-float vectors, 24 would not */
#if VF >= 8
#define TAIL_NB GROUP
#else
#define TAIL_NB NB
#endif

/* VF int8 weights widened to floats (float32 weights: vec.h's load) */
static inline vf lanes_i8(const signed char *p) {
#if VF == 16 /* (AVX-512) */
    __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    vf out;
    __builtin_memcpy(&out, &f, sizeof out);
    return out;
#elif VF == 8 && defined(__AVX2__)
    __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    vf out;
    __builtin_memcpy(&out, &f, sizeof out);
    return out;
#else
    vf out;
    for (int i = 0; i < VF; i++)
        out[i] = (float)p[i];
    return out;
#endif
}

/* MB rows against NB panels starting at p (output column col); T the weights' element type,
 * LOAD its VF lanes as floats. scale: NULL, or each padded column's scale (the sum times
 * it, before the bias) */
#define ROWS(NAME, T, LOAD, MB, NB)                                                          \
    static void NAME##_##MB##_##NB(const float *x, long ldx, long k, const T *p,             \
                            const float *scale, const float *bias, float *y, long ldy,       \
                            long col, long n) {                                              \
        vf a[NB][NV][MB];                                                                    \
        for (int b = 0; b < NB; b++)                                                         \
            for (int h = 0; h < NV; h++)                                                     \
                for (int r = 0; r < (MB); r++)                                               \
                    a[b][h][r] = (vf){0};                                                    \
        for (long t = 0; t < k; t++) {                                                       \
            for (int b = 0; b < NB; b++)                                                     \
                __builtin_prefetch((const char *)(p + b * k * PANEL + t * PANEL) +           \
                                   PREFETCH_BYTES, 0, 3);                                    \
            vf w[NB][NV];                                                                    \
            for (int b = 0; b < NB; b++)                                                     \
                for (int h = 0; h < NV; h++)                                                 \
                    w[b][h] = LOAD(p + b * k * PANEL + t * PANEL + h * VF);                  \
            for (int r = 0; r < (MB); r++) {                                                 \
                float s = x[r * ldx + t];                                                    \
                for (int b = 0; b < NB; b++)                                                 \
                    for (int h = 0; h < NV; h++)                                             \
                        a[b][h][r] += s * w[b][h];                                           \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < (MB); r++)                                                       \
            for (int b = 0; b < NB; b++)                                                     \
                for (int h = 0; h < NV; h++) {                                               \
                    long c = col + b * PANEL + h * VF, left = n - c;                         \
                    if (left <= 0)                                                           \
                        break;                                                               \
                    vf out = a[b][h][r];                                                     \
                    if (scale)                                                               \
                        out *= *(const vf *)(scale + c);                                     \
                    if (bias)                                                                \
                        out += *(const vf *)(bias + c);                                      \
                    __builtin_memcpy(y + r * ldy + c, &out,                                  \
                                     sizeof(float) * (left < VF ? left : VF));               \
                }                                                                            \
    }

/* rows m0.. of NB panels at p: whole passes of MB_MAX rows (8 or 6), then of 4 */
#define PASSES(NAME)                                                                         \
    for (; MB_MAX == 8 && m0 + 8 <= rows; m0 += 8)                                           \
        NAME##_8_##NB(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);      \
    for (; MB_MAX == 6 && m0 + 6 <= rows; m0 += 6)                                           \
        NAME##_6_##NB(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);      \
    for (; m0 + 4 <= rows; m0 += 4)                                                          \
        NAME##_4_##NB(x + m0 * ldx, ldx, k, p, scale, bias, y + m0 * ldy, ldy, col, n);

/* The one or two rows left (all of a decode step of one or two sequences) against the whole
 * group at once, its 3 panels' streams side by side (6 or 12 accumulators): where a pass
 * holds one panel (AVX2), a row left alone read one stream at a time at 11-12 GB/s where
 * three read 13-14, and two rows kept 4 chains of multiply-adds, each waiting on its last
 * (twice the time of their share of the 6-row pass). The panels are in the cache when
 * passes before went through them. */
#define TAIL(NAME, T, TNB)                                                                      \
    for (int q = 0; q < GROUP && g * width + q * PANEL < n; q += TNB) {                      \
        const T *p = panels + (g * GROUP + q) * k * PANEL;                                   \
        long col = g * width + q * PANEL, r = m0;                                            \
        if (r + 2 <= rows) {                                                                 \
            NAME##_2_##TNB(x + r * ldx, ldx, k, p, scale, bias, y + r * ldy, ldy, col, n); \
            r += 2;                                                                          \
        }                                                                                    \
        if (r < rows)                                                                        \
            NAME##_1_##TNB(x + r * ldx, ldx, k, p, scale, bias, y + r * ldy, ldy, col, n); \
    }

#define KERNEL(NAME, T, LOAD, TNB)                                                           \
    ROWS(NAME, T, LOAD, 8, NB)                                                               \
    ROWS(NAME, T, LOAD, 6, NB)                                                               \
    ROWS(NAME, T, LOAD, 4, NB)                                                               \
    ROWS(NAME, T, LOAD, 2, TNB)                                                              \
    ROWS(NAME, T, LOAD, 1, TNB)                                                              \
    static void NAME(const float *x, long rows, long ldx, long k, const T *panels,           \
                     const float *scale, const float *bias, long n, float *y, long ldy,      \
                     int threads) {                                                          \
        long width = GROUP * PANEL, groups = (n + width - 1) / width;                        \
        _Pragma("omp parallel for num_threads(threads) schedule(static) if (threads > 1)")   \
        for (long g = 0; g < groups; g++) {                                                  \
            long m0 = 0;                                                                     \
            for (int q = 0; q < GROUP; q += NB) {                                            \
                const T *p = panels + (g * GROUP + q) * k * PANEL;                           \
                long col = g * width + q * PANEL;                                            \
                if (col >= n)                                                                \
                    break;                                                                   \
                m0 = 0;                                                                      \
                PASSES(NAME)                                                                 \
            }                                                                                \
            TAIL(NAME, T, TNB) /* (m0: the rows the passes left, 0 to 3) */                  \
        }                                                                                    \
    }

KERNEL(linear_f32, float, load, TAIL_NB)
/* (int8: a panel at a time, as the passes before: the widening of 6 weight vectors a step
 * beside 12 accumulators spilled, 33 -> 26 GB/s at 2 rows on AVX2) */
KERNEL(linear_i8, signed char, lanes_i8, NB)

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
