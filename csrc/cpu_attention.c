/* Attention on the CPU, read from the paged KV pool in place (engines._cpu_attention): decode rows,
 * and with `every_row` the rows of prompt chunks too.
 *
 * A decode row (one new query token) attends over its sequence's whole cached context; row j of a
 * chunk of n new tokens over a context of L attends over the first L - n + 1 + j tokens, exactly as a
 * decode row at that place would. The torch path gathers every row's context out of its pages into
 * dense tensors before two batched matmuls read them again; here each work item — a block of a
 * sequence's rows and one KV head — walks the sequence's pages directly: scores q.k for the block's
 * rows and the query heads of the KV head (grouped-query attention: they share each key read), a
 * softmax per row and head, then the probability-weighted sums of the values. K/V may be float32,
 * float16 or bfloat16 (converted to float32 in registers); all arithmetic is float32.
 *
 * Each row is computed in a fixed order whatever else is in the batch or the block, so a token's
 * output is bit-identical alone or batched, in a decode step or in any chunk of a prompt: for the int8
 * model, whose activations are rounded to 8 bits per token, SDPA's blocking (which follows the chunk's
 * length) changed the rounding of some activations and with it, through the layers, a prompt's
 * logits by up to ~1.2 when it was cut in two (a prefix cache held its first pages). Items run on OpenMP threads: the extension links
 * libgomp by soname, so inside a torch process it shares torch's OpenMP runtime (and its thread pool
 * and affinity) instead of starting a second one.
 *
 * Three implementations: AVX-512 (F/BW/VL + F16C), AVX2 (+FMA, F16C) and portable C.
 * Each vector implementation is compiled for its own target (function attributes: the module itself
 * stays baseline x86-64) and runs only where `best_isa()` — the CPU's own answer, __builtin_cpu_supports —
 * says the instructions exist: the caller may ask for less (a process whose kernels are capped at AVX2
 * runs the AVX2 code), never for more. A compiler without a target's flags builds without that
 * implementation (setup.py defines BULLET_NO_AVX512 / BULLET_NO_AVX2; BULLET_CPU_ATTENTION_ISA=avx2 or
 * generic forces it, to test the narrower paths on a wider CPU).
 *
 * The tables come from Python, but the kernel trusts none of them: every page, row and length is
 * checked against the pool and the batch before a thread starts. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

typedef struct {
    const float *q;         /* [T, heads, D], rows q_stride floats apart */
    const void *k, *v;      /* one layer: [kv_heads, num_slots, D] */
    float *out;             /* [T, heads, D] */
    const int32_t *table;   /* [n_seqs, table_stride] pages */
    const int32_t *lens;    /* [n_seqs] context length (tokens) */
    const int32_t *q_starts; /* [n_seqs + 1] sequence s's new tokens are rows q_starts[s] .. q_starts[s+1] */
    int64_t num_slots, q_stride;
    int every_row; /* also the rows of sequences with several new tokens, each as a decode row at its place */
    int n_seqs, heads, kv_heads, head_dim, page_size, table_stride, kv_dtype;
    float scale;
} decode_args;

static inline float kv_at(const void *base, int dtype, int64_t i) {
    if (dtype == ELEM_F32) return ((const float *)base)[i];
    if (dtype == ELEM_F16) return half_to_float(((const uint16_t *)base)[i]);
    return bf16_to_float(((const uint16_t *)base)[i]);
}

static inline size_t kv_elem(int dtype) { return dtype == ELEM_F32 ? 4 : 2; }

/* the context slot of token j of sequence s */
static inline int64_t slot_of(const decode_args *a, int s, int j) {
    return (int64_t)a->table[(int64_t)s * a->table_stride + j / a->page_size] * a->page_size + j % a->page_size;
}

