/* A CPU decode step's attention: one query per row, each key/value head's group of query
 * heads against that row's keys and values, reading each key and value once.
 *
 * Built by engine/models/decode_kernels.py with the machine's C compiler and loaded through
 * ctypes; see that module for why and for what calls it. No Python or torch headers: plain
 * pointers and strides (in elements), float32 throughout.
 *
 *   q      (rows, kv_heads, group, dim), contiguous
 *   k, v   element (r, h, c, t) at r*sr + h*sh + c*sc + t (t contiguous)
 *   keep   (rows, columns) bytes, row stride keep_sr; a column whose byte is 0 is not
 *          attended (its key and value are not read); NULL: every column is attended
 *   out    (rows, kv_heads, group, dim), contiguous: the softmax over the kept columns of
 *          scale * q.k, times v
 *
 * Per (row, head) pair, in a buffer of the thread's own: the scores (-inf where not kept),
 * their softmax's weights (a vectorized exp), then the weighted sum of the values, scaled by
 * one over the weights' sum at the end. Every sum runs over the row's own columns from its
 * first kept one, in column order (the weights' sum in VF lanes counted from that column):
 * a row whose kept columns are its last ones (the running batch's left padding) gets the
 * same bits whatever the frame's width, that is whatever its batch-mates.
 *
 * Work is split over (row, head) pairs on `threads` OpenMP threads (the process's own
 * OpenMP runtime: the library names libgomp.so.1, which torch has already loaded).
 */
#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "vec.h"

#define MAX_GROUP 16
/* keys and values are prefetched this many columns ahead of the one read (the hardware's
 * prefetchers alone left a step's attention at 5.5 GB/s on this project's machines; 8
 * columns ahead, 7.8: scripts/attention_bench.py) */
#define PREFETCH 8
#define MAX_DIM 256

int ap_decode_limits(int *max_group, int *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 1;
}

/* one (row, head) pair's scores. A dot product runs on vectors of VF floats (see vec.h)
 * and adds the lanes by halving at the end; a head size that is not a multiple of 16 takes
 * the plain loop. */
/* column c's scores (-inf where it is not kept) */
#define SCORES_COLUMN(DIM, c)                                                                \
    if (kr && !kr[c]) {                                                                      \
        for (long j = 0; j < group; j++)                                                     \
            sp[j * columns + (c)] = -INFINITY;                                               \
    } else {                                                                                 \
        const float *kc = kp + (c) * sc;                                                     \
        for (long j = 0; j < group; j++) {                                                   \
            const float *qj = qp + j * (DIM);                                                \
            vf acc = {0};                                                                    \
            for (long t = 0; t < (DIM); t += VF)                                             \
                acc += load(qj + t) * load(kc + t);                                          \
            sp[j * columns + (c)] = lanes_sum(acc) * scale;                                  \
        }                                                                                    \
    }

/* four kept columns at a time (their dot products side by side: four independent chains
 * for the processor to overlap); a block with padding in it, and the last columns, one at a
 * time */
#define SCORES_BODY(DIM)                                                                     \
    long c = 0;                                                                              \
    for (; c + 4 <= columns; c += 4) {                                                       \
        if (kr && !(kr[c] && kr[c + 1] && kr[c + 2] && kr[c + 3])) {                         \
            for (long i = c; i < c + 4; i++) {                                               \
                SCORES_COLUMN(DIM, i)                                                        \
            }                                                                                \
            continue;                                                                        \
        }                                                                                    \
        const float *k0 = kp + c * sc, *k1 = k0 + sc, *k2 = k1 + sc, *k3 = k2 + sc;          \
        for (long l = 0; l < 4 * (DIM); l += 16) /* the keys PREFETCH columns on */          \
            __builtin_prefetch(kp + (c + PREFETCH + l / (DIM)) * sc + l % (DIM), 0, 3);      \
        for (long j = 0; j < group; j++) {                                                   \
            const float *qj = qp + j * (DIM);                                                \
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                       \
            for (long t = 0; t < (DIM); t += VF) {                                           \
                vf x = load(qj + t);                                                         \
                a0 += x * load(k0 + t);                                                      \
                a1 += x * load(k1 + t);                                                      \
                a2 += x * load(k2 + t);                                                      \
                a3 += x * load(k3 + t);                                                      \
            }                                                                                \
            float *out = sp + j * columns + c;                                               \
            out[0] = lanes_sum(a0) * scale;                                                  \
            out[1] = lanes_sum(a1) * scale;                                                  \
            out[2] = lanes_sum(a2) * scale;                                                  \
            out[3] = lanes_sum(a3) * scale;                                                  \
        }                                                                                    \
    }                                                                                        \
    for (; c < columns; c++) {                                                               \
        SCORES_COLUMN(DIM, c)                                                                \
    }

static void scores_pair(const float *qp, const float *kp, long sc, const unsigned char *kr,
                        float *sp, long group, long dim, long columns, float scale) {
    if (dim % 16) {
        for (long c = 0; c < columns; c++)
            for (long j = 0; j < group; j++) {
                float acc = 0.0f;
                if (kr && !kr[c]) {
                    sp[j * columns + c] = -INFINITY;
                    continue;
                }
                for (long t = 0; t < dim; t++)
                    acc += qp[j * dim + t] * kp[c * sc + t];
                sp[j * columns + c] = acc * scale;
            }
        return;
    }
    switch (dim) {
    case 64: { SCORES_BODY(64) } break;
    case 128: { SCORES_BODY(128) } break;
    case 32: { SCORES_BODY(32) } break;
    default: { SCORES_BODY(dim) } break;
    }
}

