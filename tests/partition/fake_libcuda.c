/* A fake libcuda.so.1 for testing csrc/gpu_partition.c end to end on a machine without a GPU.
 *
 * It exports cuDriverGetVersion and cuGetProcAddress_v2 (the only two symbols the helper dlsym()s)
 * and hands out its own implementations of the driver calls, enforcing what the real driver would:
 * cuInit before use, the CUDA version each entry point first appeared in, split granularity. SMs are
 * numbered; each resource, green context and stream remembers which SMs it holds, and
 * fake_stream_sms() lets a test read them back.
 *
 * Device shape from the environment: FAKE_CUDA_SMS (132), FAKE_CUDA_MIN (8), FAKE_CUDA_ALIGN (8),
 * FAKE_CUDA_VERSION (12080). Build flags: -DNO_GREEN (a 12.3 driver), -DNO_GREEN_STREAM (12.4:
 * no cuGreenCtxStreamCreate, exercising the helper's fallback). */
#include <cuda.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* -DNO_GREEN variants leave some implementations out of the table below */
#pragma GCC diagnostic ignored "-Wunused-function"

#define MAX_SMS 256

typedef struct { unsigned first, count; } span; /* kept in CUdevResource's internal padding */
struct CUdevResourceDesc_st { unsigned char sms[MAX_SMS]; };
struct CUgreenCtx_st { unsigned char sms[MAX_SMS]; };
struct CUstream_st { struct CUgreenCtx_st *green; };

static int initialized, live_green, live_streams;
static struct CUgreenCtx_st *current; /* green context made current through its CUcontext */

static unsigned env(const char *name, unsigned fallback) {
    const char *v = getenv(name);
    return v && *v ? (unsigned)atoi(v) : fallback;
}

CUresult cuDriverGetVersion(int *v) { *v = (int)env("FAKE_CUDA_VERSION", 12080); return CUDA_SUCCESS; }
static CUresult f_init(unsigned flags) { (void)flags; initialized = 1; return CUDA_SUCCESS; }

static CUresult f_error_name(CUresult rc, const char **s) {
    *s = rc == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_FAKE";
    return CUDA_SUCCESS;
}
static CUresult f_error_string(CUresult rc, const char **s) { (void)rc; *s = "fake driver error"; return CUDA_SUCCESS; }

static CUresult f_device_get(CUdevice *d, int ordinal) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

