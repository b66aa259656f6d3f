/* The scale searches of GGUF's k-quants (Q2_K ... Q6_K), group by group, for
 * fewbits.quant.scales (group_params and the floor/ceil choice of the sub-scale codes), and
 * IQ4_NL's signed-scale search (fb_lookup_signed, at the end).
 *
 * C twins of the torch reference in fewbits/quant/scales.py (_float_min_params,
 * _symmetric_params, _refine_codes_reference; the Python there is the definition, the tests
 * compare the two bit for bit): every value in float64, the same operations in the same order,
 * built with -ffp-contract=off and without -ffast-math; each sum over a group in the order of
 * scales.group_sum (halving: a[i] += a[i + m - h], h = m / 2, m -> m - h). torch runs the ~22
 * candidate scales of a group as ~10 passes each over [rows, groups, n] float64 temporaries;
 * here a group's values stay in registers / L1 for all of its candidates.
 *
 * x: float32 [count, n], group gi of column group gi % groups; valid: NULL or uint8
 * [groups, n], the mask of real (non-padding) entries, the same on every row; wts: NULL (the
 * weights each search defines from x) or float64 [count, n], the weights of every value, given
 * (importance-weighted rounding: fewbits.quant.kquant_search.importance_weights), 0 on padding. The groups are
 * shared out over torch's OpenMP threads where the library was built with OpenMP. */
#include <math.h>
#include <stdint.h>

#define FB_KQ_MAX_N 256 /* the longest group (fewbits takes the torch path above) */

static inline __attribute__((always_inline)) double tree_sum(double *a, int n) {
    int m = n;
    while (m > 1) {
        const int h = m / 2, off = m - h;
        for (int i = 0; i < h; i++) a[i] = a[i] + a[i + off];
        m = off;
    }
    return m ? a[0] : 0.0;
}

static inline __attribute__((always_inline)) double clampd(double v, double lo, double hi) {
    /* torch's clamp: max then min, a NaN passes, -0.0 stays -0.0 */
    v = v < lo ? lo : v;
    return v > hi ? hi : v;
}

/* x as float64 and the weights of the float-minimum search: |x| + sqrt(sum x^2 / count),
 * 0 on padding */
static inline __attribute__((always_inline)) void float_min_weights(const float *xg, const uint8_t *vm, int n,
                                                                    double *xd, double *w) {
    double t[FB_KQ_MAX_N];
    int cnt = 0;
    for (int k = 0; k < n; k++) {
        xd[k] = (double)xg[k];
        t[k] = xd[k] * xd[k];
    }
    if (vm) {
        for (int k = 0; k < n; k++) cnt += vm[k] != 0;
        if (cnt < 1) cnt = 1;
    } else {
        cnt = n;
    }
    const double rms = sqrt(tree_sum(t, n) / (double)cnt);
    for (int k = 0; k < n; k++) {
        w[k] = fabs(xd[k]) + rms;
        if (vm && !vm[k]) w[k] = 0.0;
    }
}

static inline __attribute__((always_inline)) void symmetric_weights(const float *xg, const uint8_t *vm, int n,
                                                                    double *xd, double *w) {
    for (int k = 0; k < n; k++) {
        xd[k] = (double)xg[k];
        w[k] = xd[k] * xd[k];
        if (vm && !vm[k]) w[k] = 0.0;
    }
}

/* x as float64 and the given weights of one group */
static inline __attribute__((always_inline)) void given_weights(const float *xg, const double *wg, int n, double *xd,
                                                                double *w) {
    for (int k = 0; k < n; k++) {
        xd[k] = (double)xg[k];
        w[k] = wg[k];
    }
}

static inline __attribute__((always_inline)) double weighted_error(double s, double m, double sl, double sl2,
                                                                   double sxl, double sw, double sx, double sx2) {
    return s * s * sl2 + 2 * s * m * sl - 2 * s * sxl + m * m * sw - 2 * m * sx + sx2;
}

static inline __attribute__((always_inline)) void candidate_sums(const double *xs, const double *w, const double *xd,
                                                                 int n, double iscale, double nmax, double *sl,
                                                                 double *sl2, double *sxl) {
    double a[FB_KQ_MAX_N], b[FB_KQ_MAX_N], c[FB_KQ_MAX_N];
    for (int k = 0; k < n; k++) {
        const double L = clampd(nearbyint(xs[k] * iscale), 0.0, nmax);
        const double wl = w[k] * L;
        a[k] = wl;
        b[k] = wl * L;
        c[k] = wl * xd[k];
    }
    *sl = tree_sum(a, n);
    *sl2 = tree_sum(b, n);
    *sxl = tree_sum(c, n);
}