/* -- portable C ------------------------------------------------------------------------------------ */
static void item_generic(const decode_args *a, int s, int row, int n, int h, float *scores) {
    const int G = a->heads / a->kv_heads, D = a->head_dim;
    const float *q = a->q + (int64_t)row * a->q_stride + (int64_t)h * G * D;
    float *out = a->out + (int64_t)row * a->heads * D + (int64_t)h * G * D;
    const int64_t head_base = (int64_t)h * a->num_slots * D;
    for (int j = 0; j < n; j++) {
        const int64_t base = head_base + slot_of(a, s, j) * D;
        for (int g = 0; g < G; g++) {
            float acc = 0.f;
            for (int d = 0; d < D; d++) acc += q[g * D + d] * kv_at(a->k, a->kv_dtype, base + d);
            scores[(int64_t)g * n + j] = acc * a->scale;
        }
    }
    for (int g = 0; g < G; g++) {
        float *sc = scores + (int64_t)g * n, mx = -INFINITY, sum = 0.f;
        for (int j = 0; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;
        for (int j = 0; j < n; j++) {
            sc[j] = expf(sc[j] - mx);
            sum += sc[j];
        }
        for (int d = 0; d < D; d++) out[g * D + d] = 0.f;
        for (int j = 0; j < n; j++) {
            const int64_t base = head_base + slot_of(a, s, j) * D;
            for (int d = 0; d < D; d++) out[g * D + d] += sc[j] * kv_at(a->v, a->kv_dtype, base + d);
        }
        for (int d = 0; d < D; d++) out[g * D + d] /= sum;
    }
}

/* -- the vector kernels ----------------------------------------------------------------------------- */
/* A work item is a block of rows of one sequence — consecutive rows of a prompt chunk, or one decode
 * row — and one KV head. Row r's context is the sequence's first n_r tokens (n_r growing by one per
 * row of a chunk). For each row the arithmetic is that of the row alone: every score, softmax sum and
 * value sum is the same operations in the same order whatever rows share the block, so a token's
 * output does not depend on its batch, its chunk or what a prefix cache held. The rows share each key
 * and value read. Per block: every key's scores against the block's (row, query head) pairs, a softmax
 * per pair, then the value sums in blocks of VALUE_BLOCK keys (each row's partial sums kept in its
 * output row between blocks, so the values of a block stay in cache across the rows). W floats per
 * register, the head dim a multiple of W; the value pass keeps CH registers of accumulators per query
 * head and walks the head dim in slices of CH * W so that G x CH accumulators stay in registers. */
#if HAVE_X86
enum { VALUE_BLOCK = 64 };

/* offs[j]: where key j of sequence s lies in the layer's cache (head h), for j < n; up to n_pad the
 * last key again (finite, and never read back) */
static void key_offsets(const decode_args *a, int s, int h, int n, int n_pad, int64_t *offs) {
    const int ps = a->page_size, D = a->head_dim;
    const int64_t head_base = (int64_t)h * a->num_slots * D;
    const int32_t *pages = a->table + (int64_t)s * a->table_stride;
    for (int j0 = 0, p = 0; j0 < n; j0 += ps, p++) {
        const int64_t base = head_base + (int64_t)pages[p] * ps * D;
        for (int t = 0; t < ps && j0 + t < n; t++) offs[j0 + t] = base + (int64_t)t * D;
    }
    for (int j = n; j < n_pad; j++) offs[j] = offs[n - 1];
}

/* Pages lie anywhere in the pool, so the hardware prefetcher cannot guess where the next one starts:
 * the kernels fetch them ahead. One page of `cache` (the keys or the values of the layer), whose first
 * key lies at element `at`, into the first-level cache or (`l2`) the second. */
static inline void prefetch_page(const decode_args *a, const void *cache, int64_t at, int l2) {
    const size_t esz = kv_elem(a->kv_dtype), page_bytes = (size_t)a->page_size * a->head_dim * esz;
    const char *p = (const char *)cache + at * esz;
    for (size_t off = 0; off < page_bytes; off += 64)
        if (l2)
            PREFETCH_L2(p + off);
        else
            PREFETCH(p + off);
}

/* NAME(sc, n): exp(sc[j] - max) in place over n scores; returns 1 / their sum */
#define SOFTMAX_FN(NAME, TARGET, VEC, W, SET1, LOAD, STORE, SUBV, EXPV, ADDV, REDUCE_ADD, MAXV, REDUCE_MAX)    \
    __attribute__((target(TARGET))) static float NAME(float *sc, int n) {                                  \
        float mx = -INFINITY, sum;                                                                         \
        int j = 0;                                                                                         \
        if (n >= W) {                                                                                      \
            VEC m = LOAD(sc);                                                                              \
            for (j = W; j + W <= n; j += W) m = MAXV(m, LOAD(sc + j));                                     \
            mx = REDUCE_MAX(m);                                                                            \
        }                                                                                                  \
        for (; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;                                                   \
        VEC vs = SET1(0.f), vm = SET1(mx);                                                                 \
        for (j = 0; j + W <= n; j += W) {                                                                  \
            VEC e = EXPV(SUBV(LOAD(sc + j), vm));                                                          \
            STORE(sc + j, e);                                                                              \
            vs = ADDV(vs, e);                                                                              \
        }                                                                                                  \
        sum = REDUCE_ADD(vs);                                                                              \
        for (; j < n; j++) {                                                                               \
            sc[j] = expf(sc[j] - mx);                                                                      \
            sum += sc[j];                                                                                  \
        }                                                                                                  \
        return 1.f / sum;                                                                                  \
    }

/* The softmax of every (row, query head) pair of the block, then its value sums, written to `out`.
 * In scope: a, h, r0, r1, n_last, n_pad, scores, offs, G, D, dt. */
#define SOFTMAX_AND_VALUES(VEC, W, CH, SOFTMAX, LOADV, ZERO, LOADU, STOREU, SET1, FMA, MUL)                   \
    float inv[16 * 16];                                                                                    \
    for (int r = r0; r < r1; r++)                                                                          \
        for (int g = 0; g < G; g++)                                                                        \
            inv[(r - r0) * G + g] = SOFTMAX(scores + ((int64_t)(r - r0) * G + g) * n_pad, n_last - (r1 - 1 - r)); \
    for (int j0 = 0; j0 < n_last; j0 += VALUE_BLOCK) {                                                     \
        int ahead = 1; /* the first pass over the block fetches each next page as it reaches a page */     \
        const int first_page = (j0 + a->page_size - 1) / a->page_size * a->page_size; /* a page's start */ \
        for (int r = r0; r < r1; r++) {                                                                    \
            const int n_r = n_last - (r1 - 1 - r), j1 = j0 + VALUE_BLOCK < n_r ? j0 + VALUE_BLOCK : n_r;    \
            if (j1 <= j0) continue;                                                                        \
            const float *sc = scores + (int64_t)(r - r0) * G * n_pad;                                      \
            float *out = a->out + (int64_t)r * a->heads * D + (int64_t)h * G * D;                          \
            const int last = j1 == n_r; /* the row's sums are whole: scale them by 1 / the softmax's sum */ \
            for (int d0 = 0; d0 < D; d0 += W * CH) {                                                       \
                VEC acc[16][CH];                                                                           \
                for (int g = 0; g < G; g++)                                                                \
                    for (int c = 0; c < CH; c++)                                                           \
                        acc[g][c] = j0 == 0 || d0 + W * c >= D ? ZERO() : LOADU(out + g * D + d0 + W * c); \
                for (int j = j0, page = first_page; j < j1; j++) {                                         \
                    if (ahead && j == page) { /* a page starts: fetch the next one's values */             \
                        if (j + a->page_size < n_last) prefetch_page(a, a->v, offs[j + a->page_size], 0);  \
                        page += a->page_size;                                                              \
                    }                                                                                      \
                    VEC vv[CH];                                                                            \
                    for (int c = 0; c < CH; c++) vv[c] = d0 + W * c < D ? LOADV(a->v, dt, offs[j] + d0 + W * c) : ZERO(); \
                    for (int g = 0; g < G; g++) {                                                          \
                        const VEC p = SET1(sc[(int64_t)g * n_pad + j]);                                    \
                        for (int c = 0; c < CH; c++) acc[g][c] = FMA(p, vv[c], acc[g][c]);                 \
                    }                                                                                      \
                }                                                                                          \
                for (int g = 0; g < G; g++)                                                                \
                    for (int c = 0; c < CH && d0 + W * c < D; c++)                                         \
                        STOREU(out + g * D + d0 + W * c, last ? MUL(acc[g][c], SET1(inv[(r - r0) * G + g])) : acc[g][c]); \
                ahead = 0;                                                                                 \
            }                                                                                              \
        }                                                                                                  \
    }

/* the group size and the pool's dtype as compile-time constants: the accumulators stay in registers
 * and no load branches on the dtype */
#define BLOCK_FOR_DTYPE(NAME, TARGET, FN, DT)                                                               \
    __attribute__((target(TARGET))) static void NAME(const decode_args *a, int s, int r0, int r1, int h,   \
                                                     float *sc, int64_t *offs, float *kt) {                \
        switch (a->heads / a->kv_heads) {                                                                  \
        case 1: FN(a, s, r0, r1, h, sc, offs, kt, 1, DT); break;                                           \
        case 2: FN(a, s, r0, r1, h, sc, offs, kt, 2, DT); break;                                           \
        case 3: FN(a, s, r0, r1, h, sc, offs, kt, 3, DT); break;                                           \
        case 4: FN(a, s, r0, r1, h, sc, offs, kt, 4, DT); break;                                           \
        case 5: FN(a, s, r0, r1, h, sc, offs, kt, 5, DT); break;                                           \
        case 6: FN(a, s, r0, r1, h, sc, offs, kt, 6, DT); break;                                           \
        case 7: FN(a, s, r0, r1, h, sc, offs, kt, 7, DT); break;                                           \
        case 8: FN(a, s, r0, r1, h, sc, offs, kt, 8, DT); break;                                           \
        default: FN(a, s, r0, r1, h, sc, offs, kt, a->heads / a->kv_heads, DT); break;                     \
        }                                                                                                  \
    }

#define AVX2_TARGET "avx2,fma,f16c"

__attribute__((target(AVX2_TARGET))) static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

SOFTMAX_FN(softmax8, AVX2_TARGET, __m256, 8, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_sub_ps, exp8,
           _mm256_add_ps, hsum8, _mm256_max_ps, hmax8)

/* AVX2: key by key, each score a dot product of 8-float slices summed in a register, then across it
 * (`hsum8`); the block's rows read the key once from memory and again from the first-level cache */
__attribute__((target(AVX2_TARGET), always_inline)) static inline void block_avx2_g(
    const decode_args *a, int s, int r0, int r1, int h, float *scores, int64_t *offs, float *kt, const int G,
    const int dt) {
    const int D = a->head_dim, end = a->q_starts[s + 1];
    const int n_last = a->lens[s] - (end - r1), n_pad = (n_last + 15) & ~15;
    (void)kt;
    const int ps = a->page_size;
    key_offsets(a, s, h, n_last, n_pad, offs);
    for (int j0 = 0; j0 < n_last; j0 += ps) {
        /* the next page's keys, and this page's values into the second-level cache */
        if (j0 + ps < n_last) prefetch_page(a, a->k, offs[j0 + ps], 0);
        prefetch_page(a, a->v, offs[j0], 1);
        for (int j = j0; j < j0 + ps && j < n_last; j++) {
            for (int r = r1 - 1; r >= r0 && n_last - (r1 - 1 - r) > j; r--) { /* the rows whose context holds key j */
                const float *q = a->q + (int64_t)r * a->q_stride + (int64_t)h * G * D;
                __m256 acc[16];
                for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
                for (int d = 0; d < D; d += 8) {
                    const __m256 kv = load8(a->k, dt, offs[j] + d);
                    for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
                }
                for (int g = 0; g < G; g++) scores[((int64_t)(r - r0) * G + g) * n_pad + j] = hsum8(acc[g]) * a->scale;
            }
        }
    }
    /* 2 registers (16 dims) per head and slice: G <= 4 keeps 8 accumulators + 2 values */
    SOFTMAX_AND_VALUES(__m256, 8, 2, softmax8, load8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_storeu_ps,
                       _mm256_set1_ps, _mm256_fmadd_ps, _mm256_mul_ps)
}

BLOCK_FOR_DTYPE(block_avx2_f32, AVX2_TARGET, block_avx2_g, ELEM_F32)
BLOCK_FOR_DTYPE(block_avx2_f16, AVX2_TARGET, block_avx2_g, ELEM_F16)
BLOCK_FOR_DTYPE(block_avx2_bf16, AVX2_TARGET, block_avx2_g, ELEM_BF16)

#if HAVE_AVX512
#define AVX512_TARGET "avx512f,avx512bw,avx512vl,avx2,fma,f16c"

/* r[i] lane j <- r[j] lane i: a 16 x 16 transpose in registers */
__attribute__((target(AVX512_TARGET), always_inline)) static inline void transpose16(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)
        for (int k = 0; k < 2; k++) {
            r[i + 2 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + k]), _mm512_castps_pd(t[i + k + 2])));
            r[i + 2 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + k]), _mm512_castps_pd(t[i + k + 2])));
        }
    for (int i = 0; i < 16; i += 8)
        for (int k = 0; k < 4; k++) {
            t[i + k] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0x88);
            t[i + k + 4] = _mm512_shuffle_f32x4(r[i + k], r[i + k + 4], 0xDD);
        }
    for (int k = 0; k < 8; k++) {
        r[k] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0x88);
        r[k + 8] = _mm512_shuffle_f32x4(t[k], t[k + 8], 0xDD);
    }
}

