/* Bullet GPU partition helper — see gpu_partition.h for the contract.
 *
 * Build (no driver needed):  gcc -O2 -shared -fPIC -pthread -I<cuda>/include gpu_partition.c -ldl
 * Only types and constants come from cuda.h; every function is resolved at run time. */
#include "gpu_partition.h"

#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* CUDA version each entry point is requested at: the signature declared below is the one that
 * version defines, whatever newer variants the installed driver also carries. */
#define BASE_API 12000
#define GREEN_API 12040        /* green contexts appeared in 12.4 */
#define GREEN_STREAM_API 12050 /* cuGreenCtxStreamCreate appeared in 12.5 */

typedef CUresult (*get_proc_address_fn)(const char *, void **, int, cuuint64_t,
                                        CUdriverProcAddressQueryResult *);
typedef CUresult (*driver_version_fn)(int *);

static struct {
    void *lib;
    driver_version_fn driver_version;
    CUresult (*init)(unsigned int);
    CUresult (*error_name)(CUresult, const char **);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_attribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*stream_create)(CUstream *, unsigned int);
    CUresult (*stream_destroy)(CUstream);
    CUresult (*ctx_push)(CUcontext);
    CUresult (*ctx_pop)(CUcontext *);
    /* green contexts */
    CUresult (*dev_resource)(CUdevice, CUdevResource *, CUdevResourceType);
    CUresult (*split_by_count)(CUdevResource *, unsigned int *, const CUdevResource *,
                               CUdevResource *, unsigned int, unsigned int);
    CUresult (*generate_desc)(CUdevResourceDesc *, CUdevResource *, unsigned int);
    CUresult (*green_create)(CUgreenCtx *, CUdevResourceDesc, CUdevice, unsigned int);
    CUresult (*green_destroy)(CUgreenCtx);
    CUresult (*ctx_from_green)(CUcontext *, CUgreenCtx);
    CUresult (*green_stream_create)(CUstream *, CUgreenCtx, unsigned int, int); /* may be NULL */
    const char *missing_green; /* first missing green-context entry point, or NULL */
    int load_status;
    char load_error[512];
} drv;

static __thread char last_error[512];
static pthread_once_t load_once = PTHREAD_ONCE_INIT;

static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

/* A driver error as "call: NAME (code): description". */
static int cu_fail(CUresult rc, const char *call) {
    const char *name = NULL, *text = NULL;
    if (drv.error_name) drv.error_name(rc, &name);
    if (drv.error_string) drv.error_string(rc, &text);
    return fail((int)rc, "%s failed: %s (%d): %s", call, name ? name : "CUDA error", (int)rc,
                text ? text : "no description");
}

int gpu_partition_abi_version(void) { return GPU_PARTITION_ABI_VERSION; }

const char *gpu_partition_last_error(void) { return last_error; }

static void *resolve(get_proc_address_fn get, const char *symbol, int version) {
    void *fn = NULL;
    CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
    if (get(symbol, &fn, version, CU_GET_PROC_ADDRESS_DEFAULT, &status) != CUDA_SUCCESS ||
        status != CU_GET_PROC_ADDRESS_SUCCESS)
        return NULL;
    return fn;
}

#define RESOLVE(field, symbol, version) (*(void **)&drv.field = resolve(get, symbol, version))

