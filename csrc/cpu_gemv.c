/* Products of a few token rows with weights read once, on the CPU (engines._cpu_gemv): a decode step's
 * projections (`linear`) and its mixture-of-experts SwiGLU experts (`experts`).
 *
 * A decode step multiplies a handful of rows by every weight matrix, so its time is the bytes of the
 * weights. Through torch, neither MKL/oneDNN's small-M GEMMs nor torch's own kernels stream bfloat16
 * weights near the memory's rate on a CPU (engines.model.cpu_gemv has the measurements). Here each
 * weight row is read once for all the rows: its dot products with each row (up to four at a time, two
 * weight rows at a time, from float32 copies of the rows in cache), the weights widened to float32 in
 * registers. All arithmetic is float32, and every dot product is computed in the same order whatever
 * the row count, so a row's result does not depend on the rows beside it.
 *
 * `linear` splits the weight rows among OpenMP threads (torch's runtime, as csrc/cpu_attention.c
 * explains). `experts`: a decode step sends each of its T tokens to top-k of E experts, so most experts
 * it touches get one to three rows; one work item per expert, each expert's matrices read once for all
 * its rows; gate/up, SwiGLU's product, down and the weighting in float32; a token's picks summed in
 * pick order once every expert is done, so the result depends neither on which thread ran which expert
 * nor on the other tokens of the batch.
 *
 * Three implementations of the dot products: AVX-512, AVX2 and portable C, picked as in
 * csrc/cpu_vec.h; a vector one needs the reduced dimension to be whole registers, else the portable one
 * runs. Expert ids come from Python but are checked here before any thread starts.
 *
 * A prefill-sized bfloat16 batch on a CPU with AMX runs its experts here too, on the tiles
 * (csrc/cpu_amx.c, `tile_rows`), summing into per-thread float32 rows instead of per-pick ones
 * (`run_experts_tiled`). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu_amx.h"
#include "cpu_vec.h"

typedef struct {
    const void *x;         /* [T, H] tokens, `dtype` */
    void *out;             /* [T, H] `dtype` */
    const float *weights;  /* [T, k] each pick's weight */
    const int64_t *ids;    /* [T, k] each pick's expert */
    const void *gate_up;   /* [E, 2I, H] gate rows, then up rows, `dtype` */
    const void *down;      /* [E, H, I] `dtype` */
    int T, k, E, H, I, dtype;
} moe_args;

enum { MAX_ROWS = 4 }; /* rows per pass over a tile of weight rows: 2 x 4 accumulators in registers */
enum { TILE = 16 };    /* weight rows per tile: each tile is re-read from cache, not memory, by later passes */

static inline float elem_at(const void *base, int dtype, int64_t i) {
    return dtype == ELEM_F32 ? ((const float *)base)[i] : bf16_to_float(((const uint16_t *)base)[i]);
}