SOFTMAX_FN(softmax16, AVX512_TARGET, __m512, 16, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_sub_ps, exp16,
           _mm512_add_ps, _mm512_reduce_add_ps, _mm512_max_ps, _mm512_reduce_max_ps)

/* dst[i][k] = scale x (q_i . key k) for P query rows q_i and the 16 keys of kt (transposed: kt[d] holds
 * dimension d of the 16 keys). Each dot product is two running sums, over the even and the odd
 * dimensions in order (two chains of multiply-adds, so that a decode row's three do not wait on each
 * add's latency), added at the end. D is even. */
__attribute__((target(AVX512_TARGET), always_inline)) static inline void scores_rows(const float *const *qp, const int P,
                                                                                     const float *kt, int D,
                                                                                     float *const *dst, __m512 vscale) {
    __m512 even[8], odd[8];
    for (int i = 0; i < P; i++) even[i] = odd[i] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
        const __m512 k0 = _mm512_load_ps(kt + 16 * d), k1 = _mm512_load_ps(kt + 16 * (d + 1));
        for (int i = 0; i < P; i++) {
            even[i] = _mm512_fmadd_ps(_mm512_set1_ps(qp[i][d]), k0, even[i]);
            odd[i] = _mm512_fmadd_ps(_mm512_set1_ps(qp[i][d + 1]), k1, odd[i]);
        }
    }
    for (int i = 0; i < P; i++) _mm512_storeu_ps(dst[i], _mm512_mul_ps(_mm512_add_ps(even[i], odd[i]), vscale));
}

