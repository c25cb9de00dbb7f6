/* Vector helpers shared by the CPU kernels (csrc/cpu_attention.c, csrc/cpu_gemv.c): which
 * implementations this build has, which one this CPU runs, element conversions to float32.
 *
 * Each vector helper is compiled for its own target (function attributes), so a module that includes
 * this stays baseline x86-64 and calls a helper only where `best_isa()` says the CPU has it. setup.py
 * defines BULLET_NO_AVX512 / BULLET_NO_AVX2 where the compiler lacks a target's flags (or the build is
 * told to leave the wider code out). */
#ifndef BULLET_CPU_VEC_H
#define BULLET_CPU_VEC_H

#include <stdint.h>
#include <string.h>

#if (defined(__x86_64__) || defined(__i386__)) && !defined(BULLET_NO_AVX2)
#include <immintrin.h>
#define HAVE_X86 1 /* the AVX2 implementation (and the vector helpers both share) */
#else
#define HAVE_X86 0
#endif
#if HAVE_X86 && !defined(BULLET_NO_AVX512)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* element types of the tensors the kernels read (engines.model.cpu_attention.KV_CODES) */
enum { ELEM_F32 = 0, ELEM_F16 = 1, ELEM_BF16 = 2 };
enum { ISA_GENERIC = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

/* -- portable conversions ------------------------------------------------------------------------ */
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        exp = 113;
        while (!(mant & 0x400)) {
            mant <<= 1;
            exp--;
        }
        bits = sign | (exp << 23) | ((mant & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if HAVE_X86
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#else
#define PREFETCH(p) __builtin_prefetch(p)
#define PREFETCH_L2(p) __builtin_prefetch(p, 0, 2)
#endif

#if HAVE_X86
/* 8 / 16 elements of a float32, float16 or bfloat16 array at element index i, as float32 */
__attribute__((target("avx2,fma,f16c"))) static inline __m256 load8(const void *base, int dtype, int64_t i) {
    if (dtype == ELEM_F32) return _mm256_loadu_ps((const float *)base + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)base + i));
    if (dtype == ELEM_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

#if HAVE_AVX512
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static inline __m512 load16(const void *base, int dtype,
                                                                                              int64_t i) {
    if (dtype == ELEM_F32) return _mm512_loadu_ps((const float *)base + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + i));
    if (dtype == ELEM_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

__attribute__((target("avx2,fma,f16c"))) static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

#if HAVE_X86
/* e^x, 8 or 16 lanes (Cephes' expf): x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial, 2^n in
 * the exponent bits. x is clamped to [-87.34, 88.38]: below, the result flushes to ~0; above, it stays
 * the largest finite float instead of overflowing the exponent. The attention kernel's softmax takes it
 * for scores minus their maximum (<= 0), the AMX experts for SwiGLU's sigmoid. */
#define EXP_BODY(V, SET1, ADD, MUL, FMADD, MAX, MIN, ROUND, CVT, SLLI, ADDI, CASTI, SET1I)                     \
    x = MIN(MAX(x, SET1(-87.33654f)), SET1(88.37626f));                                                    \
    V n = ROUND(MUL(x, SET1(1.44269504088896341f)));                                                      \
    V r = FMADD(n, SET1(-0.693359375f), x);                                                               \
    r = FMADD(n, SET1(2.12194440e-4f), r);                                                                \
    V p = SET1(1.9875691500e-4f);                                                                         \
    p = FMADD(p, r, SET1(1.3981999507e-3f));                                                              \
    p = FMADD(p, r, SET1(8.3334519073e-3f));                                                              \
    p = FMADD(p, r, SET1(4.1665795894e-2f));                                                              \
    p = FMADD(p, r, SET1(1.6666665459e-1f));                                                              \
    p = FMADD(p, r, SET1(5.0000001201e-1f));                                                              \
    p = FMADD(MUL(p, r), r, ADD(r, SET1(1.f)));                                                           \
    return MUL(p, CASTI(SLLI(ADDI(CVT(n), SET1I(127)), 23)));

__attribute__((target("avx2,fma,f16c"))) static inline __m256 exp8(__m256 x) {
#define ROUND8(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    EXP_BODY(__m256, _mm256_set1_ps, _mm256_add_ps, _mm256_mul_ps, _mm256_fmadd_ps, _mm256_max_ps, _mm256_min_ps,
             ROUND8, _mm256_cvtps_epi32, _mm256_slli_epi32, _mm256_add_epi32, _mm256_castsi256_ps, _mm256_set1_epi32)
#undef ROUND8
}

#if HAVE_AVX512
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static inline __m512 exp16(__m512 x) {
#define ROUND16(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
    EXP_BODY(__m512, _mm512_set1_ps, _mm512_add_ps, _mm512_mul_ps, _mm512_fmadd_ps, _mm512_max_ps, _mm512_min_ps,
             ROUND16, _mm512_cvtps_epi32, _mm512_slli_epi32, _mm512_add_epi32, _mm512_castsi512_ps, _mm512_set1_epi32)
#undef ROUND16
}
#endif
#endif

/* The widest implementation both this build and this CPU have (the OS saving the wide registers
 * included: libgcc's CPU model checks XCR0 before it reports an AVX or AVX-512 feature). */
static inline int best_isa(void) {
#if HAVE_X86
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#if HAVE_AVX512
    if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
#endif
    if (avx2) return ISA_AVX2;
#endif
    return ISA_GENERIC;
}

#ifdef Py_PYTHON_H
/* Whether a caller asked `fn` for an implementation this CPU or build lacks (then a ValueError is set):
 * a caller may ask for less than best_isa(), never for more. */
static inline int isa_refused(const char *fn, int isa) {
    if (isa >= ISA_GENERIC && isa <= best_isa()) return 0;
    PyErr_Format(PyExc_ValueError, "%s: implementation %d needs instructions this CPU or build lacks (best: %d)", fn,
                 isa, best_isa());
    return 1;
}
#endif

#endif
