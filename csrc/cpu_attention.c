/* Decode attention on the CPU, read from the paged KV pool in place (engines._cpu_attention).
 *
 * One new query token per sequence attends over its whole cached context. The torch path gathers
 * every row's context out of its pages into dense tensors before two batched matmuls read them
 * again; here each (sequence, KV head) is one work item that walks the sequence's pages directly:
 * scores q.k for the item's query heads (grouped-query attention: the heads sharing a KV head read
 * each key once), a softmax, then the probability-weighted sum of the values. K/V may be float32,
 * float16 or bfloat16 (converted to float32 in registers); all arithmetic is float32.
 *
 * Each item is computed in a fixed order whatever else is in the batch, so a sequence's output is
 * bit-identical alone or batched. Items run on OpenMP threads: the extension links libgomp by
 * soname, so inside a torch process it shares torch's OpenMP runtime (and its thread pool and
 * affinity) instead of starting a second one.
 *
 * Three implementations of the same loop: AVX-512 (F/BW/VL + F16C), AVX2 (+FMA, F16C) and portable C.
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

/* Walks sequence s's context page by page: BODY runs once per token j with `base`, the element index
 * of its row in CACHE (head h). While a page is read, the next one is prefetched: pages lie anywhere
 * in the pool, so the hardware prefetcher cannot guess where the next one starts. */
#define FOR_EACH_TOKEN(a, s, n, head_base, CACHE, ALSO, BODY)                                                 \
    do {                                                                                                    \
        const int ps_ = (a)->page_size, D_ = (a)->head_dim;                                                 \
        const size_t esz_ = kv_elem((a)->kv_dtype), page_bytes_ = (size_t)ps_ * D_ * esz_;                  \
        const int32_t *pages_ = (a)->table + (int64_t)(s) * (a)->table_stride;                              \
        for (int j0_ = 0, p_ = 0; j0_ < (n); j0_ += ps_, p_++) {                                            \
            if (j0_ + ps_ < (n)) {                                                                          \
                const char *next_ = (const char *)(CACHE) + ((head_base) + (int64_t)pages_[p_ + 1] * ps_ * D_) * esz_; \
                for (size_t off_ = 0; off_ < page_bytes_; off_ += 64) PREFETCH(next_ + off_);               \
            }                                                                                               \
            if ((ALSO) != NULL) {                                                                           \
                const char *also_ = (const char *)(ALSO) + ((head_base) + (int64_t)pages_[p_] * ps_ * D_) * esz_; \
                for (size_t off_ = 0; off_ < page_bytes_; off_ += 64) PREFETCH_L2(also_ + off_);            \
            }                                                                                               \
            const int64_t page_base_ = (head_base) + (int64_t)pages_[p_] * ps_ * D_;                        \
            const int cnt_ = (n) - j0_ < ps_ ? (n) - j0_ : ps_;                                             \
            for (int t_ = 0; t_ < cnt_; t_++) {                                                             \
                const int j = j0_ + t_;                                                                     \
                const int64_t base = page_base_ + (int64_t)t_ * D_;                                         \
                BODY                                                                                        \
            }                                                                                               \
        }                                                                                                   \
    } while (0)