/* one (row, head) pair's output: each kept column's value, weighted by each query's
 * probability, added into the group's accumulators (vectors of VF floats where the head size
 * is a multiple of 16) */
#define VALUES_BODY(DIM)                                                                     \
    for (long c = 0; c < columns; c++) {                                                     \
        if (kr && !kr[c])                                                                    \
            continue;                                                                        \
        const float *vc = vp + c * sc;                                                       \
        for (long l = 0; l < (DIM); l += 16) /* the values PREFETCH columns on */            \
            __builtin_prefetch(vc + PREFETCH * sc + l, 0, 3);                                \
        for (long j = 0; j < group; j++) {                                                   \
            vf w = splat(pp[j * columns + c]);                                               \
            for (long t = 0; t < (DIM) / VF; t++)                                            \
                acc[j][t] += w * load(vc + VF * t);                                          \
        }                                                                                    \
    }

static void values_pair(const float *pp, const float *vp, long sc, const unsigned char *kr,
                        float *op, long group, long dim, long columns) {
    if (dim % 16) {
        for (long j = 0; j < group; j++)
            for (long t = 0; t < dim; t++)
                op[j * dim + t] = 0.0f;
        for (long c = 0; c < columns; c++) {
            if (kr && !kr[c])
                continue;
            for (long j = 0; j < group; j++)
                for (long t = 0; t < dim; t++)
                    op[j * dim + t] += pp[j * columns + c] * vp[c * sc + t];
        }
        return;
    }
    vf acc[MAX_GROUP][MAX_DIM / VF];
    for (long j = 0; j < group; j++)
        for (long t = 0; t < dim / VF; t++)
            acc[j][t] = (vf){0};
    switch (dim) {
    case 64: VALUES_BODY(64) break;
    case 128: VALUES_BODY(128) break;
    case 32: VALUES_BODY(32) break;
    default: VALUES_BODY(dim) break;
    }
    for (long j = 0; j < group; j++)
        for (long t = 0; t < dim / VF; t++)
            __builtin_memcpy(op + j * dim + VF * t, &acc[j][t], sizeof(vf));
}

/* each group row's scores into softmax weights (not divided by their sum: inv gets one over
 * it); from the row's first kept column, VF at a time, the last ones padded with -inf */
static void softmax_pair(float *sp, const unsigned char *kr, long group, long columns,
                         float *inv) {
    long c0 = 0;
    if (kr)
        while (c0 < columns && !kr[c0])
            c0++;
    for (long j = 0; j < group; j++) {
        float *s = sp + j * columns, m = -INFINITY;
        long c = c0;
        vf top = splat(-INFINITY);
        vi nan = {0};
        for (; c + VF <= columns; c += VF) {
            vf x = load(s + c);
            vi more = x > top;
            nan |= x != x;
            top = (vf)(((vi)x & more) | ((vi)top & ~more));
        }
        int any_nan = 0;
        for (int lane = 0; lane < VF; lane++) {
            m = top[lane] > m ? top[lane] : m;
            any_nan |= nan[lane];
        }
        for (; c < columns; c++) {
            m = s[c] > m ? s[c] : m;
            any_nan |= s[c] != s[c];
        }
        if (any_nan) /* a NaN score makes the row's weights NaN, as torch's softmax does */
            m = NAN;
        else if (m == -INFINITY) { /* nothing kept: no weights (the output is 0) */
            for (c = 0; c < columns; c++)
                s[c] = 0.0f;
            inv[j] = 0.0f;
            continue;
        }
        vf acc = {0}, none = splat(-INFINITY);
        top = splat(m);
        for (c = c0; c + VF <= columns; c += VF) {
            vf x = load(s + c);
            vi kept = (x > none) | (x != x);
            vf e = (vf)((vi)vexp(x - top) & kept);
            __builtin_memcpy(s + c, &e, sizeof e);
            acc += e;
        }
        if (c < columns) { /* the last few, padded with -inf */
            long n = columns - c;
            vf x = none;
            __builtin_memcpy(&x, s + c, sizeof(float) * n);
            vi kept = (x > none) | (x != x);
            vf e = (vf)((vi)vexp(x - top) & kept);
            __builtin_memcpy(s + c, &e, sizeof(float) * n);
            acc += e;
        }
        inv[j] = 1.0f / lanes_sum(acc);
    }
}

/* returns 0, or -1 where a thread's buffer could not be had (out is then not written) */
int ap_decode_attention(const float *q, const float *k, long ksr, long ksh, long ksc,
                        const float *v, long vsr, long vsh, long vsc,
                        const unsigned char *keep, long keep_sr, float *out, long rows,
                        long heads, long group, long dim, long columns, float scale,
                        int threads) {
    long pairs = rows * heads;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * group * columns);
        if (!buf)
            failed = 1;
#pragma omp for schedule(static)
        for (long p = 0; p < pairs; p++) {
            if (!buf)
                continue;
            long r = p / heads, h = p % heads;
            const unsigned char *kr = keep ? keep + r * keep_sr : NULL;
            float inv[MAX_GROUP], *op = out + p * group * dim;
            scores_pair(q + p * group * dim, k + r * ksr + h * ksh, ksc, kr, buf, group, dim,
                        columns, scale);
            softmax_pair(buf, kr, group, columns, inv);
            values_pair(buf, v + r * vsr + h * vsh, vsc, kr, op, group, dim, columns);
            for (long j = 0; j < group; j++)
                for (long t = 0; t < dim; t++)
                    op[j * dim + t] *= inv[j];
        }
        free(buf);
    }
    return failed ? -1 : 0;
}