static void load_driver(void) {
    const char *path = getenv("BULLET_LIBCUDA");
    if (!path || !*path) path = "libcuda.so.1";
    drv.lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!drv.lib) {
        const char *why = dlerror();
        drv.load_status = GPU_PARTITION_NO_DRIVER;
        snprintf(drv.load_error, sizeof drv.load_error, "no CUDA driver: cannot load %s (%s)", path,
                 why ? why : "unknown reason");
        return;
    }
    *(void **)&drv.driver_version = dlsym(drv.lib, "cuDriverGetVersion");
    get_proc_address_fn get = (get_proc_address_fn)dlsym(drv.lib, "cuGetProcAddress_v2");
    if (!get || !drv.driver_version) {
        drv.load_status = GPU_PARTITION_NO_SYMBOL;
        snprintf(drv.load_error, sizeof drv.load_error,
                 "%s has no cuGetProcAddress_v2: CUDA driver older than 12.0", path);
        return;
    }
    const char *missing = NULL;
    if (!RESOLVE(init, "cuInit", BASE_API)) missing = "cuInit";
    if (!RESOLVE(device_get, "cuDeviceGet", BASE_API)) missing = "cuDeviceGet";
    if (!RESOLVE(device_attribute, "cuDeviceGetAttribute", BASE_API)) missing = "cuDeviceGetAttribute";
    if (!RESOLVE(stream_create, "cuStreamCreate", BASE_API)) missing = "cuStreamCreate";
    if (!RESOLVE(stream_destroy, "cuStreamDestroy", BASE_API)) missing = "cuStreamDestroy";
    if (!RESOLVE(ctx_push, "cuCtxPushCurrent", BASE_API)) missing = "cuCtxPushCurrent";
    if (!RESOLVE(ctx_pop, "cuCtxPopCurrent", BASE_API)) missing = "cuCtxPopCurrent";
    RESOLVE(error_name, "cuGetErrorName", BASE_API);
    RESOLVE(error_string, "cuGetErrorString", BASE_API);
    if (missing) {
        drv.load_status = GPU_PARTITION_NO_SYMBOL;
        snprintf(drv.load_error, sizeof drv.load_error, "CUDA driver %s lacks %s", path, missing);
        return;
    }
    /* Green-context entry points are optional at load time: a 12.0–12.3 driver still answers
     * version and device queries. gpu_partition_green_ctx_supported() reports what is missing. */
    if (!RESOLVE(dev_resource, "cuDeviceGetDevResource", GREEN_API)) missing = "cuDeviceGetDevResource";
    if (!RESOLVE(split_by_count, "cuDevSmResourceSplitByCount", GREEN_API))
        missing = "cuDevSmResourceSplitByCount";
    if (!RESOLVE(generate_desc, "cuDevResourceGenerateDesc", GREEN_API))
        missing = "cuDevResourceGenerateDesc";
    if (!RESOLVE(green_create, "cuGreenCtxCreate", GREEN_API)) missing = "cuGreenCtxCreate";
    if (!RESOLVE(green_destroy, "cuGreenCtxDestroy", GREEN_API)) missing = "cuGreenCtxDestroy";
    if (!RESOLVE(ctx_from_green, "cuCtxFromGreenCtx", GREEN_API)) missing = "cuCtxFromGreenCtx";
    RESOLVE(green_stream_create, "cuGreenCtxStreamCreate", GREEN_STREAM_API);
    drv.missing_green = missing;

    CUresult rc = drv.init(0);
    if (rc != CUDA_SUCCESS) {
        cu_fail(rc, "cuInit(0)");
        drv.load_status = (int)rc;
        snprintf(drv.load_error, sizeof drv.load_error, "%s", last_error);
        return;
    }
    drv.load_status = GPU_PARTITION_OK;
}

int gpu_partition_load(void) {
    pthread_once(&load_once, load_driver);
    if (drv.load_status != GPU_PARTITION_OK) return fail(drv.load_status, "%s", drv.load_error);
    return GPU_PARTITION_OK;
}

int gpu_partition_driver_version(int *version) {
    if (!version) return fail(GPU_PARTITION_BAD_ARGUMENT, "version is NULL");
    pthread_once(&load_once, load_driver);
    /* Readable even when cuInit failed (e.g. no device): only a missing library stops it. */
    if (!drv.driver_version) return fail(drv.load_status, "%s", drv.load_error);
    CUresult rc = drv.driver_version(version);
    return rc == CUDA_SUCCESS ? GPU_PARTITION_OK : cu_fail(rc, "cuDriverGetVersion");
}

