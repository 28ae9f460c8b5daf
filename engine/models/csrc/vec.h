/* Vectors of 16 floats for the decode kernels: GCC's and clang's vector extensions (the
 * compiler picks the registers the target has: AVX-512, two AVX2 halves, four NEON
 * quarters), no intrinsics. aligned(4): loads and stores of any float address. */
#ifndef APHRODITE_VEC_H
#define APHRODITE_VEC_H

typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef int i16 __attribute__((vector_size(64), aligned(4)));
typedef unsigned u16 __attribute__((vector_size(64), aligned(4)));

#ifdef __has_builtin
#if __has_builtin(__builtin_convertvector)
#define AP_HAS_CONVERTVECTOR 1
#endif
#endif

/* lanewise float to int (each lane an integer already) */
static inline i16 to_int16(v16 x) {
#ifdef AP_HAS_CONVERTVECTOR
    return __builtin_convertvector(x, i16);
#else /* (GCC before 9): a lane at a time, which the compiler vectorizes */
    i16 out;
    for (int i = 0; i < 16; i++)
        out[i] = (int)x[i];
    return out;
#endif
}

/* the 16 lanes added by halving: a fixed order */
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

/* e^x, lanewise (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times 2^n;
 * within 2 units in the last place). x is held to [-87, 88]: below, 2^-126 times about 1;
 * above, about 2^127. */
static inline v16 exp16(v16 x) {
    const v16 low = (v16){0} - 87.0f, high = (v16){0} + 88.0f;
    i16 under = x < low, over = x > high;
    x = (v16)(((i16)x & ~under) | ((i16)low & under));
    x = (v16)(((i16)x & ~over) | ((i16)high & over));
    /* n = round(x / ln 2): adding and taking away 1.5 * 2^23 rounds to an integer */
    v16 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    v16 r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    v16 p = (v16){0} + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    n = (v16)((i16)n & (n == n)); /* (a NaN lane's n 0: p is NaN there anyway) */
    u16 bits = (u16)(to_int16(n) + 127) << 23;
    return p * (v16)bits;
}

#endif