/* AVX-512: sixteen keys at a time, transposed in registers into kt (16 x D, 64-byte aligned) so that
 * a lane holds a key: a score needs no sum across a register, and eight (row, query head) pairs
 * multiply against each loaded slice of keys */
__attribute__((target(AVX512_TARGET), always_inline)) static inline void block_avx512_g(
    const decode_args *a, int s, int r0, int r1, int h, float *scores, int64_t *offs, float *kt, const int G,
    const int dt) {
    const int D = a->head_dim, ps = a->page_size, end = a->q_starts[s + 1];
    const int n_last = a->lens[s] - (end - r1), n_pad = (n_last + 15) & ~15;
    const size_t page_bytes = (size_t)ps * D * kv_elem(dt);
    key_offsets(a, s, h, n_last, n_pad, offs);
    for (int j = 0; j < 32 && j < n_last; j += ps) /* the first two blocks' pages */
        prefetch_page(a, a->k, offs[j], 0), prefetch_page(a, a->v, offs[j], 1);
    const __m512 vscale = _mm512_set1_ps(a->scale);
    for (int j0 = 0; j0 < n_last; j0 += 16) {
        /* the pages that start two blocks ahead, a share of their lines beside each slice of this
         * block's transpose (issued all at once, the requests queued behind each other: slower) */
        int64_t ahead[16];
        int n_ahead = 0;
        for (int j = (j0 + 32 + ps - 1) / ps * ps; j < j0 + 48 && j < n_last; j += ps) ahead[n_ahead++] = offs[j];
        const size_t per_slice = ((size_t)n_ahead * ((page_bytes + 63) / 64) + D / 16 - 1) / (D / 16);
        size_t off = 0;
        for (int d0 = 0, p = 0; d0 < D; d0 += 16) { /* kt[d] = dimension d of each of the block's keys */
            for (size_t l = 0; l < per_slice && p < n_ahead; l++) {
                const size_t at = (size_t)ahead[p] * kv_elem(dt) + off;
                PREFETCH((const char *)a->k + at), PREFETCH_L2((const char *)a->v + at);
                if ((off += 64) >= page_bytes) off = 0, p++;
            }
            __m512 r[16];
            for (int k = 0; k < 16; k++) r[k] = load16(a->k, dt, offs[j0 + k] + d0);
            transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_store_ps(kt + 16 * (d0 + i), r[i]);
        }
        /* the (row, query head) pairs whose context reaches this block, eight at a time */
        const float *qp[8];
        float *dst[8];
        int P = 0;
        for (int r = r0; r < r1; r++) {
            if (n_last - (r1 - 1 - r) <= j0) continue; /* this row's context ends before the block */
            for (int g = 0; g < G; g++) {
                qp[P] = a->q + (int64_t)r * a->q_stride + ((int64_t)h * G + g) * D;
                dst[P++] = scores + ((int64_t)(r - r0) * G + g) * n_pad + j0;
                if (P == 8) {
                    scores_rows(qp, 8, kt, D, dst, vscale);
                    P = 0;
                }
            }
        }
        switch (P) {
        case 1: scores_rows(qp, 1, kt, D, dst, vscale); break;
        case 2: scores_rows(qp, 2, kt, D, dst, vscale); break;
        case 3: scores_rows(qp, 3, kt, D, dst, vscale); break;
        case 4: scores_rows(qp, 4, kt, D, dst, vscale); break;
        case 5: scores_rows(qp, 5, kt, D, dst, vscale); break;
        case 6: scores_rows(qp, 6, kt, D, dst, vscale); break;
        case 7: scores_rows(qp, 7, kt, D, dst, vscale); break;
        default: break;
        }
    }
    /* 4 registers (64 dims) per head and slice: G <= 6 keeps 24 accumulators + 4 values */
    SOFTMAX_AND_VALUES(__m512, 16, 4, softmax16, load16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_storeu_ps,
                       _mm512_set1_ps, _mm512_fmadd_ps, _mm512_mul_ps)
}

