/* A bfloat16 SwiGLU expert on AMX tiles (see csrc/cpu_amx.h), for csrc/cpu_gemv.c's experts.
 *
 * Why: a prefill's experts get tens to hundreds of rows each, and the weights they read are cold (a
 * 512-token prompt touches most of a layer's experts). Through oneDNN each GEMM packs its right operand
 * into tiles on every call; in x @ W^T that operand is the cold weight. Here the weights are the
 * tiles' left operand, which AMX reads row-major as it lies, 16 rows of 32 elements per tile, and the
 * expert's few rows are packed instead (the right operand's layout pairs two consecutive elements of
 * the reduced dimension in each 32-bit word). Both GEMMs run as W @ x^T:
 *
 *   h = gate_up @ x^T    [2I, n], 16 gate rows and the matching 16 up rows per pass, so SwiGLU's
 *                         product silu(gate) * up is taken as the tiles come out (float32, rounded once
 *                         to bfloat16) and written straight into the packed right operand of
 *   y = down @ act       [H, n], 32 weight rows per pass, each 16x16 result tile transposed in registers
 *                         and added, times the pick's weight, to its token's float32 sums.
 *
 * Each pass holds 4 result tiles (two weight tiles x two 16-column blocks of rows), so every weight tile
 * loaded is used twice and every row tile twice. Accumulation is float32 inside the tile unit; an
 * element's sum is formed the same way whatever the other rows of the expert, so a row's expert output
 * does not depend on which rows share its expert. Results equal the float64 definition within bfloat16
 * rounding of the activation (tests/engines/test_cpu_amx.py). */

#include "cpu_amx.h"

#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#if HAVE_AVX512 && !defined(BULLET_NO_AMX) && defined(__linux__)
#define HAVE_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HAVE_AMX 0
#endif

int amx_shapes_fit(int H, int I) { return H > 0 && I > 0 && H % 32 == 0 && I % 32 == 0; }

size_t amx_scratch_bytes(int rows, int H, int I) {
    const size_t blocks = (size_t)(rows + 15) / 16; /* 16-row blocks of the expert's rows */
    /* packed rows (H/32 tiles of 1 KB per block), packed activation (I/32 per block), 4 result tiles per pair */
    return blocks * ((size_t)H / 32 + (size_t)I / 32) * 1024 + (blocks + 1) / 2 * 4 * 1024;
}