static inline uint16_t float_to_bf16(float f) { /* round to nearest even, NaN kept a NaN */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

/* y[r * ldy + n] = W[n, :K] . xs[r * K : (r + 1) * K] for n < N, r < R; W `dtype` [N, K] row-major */
static void dots_generic(const void *W, int dtype, int N, int K, const float *xs, int R, float *y, int ldy) {
    for (int n = 0; n < N; n++)
        for (int r = 0; r < R; r++) {
            float acc = 0.f;
            for (int j = 0; j < K; j++) acc += elem_at(W, dtype, (int64_t)n * K + j) * xs[(int64_t)r * K + j];
            y[(int64_t)r * ldy + n] = acc;
        }
}

/* The vector dot products: for each tile of TILE weight rows, passes of up to MAX_ROWS token rows,
 * two weight rows at a time. R_ (1..MAX_ROWS) is a compile-time constant in each copy.
 * The first pass over a tile also prefetches the next two weight rows while it reads these two: the
 * hardware prefetcher follows the two streams being read, but a row of a few KB ends before it has
 * run far ahead, so each new pair of rows began with misses. bfloat16 projections read from memory ran
 * 1.09-1.34x faster (medians over nine weight shapes, 1-4 rows, one and two threads of a Xeon with AMX;
 * float32 unchanged: docs/cpu_gemv.md). The sums are computed exactly as before. */
#define DOTS_PASS(VEC, WIDTH, LOADW, LOADX, FMA, ZERO, REDUCE, R_)                                           \
    for (int n = n0; n < n1; n += 2) {                                                                     \
        const int two = n + 1 < n1;                                                                        \
        VEC acc0[R_], acc1[R_];                                                                            \
        for (int r = 0; r < R_; r++) acc0[r] = acc1[r] = ZERO();                                           \
        const int64_t w0 = (int64_t)n * K, w1 = (int64_t)(two ? n + 1 : n) * K;                            \
        const char *next = (const char *)W + (w0 + 2 * (int64_t)K) * esz;                                  \
        for (int j = 0; j < K; j += WIDTH) {                                                               \
            if (prefetch_next) {                                                                           \
                PREFETCH(next + (int64_t)j * esz);                                                         \
                PREFETCH(next + ((int64_t)K + j) * esz);                                                   \
            }                                                                                              \
            const VEC a = LOADW(W, dtype, w0 + j), b = LOADW(W, dtype, w1 + j);                            \
            for (int r = 0; r < R_; r++) {                                                                 \
                const VEC xv = LOADX(x0 + (int64_t)r * K + j);                                             \
                acc0[r] = FMA(a, xv, acc0[r]);                                                             \
                acc1[r] = FMA(b, xv, acc1[r]);                                                             \
            }                                                                                              \
        }                                                                                                  \
        for (int r = 0; r < R_; r++) {                                                                     \
            y0[(int64_t)r * ldy + n] = REDUCE(acc0[r]);                                                    \
            if (two) y0[(int64_t)r * ldy + n + 1] = REDUCE(acc1[r]);                                       \
        }                                                                                                  \
    }

#define DOTS_BODY(PASS)                                                                                    \
    const int64_t esz = dtype == ELEM_F32 ? 4 : 2;                                                         \
    for (int n0 = 0; n0 < N; n0 += TILE) {                                                                 \
        const int n1 = n0 + TILE < N ? n0 + TILE : N;                                                      \
        for (int r0 = 0; r0 < R; r0 += MAX_ROWS) {                                                         \
            const int prefetch_next = r0 == 0;                                                             \
            const float *x0 = xs + (int64_t)r0 * K;                                                        \
            float *y0 = y + (int64_t)r0 * ldy;                                                             \
            switch (R - r0 < MAX_ROWS ? R - r0 : MAX_ROWS) {                                               \
            case 1: PASS(1) break;                                                                         \
            case 2: PASS(2) break;                                                                         \
            case 3: PASS(3) break;                                                                         \
            default: PASS(4) break;                                                                        \
            }                                                                                              \
        }                                                                                                  \
    }

#if HAVE_X86
#define PASS8(R_) DOTS_PASS(__m256, 8, load8, _mm256_loadu_ps, _mm256_fmadd_ps, _mm256_setzero_ps, hsum8, R_)
__attribute__((target("avx2,fma,f16c"))) static void dots_avx2(const void *W, int dtype, int N, int K, const float *xs,
                                                               int R, float *y, int ldy) {
    DOTS_BODY(PASS8)
}
#undef PASS8
#endif

#if HAVE_AVX512
#define PASS16(R_)                                                                                          \
    DOTS_PASS(__m512, 16, load16, _mm512_loadu_ps, _mm512_fmadd_ps, _mm512_setzero_ps, _mm512_reduce_add_ps, R_)
__attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c"))) static void dots_avx512(const void *W, int dtype, int N,
                                                                                          int K, const float *xs, int R,
                                                                                          float *y, int ldy) {
    DOTS_BODY(PASS16)
}
#undef PASS16
#endif

static void dots(int isa, const void *W, int dtype, int N, int K, const float *xs, int R, float *y, int ldy) {
#if HAVE_AVX512
    if (isa == ISA_AVX512 && K % 16 == 0) {
        dots_avx512(W, dtype, N, K, xs, R, y, ldy);
        return;
    }
#endif
#if HAVE_X86
    if (isa >= ISA_AVX2 && K % 8 == 0) {
        dots_avx2(W, dtype, N, K, xs, R, y, ldy);
        return;
    }
#endif
    dots_generic(W, dtype, N, K, xs, R, y, ldy);
}