static inline __attribute__((always_inline)) void float_min_group(const float *xg, const uint8_t *vm,
                                                                  const double *wg, int n, double nmax,
                                                                  const double *cands, int ncand, double *scale_out,
                                                                  double *negmin_out) {
    double xd[FB_KQ_MAX_N], w[FB_KQ_MAX_N], xs[FB_KQ_MAX_N], t[FB_KQ_MAX_N];
    if (wg)
        given_weights(xg, wg, n, xd, w);
    else
        float_min_weights(xg, vm, n, xd, w);
    double lo = INFINITY, hi = -INFINITY;
    for (int k = 0; k < n; k++) {
        if (vm && !vm[k]) continue;
        lo = xd[k] < lo ? xd[k] : lo;
        hi = xd[k] > hi ? xd[k] : hi;
    }
    lo = lo < 0 ? lo : 0.0;
    const double span = hi - lo;
    const int flat = span <= 0;
    const double safe_span = flat ? 1.0 : span;
    double scale = flat ? 0.0 : span / nmax;
    double minimum = lo;
    double sw, sx, sx2;
    for (int k = 0; k < n; k++) t[k] = w[k];
    sw = tree_sum(t, n);
    for (int k = 0; k < n; k++) t[k] = w[k] * xd[k];
    sx = tree_sum(t, n);
    for (int k = 0; k < n; k++) t[k] = w[k] * xd[k] * xd[k];
    sx2 = tree_sum(t, n);
    for (int k = 0; k < n; k++) xs[k] = xd[k] - lo;
    double sl, sl2, sxl;
    candidate_sums(xs, w, xd, n, 1.0 / (flat ? 1.0 : scale), nmax, &sl, &sl2, &sxl);
    double best = weighted_error(scale, minimum, sl, sl2, sxl, sw, sx, sx2);
    const double rspan = 1.0 / safe_span;
    for (int i = 0; i < ncand; i++) {
        candidate_sums(xs, w, xd, n, rspan * cands[i], nmax, &sl, &sl2, &sxl);
        const double D = sw * sl2 - sl * sl;
        const int ok = (D > 0) && !flat;
        const double safe_D = ok ? D : 1.0;
        double s = (sw * sxl - sx * sl) / safe_D;
        double m = (sl2 * sx - sl * sxl) / safe_D;
        if (m > 0) {
            s = sxl / (sl2 > 0 ? sl2 : 1.0);
            m = 0.0;
        }
        const double err = weighted_error(s, m, sl, sl2, sxl, sw, sx, sx2);
        if (ok && s > 0 && err < best) {
            best = err;
            scale = s;
            minimum = m;
        }
    }
    *scale_out = scale;
    *negmin_out = -minimum;
}

/* float minimums (make_qkx2_quants' rule, weighted least squares): scale and -minimum per
 * group, cands[i] = nmax + rmin + rdelta * i */
void fb_kquant_float_min(const float *x, int64_t count, int64_t groups, int32_t n, const uint8_t *valid,
                         const double *wts, double nmax, const double *cands, int32_t ncand, double *scale,
                         double *negmin) {
#pragma omp parallel for schedule(static) if (count >= 256)
    for (int64_t gi = 0; gi < count; gi++) {
        const float *xg = x + gi * (int64_t)n;
        const uint8_t *vm = valid ? valid + (gi % groups) * n : 0;
        const double *wg = wts ? wts + gi * (int64_t)n : 0;
        if (n == 32)
            float_min_group(xg, vm, wg, 32, nmax, cands, ncand, scale + gi, negmin + gi);
        else if (n == 16)
            float_min_group(xg, vm, wg, 16, nmax, cands, ncand, scale + gi, negmin + gi);
        else
            float_min_group(xg, vm, wg, n, nmax, cands, ncand, scale + gi, negmin + gi);
    }
}