#if HAVE_AMX

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_probe(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
    const int tile = (d >> 24) & 1, bf16 = (d >> 22) & 1;
    if (!tile || !bf16 || best_isa() != ISA_AVX512) return 0;
    /* the OS must also save the tile state (XCR0 bits 17 and 18) and grant it to this process */
    if (!__get_cpuid_count(0xd, 0, &a, &b, &c, &d) || ((a >> 17) & 3) != 3) return 0;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

int amx_ready(void) {
    static int ready = -1; /* decided once; a race between threads only repeats the same probe */
    if (ready < 0) ready = amx_probe();
    return ready;
}

/* palette 1: every tile used here is 16 rows of 64 bytes (16x32 bfloat16 operands, 16x16 float32 results) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

__attribute__((target("amx-tile,amx-bf16"))) void amx_thread_begin(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    /* GCC does not see that ldtilecfg reads the whole struct and dropped the stores above (a fault) */
    __asm__ __volatile__("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void amx_thread_end(void) { _tile_release(); }

/* 16 vectors of 16 32-bit lanes transposed in place: r[j] lane i <- old r[i] lane j */
__attribute__((target("avx512f"))) static inline void transpose16(__m512 *r) {
    __m512 a[16], b[16];
    for (int i = 0; i < 8; i++) {
        a[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) { /* b[4g + j], per 128-bit lane L: column 4L + j of rows 4g..4g+3 */
        b[4 * g] = _mm512_shuffle_ps(a[4 * g], a[4 * g + 2], 0x44);
        b[4 * g + 1] = _mm512_shuffle_ps(a[4 * g], a[4 * g + 2], 0xEE);
        b[4 * g + 2] = _mm512_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0x44);
        b[4 * g + 3] = _mm512_shuffle_ps(a[4 * g + 1], a[4 * g + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        const __m512 c0 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0x88), c1 = _mm512_shuffle_f32x4(b[j], b[4 + j], 0xDD);
        const __m512 d0 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0x88);
        const __m512 d1 = _mm512_shuffle_f32x4(b[8 + j], b[12 + j], 0xDD);
        r[j] = _mm512_shuffle_f32x4(c0, d0, 0x88);
        r[4 + j] = _mm512_shuffle_f32x4(c1, d1, 0x88);
        r[8 + j] = _mm512_shuffle_f32x4(c0, d0, 0xDD);
        r[12 + j] = _mm512_shuffle_f32x4(c1, d1, 0xDD);
    }
}

/* silu(g) * u in float32, rounded to bfloat16 (to nearest even) in the low half of each lane */
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static inline __m512i swiglu_bf16(__m512 g, __m512 u) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512i v = _mm512_castps_si512(_mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e)), u));
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(v, 16), _mm512_set1_epi32(1));
    return _mm512_srli_epi32(_mm512_add_epi32(v, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
}

/* The rows as the tiles' right operand: for each 16-row block and each 32-element step of H, one 1 KB
 * tile whose row r holds, for each of the 16 rows, elements 2r and 2r+1 of the step (a 32-bit word);
 * missing rows of the last block are zeros. A 16x16 transpose of 32-bit words per tile. */
__attribute__((target("avx512f"))) static void pack_rows(const uint16_t *x, int k, const int32_t *picks, int m, int H,
                                                        uint32_t *packed) {
    const int steps = H / 32;
    for (int b = 0; b * 16 < m; b++) {
        const uint16_t *rows[16];
        for (int c = 0; c < 16; c++) rows[c] = b * 16 + c < m ? x + (int64_t)(picks[b * 16 + c] / k) * H : NULL;
        for (int s = 0; s < steps; s++) {
            __m512 r[16];
            for (int c = 0; c < 16; c++) r[c] = rows[c] ? _mm512_loadu_ps((const float *)(rows[c] + s * 32)) : _mm512_setzero_ps();
            transpose16(r);
            float *tile = (float *)(packed + ((size_t)b * steps + s) * 256);
            for (int i = 0; i < 16; i++) _mm512_store_ps(tile + 16 * i, r[i]);
        }
    }
}

/* step s's share of the next pass's weights: the s-th KB of each (16 rows x 32 elements per step) */
static inline void prefetch_step(const uint16_t *next0, const uint16_t *next1, int s) {
    const char *a = (const char *)next0 + (size_t)s * 1024, *b = (const char *)next1 + (size_t)s * 1024;
    for (int l = 0; l < 1024; l += 64) {
        PREFETCH_L2(a + l);
        PREFETCH_L2(b + l);
    }
}

/* Two 16-row weight tiles' rows (w0, w1: row stride `ld` elements) times every 16-row block of the packed
 * rows `xp` ([blocks][steps] tiles), summed over `steps` 32-element steps: res[p] gets the four 16x16
 * results of block pair p (w0 x block 2p, w0 x 2p+1, w1 x 2p, w1 x 2p+1; the odd ones only where that
 * block exists). The weight rows come from memory for the first pair and from cache for the others.
 *
 * While the first pair runs, the next pass's 16 + 16 weight rows (next0, next1: contiguous, as many
 * bytes as w0's and w1's; NULL for none) are prefetched into the second-level cache, 1 KB of each per
 * step. Why: a tile load touches 16 rows at once, a few KB apart, and a row ends before the hardware
 * prefetcher runs ahead of it. In the MoE benchmark's 512-token prefill with picks drawn uniformly
 * (17-64 rows per expert; an Intel Xeon with AMX) the experts took 410 -> 348 ms on one thread and
 * 176 -> 162 ms on two; with the dummy router's few large experts, no change (207 -> 210 ms). Measured
 * and left out: prefetching into the first-level cache (380 ms), two passes ahead (350 ms), the whole
 * next pass at once (slower than the kept form at every row count), and the steps in chunks that keep
 * 32 weight rows in the first-level cache across the pairs (no change). */
__attribute__((target("amx-tile,amx-bf16"))) static void rows_times_blocks(const uint16_t *w0, const uint16_t *w1,
                                                                          int ld, const uint32_t *xp, int steps,
                                                                          int blocks, float (*res)[4][256],
                                                                          const uint16_t *next0, const uint16_t *next1) {
    for (int p = 0; 2 * p < blocks; p++) {
        const uint32_t *x0 = xp + (size_t)2 * p * steps * 256, *x1 = x0 + (size_t)steps * 256;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        const int prefetch = p == 0 && next0;
        if (2 * p + 1 < blocks) {
            for (int s = 0; s < steps; s++) {
                if (prefetch) prefetch_step(next0, next1, s);
                _tile_loadd(4, w0 + s * 32, ld * 2);
                _tile_loadd(5, w1 + s * 32, ld * 2);
                _tile_loadd(6, x0 + (size_t)s * 256, 64);
                _tile_loadd(7, x1 + (size_t)s * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
            _tile_stored(1, res[p][1], 64);
            _tile_stored(3, res[p][3], 64);
        } else {
            for (int s = 0; s < steps; s++) {
                if (prefetch) prefetch_step(next0, next1, s);
                _tile_loadd(4, w0 + s * 32, ld * 2);
                _tile_loadd(5, w1 + s * 32, ld * 2);
                _tile_loadd(6, x0 + (size_t)s * 256, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(2, 5, 6);
            }
        }
        _tile_stored(0, res[p][0], 64);
        _tile_stored(2, res[p][2], 64);
    }
}

__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) void amx_expert(const uint16_t *x, int k, const int32_t *picks, int m,
                                                                     const uint16_t *gate_up, const uint16_t *down,
                                                                     int H, int I, const float *weights, float *acc,
                                                                     void *scratch) {
    const int blocks = (m + 15) / 16, hs = H / 32, is = I / 32;
    uint32_t *xp = scratch;                                    /* [blocks][hs] tiles: the rows */
    uint32_t *ap = xp + (size_t)blocks * hs * 256;             /* [blocks][is] tiles: the activation */
    float(*res)[4][256] = (float(*)[4][256])(ap + (size_t)blocks * is * 256); /* [pairs][4] result tiles */
    pack_rows(x, k, picks, m, H, xp);

    /* gate_up: gate rows i..i+15 with the matching up rows; SwiGLU's product as the results come out,
     * element i + j of each row's activation from gate row j and up row j; elements 2q and 2q+1 share a
     * 32-bit word of the packed activation */
    for (int i = 0; i < I; i += 16) {
        const uint16_t *gate = gate_up + (size_t)i * H, *up = gate_up + (size_t)(I + i) * H;
        const int last = i + 16 >= I; /* then the next pass is down's first */
        rows_times_blocks(gate, up, H, xp, hs, blocks, res, last ? down : gate + (size_t)16 * H,
                          last ? down + (size_t)16 * I : up + (size_t)16 * H);
        for (int b = 0; b < blocks; b++) {
            const float *g = res[b / 2][b % 2], *u = res[b / 2][2 + b % 2];
            for (int j = 0; j < 16; j += 2) {
                const __m512i lo = swiglu_bf16(_mm512_load_ps(g + 16 * j), _mm512_load_ps(u + 16 * j));
                const __m512i hi = swiglu_bf16(_mm512_load_ps(g + 16 * (j + 1)), _mm512_load_ps(u + 16 * (j + 1)));
                const int e = i + j;
                _mm512_store_si512(ap + ((size_t)b * is + e / 32) * 256 + (e % 32) / 2 * 16,
                                   _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
        }
    }

    /* down: weight rows o..o+31; each 16x16 result transposed in registers to 16 outputs of 16 rows */
    for (int o = 0; o < H; o += 32) {
        const uint16_t *w0 = down + (size_t)o * I;
        const int last = o + 32 >= H;
        rows_times_blocks(w0, w0 + (size_t)16 * I, I, ap, is, blocks, res, last ? NULL : w0 + (size_t)32 * I,
                          last ? NULL : w0 + (size_t)48 * I);
        for (int b = 0; b < blocks; b++) {
            const int first = b * 16, cols = m - first < 16 ? m - first : 16;
            for (int half = 0; half < 2; half++) { /* weight rows o.. and o+16.. */
                __m512 r[16];
                const float *t = res[b / 2][2 * half + b % 2];
                for (int j = 0; j < 16; j++) r[j] = _mm512_load_ps(t + 16 * j);
                transpose16(r);
                for (int c = 0; c < cols; c++) {
                    float *dst = acc + (int64_t)(picks[first + c] / k) * H + o + 16 * half;
                    _mm512_storeu_ps(dst, _mm512_fmadd_ps(_mm512_set1_ps(weights[picks[first + c]]), r[c],
                                                          _mm512_loadu_ps(dst)));
                }
            }
        }
    }
}

#else /* no tile code in this build: amx_ready() says so, and nothing calls the rest */

int amx_ready(void) { return 0; }
void amx_thread_begin(void) {}
void amx_thread_end(void) {}
void amx_expert(const uint16_t *x, int k, const int32_t *picks, int m, const uint16_t *gate_up, const uint16_t *down,
                int H, int I, const float *weights, float *acc, void *scratch) {
    (void)x, (void)k, (void)picks, (void)m, (void)gate_up, (void)down, (void)H, (void)I, (void)weights, (void)acc,
        (void)scratch;
    abort();
}

#endif