/* One expert over its rows: picks[0..m) index (token * k + pick); ys [m, H] gets the expert's output
 * for each (float32). Scratch: xs [m, H], h [m, 2I], act [m, I]. */
static void expert_rows(const moe_args *a, int isa, int e, const int32_t *picks, int m, float *xs, float *h, float *act,
                        float *ys) {
    const int H = a->H, I = a->I, esz = a->dtype == ELEM_F32 ? 4 : 2;
    for (int i = 0; i < m; i++) {
        const int64_t row = (int64_t)(picks[i] / a->k) * H;
        for (int j = 0; j < H; j++) xs[(int64_t)i * H + j] = elem_at(a->x, a->dtype, row + j);
    }
    const char *gu = (const char *)a->gate_up + (int64_t)e * 2 * I * H * esz;
    const char *dn = (const char *)a->down + (int64_t)e * H * I * esz;
    dots(isa, gu, a->dtype, 2 * I, H, xs, m, h, 2 * I);
    for (int i = 0; i < m; i++)
        for (int j = 0; j < I; j++) {
            const float g = h[(int64_t)i * 2 * I + j], u = h[(int64_t)i * 2 * I + I + j];
            act[(int64_t)i * I + j] = g / (1.f + expf(-g)) * u; /* SwiGLU: silu(gate) * up */
        }
    dots(isa, dn, a->dtype, H, I, act, m, ys, H);
}

static void store_out(const moe_args *a, int64_t i, float v) {
    if (a->dtype == ELEM_F32)
        ((float *)a->out)[i] = v;
    else
        ((uint16_t *)a->out)[i] = float_to_bf16(v);
}

/* Every active expert, one per work item, then each token's picks weighted and summed in pick order:
 * a token's result depends neither on which thread ran which expert nor on the other tokens of the
 * batch. `scratch` holds `threads` blocks of `per_thread` floats; per_pick [T * k, H] float32. */
static void run_experts(const moe_args *a, int isa, int threads, const int32_t *order, const int32_t *starts,
                        const int32_t *active, int n_active, int max_rows, float *scratch, size_t per_thread,
                        float *per_pick) {
    const int H = a->H, I = a->I;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        float *xs = scratch + per_thread * (size_t)omp_get_thread_num();
#else
        float *xs = scratch;
#endif
        float *h = xs + (size_t)max_rows * H, *act = h + (size_t)max_rows * 2 * I, *ys = act + (size_t)max_rows * I;
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < n_active; it++) {
            const int e = active[it], n = starts[e + 1] - starts[e];
            expert_rows(a, isa, e, order + starts[e], n, xs, h, act, ys);
            for (int i = 0; i < n; i++)
                memcpy(per_pick + (int64_t)order[starts[e] + i] * H, ys + (int64_t)i * H, sizeof(float) * H);
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < a->T; t++) {
        for (int j = 0; j < H; j++) {
            float acc = 0.f;
            for (int p = 0; p < a->k; p++)
                acc += a->weights[(int64_t)t * a->k + p] * per_pick[((int64_t)t * a->k + p) * H + j];
            store_out(a, (int64_t)t * H + j, acc);
        }
    }
}

/* The same with experts of at least `tile_rows` rows on AMX tiles (csrc/cpu_amx.c), for batches as large
 * as a prefill's: a (token, pick)'s output is added, weighted, to its token's row of its thread's float32
 * sums `acc` ([threads][T, H], zeroed) as soon as its expert is done — T x H floats per thread where the
 * pick-order sum above keeps T x k x H — and the threads' sums are added in thread order at the end.
 * Each thread takes a fixed share of the experts (the largest first, each to the thread with the least
 * work so far, counting an expert's rows and the reading of its weights), so the result is the same on
 * every run of the same batch and thread count; unlike the decode path's, it may differ in the last bits
 * with the batch or the thread count. `tile_scratch` holds `threads` blocks of `tile_per_thread` bytes. */