int gpu_partition_device_info(int device, int *sm_count, int *cc_major, int *cc_minor) {
    int rc = gpu_partition_load();
    if (rc) return rc;
    CUdevice dev;
    CUresult r = drv.device_get(&dev, device);
    if (r != CUDA_SUCCESS) return cu_fail(r, "cuDeviceGet");
    if ((r = drv.device_attribute(sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev)) ||
        (r = drv.device_attribute(cc_major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev)) ||
        (r = drv.device_attribute(cc_minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev)))
        return cu_fail(r, "cuDeviceGetAttribute");
    return GPU_PARTITION_OK;
}

int gpu_partition_green_ctx_supported(void) {
    int rc = gpu_partition_load();
    if (rc) return rc;
    if (drv.missing_green)
        return fail(GPU_PARTITION_NO_SYMBOL,
                    "CUDA driver lacks %s: green contexts need a CUDA 12.4 or newer driver",
                    drv.missing_green);
    return GPU_PARTITION_OK;
}

static int device_sm_resource(int device, CUdevice *dev, CUdevResource *res) {
    int rc = gpu_partition_green_ctx_supported();
    if (rc) return rc;
    CUresult r = drv.device_get(dev, device);
    if (r != CUDA_SUCCESS) return cu_fail(r, "cuDeviceGet");
    r = drv.dev_resource(*dev, res, CU_DEV_RESOURCE_TYPE_SM);
    return r == CUDA_SUCCESS ? GPU_PARTITION_OK : cu_fail(r, "cuDeviceGetDevResource(SM)");
}

int gpu_partition_sm_resource(int device, unsigned *sm_count, unsigned *min_partition_size,
                              unsigned *coscheduled_alignment) {
    CUdevice dev;
    CUdevResource res;
    memset(&res, 0, sizeof res);
    int rc = device_sm_resource(device, &dev, &res);
    if (rc) return rc;
    *sm_count = res.sm.smCount;
    *min_partition_size = res.sm.minSmPartitionSize;
    *coscheduled_alignment = res.sm.smCoscheduledAlignment;
    return GPU_PARTITION_OK;
}

struct gpu_sm_split {
    CUdevice device;
    unsigned n_groups;
    CUdevResource remainder;
    CUdevResource groups[];
};

int gpu_partition_split(int device, unsigned group_sms, unsigned flags, gpu_sm_split **out) {
    if (!out || group_sms == 0) return fail(GPU_PARTITION_BAD_ARGUMENT, "need out and group_sms > 0");
    CUdevice dev;
    CUdevResource all;
    memset(&all, 0, sizeof all);
    int rc = device_sm_resource(device, &dev, &all);
    if (rc) return rc;
    unsigned n = 0;  /* first ask how many groups the driver would make, then make them */
    CUresult r = drv.split_by_count(NULL, &n, &all, NULL, flags, group_sms);
    if (r != CUDA_SUCCESS) return cu_fail(r, "cuDevSmResourceSplitByCount(query)");
    if (n == 0) return fail(GPU_PARTITION_BAD_ARGUMENT, "no group of %u SMs fits the device", group_sms);
    gpu_sm_split *split = calloc(1, sizeof *split + n * sizeof(CUdevResource));
    if (!split) return fail(GPU_PARTITION_NO_MEMORY, "out of memory for %u groups", n);
    split->device = dev;
    split->n_groups = n;
    r = drv.split_by_count(split->groups, &split->n_groups, &all, &split->remainder, flags, group_sms);
    if (r != CUDA_SUCCESS) {
        free(split);
        return cu_fail(r, "cuDevSmResourceSplitByCount");
    }
    *out = split;
    return GPU_PARTITION_OK;
}

unsigned gpu_partition_split_groups(const gpu_sm_split *split) { return split ? split->n_groups : 0; }

