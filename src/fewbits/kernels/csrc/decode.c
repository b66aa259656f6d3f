/* One decode step of a Llama-architecture model in one C call: every layer's RMSNorms, rotary
 * embedding (after Qwen3's per-head q/k RMSNorms where the layer has them), KV-cache write,
 * one-query attention, SiLU or GELU (tanh) gate and residuals (and, per layer where given, Gemma
 * 2/3's norms of the attention's and the MLP's outputs, a sliding window, a rotary table of its own,
 * Gemma 2's capped attention scores;
 * Phi-3's fused q/k/v and gate/up kernels), with the seven linear layers of each run by their
 * own one-row kernels (lut4.c's fb_lut4_row, introw.c's fb_introw_row, w4a8.c's fb_w4a8_row,
 * int8w.c's fb_int8w_row, int8mm.c's fb_w8a8_amx_row: all int32 f(const void *args, const float
 * *x, float *y)) through the addresses Python hands over. What it replaces is Python: ~45 torch
 * ops a layer at 2-8 us each, more than a small model's layers' arithmetic.
 *
 * float32 throughout. The elementwise steps are the torch decode path's operations in its order
 * (rotary: q * cos + rotate_half(q) * sin; -ffp-contract=off keeps each product rounded, so these
 * are bit for bit); the reductions have their own order and precision: the RMSNorm's sum of
 * squares in double, the attention's dot products and weighted sums in float32 over 16 lanes, and
 * exp is fexp below (a polynomial the compiler vectorizes, < 2 ulp, where libm's expf is a call
 * per value). models/decoder.py's torch path (transformers' sdpa forward bit for bit) is the
 * reference; tests/kernels/test_decode.py bounds each step against float64, and
 * tests/models/test_decoder.py the whole step against the reference. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "threads.h"

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
    const float *q_norm, *k_norm; /* [head_dim] RMSNorms of each head of q and k (Qwen3), or NULL */
    float eps_q, eps_k;
    /* Gemma 3: RMSNorms of the attention's and the MLP's outputs before the residual adds, or NULL */
    const float *post1, *post2;
    float eps_p1, eps_p2;
    int32_t act;                /* the MLP's activation: 0 SiLU, 1 GELU (tanh) */
    int64_t window;             /* > 0: attend over the last `window` positions only (sliding window) */
    const float *cos, *sin;     /* [capacity, head_dim] this layer's rotary embedding, or NULL: the model's */
    float softcap;              /* > 0: attention scores capped as softcap * tanh(score / softcap) (Gemma 2) */
} DecLayer;
/* Fused projections (Phi-3): k.fn and v.fn NULL, q's kernel writes q, k, v one after the other
 * (the model's q, k, v scratch laid out so); up.fn NULL, gate's kernel writes gate then up (g, u
 * so laid out). */

typedef struct {
    int64_t layers, d, heads, kv_heads, head_dim, inter, capacity;
    const DecLayer *layer;
    float *k_cache, *v_cache;   /* [layers, kv_heads, capacity, head_dim] */
    const float *cos, *sin;     /* [capacity, head_dim] */
    float scaling;
    const float *norm_f;        /* [d] the final RMSNorm's weight */
    float eps_f;
    /* scratch: x [d], q [heads * head_dim], k, v [kv_heads * head_dim], att [heads * head_dim],
     * g, u [inter], o [d], scores [heads * capacity] */
    float *x, *q, *k, *v, *att, *g, *u, *o, *scores;
    int64_t failed_layer, failed_linear; /* where a kernel returned non-zero */
} DecModel;

#define LANES 16

/* e^x in float32: n = rint(x log2 e), r = x - n ln 2 in two steps (Cody-Waite: 0.693359375 holds
 * few enough bits that n * it is exact), e^r on |r| <= ln2 / 2 by Cephes' expf polynomial, times
 * 2^n as two powers of two built in the exponent field (each within the normal range, so 2^128 and
 * 2^-126 scale correctly). Below -87.33654 (where e^x leaves float32's normal range) the result is
 * 0; past 88.7228 it is inf; NaN stays NaN. Plain arithmetic and selects, so that loops
 * over it vectorize. Within 2 ulp of e^x on the normal range (tests/kernels/test_decode.py). */
static inline float fexp(float x) {
    const float hi = 88.72283935546875f, lo = -87.33654022216797f;
    const float xc = x > hi ? hi : (x >= lo ? x : lo); /* NaN -> lo: no NaN reaches the int conversion */
    const float n = rintf(xc * 1.44269504088896341f);
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.0f;
    const int32_t ni = (int32_t)n, n1 = ni / 2, n2 = ni - n1;
    const uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, 4);
    memcpy(&s2, &b2, 4);
    float y = p * s1 * s2;
    y = x < lo ? 0.0f : y;
    y = x > hi ? INFINITY : y;
    return x != x ? x : y;
}

