/* The decode kernels' vectors: VF floats, the width of the target's own registers (16 with
 * AVX-512, 8 with AVX/AVX2, 4 otherwise: NEON, SSE), through GCC's and clang's vector
 * extensions, no intrinsics. Wider vectors than the registers are lowered badly: GCC 12
 * builds a 16-float broadcast on AVX2 through the stack and spills, and the kernels ran ten
 * times slower than the memory on a Zen 3 EPYC. aligned(4): loads and stores of any float
 * address. */
#ifndef APHRODITE_VEC_H
#define APHRODITE_VEC_H

#if defined(__AVX512F__)
#define VF 16
#elif defined(__AVX__)
#define VF 8
#else
#define VF 4
#endif

typedef float vf __attribute__((vector_size(VF * 4), aligned(4)));
typedef int vi __attribute__((vector_size(VF * 4), aligned(4)));
typedef unsigned vu __attribute__((vector_size(VF * 4), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

#ifdef __has_builtin
#if __has_builtin(__builtin_convertvector)
#define AP_HAS_CONVERTVECTOR 1
#endif
#endif

/* every lane s */
static inline vf splat(float s) {
    vf out;
    for (int i = 0; i < VF; i++)
        out[i] = s;
    return out;
}

/* VF floats from p (any float address) */
static inline vf load(const float *p) { return *(const vf *)p; }

/* lanewise float to int (each lane an integer already) */
static inline vi to_int(vf x) {
#ifdef AP_HAS_CONVERTVECTOR
    return __builtin_convertvector(x, vi);
#else /* (GCC before 9): a lane at a time, which the compiler vectorizes */
    vi out;
    for (int i = 0; i < VF; i++)
        out[i] = (int)x[i];
    return out;
#endif
}

/* the lanes added by halving down to 4, then (0 + 2) + (1 + 3): a fixed order (with 16
 * lanes the order the kernels always had) */
static inline float lanes_sum(vf a) {
    v4 e;
#if VF == 16
    typedef float v8 __attribute__((vector_size(32), aligned(4)));
    v8 lo, hi;
    __builtin_memcpy(&lo, &a, sizeof lo);
    __builtin_memcpy(&hi, (const char *)&a + sizeof lo, sizeof hi);
    v8 b = lo + hi;
    v4 c, d;
    __builtin_memcpy(&c, &b, sizeof c);
    __builtin_memcpy(&d, (const char *)&b + sizeof c, sizeof d);
    e = c + d;
#elif VF == 8
    v4 c, d;
    __builtin_memcpy(&c, &a, sizeof c);
    __builtin_memcpy(&d, (const char *)&a + sizeof c, sizeof d);
    e = c + d;
#else
    e = a;
#endif
    return (e[0] + e[2]) + (e[1] + e[3]);
}

/* e^x, lanewise (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times 2^n;
 * within 2 units in the last place). x is held to [-87, 88]: below, 2^-126 times about 1;
 * above, about 2^127. */
static inline vf vexp(vf x) {
    const vf low = splat(-87.0f), high = splat(88.0f);
    vi under = x < low, over = x > high;
    x = (vf)(((vi)x & ~under) | ((vi)low & under));
    x = (vf)(((vi)x & ~over) | ((vi)high & over));
    /* n = round(x / ln 2): adding and taking away 1.5 * 2^23 rounds to an integer */
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    vf r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    n = (vf)((vi)n & (n == n)); /* (a NaN lane's n 0: p is NaN there anyway) */
    vu bits = (vu)(to_int(n) + 127) << 23;
    return p * (vf)bits;
}

#endif