unsigned gpu_partition_split_group_sms(const gpu_sm_split *split, unsigned index) {
    return split && index < split->n_groups ? split->groups[index].sm.smCount : 0;
}

unsigned gpu_partition_split_remainder_sms(const gpu_sm_split *split) {
    return split && split->remainder.type == CU_DEV_RESOURCE_TYPE_SM ? split->remainder.sm.smCount : 0;
}

void gpu_partition_split_free(gpu_sm_split *split) { free(split); }

/* A stream inside green context `green`: the 12.5 call when present, else the 12.4 route of
 * making the green context current and creating an ordinary stream in it. */
static CUresult green_stream(CUgreenCtx green, CUstream *stream, const char **call) {
    if (drv.green_stream_create) {
        *call = "cuGreenCtxStreamCreate";
        return drv.green_stream_create(stream, green, CU_STREAM_NON_BLOCKING, 0);
    }
    CUcontext ctx, popped;
    CUresult r;
    *call = "cuCtxFromGreenCtx";
    if ((r = drv.ctx_from_green(&ctx, green)) != CUDA_SUCCESS) return r;
    *call = "cuCtxPushCurrent";
    if ((r = drv.ctx_push(ctx)) != CUDA_SUCCESS) return r;
    *call = "cuStreamCreate";
    r = drv.stream_create(stream, CU_STREAM_NON_BLOCKING);
    drv.ctx_pop(&popped);
    return r;
}

int gpu_partition_create_stream(gpu_sm_split *split, unsigned first, unsigned count,
                                int with_remainder, uint64_t *green_ctx, uint64_t *stream) {
    if (!split || !green_ctx || !stream || count == 0 || first + count > split->n_groups)
        return fail(GPU_PARTITION_BAD_ARGUMENT, "groups [%u, %u) outside the split's %u groups",
                    first, first + count, split ? split->n_groups : 0);
    int rc = gpu_partition_green_ctx_supported();
    if (rc) return rc;
    int add_rest = with_remainder && gpu_partition_split_remainder_sms(split) > 0;
    CUdevResource *parts = malloc((count + 1) * sizeof(CUdevResource));
    if (!parts) return fail(GPU_PARTITION_NO_MEMORY, "out of memory");
    memcpy(parts, split->groups + first, count * sizeof(CUdevResource));
    if (add_rest) parts[count] = split->remainder;
    CUdevResourceDesc desc;
    CUresult r = drv.generate_desc(&desc, parts, count + (unsigned)add_rest);
    free(parts);
    if (r != CUDA_SUCCESS) return cu_fail(r, "cuDevResourceGenerateDesc");
    CUgreenCtx green;
    if ((r = drv.green_create(&green, desc, split->device, CU_GREEN_CTX_DEFAULT_STREAM)) != CUDA_SUCCESS)
        return cu_fail(r, "cuGreenCtxCreate");
    CUstream s;
    const char *call = "";
    if ((r = green_stream(green, &s, &call)) != CUDA_SUCCESS) {
        rc = cu_fail(r, call);
        drv.green_destroy(green);
        return rc;
    }
    *green_ctx = (uint64_t)(uintptr_t)green;
    *stream = (uint64_t)(uintptr_t)s;
    return GPU_PARTITION_OK;
}

int gpu_partition_destroy_stream(uint64_t green_ctx, uint64_t stream) {
    int rc = gpu_partition_green_ctx_supported();
    if (rc) return rc;
    CUresult r;
    if (stream && (r = drv.stream_destroy((CUstream)(uintptr_t)stream)) != CUDA_SUCCESS)
        return cu_fail(r, "cuStreamDestroy");
    if (green_ctx && (r = drv.green_destroy((CUgreenCtx)(uintptr_t)green_ctx)) != CUDA_SUCCESS)
        return cu_fail(r, "cuGreenCtxDestroy");
    return GPU_PARTITION_OK;
}