static void run_experts_tiled(const moe_args *a, int isa, int threads, const int32_t *order, const int32_t *starts,
                              const int32_t *active, int n_active, int max_rows, float *scratch, size_t per_thread,
                              int tile_rows, char *tile_scratch, size_t tile_per_thread, int32_t *owner, float *acc) {
    const int H = a->H, I = a->I;
    const size_t plane = (size_t)a->T * H;
    int team = 1;
#pragma omp parallel num_threads(threads)
    {
#ifdef _OPENMP
        const int me = omp_get_thread_num();
#else
        const int me = 0;
#endif
#pragma omp single
        {
#ifdef _OPENMP
            team = omp_get_num_threads();
#endif
            int64_t load[team];
            for (int t = 0; t < team; t++) load[t] = 0;
            for (int it = 0; it < n_active; it++) { /* `active` lists the largest experts first */
                int best = 0;
                for (int t = 1; t < team; t++) best = load[t] < load[best] ? t : best;
                owner[it] = best;
                load[best] += 64 + starts[active[it] + 1] - starts[active[it]]; /* weights ~ 64 rows' compute */
            }
        }
        float *xs = scratch + per_thread * (size_t)me, *mine = acc + plane * (size_t)me;
        float *h = xs + (size_t)max_rows * H, *act = h + (size_t)max_rows * 2 * I, *ys = act + (size_t)max_rows * I;
        amx_thread_begin();
        for (int it = 0; it < n_active; it++) {
            if (owner[it] != me) continue;
            const int e = active[it], n = starts[e + 1] - starts[e];
            const int32_t *picks = order + starts[e];
            if (n >= tile_rows) {
                amx_expert(a->x, a->k, picks, n, (const uint16_t *)a->gate_up + (int64_t)e * 2 * I * H,
                           (const uint16_t *)a->down + (int64_t)e * H * I, H, I, a->weights, mine,
                           tile_scratch + tile_per_thread * (size_t)me);
                continue;
            }
            expert_rows(a, isa, e, picks, n, xs, h, act, ys);
            for (int i = 0; i < n; i++) {
                const float w = a->weights[picks[i]];
                float *dst = mine + (int64_t)(picks[i] / a->k) * H;
                for (int j = 0; j < H; j++) dst[j] += w * ys[(int64_t)i * H + j];
            }
        }
        amx_thread_end();
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < a->T; t++)
        for (int j = 0; j < H; j++) {
            float sum = acc[(int64_t)t * H + j];
            for (int th = 1; th < team; th++) sum += acc[plane * th + (int64_t)t * H + j];
            store_out(a, (int64_t)t * H + j, sum);
        }
}

static int by_key(const void *l, const void *r) {
    const int64_t a = *(const int64_t *)l, b = *(const int64_t *)r;
    return (a > b) - (a < b);
}

/* experts(x, out, weights, ids, gate_up, down, T, k, E, H, I, dtype, isa, threads, tile_rows): addresses
 * as integers (the tensors' data_ptr; dtypes, shapes and contiguity checked by engines.model.cpu_gemv),
 * every expert id checked here. Experts of at least `tile_rows` rows run on AMX tiles (0: none; only
 * bfloat16, where amx_ready() and the shapes fit). Writes out [T, H]. Releases the GIL. */