static CUresult f_device_attribute(int *out, CUdevice_attribute attr, CUdevice d) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    (void)d;
    switch (attr) {
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *out = (int)env("FAKE_CUDA_SMS", 132); break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *out = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *out = 0; break;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

static void make_sm_resource(CUdevResource *r, unsigned first, unsigned count) {
    memset(r, 0, sizeof *r);
    r->type = CU_DEV_RESOURCE_TYPE_SM;
    r->sm.smCount = count;
    r->sm.minSmPartitionSize = env("FAKE_CUDA_MIN", 8);
    r->sm.smCoscheduledAlignment = env("FAKE_CUDA_ALIGN", 8);
    span s = {first, count};
    memcpy(r->_internal_padding, &s, sizeof s);
}

static span span_of(const CUdevResource *r) { span s; memcpy(&s, r->_internal_padding, sizeof s); return s; }

static CUresult f_dev_resource(CUdevice d, CUdevResource *r, CUdevResourceType type) {
    if (!initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (d != 0 || type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
    make_sm_resource(r, 0, env("FAKE_CUDA_SMS", 132));
    return CUDA_SUCCESS;
}

static CUresult f_split(CUdevResource *result, unsigned *nb, const CUdevResource *input,
                        CUdevResource *remaining, unsigned flags, unsigned min_count) {
    (void)flags;
    if (!nb || !input || input->type != CU_DEV_RESOURCE_TYPE_SM) return CUDA_ERROR_INVALID_VALUE;
    unsigned align = input->sm.smCoscheduledAlignment, size = (min_count + align - 1) / align * align;
    if (size < input->sm.minSmPartitionSize) size = input->sm.minSmPartitionSize;
    span in = span_of(input);
    unsigned fit = in.count / size;
    if (!result) { *nb = fit; return CUDA_SUCCESS; }
    unsigned n = *nb < fit ? *nb : fit;
    for (unsigned i = 0; i < n; i++) make_sm_resource(&result[i], in.first + i * size, size);
    if (remaining) make_sm_resource(remaining, in.first + n * size, in.count - n * size);
    *nb = n;
    return CUDA_SUCCESS;
}

static CUresult f_generate_desc(CUdevResourceDesc *out, CUdevResource *res, unsigned n) {
    struct CUdevResourceDesc_st *d = calloc(1, sizeof *d); /* leaked on purpose, as the API has no free */
    for (unsigned i = 0; i < n; i++) {
        span s = span_of(&res[i]);
        for (unsigned k = 0; k < s.count; k++) {
            if (d->sms[s.first + k]) { free(d); return CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION; }
            d->sms[s.first + k] = 1;
        }
    }
    *out = d;
    return CUDA_SUCCESS;
}

static CUresult f_green_create(CUgreenCtx *g, CUdevResourceDesc desc, CUdevice dev, unsigned flags) {
    if (dev != 0 || flags != CU_GREEN_CTX_DEFAULT_STREAM) return CUDA_ERROR_INVALID_VALUE;
    if ((int)env("FAKE_CUDA_MAX_GREEN", 1000) <= live_green) return CUDA_ERROR_OUT_OF_MEMORY;
    struct CUgreenCtx_st *c = malloc(sizeof *c);
    memcpy(c->sms, desc->sms, sizeof c->sms);
    live_green++;
    *g = c;
    return CUDA_SUCCESS;
}

static CUresult f_green_destroy(CUgreenCtx g) { free(g); live_green--; return CUDA_SUCCESS; }

static CUresult new_stream(CUstream *s, struct CUgreenCtx_st *g, unsigned flags) {
    if (!(flags & CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
    struct CUstream_st *st = malloc(sizeof *st);
    st->green = g;
    live_streams++;
    *s = st;
    return CUDA_SUCCESS;
}

static CUresult f_green_stream(CUstream *s, CUgreenCtx g, unsigned flags, int prio) {
    (void)prio;
    return new_stream(s, g, flags);
}
/* the 12.4 route: green context -> CUcontext -> current -> ordinary stream */
static CUresult f_ctx_from_green(CUcontext *c, CUgreenCtx g) { *c = (CUcontext)g; return CUDA_SUCCESS; }
static CUresult f_ctx_push(CUcontext c) { current = (struct CUgreenCtx_st *)c; return CUDA_SUCCESS; }
static CUresult f_ctx_pop(CUcontext *c) { *c = (CUcontext)current; current = NULL; return CUDA_SUCCESS; }
static CUresult f_stream_create(CUstream *s, unsigned flags) {
    return current ? new_stream(s, current, flags) : CUDA_ERROR_INVALID_CONTEXT;
}
static CUresult f_stream_destroy(CUstream s) { free(s); live_streams--; return CUDA_SUCCESS; }

static const struct { const char *name; void *fn; int since; } table[] = {
    {"cuInit", (void *)f_init, 2000},
    {"cuGetErrorName", (void *)f_error_name, 6000},
    {"cuGetErrorString", (void *)f_error_string, 6000},
    {"cuDeviceGet", (void *)f_device_get, 2000},
    {"cuDeviceGetAttribute", (void *)f_device_attribute, 2000},
    {"cuStreamCreate", (void *)f_stream_create, 2000},
    {"cuStreamDestroy", (void *)f_stream_destroy, 4000},
    {"cuCtxPushCurrent", (void *)f_ctx_push, 4000},
    {"cuCtxPopCurrent", (void *)f_ctx_pop, 4000},
#ifndef NO_GREEN
    {"cuDeviceGetDevResource", (void *)f_dev_resource, 12040},
    {"cuDevSmResourceSplitByCount", (void *)f_split, 12040},
    {"cuDevResourceGenerateDesc", (void *)f_generate_desc, 12040},
    {"cuGreenCtxCreate", (void *)f_green_create, 12040},
    {"cuGreenCtxDestroy", (void *)f_green_destroy, 12040},
    {"cuCtxFromGreenCtx", (void *)f_ctx_from_green, 12040},
#ifndef NO_GREEN_STREAM
    {"cuGreenCtxStreamCreate", (void *)f_green_stream, 12050},
#endif
#endif
};

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, cuuint64_t flags,
                             CUdriverProcAddressQueryResult *status) {
    (void)flags;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        if (strcmp(table[i].name, symbol)) continue;
        if (version < table[i].since) {
            *pfn = NULL, *status = CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT;
            return CUDA_ERROR_NOT_FOUND;
        }
        *pfn = table[i].fn, *status = CU_GET_PROC_ADDRESS_SUCCESS;
        return CUDA_SUCCESS;
    }
    *pfn = NULL, *status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    return CUDA_ERROR_NOT_FOUND;
}

/* test-only accessors */
int fake_live_green(void) { return live_green; }
int fake_live_streams(void) { return live_streams; }
unsigned fake_stream_sms(uint64_t stream, unsigned *out, unsigned cap) {
    struct CUstream_st *s = (struct CUstream_st *)(uintptr_t)stream;
    unsigned n = 0;
    for (unsigned k = 0; k < MAX_SMS && n < cap; k++)
        if (s->green->sms[k]) out[n++] = k;
    return n;
}
