/* A decode step's decoder layers in one call: for each layer, the fused q/k/v product, the
 * rotary embedding, the new key and value written into the layer's cache buffers, attention,
 * the output product with the residual add and the next RMS norm, the fused gate/up
 * product, SiLU(gate) * up, and the down product with the residual add and the next norm.
 *
 * The same kernels (decode_linear.c, decode_ops.c, decode_attention.c) on the same operands
 * in the same order as engine/models/lean_decode.py's kernel step calls them one by one from
 * Python, so the results are the same bits; what goes is the Python between them (about 60
 * calls a step, each checking its tensors and making its outputs: 10-15% of a small model's
 * step at one row). Built with them by engine/models/decode_kernels.py; its caller
 * (engine/models/decode_layers.py) checks every shape and pointer before the call.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* one product's packed weights: float32 panels (ap_linear_pack), or int8 panels
 * (ap_linear_pack_i8) with each column's scale; bias NULL or padded as the columns */
typedef struct {
    const void *panels;
    const float *scale;
    const float *bias;
    long n, k;
} ap_product;

/* a decoder layer: its four products, the norm after attention, the norm of what comes
 * next (the next layer's input norm, or the final norm), and its cache buffers (rows,
 * kv_heads, room, dim) by strides in floats, the new column written at `used` */
typedef struct {
    ap_product qkv, o, gate_up, down;
    const float *norm_after, *norm_next;
    float *keys, *values;
    long ksr, ksh, ksc, vsr, vsh, vsc;
} ap_layer;

void ap_linear(const float *x, long rows, long ldx, long k, const float *panels,
               const float *bias, long n, float *y, long ldy, int threads);
void ap_linear_i8(const float *x, long rows, long ldx, long k, const signed char *panels,
                  const float *scale, const float *bias, long n, float *y, long ldy,
                  int threads);
void ap_add_rms(float *h, const float *delta, const float *weight, float eps, float *x,
                long rows, long n);
void ap_rotate_qk(const float *qkv, long ld, const float *cos, const float *sin, float *q,
                  float *k, long rows, long heads, long kv_heads, long dim);
void ap_silu_mul(const float *gate_up, float *out, long rows, long width);
int ap_decode_attention(const float *q, const float *k, long ksr, long ksh, long ksc,
                        const float *v, long vsr, long vsh, long vsc,
                        const unsigned char *keep, long keep_sr, float *out, long rows,
                        long heads, long group, long dim, long columns, float scale,
                        int threads);

long ap_step_layer_bytes(void) { return (long)sizeof(ap_layer); }

static void product(const ap_product *p, const float *x, long rows, float *y, int threads) {
    if (p->scale)
        ap_linear_i8(x, rows, p->k, p->k, p->panels, p->scale, p->bias, p->n, y, p->n,
                     threads);
    else
        ap_linear(x, rows, p->k, p->k, p->panels, p->bias, p->n, y, p->n, threads);
}

/* h (rows, hidden): the hidden states, updated in place; x (rows, hidden): the first
 * layer's input norm of h on entry, the last norm (norm_next of the last layer) on return.
 * cos, sin (rows, dim); keep (rows, used + 1), row stride keep_sr: the columns each row
 * attends to. Returns 0, or -1 where a buffer could not be had (the caches may then hold
 * a written column past `used`, which no one reads). */
int ap_decode_layers(const ap_layer *layers, long count, long rows, long heads, long kv_heads,
                     long dim, float eps, float scaling, float *h, float *x, const float *cos,
                     const float *sin, const unsigned char *keep, long keep_sr, long used,
                     int threads) {
    long hidden = layers[0].o.n, qkv_n = layers[0].qkv.n, width = layers[0].gate_up.n / 2;
    long qd = heads * dim, kd = kv_heads * dim;
    float *buf = malloc(sizeof(float) * rows * (qkv_n + 2 * qd + kd + hidden + 3 * width));
    if (!buf)
        return -1;
    float *qkv = buf, *q = qkv + rows * qkv_n, *k = q + rows * qd, *att = k + rows * kd;
    float *delta = att + rows * qd, *gate_up = delta + rows * hidden;
    float *act = gate_up + rows * 2 * width;
    for (long i = 0; i < count; i++) {
        const ap_layer *L = layers + i;
        product(&L->qkv, x, rows, qkv, threads);
        ap_rotate_qk(qkv, qkv_n, cos, sin, q, k, rows, heads, kv_heads, dim);
        for (long r = 0; r < rows; r++)
            for (long g = 0; g < kv_heads; g++) {
                memcpy(L->keys + r * L->ksr + g * L->ksh + used * L->ksc,
                       k + (r * kv_heads + g) * dim, sizeof(float) * dim);
                memcpy(L->values + r * L->vsr + g * L->vsh + used * L->vsc,
                       qkv + r * qkv_n + qd + kd + g * dim, sizeof(float) * dim);
            }
        if (ap_decode_attention(q, L->keys, L->ksr, L->ksh, L->ksc, L->values, L->vsr, L->vsh,
                                L->vsc, keep, keep_sr, att, rows, kv_heads, heads / kv_heads,
                                dim, used + 1, scaling, threads)) {
            free(buf);
            return -1;
        }
        product(&L->o, att, rows, delta, threads);
        ap_add_rms(h, delta, L->norm_after, eps, x, rows, hidden);
        product(&L->gate_up, x, rows, gate_up, threads);
        ap_silu_mul(gate_up, act, rows, width);
        product(&L->down, act, rows, delta, threads);
        ap_add_rms(h, delta, L->norm_next, eps, x, rows, hidden);
    }
    free(buf);
    return 0;
}