/* out[i] = fexp(x[i]): for the tests */
void fb_decode_exp(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = fexp(x[i]);
}

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
    if (hd > 512 || hd % 2) return; /* fb_decode_step refuses such shapes first */
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

/* 16 float32 lanes (GCC/Clang vector extensions: one AVX-512 register, two AVX ones elsewhere) */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

/* the sum of the 16 lanes, pairwise by shuffles */
#if defined(__clang__)
#define SWAP(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define SWAP(v, ...) __builtin_shuffle(v, (v16i){__VA_ARGS__})
#endif
static inline float lane_sum(v16 acc) {
    acc += SWAP(acc, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    acc += SWAP(acc, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    acc += SWAP(acc, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    acc += SWAP(acc, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
    return acc[0];
}

/* s [n] replaced by e^(s - max s), returning 1 / their sum; the max and the sum over 16 lanes
 * (a sequential sum was bound by the adds' latency: half of a head-position's time) */
static float softmax_in_place(float *s, int64_t n) {
    float mx[LANES];
    for (int j = 0; j < LANES; j++) mx[j] = -INFINITY;
    int64_t p = 0;
    for (; p + LANES <= n; p += LANES)
        for (int j = 0; j < LANES; j++) mx[j] = s[p + j] > mx[j] ? s[p + j] : mx[j];
    for (int j = 0; p + j < n; j++) mx[j] = s[p + j] > mx[j] ? s[p + j] : mx[j];
    float m = -INFINITY;
    for (int j = 0; j < LANES; j++) m = mx[j] > m ? mx[j] : m;
    for (p = 0; p < n; p++) s[p] = fexp(s[p] - m);
    v16 acc = {0};
    for (p = 0; p + LANES <= n; p += LANES) {
        v16 x;
        memcpy(&x, s + p, sizeof x);
        acc += x;
    }
    for (int j = 0; p + j < n; j++) acc[j] += s[p + j];
    return 1.0f / lane_sum(acc);
}

/* the dot product of a and b [n]: 16 lanes of partial sums, then summed pairwise across the lanes
 * by shuffles (a sequential sum of the lanes cost more than the products at head_dim 64) */
static inline float dot(const float *a, const float *b, int64_t n) {
    v16 acc = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        v16 x, y;
        memcpy(&x, a + i, sizeof x);
        memcpy(&y, b + i, sizeof y);
        acc += x * y;
    }
    for (int j = 0; i + j < n; j++) acc[j] += a[i + j] * b[i + j];
    return lane_sum(acc);
}

/* out [hd] = (sum over p < len of w[p] v[p]) * scale, v rows hd apart: the sums for 64 columns at
 * a time held in four registers across the positions (accumulating in memory, each position's
 * row added into out, was store-bound), each column's sum in position order */
static void weighted_sum(const float *w, const float *v, int64_t len, int64_t hd, float scale, float *out) {
    int64_t j0 = 0;
    for (; j0 + 4 * LANES <= hd; j0 += 4 * LANES) {
        v16 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t p = 0; p < len; p++) {
            const float *vp = v + p * hd + j0;
            v16 x0, x1, x2, x3;
            memcpy(&x0, vp, sizeof x0);
            memcpy(&x1, vp + LANES, sizeof x1);
            memcpy(&x2, vp + 2 * LANES, sizeof x2);
            memcpy(&x3, vp + 3 * LANES, sizeof x3);
            const float c = w[p];
            a0 += c * x0;
            a1 += c * x1;
            a2 += c * x2;
            a3 += c * x3;
        }
        a0 *= scale;
        a1 *= scale;
        a2 *= scale;
        a3 *= scale;
        memcpy(out + j0, &a0, sizeof a0);
        memcpy(out + j0 + LANES, &a1, sizeof a1);
        memcpy(out + j0 + 2 * LANES, &a2, sizeof a2);
        memcpy(out + j0 + 3 * LANES, &a3, sizeof a3);
    }
    for (; j0 + LANES <= hd; j0 += LANES) {
        v16 a = {0};
        for (int64_t p = 0; p < len; p++) {
            v16 x;
            memcpy(&x, v + p * hd + j0, sizeof x);
            a += w[p] * x;
        }
        a *= scale;
        memcpy(out + j0, &a, sizeof a);
    }
    for (int64_t j = j0; j < hd; j++) {
        float a = 0.0f;
        for (int64_t p = 0; p < len; p++) a += w[p] * v[p * hd + j];
        out[j] = a * scale;
    }
}

/* out [heads, hd] = softmax(q k^T * scaling) v for one query per head over positions [0, len)
 * of k, v [kv_heads, capacity, hd]; query head h reads kv head h / (heads / kv_heads). The query
 * heads of one kv head go together, each k and v row read once for all of them. scores: room for
 * heads * len floats. */
void fb_decode_attend(const float *q, const float *k, const float *v, int64_t heads, int64_t kv_heads,
                      int64_t capacity, int64_t hd, int64_t len, float scaling, float softcap, float *scores,
                      float *out) {
    const int64_t group = heads / kv_heads;
    /* the kv heads over torch's threads (each head's result is the same whoever computes it) */
#pragma omp parallel for schedule(static) if (kv_heads > 1 && heads * len * hd >= 32768)
    for (int64_t g = 0; g < kv_heads; g++) {
        const float *kg = k + g * capacity * hd, *vg = v + g * capacity * hd;
        const float *qg = q + g * group * hd;
        float *og = out + g * group * hd;
        float *sg = scores + g * group * len;
        for (int64_t p = 0; p < len; p++)
            for (int64_t i = 0; i < group; i++) sg[i * len + p] = dot(qg + i * hd, kg + p * hd, hd) * scaling;
        if (softcap > 0) /* Gemma 2: scores / cap, tanh, * cap, as transformers' eager attention */
            for (int64_t j = 0; j < group * len; j++) sg[j] = tanhf(sg[j] / softcap) * softcap;
        for (int64_t i = 0; i < group; i++) {
            const float inv = softmax_in_place(sg + i * len, len);
            weighted_sum(sg + i * len, vg, len, hd, inv, og + i * hd);
        }
    }
}

/* g = silu(g) * u, silu(x) = x / (1 + exp(-x)) */
void fb_decode_silu_mul(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = g[i] / (1.0f + fexp(-g[i])) * u[i];
}

/* g = gelu_tanh(g) * u, gelu_tanh(x) = x / 2 (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))), as
 * torch's GELU(approximate="tanh"); 1 + tanh(y) = 2 / (1 + e^(-2y)), so the product is
 * x / (1 + e^(-2y)) */
void fb_decode_gelu_tanh_mul(float *g, const float *u, int64_t n) {
    const float c = 0.7978845608028654f;
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i], y = c * (x + 0.044715f * x * x * x);
        g[i] = x / (1.0f + fexp(-2.0f * y)) * u[i];
    }
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
    for (int64_t l = 0; l < m->layers; l++) {
        const DecLayer *L = m->layer + l;
        const float *cos = (L->cos ? L->cos : m->cos) + pos * hd, *sin = (L->sin ? L->sin : m->sin) + pos * hd;
        fb_decode_rms_norm(h, L->norm1, L->eps1, d, m->x);
        RUN(q, 0, m->x, m->q);
        if (L->k.fn) RUN(k, 1, m->x, m->k);
        if (L->v.fn) RUN(v, 2, m->x, m->v);
        if (L->q_norm) /* each head's RMSNorm before the rotation, as Qwen3's attention */
            for (int64_t i = 0; i < H; i++) fb_decode_rms_norm(m->q + i * hd, L->q_norm, L->eps_q, hd, m->q + i * hd);
        if (L->k_norm)
            for (int64_t i = 0; i < KVH; i++) fb_decode_rms_norm(m->k + i * hd, L->k_norm, L->eps_k, hd, m->k + i * hd);
        fb_decode_rope(m->q, H, hd, cos, sin);
        fb_decode_rope(m->k, KVH, hd, cos, sin);
        float *kc = m->k_cache + l * KVH * P * hd, *vc = m->v_cache + l * KVH * P * hd;
        for (int64_t g = 0; g < KVH; g++) {
            memcpy(kc + (g * P + pos) * hd, m->k + g * hd, sizeof(float) * (size_t)hd);
            memcpy(vc + (g * P + pos) * hd, m->v + g * hd, sizeof(float) * (size_t)hd);
        }
        const int64_t first = L->window > 0 && pos + 1 > L->window ? pos + 1 - L->window : 0;
        fb_decode_attend(m->q, kc + first * hd, vc + first * hd, H, KVH, P, hd, pos + 1 - first, m->scaling,
                         L->softcap, m->scores, m->att);
        RUN(o, 3, m->att, m->o);
        if (L->post1) fb_decode_rms_norm(m->o, L->post1, L->eps_p1, d, m->o);
        for (int64_t i = 0; i < d; i++) h[i] += m->o[i];
        fb_decode_rms_norm(h, L->norm2, L->eps2, d, m->x);
        RUN(gate, 4, m->x, m->g);
        if (L->up.fn) RUN(up, 5, m->x, m->u);
        if (L->act == 1)
            fb_decode_gelu_tanh_mul(m->g, m->u, m->inter);
        else
            fb_decode_silu_mul(m->g, m->u, m->inter);
        RUN(down, 6, m->g, m->o);
        if (L->post2) fb_decode_rms_norm(m->o, L->post2, L->eps_p2, d, m->o);
        for (int64_t i = 0; i < d; i++) h[i] += m->o[i];
    }
    fb_decode_rms_norm(h, m->norm_f, m->eps_f, d, m->x);
    return 0;
}
