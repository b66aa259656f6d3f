/* One decode step of a Llama-architecture model in one C call: every layer's RMSNorms, rotary
 * embedding, KV-cache write, one-query attention, SiLU gate and residuals, with the seven linear
 * layers of each run by their own one-row kernels (lut4.c's fb_lut4_row, w4a8.c's fb_w4a8_row,
 * int8w.c's fb_int8w_row, int8mm.c's fb_w8a8_amx_row: all int32 f(const void *args, const float
 * *x, float *y)) through the addresses Python hands over. What it replaces is Python: ~45 torch
 * ops a layer at 2-8 us each, more than a small model's layers' arithmetic.
 *
 * float32 throughout. The elementwise steps are the torch decode path's operations in its order
 * (rotary: q * cos + rotate_half(q) * sin; -ffp-contract=off keeps each product rounded, so these
 * are bit for bit); the reductions have their own order and precision: the RMSNorm's sum of
 * squares in double, the attention's dot products and weighted sums in float32 over 16 lanes, exp
 * from libm. models/decoder.py's torch path (transformers' sdpa forward bit for bit) is the
 * reference; tests/kernels/test_decode.py bounds each step against float64 and the whole step
 * against the reference. */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef int32_t (*RowFn)(const void *args, const float *x, float *y);

typedef struct {
    RowFn fn;
    const void *args;
    const float *bias; /* [out] or NULL: added in float32 after the kernel, as QuantLinear does */
    int64_t out;
} Lin;

typedef struct {
    Lin q, k, v, o, gate, up, down;
    const float *norm1, *norm2; /* [d] RMSNorm weights */
    float eps1, eps2;
} DecLayer;

typedef struct {
    int64_t layers, d, heads, kv_heads, head_dim, inter, capacity;
    const DecLayer *layer;
    float *k_cache, *v_cache;   /* [layers, kv_heads, capacity, head_dim] */
    const float *cos, *sin;     /* [capacity, head_dim] */
    float scaling;
    const float *norm_f;        /* [d] the final RMSNorm's weight */
    float eps_f;
    /* scratch: x [d], q [heads * head_dim], k, v [kv_heads * head_dim], att [heads * head_dim],
     * g, u [inter], o [d], scores [capacity] */
    float *x, *q, *k, *v, *att, *g, *u, *o, *scores;
    int64_t failed_layer, failed_linear; /* where a kernel returned non-zero */
} DecModel;

#define LANES 16

/* out = weight * (h * (1 / sqrt(mean(h^2) + eps))): transformers' RMSNorm in float32 with the
 * mean's sum in double */
void fb_decode_rms_norm(const float *h, const float *weight, float eps, int64_t d, float *out) {
    double acc[8] = {0};
    int64_t i = 0;
    for (; i + 8 <= d; i += 8)
        for (int j = 0; j < 8; j++) acc[j] += (double)h[i + j] * (double)h[i + j];
    double s = 0.0;
    for (; i < d; i++) s += (double)h[i] * (double)h[i];
    for (int j = 0; j < 8; j++) s += acc[j];
    const float variance = (float)(s / (double)d);
    const float r = 1.0f / sqrtf(variance + eps);
    for (i = 0; i < d; i++) out[i] = weight[i] * (h[i] * r);
}