static inline __attribute__((always_inline)) double symmetric_group(const float *xg, const uint8_t *vm,
                                                                    const double *wg, int n, double lowest, double top,
                                                                    const double *cands, int ncand) {
    double xd[FB_KQ_MAX_N], w[FB_KQ_MAX_N], a[FB_KQ_MAX_N], b[FB_KQ_MAX_N];
    if (wg)
        given_weights(xg, wg, n, xd, w);
    else
        symmetric_weights(xg, vm, n, xd, w);
    double amax = -1.0, peak = 0.0;
    for (int k = 0; k < n; k++) { /* the first value of largest magnitude, padding included */
        const double v = fabs(xd[k]);
        if (v > amax) {
            amax = v;
            peak = xd[k];
        }
    }
    const int zero = peak == 0;
    const double rpeak = 1.0 / (zero ? 1.0 : peak);
    double scale = 0.0, best = 0.0;
    for (int i = 0; i < ncand; i++) {
        const double iscale = rpeak * cands[i];
        for (int k = 0; k < n; k++) {
            const double L = clampd(nearbyint(xd[k] * iscale), lowest, top);
            const double wl = w[k] * L;
            a[k] = wl * xd[k];
            b[k] = wl * L;
        }
        const double sumlx = tree_sum(a, n), suml2 = tree_sum(b, n);
        const int ok = suml2 > 0;
        const double s = sumlx / (ok ? suml2 : 1.0);
        const double merit = sumlx * s;
        if (i == 0) {
            scale = ok ? s : 0.0;
            best = ok ? merit : 0.0;
        } else if (ok && merit > best) {
            best = merit;
            scale = s;
        }
    }
    return zero ? 0.0 : scale;
}

/* symmetric scales (make_qx_quants' rule): cands[i] = -(nmax + 0.1 * step_i) */
void fb_kquant_symmetric(const float *x, int64_t count, int64_t groups, int32_t n, const uint8_t *valid,
                         const double *wts, double lowest, double top, const double *cands, int32_t ncand,
                         double *scale) {
#pragma omp parallel for schedule(static) if (count >= 256)
    for (int64_t gi = 0; gi < count; gi++) {
        const float *xg = x + gi * (int64_t)n;
        const uint8_t *vm = valid ? valid + (gi % groups) * n : 0;
        const double *wg = wts ? wts + gi * (int64_t)n : 0;
        if (n == 16)
            scale[gi] = symmetric_group(xg, vm, wg, 16, lowest, top, cands, ncand);
        else if (n == 32)
            scale[gi] = symmetric_group(xg, vm, wg, 32, lowest, top, cands, ncand);
        else
            scale[gi] = symmetric_group(xg, vm, wg, n, lowest, top, cands, ncand);
    }
}

static inline __attribute__((always_inline)) void refine_group(const float *xg, const uint8_t *vm,
                                                               const double *wg, int n, int float_min, double lo_q,
                                                               double hi_q, double de, const double cs[2], double dme,
                                                               const double cm[2], double *best_s, double *best_m) {
    double xd[FB_KQ_MAX_N], w[FB_KQ_MAX_N], t[FB_KQ_MAX_N];
    if (wg)
        given_weights(xg, wg, n, xd, w);
    else if (float_min)
        float_min_weights(xg, vm, n, xd, w);
    else
        symmetric_weights(xg, vm, n, xd, w);
    double best = 0.0, bs = 0.0, bm = 0.0;
    int first = 1;
    for (int a = 0; a < 2; a++) {
        for (int b = 0; b < (float_min ? 2 : 1); b++) {
            const double s = de * cs[a];
            const double m = float_min ? -(dme * cm[b]) : 0.0;
            const double safe = s == 0 ? 1.0 : s;
            for (int k = 0; k < n; k++) {
                const double q = clampd(nearbyint((xd[k] - m) / safe), lo_q, hi_q);
                const double e = q * s + m - xd[k];
                t[k] = w[k] * (e * e);
            }
            const double err = tree_sum(t, n);
            if (first || err < best) {
                first = 0;
                best = err;
                bs = cs[a];
                bm = float_min ? cm[b] : 0.0;
            }
        }
    }
    *best_s = bs;
    if (best_m) *best_m = bm;
}

/* Each group's sub-scale code (and sub-minimum code) of the pairs (cs0 | cs1) x (cm0 | cm1), in
 * that order, of least weighted squared error (the first of equal ones); de, dme: the group's
 * super-block scales, float64. cm0, cm1, dme, best_m: NULL when symmetric. */