/* The whole step around the layers: each row's embedding (embed: (vocab, hidden) rows; ids
 * checked before anything is written), the first layer's input norm (norm_first), the
 * layers (ap_decode_layers: the caches as it leaves them), then the head product of the last
 * norm into logits (rows, head->n). What ran between these in Python (an embedding lookup,
 * a norm, the head's call: tensors made and checked after a step that streamed every weight
 * through the caches) is one call. Returns 0; -2 where an id is not a row of embed (nothing
 * written); -1 where a buffer could not be had (as ap_decode_layers). */
int ap_decode_step(const ap_layer *layers, long count, long rows, long heads, long kv_heads,
                   long dim, float eps, float scaling, const float *embed, long vocab,
                   const int64_t *ids, const float *norm_first, const ap_product *head,
                   float *logits, const float *cos, const float *sin,
                   const unsigned char *keep, long keep_sr, long used, int threads) {
    long hidden = layers[0].o.n;
    for (long r = 0; r < rows; r++)
        if (ids[r] < 0 || ids[r] >= vocab)
            return -2;
    float *h = malloc(sizeof(float) * rows * hidden * 2);
    if (!h)
        return -1;
    float *x = h + rows * hidden;
    for (long r = 0; r < rows; r++)
        memcpy(h + r * hidden, embed + ids[r] * hidden, sizeof(float) * hidden);
    ap_add_rms(h, NULL, norm_first, eps, x, rows, hidden);
    int failed = ap_decode_layers(layers, count, rows, heads, kv_heads, dim, eps, scaling, h, x,
                                  cos, sin, keep, keep_sr, used, threads);
    if (!failed)
        product(head, x, rows, logits, threads);
    free(h);
    return failed;
}

/* Each row's index of its greatest value in x (rows, n): the first maximal one, or the first
 * NaN where the row has one (torch.max's index over the last dimension). */
void ap_argmax_rows(const float *x, long rows, long n, int64_t *out) {
    for (long r = 0; r < rows; r++) {
        const float *row = x + r * n;
        long best = 0;
        for (long j = 0; j < n; j++) {
            if (row[j] != row[j]) {  /* NaN */
                best = j;
                break;
            }
            if (row[j] > row[best])
                best = j;
        }
        out[r] = best;
    }
}

/* ap_decode_step for rows given by their positions: each row's rotary cos and sin are the
 * row of cos_table and sin_table (table_rows, dim) at its position (the table of
 * engine/models/rope_table.py, whose rows are the bits the model's rotary gives each
 * position), gathered here instead of by PyTorch operations from Python; and, where argmax
 * is not NULL, each row's token of greatest logit after the step (ap_argmax_rows: what the
 * greedy sampler takes). Returns -3 where a position is not a row of the tables (nothing
 * written); otherwise as ap_decode_step. */
int ap_decode_step_at(const ap_layer *layers, long count, long rows, long heads, long kv_heads,
                      long dim, float eps, float scaling, const float *embed, long vocab,
                      const int64_t *ids, const float *norm_first, const ap_product *head,
                      float *logits, const int64_t *positions, const float *cos_table,
                      const float *sin_table, long table_rows, int64_t *argmax,
                      const unsigned char *keep, long keep_sr, long used, int threads) {
    for (long r = 0; r < rows; r++)
        if (positions[r] < 0 || positions[r] >= table_rows)
            return -3;
    float *cos = malloc(sizeof(float) * rows * dim * 2);
    if (!cos)
        return -1;
    float *sin = cos + rows * dim;
    for (long r = 0; r < rows; r++) {
        memcpy(cos + r * dim, cos_table + positions[r] * dim, sizeof(float) * dim);
        memcpy(sin + r * dim, sin_table + positions[r] * dim, sizeof(float) * dim);
    }
    int failed = ap_decode_step(layers, count, rows, heads, kv_heads, dim, eps, scaling, embed,
                                vocab, ids, norm_first, head, logits, cos, sin, keep, keep_sr,
                                used, threads);
    free(cos);
    if (!failed && argmax)
        ap_argmax_rows(logits, rows, head->n, argmax);
    return failed;
}
