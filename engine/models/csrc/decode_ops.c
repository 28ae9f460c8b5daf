/* The small operations between a decode step's products, for a few rows of float32: a
 * residual add with the next RMS norm, the rotary embedding of the query and key heads out
 * of the fused q/k/v product, and SiLU(gate) * up. Each replaces several PyTorch calls
 * (each a dispatch and a pass over cold memory, a third of a small model's step) with one.
 *
 * Built with the other decode kernels by engine/models/decode_kernels.py (see
 * engine/models/lean_decode.py for what calls them). One thread: a step's rows are a few
 * vectors. Each row on its own, in a fixed order: a row's results never depend on the
 * others.
 */
#include <math.h>
#include <stddef.h>

#include "vec.h"

/* floats per vector the kernels were built with (vec.h's VF: the target's register width) */
long ap_vector_floats(void) { return VF; }

/* h (rows, n) += delta (NULL: nothing added); x = weight * (h / sqrt(mean(h^2) + eps)), as
 * transformers' Qwen2/Llama RMSNorm in float32 (the mean's sum in VF lanes, then halved) */
void ap_add_rms(float *h, const float *delta, const float *weight, float eps, float *x,
                long rows, long n) {
    for (long r = 0; r < rows; r++) {
        float *hr = h + r * n, *xr = x + r * n;
        if (delta) {
            const float *dr = delta + r * n;
            for (long i = 0; i < n; i++)
                hr[i] = hr[i] + dr[i];
        }
        vf acc = {0};
        long i = 0;
        for (; i + VF <= n; i += VF) {
            vf v = load(hr + i);
            acc += v * v;
        }
        float sum = lanes_sum(acc);
        for (; i < n; i++)
            sum += hr[i] * hr[i];
        float inv = 1.0f / sqrtf(sum / (float)n + eps);
        for (i = 0; i < n; i++)
            xr[i] = weight[i] * (hr[i] * inv);
    }
}

/* the rotary embedding of each row's query and key heads, taken from the fused product's
 * row (qkv, row stride ld: heads * dim query values, then kv_heads * dim key values):
 * out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]); cos and sin
 * (rows, dim). q (rows, heads, dim) and k (rows, kv_heads, dim), contiguous. */
void ap_rotate_qk(const float *qkv, long ld, const float *cos, const float *sin, float *q,
                  float *k, long rows, long heads, long kv_heads, long dim) {
    long half = dim / 2;
    for (long r = 0; r < rows; r++) {
        const float *c = cos + r * dim, *s = sin + r * dim;
        for (long h = 0; h < heads + kv_heads; h++) {
            const float *x = qkv + r * ld + h * dim;
            float *out = h < heads ? q + (r * heads + h) * dim
                                   : k + (r * kv_heads + h - heads) * dim;
            for (long t = 0; t < half; t++)
                out[t] = x[t] * c[t] + (-x[t + half]) * s[t];
            for (long t = half; t < dim; t++)
                out[t] = x[t] * c[t] + x[t - half] * s[t];
        }
    }
}

/* out (rows, width) = silu(gate) * up, gate and up the two halves of each gate_up row
 * (rows, 2 * width); silu(g) = g / (1 + e^-g) */
void ap_silu_mul(const float *gate_up, float *out, long rows, long width) {
    for (long r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * width, *u = g + width;
        float *o = out + r * width;
        long i = 0;
        for (; i + VF <= width; i += VF) {
            vf gv = load(g + i);
            vf sv = gv / (1.0f + vexp(splat(0.0f) - gv));
            vf ov = sv * load(u + i);
            __builtin_memcpy(o + i, &ov, sizeof ov);
        }
        for (; i < width; i++) { /* the same arithmetic on one lane */
            vf gv = splat(g[i]);
            vf sv = gv / (1.0f + vexp(splat(0.0f) - gv));
            o[i] = sv[0] * u[i];
        }
    }
}