/* -- portable C ------------------------------------------------------------------------------------ */
static void item_generic(const decode_args *a, int s, int h, float *scores) {
    const int G = a->heads / a->kv_heads, D = a->head_dim, n = a->lens[s];
    const float *q = a->q + a->q_starts[s] * a->q_stride + (int64_t)h * G * D;
    float *out = a->out + a->q_starts[s] * (int64_t)a->heads * D + (int64_t)h * G * D;
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

#if HAVE_X86
/* The vector kernels: W floats per register, the head dim a multiple of W. Scores, softmax and the
 * weighted sum as in item_generic; the value pass keeps CH registers of accumulators per query head
 * and walks the head dim in slices of CH * W so that G x CH accumulators stay in registers. */
#define SOFTMAX_BODY(VEC, W, SET1, LOAD, STORE, SUBV, EXPV, ADDV, REDUCE_ADD, MAXV, REDUCE_MAX)             \
    for (int g = 0; g < G; g++) {                                                                          \
        float *sc = scores + (int64_t)g * n, mx = -INFINITY, sum = 0.f;                                   \
        int j = 0;                                                                                        \
        if (n >= W) {                                                                                     \
            VEC m = LOAD(sc);                                                                             \
            for (j = W; j + W <= n; j += W) m = MAXV(m, LOAD(sc + j));                                    \
            mx = REDUCE_MAX(m);                                                                           \
        }                                                                                                 \
        for (; j < n; j++) mx = sc[j] > mx ? sc[j] : mx;                                                  \
        VEC vs = SET1(0.f), vm = SET1(mx);                                                                \
        for (j = 0; j + W <= n; j += W) {                                                                 \
            VEC e = EXPV(SUBV(LOAD(sc + j), vm));                                                         \
            STORE(sc + j, e);                                                                             \
            vs = ADDV(vs, e);                                                                             \
        }                                                                                                 \
        sum = REDUCE_ADD(vs);                                                                             \
        for (; j < n; j++) {                                                                              \
            sc[j] = expf(sc[j] - mx);                                                                     \
            sum += sc[j];                                                                                 \
        }                                                                                                 \
        inv[g] = 1.f / sum;                                                                               \
    }

__attribute__((target("avx2,fma,f16c"))) static inline float hmax8(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,f16c"), always_inline)) static inline void item_avx2_g(const decode_args *a, int s, int h,
                                                                                     float *scores, const int G) {
    const int D = a->head_dim, n = a->lens[s], dt = a->kv_dtype;
    const float *q = a->q + a->q_starts[s] * a->q_stride + (int64_t)h * G * D;
    float *out = a->out + a->q_starts[s] * (int64_t)a->heads * D + (int64_t)h * G * D;
    const int64_t head_base = (int64_t)h * a->num_slots * D;
    float inv[16];
    FOR_EACH_TOKEN(a, s, n, head_base, a->k, a->v, {
        __m256 acc[16];
        for (int g = 0; g < G; g++) acc[g] = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            __m256 kv = load8(a->k, dt, base + d);
            for (int g = 0; g < G; g++) acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + d), kv, acc[g]);
        }
        for (int g = 0; g < G; g++) scores[(int64_t)g * n + j] = hsum8(acc[g]) * a->scale;
    });
    SOFTMAX_BODY(__m256, 8, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_sub_ps, exp8, _mm256_add_ps,
                 hsum8, _mm256_max_ps, hmax8)
    enum { CH = 2 }; /* 2 registers (16 dims) per head and slice: G <= 4 keeps 8 accumulators + 2 values */
    for (int d0 = 0; d0 < D; d0 += 8 * CH) {
        __m256 acc[16][CH];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) acc[g][c] = _mm256_setzero_ps();
        FOR_EACH_TOKEN(a, s, n, head_base, a->v, (const void *)NULL, {
            __m256 vv[CH];
            for (int c = 0; c < CH; c++) vv[c] = d0 + 8 * c < D ? load8(a->v, dt, base + d0 + 8 * c) : _mm256_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m256 p = _mm256_set1_ps(scores[(int64_t)g * n + j]);
                for (int c = 0; c < CH; c++) acc[g][c] = _mm256_fmadd_ps(p, vv[c], acc[g][c]);
            }
        });
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH && d0 + 8 * c < D; c++)
                _mm256_storeu_ps(out + g * D + d0 + 8 * c, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
    }
}

#if HAVE_AVX512
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"), always_inline)) static inline void item_avx512_g(
    const decode_args *a, int s, int h, float *scores, const int G) {
    const int D = a->head_dim, n = a->lens[s], dt = a->kv_dtype;
    const float *q = a->q + a->q_starts[s] * a->q_stride + (int64_t)h * G * D;
    float *out = a->out + a->q_starts[s] * (int64_t)a->heads * D + (int64_t)h * G * D;
    const int64_t head_base = (int64_t)h * a->num_slots * D;
    float inv[16];
    FOR_EACH_TOKEN(a, s, n, head_base, a->k, a->v, {
        __m512 acc[16];
        for (int g = 0; g < G; g++) acc[g] = _mm512_setzero_ps();
        for (int d = 0; d < D; d += 16) {
            __m512 kv = load16(a->k, dt, base + d);
            for (int g = 0; g < G; g++) acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + d), kv, acc[g]);
        }
        for (int g = 0; g < G; g++) scores[(int64_t)g * n + j] = _mm512_reduce_add_ps(acc[g]) * a->scale;
    });
    SOFTMAX_BODY(__m512, 16, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_sub_ps, exp16, _mm512_add_ps,
                 _mm512_reduce_add_ps, _mm512_max_ps, _mm512_reduce_max_ps)
    enum { CH = 4 }; /* 4 registers (64 dims) per head and slice: G <= 6 keeps 24 accumulators + 4 values */
    for (int d0 = 0; d0 < D; d0 += 16 * CH) {
        __m512 acc[16][CH];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH; c++) acc[g][c] = _mm512_setzero_ps();
        FOR_EACH_TOKEN(a, s, n, head_base, a->v, (const void *)NULL, {
            __m512 vv[CH];
            for (int c = 0; c < CH; c++) vv[c] = d0 + 16 * c < D ? load16(a->v, dt, base + d0 + 16 * c) : _mm512_setzero_ps();
            for (int g = 0; g < G; g++) {
                __m512 p = _mm512_set1_ps(scores[(int64_t)g * n + j]);
                for (int c = 0; c < CH; c++) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
            }
        });
        for (int g = 0; g < G; g++)
            for (int c = 0; c < CH && d0 + 16 * c < D; c++)
                _mm512_storeu_ps(out + g * D + d0 + 16 * c, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
    }
}
#endif