static PyObject *py_experts(PyObject *self, PyObject *args) {
    unsigned long long x, out, weights, ids, gate_up, down;
    moe_args a;
    int isa, threads, tile_rows;
    if (!PyArg_ParseTuple(args, "KKKKKKiiiiiiiii", &x, &out, &weights, &ids, &gate_up, &down, &a.T, &a.k, &a.E, &a.H,
                          &a.I, &a.dtype, &isa, &threads, &tile_rows))
        return NULL;
    if (a.T < 0 || a.k <= 0 || a.E <= 0 || a.H <= 0 || a.I <= 0 || (a.dtype != ELEM_F32 && a.dtype != ELEM_BF16)) {
        PyErr_SetString(PyExc_ValueError, "experts: bad shape or dtype");
        return NULL;
    }
    if (isa_refused("experts", isa)) return NULL;
    if (tile_rows < 0 || (tile_rows && (a.dtype != ELEM_BF16 || !amx_shapes_fit(a.H, a.I) || !amx_ready()))) {
        PyErr_Format(PyExc_ValueError, "experts: AMX tiles need bfloat16, hidden and expert sizes in whole multiples of 32 "
                     "and a CPU whose tiles this process may use (tile_rows %d, H %d, I %d, ready %d)", tile_rows, a.H, a.I,
                     amx_ready());
        return NULL;
    }
    a.x = (const void *)(uintptr_t)x;
    a.out = (void *)(uintptr_t)out;
    a.weights = (const float *)(uintptr_t)weights;
    a.ids = (const int64_t *)(uintptr_t)ids;
    a.gate_up = (const void *)(uintptr_t)gate_up;
    a.down = (const void *)(uintptr_t)down;
    const int64_t n_picks = (int64_t)a.T * a.k;
    for (int64_t p = 0; p < n_picks; p++)
        if (a.ids[p] < 0 || a.ids[p] >= a.E) {
            PyErr_Format(PyExc_ValueError, "experts: pick %lld names expert %lld of %d", (long long)p,
                         (long long)a.ids[p], a.E);
            return NULL;
        }
    /* the picks grouped by expert, in pick order within each (a counting sort) */
    threads = threads > 0 ? threads : 1;
    int32_t *starts = calloc((size_t)a.E + 1, sizeof(int32_t)), *order = malloc(sizeof(int32_t) * (n_picks ? n_picks : 1)),
            *active = malloc(sizeof(int32_t) * (size_t)a.E), *fill = malloc(sizeof(int32_t) * (size_t)a.E);
    int64_t *keys = malloc(sizeof(int64_t) * (size_t)a.E);
    float *per_pick = tile_rows ? NULL : malloc(sizeof(float) * (size_t)(n_picks ? n_picks : 1) * a.H), *scratch = NULL;
    char *tile_scratch = NULL;
    int n_active = 0, max_rows = 0, max_tiled = 0; /* the most rows of an expert without and with tiles */
    const int tables = starts && order && active && fill && keys;
    if (tables) {
        for (int64_t p = 0; p < n_picks; p++) starts[a.ids[p] + 1]++;
        for (int e = 0; e < a.E; e++) {
            const int n = starts[e + 1];
            if (n) keys[n_active++] = ((int64_t)(INT32_MAX - n) << 32) | e; /* most rows first, then by id */
            if (tile_rows && n >= tile_rows)
                max_tiled = n > max_tiled ? n : max_tiled;
            else
                max_rows = n > max_rows ? n : max_rows;
            starts[e + 1] += starts[e];
            fill[e] = starts[e];
        }
        qsort(keys, (size_t)n_active, sizeof(int64_t), by_key);
        for (int i = 0; i < n_active; i++) active[i] = (int32_t)(keys[i] & 0xffffffff);
        for (int64_t p = 0; p < n_picks; p++) order[fill[a.ids[p]]++] = (int32_t)p;
    }
    const size_t per_thread = (size_t)(max_rows > 0 ? max_rows : 1) * (2 * (size_t)a.H + 3 * (size_t)a.I);
    const size_t tile_per_thread = max_tiled ? amx_scratch_bytes(max_tiled, a.H, a.I) : 0;
    scratch = tables ? malloc(sizeof(float) * per_thread * (size_t)threads) : NULL;
    /* with tiles: each thread's sums [T, H] instead of the per-pick outputs, and who runs each expert */
    float *acc = NULL;
    int32_t *owner = NULL;
    if (scratch && tile_rows) {
        acc = calloc((size_t)threads * a.T * a.H + 1, sizeof(float));
        owner = malloc(sizeof(int32_t) * (size_t)(n_active ? n_active : 1));
        tile_scratch = aligned_alloc(64, tile_per_thread ? tile_per_thread * (size_t)threads : 64);
    }
    const int ok = scratch != NULL && (!tile_rows || (acc && owner && tile_scratch)) && (tile_rows || per_pick);
    if (ok) {
        Py_BEGIN_ALLOW_THREADS
        if (tile_rows)
            run_experts_tiled(&a, isa, threads, order, starts, active, n_active, max_rows, scratch, per_thread, tile_rows,
                              tile_scratch, tile_per_thread, owner, acc);
        else
            run_experts(&a, isa, threads, order, starts, active, n_active, max_rows, scratch, per_thread, per_pick);
        Py_END_ALLOW_THREADS
    }
    free(starts), free(order), free(active), free(fill), free(keys), free(per_pick), free(scratch), free(tile_scratch);
    free(acc), free(owner);
    if (!ok) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_amx_ready(PyObject *self, PyObject *unused) {
    /* whether experts may run on AMX tiles here: this build has the code, the CPU the tiles, the OS granted them */
    return PyBool_FromLong(amx_ready());
}

/* linear(x, w, bias, out, M, N, K, dtype, isa, threads): out [M, N] = x [M, K] @ w [N, K]^T (+ bias [N],
 * 0 for none); addresses as integers (dtypes, shapes and contiguity checked by engines.model.cpu_gemv).
 * Releases the GIL. */
static PyObject *py_linear(PyObject *self, PyObject *args) {
    unsigned long long x, w, bias, out;
    int M, N, K, dtype, isa, threads;
    if (!PyArg_ParseTuple(args, "KKKKiiiiii", &x, &w, &bias, &out, &M, &N, &K, &dtype, &isa, &threads)) return NULL;
    if (M < 0 || N <= 0 || K <= 0 || (dtype != ELEM_F32 && dtype != ELEM_BF16)) {
        PyErr_SetString(PyExc_ValueError, "linear: bad shape or dtype");
        return NULL;
    }
    if (isa_refused("linear", isa)) return NULL;
    float *xs = malloc(sizeof(float) * (size_t)(M ? M : 1) * K), *y = malloc(sizeof(float) * (size_t)(M ? M : 1) * N);
    if (!xs || !y) {
        free(xs), free(y);
        return PyErr_NoMemory();
    }
    const void *xp = (const void *)(uintptr_t)x, *wp = (const void *)(uintptr_t)w, *bp = (const void *)(uintptr_t)bias;
    void *op = (void *)(uintptr_t)out;
    const int64_t esz = dtype == ELEM_F32 ? 4 : 2;
    threads = threads > 0 ? threads : 1;
    Py_BEGIN_ALLOW_THREADS
    for (int64_t i = 0; i < (int64_t)M * K; i++) xs[i] = elem_at(xp, dtype, i);
    /* weight rows in slices of 64, a thread's share contiguous */
    const int slices = (N + 63) / 64;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int t = 0; t < slices; t++) {
        const int n0 = t * 64, n = N - n0 < 64 ? N - n0 : 64;
        dots(isa, (const char *)wp + (int64_t)n0 * K * esz, dtype, n, K, xs, M, y + n0, N);
    }
    for (int64_t i = 0; i < (int64_t)M * N; i++) {
        const float v = y[i] + (bias ? elem_at(bp, dtype, i % N) : 0.f);
        if (dtype == ELEM_F32)
            ((float *)op)[i] = v;
        else
            ((uint16_t *)op)[i] = float_to_bf16(v);
    }
    Py_END_ALLOW_THREADS
    free(xs), free(y);
    Py_RETURN_NONE;
}

static PyObject *py_best_isa(PyObject *self, PyObject *unused) {
    /* 0 portable C, 1 AVX2, 2 AVX-512: the widest this build contains and this CPU runs */
    return PyLong_FromLong(best_isa());
}

static PyMethodDef methods[] = {
    {"linear", py_linear, METH_VARARGS, "x @ w^T (+ bias) over a few rows (see engines.model.cpu_gemv)."},
    {"experts", py_experts, METH_VARARGS, "MoE SwiGLU experts over decode-sized batches (see engines.model.cpu_gemv)."},
    {"amx_ready", py_amx_ready, METH_NOARGS, "whether experts may run on AMX tiles in this process"},
    {"best_isa", py_best_isa, METH_NOARGS, "the widest implementation this build and this CPU run"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_gemv", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_gemv(void) { return PyModule_Create(&module); }