/* x [n_heads, hd] rotated in place: x * cos + rotate_half(x) * sin */
void fb_decode_rope(float *x, int64_t n_heads, int64_t hd, const float *cos, const float *sin) {
    const int64_t half = hd / 2;
    float rot[512];
    for (int64_t h = 0; h < n_heads; h++) {
        float *v = x + h * hd;
        for (int64_t j = 0; j < half; j++) {
            rot[j] = -v[j + half];
            rot[j + half] = v[j];
        }
        for (int64_t j = 0; j < hd; j++) {
            const float a = v[j] * cos[j], b = rot[j] * sin[j];
            v[j] = a + b;
        }
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* out [heads, hd] = softmax(q k^T * scaling) v for one query per head over positions [0, len)
 * of k, v [kv_heads, capacity, hd]; query head h reads kv head h / (heads / kv_heads) */
void fb_decode_attend(const float *q, const float *k, const float *v, int64_t heads, int64_t kv_heads,
                      int64_t capacity, int64_t hd, int64_t len, float scaling, float *scores, float *out) {
    const int64_t group = heads / kv_heads;
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * hd;
        const float *kh = k + (h / group) * capacity * hd, *vh = v + (h / group) * capacity * hd;
        float m = -INFINITY;
        for (int64_t p = 0; p < len; p++) {
            scores[p] = dot(qh, kh + p * hd, hd) * scaling;
            if (scores[p] > m) m = scores[p];
        }
        float sum = 0.0f;
        for (int64_t p = 0; p < len; p++) {
            scores[p] = expf(scores[p] - m);
            sum += scores[p];
        }
        float *oh = out + h * hd;
        for (int64_t j = 0; j < hd; j++) oh[j] = 0.0f;
        for (int64_t p = 0; p < len; p++) {
            const float w = scores[p];
            const float *vp = vh + p * hd;
            for (int64_t j = 0; j < hd; j++) oh[j] += w * vp[j];
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < hd; j++) oh[j] *= inv;
    }
}

/* g = silu(g) * u, silu(x) = x / (1 + exp(-x)) */
void fb_decode_silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

static int32_t linear(const Lin *l, const float *x, float *y) {
    const int32_t rc = l->fn(l->args, x, y);
    if (rc == 0 && l->bias)
        for (int64_t i = 0; i < l->out; i++) y[i] += l->bias[i];
    return rc;
}

#define RUN(which, index, x, y)                                   \
    do {                                                          \
        const int32_t rc_ = linear(&L->which, (x), (y));         \
        if (rc_) {                                                \
            m->failed_layer = l;                                  \
            m->failed_linear = (index);                           \
            return rc_;                                           \
        }                                                         \
    } while (0)

/* h [d]: the embedding of the token at position pos in, the final RMSNorm of the last layer's
 * output out (in m->x); the token's k and v written into the caches at pos. Returns 0, -1 for
 * arguments out of range, or the first non-zero return code of a linear kernel (its layer and
 * index, 0-6 for q k v o gate up down, in failed_layer / failed_linear). */
int32_t fb_decode_step(DecModel *m, float *h, int64_t pos) {
    const int64_t d = m->d, hd = m->head_dim, H = m->heads, KVH = m->kv_heads, P = m->capacity;
    if (pos < 0 || pos >= P || hd > 512 || hd % 2 || KVH < 1 || H % KVH) return -1;
    m->failed_layer = m->failed_linear = -1;
    const float *cos = m->cos + pos * hd, *sin = m->sin + pos * hd;
    for (int64_t l = 0; l < m->layers; l++) {
        const DecLayer *L = m->layer + l;
        fb_decode_rms_norm(h, L->norm1, L->eps1, d, m->x);
        RUN(q, 0, m->x, m->q);
        RUN(k, 1, m->x, m->k);
        RUN(v, 2, m->x, m->v);
        fb_decode_rope(m->q, H, hd, cos, sin);
        fb_decode_rope(m->k, KVH, hd, cos, sin);
        float *kc = m->k_cache + l * KVH * P * hd, *vc = m->v_cache + l * KVH * P * hd;
        for (int64_t g = 0; g < KVH; g++) {
            memcpy(kc + (g * P + pos) * hd, m->k + g * hd, sizeof(float) * (size_t)hd);
            memcpy(vc + (g * P + pos) * hd, m->v + g * hd, sizeof(float) * (size_t)hd);
        }
        fb_decode_attend(m->q, kc, vc, H, KVH, P, hd, pos + 1, m->scaling, m->scores, m->att);
        RUN(o, 3, m->att, m->o);
        for (int64_t i = 0; i < d; i++) h[i] += m->o[i];
        fb_decode_rms_norm(h, L->norm2, L->eps2, d, m->x);
        RUN(gate, 4, m->x, m->g);
        RUN(up, 5, m->x, m->u);
        fb_decode_silu_mul(m->g, m->u, m->inter);
        RUN(down, 6, m->g, m->o);
        for (int64_t i = 0; i < d; i++) h[i] += m->o[i];
    }
    fb_decode_rms_norm(h, m->norm_f, m->eps_f, d, m->x);
    return 0;
}
