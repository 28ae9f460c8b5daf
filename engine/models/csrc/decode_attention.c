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
 *   scores (rows, kv_heads, group, columns), contiguous: scale * q.k, -inf where not kept
 *   probs  the same shape (softmax of scores, by the caller)
 *   out    (rows, kv_heads, group, dim), contiguous: sum over kept columns of probs * v
 *
 * Work is split over (row, head) pairs on `threads` OpenMP threads (the process's own
 * OpenMP runtime: the library names libgomp.so.1, which torch has already loaded).
 */
#include <math.h>
#include <stddef.h>

#define MAX_GROUP 16
#define MAX_DIM 256

int ap_decode_limits(int *max_group, int *max_dim) {
    *max_group = MAX_GROUP;
    *max_dim = MAX_DIM;
    return 1;
}

/* one (row, head) pair's scores. A dot product runs on vectors of 16 floats (GCC's and
 * clang's vector extensions: the compiler picks the registers the target has) and adds the
 * 16 lanes by halving at the end; a head size that is not a multiple of 16 takes the plain
 * loop. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

static inline float lanes_sum(v16 a) {
    v8 lo, hi;
    __builtin_memcpy(&lo, &a, sizeof lo);
    __builtin_memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    v8 b = lo + hi;
    v4 c, d;
    __builtin_memcpy(&c, &b, sizeof c);
    __builtin_memcpy(&d, (const char *)&b + sizeof c, sizeof d);
    v4 e = c + d;
    return (e[0] + e[2]) + (e[1] + e[3]);
}

/* column c's scores (-inf where it is not kept) */
#define SCORES_COLUMN(DIM, c)                                                                \
    if (kr && !kr[c]) {                                                                      \
        for (long j = 0; j < group; j++)                                                     \
            sp[j * columns + (c)] = -INFINITY;                                               \
    } else {                                                                                 \
        const float *kc = kp + (c) * sc;                                                     \
        for (long j = 0; j < group; j++) {                                                   \
            const float *qj = qp + j * (DIM);                                                \
            v16 acc = {0};                                                                   \
            for (long t = 0; t < (DIM); t += 16)                                             \
                acc += *(const v16 *)(qj + t) * *(const v16 *)(kc + t);                      \
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
        for (long j = 0; j < group; j++) {                                                   \
            const float *qj = qp + j * (DIM);                                                \
            v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};                                      \
            for (long t = 0; t < (DIM); t += 16) {                                           \
                v16 x = *(const v16 *)(qj + t);                                              \
                a0 += x * *(const v16 *)(k0 + t);                                            \
                a1 += x * *(const v16 *)(k1 + t);                                            \
                a2 += x * *(const v16 *)(k2 + t);                                            \
                a3 += x * *(const v16 *)(k3 + t);                                            \
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

void ap_decode_scores(const float *q, const float *k, long sr, long sh, long sc,
                      const unsigned char *keep, long keep_sr, float *scores,
                      long rows, long heads, long group, long dim, long columns, float scale,
                      int threads) {
    long pairs = rows * heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long p = 0; p < pairs; p++) {
        long r = p / heads, h = p % heads;
        scores_pair(q + p * group * dim, k + r * sr + h * sh, sc,
                    keep ? keep + r * keep_sr : NULL, scores + p * group * columns, group, dim,
                    columns, scale);
    }
}

/* one (row, head) pair's output: each kept column's value, weighted by each query's
 * probability, added into the group's accumulators (vectors of 16 floats where the head size
 * is a multiple of 16) */
#define VALUES_BODY(DIM)                                                                     \
    for (long c = 0; c < columns; c++) {                                                     \
        if (kr && !kr[c])                                                                    \
            continue;                                                                        \
        const float *vc = vp + c * sc;                                                       \
        for (long j = 0; j < group; j++) {                                                   \
            float w = pp[j * columns + c];                                                   \
            for (long t = 0; t < (DIM) / 16; t++)                                            \
                acc[j][t] += w * *(const v16 *)(vc + 16 * t);                                \
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
    v16 acc[MAX_GROUP][MAX_DIM / 16];
    for (long j = 0; j < group; j++)
        for (long t = 0; t < dim / 16; t++)
            acc[j][t] = (v16){0};
    switch (dim) {
    case 64: VALUES_BODY(64) break;
    case 128: VALUES_BODY(128) break;
    case 32: VALUES_BODY(32) break;
    default: VALUES_BODY(dim) break;
    }
    for (long j = 0; j < group; j++)
        for (long t = 0; t < dim / 16; t++)
            __builtin_memcpy(op + j * dim + 16 * t, &acc[j][t], sizeof(v16));
}

void ap_decode_values(const float *probs, const float *v, long sr, long sh, long sc,
                      const unsigned char *keep, long keep_sr, float *out, long rows,
                      long heads, long group, long dim, long columns, int threads) {
    long pairs = rows * heads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (long p = 0; p < pairs; p++) {
        long r = p / heads, h = p % heads;
        values_pair(probs + p * group * columns, v + r * sr + h * sh, sc,
                    keep ? keep + r * keep_sr : NULL, out + p * group * dim, group, dim,
                    columns);
    }
}