void fb_kquant_refine(const float *x, int64_t count, int64_t groups, int32_t n, const uint8_t *valid,
                      const double *wts, int32_t float_min, double lo_q, double hi_q, const double *de, const double *cs0,
                      const double *cs1, const double *dme, const double *cm0, const double *cm1, double *best_s,
                      double *best_m) {
#pragma omp parallel for schedule(static) if (count >= 256)
    for (int64_t gi = 0; gi < count; gi++) {
        const float *xg = x + gi * (int64_t)n;
        const uint8_t *vm = valid ? valid + (gi % groups) * n : 0;
        const double cs[2] = {cs0[gi], cs1[gi]};
        const double cm[2] = {float_min ? cm0[gi] : 0.0, float_min ? cm1[gi] : 0.0};
        const double dm = float_min ? dme[gi] : 0.0;
        double *bm = float_min ? best_m + gi : 0;
        const double *wg = wts ? wts + gi * (int64_t)n : 0;
        if (n == 32)
            refine_group(xg, vm, wg, 32, float_min, lo_q, hi_q, de[gi], cs, dm, cm, best_s + gi, bm);
        else if (n == 16)
            refine_group(xg, vm, wg, 16, float_min, lo_q, hi_q, de[gi], cs, dm, cm, best_s + gi, bm);
        else
            refine_group(xg, vm, wg, n, float_min, lo_q, hi_q, de[gi], cs, dm, cm, best_s + gi, bm);
    }
}

/* The signed-scale search of a codebook block (GGUF's IQ4_NL; fewbits.quant.lookup_search,
 * signed_lookup_scales_reference is the definition): per group, for each candidate inverse scale
 * cands[i] / peak (peak: the first value of largest magnitude, with its sign), every value to
 * the nearest table entry (ties to the larger: the count of midpoints <= x * inverse), the
 * weighted least-squares scale sum(w q x) / sum(w q^2) and its merit scale * sum(w q x); the
 * first candidate is taken, a later one where its merit is larger. Weights: x^2 or given; 0 on
 * padding, where x reads as 0. A group whose largest magnitude is below 1e-15 gets 0. */
#define FB_LOOKUP_MAX 16

static inline __attribute__((always_inline)) double lookup_group(const float *xg, const uint8_t *vm,
                                                                 const double *wg, int n, const double *table,
                                                                 const double *mid, int nt, const double *cands,
                                                                 int ncand) {
    double xd[FB_KQ_MAX_N], w[FB_KQ_MAX_N], a[FB_KQ_MAX_N], b[FB_KQ_MAX_N];
    for (int k = 0; k < n; k++) {
        const int pad = vm && !vm[k];
        xd[k] = pad ? 0.0 : (double)xg[k];
        w[k] = pad ? 0.0 : (wg ? wg[k] : xd[k] * xd[k]);
    }
    double amax = -1.0, peak = 0.0;
    for (int k = 0; k < n; k++) {
        const double v = fabs(xd[k]);
        if (v > amax) {
            amax = v;
            peak = xd[k];
        }
    }
    const int empty = fabs(peak) < 1e-15;
    const double safe = empty ? 1.0 : peak;
    double scale = 0.0, best = 0.0;
    for (int i = 0; i < ncand; i++) {
        const double inv = cands[i] / safe;
        for (int k = 0; k < n; k++) {
            const double y = xd[k] * inv;
            int idx = 0;
            for (int j = 0; j < nt - 1; j++) idx += y >= mid[j];
            const double q = table[idx];
            const double wq = w[k] * q;
            a[k] = wq * xd[k];
            b[k] = wq * q;
        }
        const double sqx = tree_sum(a, n), sq2 = tree_sum(b, n);
        const int ok = sq2 > 0;
        const double s = ok ? sqx / sq2 : 0.0;
        const double merit = s * sqx;
        if (i == 0 || (ok && merit > best)) {
            scale = s;
            best = merit;
        }
    }
    return empty ? 0.0 : scale;
}

void fb_lookup_signed(const float *x, int64_t count, int64_t groups, int32_t n, const uint8_t *valid,
                      const double *wts, const double *table, int32_t nt, const double *cands, int32_t ncand,
                      double *scale) {
    double mid[FB_LOOKUP_MAX];
    for (int j = 0; j < nt - 1; j++) mid[j] = (table[j + 1] + table[j]) / 2;
#pragma omp parallel for schedule(static) if (count >= 256)
    for (int64_t gi = 0; gi < count; gi++) {
        const float *xg = x + gi * (int64_t)n;
        const uint8_t *vm = valid ? valid + (gi % groups) * n : 0;
        const double *wg = wts ? wts + gi * (int64_t)n : 0;
        if (n == 32)
            scale[gi] = lookup_group(xg, vm, wg, 32, table, mid, nt, cands, ncand);
        else
            scale[gi] = lookup_group(xg, vm, wg, n, table, mid, nt, cands, ncand);
    }
}