BLOCK_FOR_DTYPE(block_avx512_f32, AVX512_TARGET, block_avx512_g, ELEM_F32)
BLOCK_FOR_DTYPE(block_avx512_f16, AVX512_TARGET, block_avx512_g, ELEM_F16)
BLOCK_FOR_DTYPE(block_avx512_bf16, AVX512_TARGET, block_avx512_g, ELEM_BF16)
#endif
#endif

/* Rows r0 .. r1 - 1 of sequence s, KV head h, in the block kernel of the ISA (the portable C one row at
 * a time, row r over the sequence's first lens[s] - (end - 1 - r) tokens). Scratch: scores
 * [(r1 - r0) x G][n_pad], offs [n_pad] (n_pad: the last row's context rounded up to 16), kt [16 x D]
 * 64-byte aligned. */
static void attend_rows(const decode_args *a, int isa, int s, int r0, int r1, int h, float *scores, int64_t *offs,
                        float *kt) {
    const int dt = a->kv_dtype;
#if HAVE_AVX512
    if (isa == ISA_AVX512) {
        (dt == ELEM_F32 ? block_avx512_f32 : dt == ELEM_F16 ? block_avx512_f16 : block_avx512_bf16)(a, s, r0, r1, h, scores,
                                                                                                   offs, kt);
        return;
    }
#endif
#if HAVE_X86
    if (isa == ISA_AVX2) {
        (dt == ELEM_F32 ? block_avx2_f32 : dt == ELEM_F16 ? block_avx2_f16 : block_avx2_bf16)(a, s, r0, r1, h, scores, offs,
                                                                                             kt);
        return;
    }
#endif
    for (int r = r0, end = a->q_starts[s + 1]; r < r1; r++) item_generic(a, s, r, a->lens[s] - (end - 1 - r), h, scores);
}

