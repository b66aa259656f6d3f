/* 16-lane vectors (GCC/Clang vector extensions; one AVX-512 register each) and a lookup of 16
 * lanes in a 16-entry table, shared by the fewbits C kernels. */
#ifndef FEWBITS_VEC16_H
#define FEWBITS_VEC16_H
#include <stdint.h>

#define L 16
typedef float vf __attribute__((vector_size(4 * L)));
typedef int32_t vi __attribute__((vector_size(4 * L)));

static inline vf lookup(vf table, vi idx) {
#if defined(__GNUC__) && !defined(__clang__)
    return __builtin_shuffle(table, idx); /* vpermps on AVX-512 */
#else /* clang's shuffles take constant indices only */
    vf r;
    for (int l = 0; l < L; l++) r[l] = table[idx[l] & 15];
    return r;
#endif
}
#endif