/* the group size as a compile-time constant, so that the accumulators live in registers */
#define DISPATCH_G(FN, a, s, h, sc)                                                                          \
    switch ((a)->heads / (a)->kv_heads) {                                                                  \
    case 1: FN(a, s, h, sc, 1); break;                                                                     \
    case 2: FN(a, s, h, sc, 2); break;                                                                     \
    case 3: FN(a, s, h, sc, 3); break;                                                                     \
    case 4: FN(a, s, h, sc, 4); break;                                                                     \
    case 5: FN(a, s, h, sc, 5); break;                                                                     \
    case 6: FN(a, s, h, sc, 6); break;                                                                     \
    case 7: FN(a, s, h, sc, 7); break;                                                                     \
    case 8: FN(a, s, h, sc, 8); break;                                                                     \
    default: FN(a, s, h, sc, (a)->heads / (a)->kv_heads); break;                                           \
    }

__attribute__((target("avx2,fma,f16c"))) static void item_avx2(const decode_args *a, int s, int h, float *sc) {
    DISPATCH_G(item_avx2_g, a, s, h, sc)
}

#if HAVE_AVX512
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static void item_avx512(const decode_args *a, int s, int h,
                                                                                          float *sc) {
    DISPATCH_G(item_avx512_g, a, s, h, sc)
}
#endif
#endif


static void run_decode(const decode_args *a, int isa, int threads) {
    int max_len = 0;
    for (int s = 0; s < a->n_seqs; s++) max_len = a->lens[s] > max_len ? a->lens[s] : max_len;
    const int G = a->heads / a->kv_heads, items = a->n_seqs * a->kv_heads;
    (void)isa;
#pragma omp parallel num_threads(threads)
    {
        float *scores = malloc(sizeof(float) * (size_t)G * (size_t)(max_len > 0 ? max_len : 1));
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < items; it++) {
            const int s = it / a->kv_heads, h = it % a->kv_heads;
            if (a->q_starts[s + 1] - a->q_starts[s] != 1) continue; /* not a decode row: the caller's */
#if HAVE_AVX512
            if (isa == ISA_AVX512)
                item_avx512(a, s, h, scores);
            else
#endif
#if HAVE_X86
            if (isa == ISA_AVX2)
                item_avx2(a, s, h, scores);
            else
#endif
                item_generic(a, s, h, scores);
        }
        free(scores);
    }
}

/* Whether every decode row's tables stay inside the batch and the pool (NULL) or what is wrong. */
static const char *check_tables(const decode_args *a, int64_t num_tokens) {
    if (a->num_slots % a->page_size) return "the pool's slots are not whole pages";
    const int64_t num_pages = a->num_slots / a->page_size;
    if (a->q_starts[0] < 0 || a->q_starts[a->n_seqs] > num_tokens) return "q_starts run past the batch";
    for (int s = 0; s < a->n_seqs; s++) {
        if (a->q_starts[s + 1] < a->q_starts[s]) return "q_starts decrease";
        if (a->q_starts[s + 1] - a->q_starts[s] != 1) continue;
        const int n = a->lens[s], need = n / a->page_size + (n % a->page_size != 0);
        if (n < 1) return "a decode row has an empty context";
        if (need > a->table_stride) return "a context needs more pages than its table row holds";
        for (int p = 0; p < need; p++) {
            const int32_t page = a->table[(int64_t)s * a->table_stride + p];
            if (page < 0 || page >= num_pages) return "a page past the pool";
        }
    }
    return NULL;
}

/* decode(q, k, v, out, table, lens, q_starts, n_seqs, num_tokens, heads, kv_heads, head_dim, num_slots,
 *        page_size, table_stride, kv_dtype, scale, isa, threads, q_stride): addresses as integers (the
 * tensors' data_ptr; dtypes, shapes and contiguity checked by engines.model.cpu_attention), every
 * index checked here. Attends the rows of sequences with exactly one new token; leaves the others'
 * rows of `out` alone. Releases the GIL. */
static PyObject *py_decode(PyObject *self, PyObject *args) {
    unsigned long long q, k, v, out, table, lens, q_starts;
    long long num_slots, q_stride, num_tokens;
    decode_args a;
    int isa, threads;
    if (!PyArg_ParseTuple(args, "KKKKKKKiLiiiLiiifiiL", &q, &k, &v, &out, &table, &lens, &q_starts, &a.n_seqs,
                          &num_tokens, &a.heads, &a.kv_heads, &a.head_dim, &num_slots, &a.page_size, &a.table_stride,
                          &a.kv_dtype, &a.scale, &isa, &threads, &q_stride))
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
    Py_BEGIN_ALLOW_THREADS run_decode(&a, isa, threads > 0 ? threads : 1);
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
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