/* Rows of one sequence per work item: they share each key and value read. At most 48 (row, query
 * head) pairs per block, so that the block's scores (pairs x context) stay a few MB per thread. */
static int row_block(int G) {
    const int rows = 48 / G;
    return rows < 1 ? 1 : rows > 16 ? 16 : rows;
}

/* The work items: per sequence, one per KV head and block of its rows — a decode row is one block;
 * the rows of a longer chunk only with `every_row`, else none (the caller attends them). first[s] is
 * sequence s's first item; returns the count. */
static int64_t count_items(const decode_args *a, int rb, int64_t *first) {
    first[0] = 0;
    for (int s = 0; s < a->n_seqs; s++) {
        const int rows = a->q_starts[s + 1] - a->q_starts[s];
        const int64_t blocks = rows == 1 ? 1 : a->every_row ? (rows + rb - 1) / rb : 0;
        first[s + 1] = first[s] + blocks * a->kv_heads;
    }
    return first[a->n_seqs];
}

/* 0, or -1 where a scratch allocation failed (the rows it was for are not written) */
static int run_decode(const decode_args *a, int isa, int threads) {
    int max_len = 0, failed = 0;
    for (int s = 0; s < a->n_seqs; s++) max_len = a->lens[s] > max_len ? a->lens[s] : max_len;
    const int G = a->heads / a->kv_heads, rb = row_block(G);
    const size_t n_pad = ((size_t)(max_len > 0 ? max_len : 1) + 15) & ~(size_t)15;
    int64_t *first = malloc(sizeof(int64_t) * ((size_t)a->n_seqs + 1));
    if (first == NULL) return -1;
    const int64_t items = count_items(a, rb, first);
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)rb * G * n_pad);
        int64_t *offs = malloc(sizeof(int64_t) * n_pad);
        float *kt = aligned_alloc(64, sizeof(float) * 16 * (size_t)a->head_dim);
        if (scores == NULL || offs == NULL || kt == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < items; i++) {
            const int64_t it = items - 1 - i; /* a chunk's last rows, the longest contexts, first */
            int lo = 0, hi = a->n_seqs - 1;   /* the sequence whose items hold `it` */
            while (lo < hi) {
                const int mid = (lo + hi + 1) / 2;
                if (first[mid] <= it) lo = mid; else hi = mid - 1;
            }
            const int s = lo, h = (int)((it - first[s]) % a->kv_heads), b = (int)((it - first[s]) / a->kv_heads);
            const int end = a->q_starts[s + 1], r0 = a->q_starts[s] + b * rb, r1 = r0 + rb < end ? r0 + rb : end;
            if (scores != NULL && offs != NULL && kt != NULL) attend_rows(a, isa, s, r0, r1, h, scores, offs, kt);
        }
        free(scores);
        free(offs);
        free(kt);
    }
    free(first);
    return failed ? -1 : 0;
}

/* Whether every decode row's tables stay inside the batch and the pool (NULL) or what is wrong. */
static const char *check_tables(const decode_args *a, int64_t num_tokens) {
    if (a->num_slots % a->page_size) return "the pool's slots are not whole pages";
    const int64_t num_pages = a->num_slots / a->page_size;
    if (a->q_starts[0] < 0 || a->q_starts[a->n_seqs] > num_tokens) return "q_starts run past the batch";
    for (int s = 0; s < a->n_seqs; s++) {
        if (a->q_starts[s + 1] < a->q_starts[s]) return "q_starts decrease";
        const int rows = a->q_starts[s + 1] - a->q_starts[s];
        if (rows != 1 && !(a->every_row && rows > 1)) continue;
        const int n = a->lens[s], need = n / a->page_size + (n % a->page_size != 0);
        if (n < rows) return "a sequence has fewer context tokens than new rows";
        if (need > a->table_stride) return "a context needs more pages than its table row holds";
        for (int p = 0; p < need; p++) {
            const int32_t page = a->table[(int64_t)s * a->table_stride + p];
            if (page < 0 || page >= num_pages) return "a page past the pool";
        }
    }
    return NULL;
}

/* decode(q, k, v, out, table, lens, q_starts, n_seqs, num_tokens, heads, kv_heads, head_dim, num_slots,
 *        page_size, table_stride, kv_dtype, scale, isa, threads, q_stride, every_row): addresses as
 * integers (the tensors' data_ptr; dtypes, shapes and contiguity checked by engines.model.cpu_attention),
 * every index checked here. Attends the rows of sequences with exactly one new token and, with
 * `every_row`, every row of the others too (row j of n new tokens over a context of L sees its first
 * L - n + 1 + j tokens); without it, leaves the others' rows of `out` alone. Releases the GIL. */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, out, table, lens, q_starts;
    long long num_slots, q_stride, num_tokens;
    decode_args a;
    int isa, threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKiLiiiLiiifiiLp", &q, &k, &v, &out, &table, &lens, &q_starts, &a.n_seqs,
                          &num_tokens, &a.heads, &a.kv_heads, &a.head_dim, &num_slots, &a.page_size, &a.table_stride,
                          &a.kv_dtype, &a.scale, &isa, &threads, &q_stride, &a.every_row))
        return NULL;
    if (a.n_seqs < 0 || a.kv_heads <= 0 || a.heads % a.kv_heads || a.heads / a.kv_heads > 16 || a.page_size <= 0 ||
        a.head_dim <= 0 || a.table_stride <= 0 || num_slots <= 0 || a.kv_dtype < ELEM_F32 || a.kv_dtype > ELEM_BF16) {
        PyErr_SetString(PyExc_ValueError, "decode: bad shape or dtype");
        return NULL;
    }
    if (isa_refused("decode", isa)) return NULL;
    if ((isa == ISA_AVX512 && a.head_dim % 16) || (isa == ISA_AVX2 && a.head_dim % 8)) isa = ISA_GENERIC;
    a.q = (const float *)(uintptr_t)q;
    a.k = (const void *)(uintptr_t)k;
    a.v = (const void *)(uintptr_t)v;
    a.out = (float *)(uintptr_t)out;
    a.table = (const int32_t *)(uintptr_t)table;
    a.lens = (const int32_t *)(uintptr_t)lens;
    a.q_starts = (const int32_t *)(uintptr_t)q_starts;
    a.num_slots = num_slots;
    a.q_stride = q_stride;
    const char *bad = check_tables(&a, num_tokens);
    if (bad != NULL) {
        PyErr_Format(PyExc_ValueError, "decode: tables out of range: %s", bad);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = run_decode(&a, isa, threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS
    if (rc != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_best_isa(PyObject *self, PyObject *unused) {
    /* 0 portable C, 1 AVX2, 2 AVX-512: the widest this build contains and this CPU runs */
    return PyLong_FromLong(best_isa());
}

static PyObject *py_compiled_isa(PyObject *self, PyObject *unused) {
    /* the widest implementation this build contains, whatever the CPU */
    return PyLong_FromLong(HAVE_AVX512 ? ISA_AVX512 : HAVE_X86 ? ISA_AVX2 : ISA_GENERIC);
}

static PyMethodDef methods[] = {
    {"decode", py_decode, METH_VARARGS, "Paged decode attention (see engines.model.cpu_attention)."},
    {"best_isa", py_best_isa, METH_NOARGS, "the widest implementation this build and this CPU run"},
    {"compiled_isa", py_compiled_isa, METH_NOARGS, "the widest implementation this build contains"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_attention", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_attention(void) { return PyModule_Create(&module); }
