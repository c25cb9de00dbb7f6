/* Bullet GPU partition helper: green-context stream pools through the CUDA driver API, loaded at
 * run time.
 *
 * The library never links against libcuda: it dlopen()s "libcuda.so.1" (or $BULLET_LIBCUDA) on the
 * first call and resolves every entry point with cuGetProcAddress, pinned to the CUDA version whose
 * signature this file was written against. It therefore builds and loads on a machine with no
 * driver, and every call there returns GPU_PARTITION_NO_DRIVER with a readable message.
 *
 * Return codes: 0 success; a negative GPU_PARTITION_* code for helper-level failures; a positive
 * CUresult from the driver otherwise. gpu_partition_last_error() describes the last failure of the
 * calling thread. Handles (green contexts, streams) cross the ABI as uint64_t so ctypes can hold
 * them as plain integers; a stream handle is a CUstream, usable as torch.cuda.ExternalStream. */
#ifndef BULLET_GPU_PARTITION_H
#define BULLET_GPU_PARTITION_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define GPU_PARTITION_ABI_VERSION 1

enum {
    GPU_PARTITION_OK = 0,
    GPU_PARTITION_NO_DRIVER = -1,    /* libcuda.so.1 could not be loaded */
    GPU_PARTITION_NO_SYMBOL = -2,    /* the driver lacks an entry point (too old for the call) */
    GPU_PARTITION_BAD_ARGUMENT = -3, /* invalid argument, caught before calling the driver */
    GPU_PARTITION_NO_MEMORY = -4,
};

/* Groups of SMs from ONE cuDevSmResourceSplitByCount call (only one call guarantees disjointness). */
typedef struct gpu_sm_split gpu_sm_split;

int gpu_partition_abi_version(void);
const char *gpu_partition_last_error(void);

/* Loads the driver and runs cuInit(0). Idempotent; later calls return the first outcome. */
int gpu_partition_load(void);

/* Driver API version (1000*major + 10*minor). Needs neither cuInit nor a device. */
int gpu_partition_driver_version(int *version);

int gpu_partition_device_info(int device, int *sm_count, int *cc_major, int *cc_minor);

/* GPU_PARTITION_OK when every green-context entry point exists (CUDA >= 12.4), else
 * GPU_PARTITION_NO_SYMBOL with the missing function named in gpu_partition_last_error(). */
int gpu_partition_green_ctx_supported(void);

/* The device's SM resource: SM count and the split constraints the driver reports. */
int gpu_partition_sm_resource(int device, unsigned *sm_count, unsigned *min_partition_size,
                              unsigned *coscheduled_alignment);

/* Splits all SMs of `device` into as many groups of at least `group_sms` SMs as fit (flags: the
 * CUdevSmResourceSplit_flags). Sizes are read back with the accessors below. */
int gpu_partition_split(int device, unsigned group_sms, unsigned flags, gpu_sm_split **out);
unsigned gpu_partition_split_groups(const gpu_sm_split *split);
unsigned gpu_partition_split_group_sms(const gpu_sm_split *split, unsigned index);
unsigned gpu_partition_split_remainder_sms(const gpu_sm_split *split);
void gpu_partition_split_free(gpu_sm_split *split);

/* A green context made of groups [first, first + count) of `split` (plus the remainder SMs if
 * with_remainder), and a non-blocking stream in it. */
int gpu_partition_create_stream(gpu_sm_split *split, unsigned first, unsigned count,
                                int with_remainder, uint64_t *green_ctx, uint64_t *stream);
int gpu_partition_destroy_stream(uint64_t green_ctx, uint64_t stream);

#ifdef __cplusplus
}
#endif

#endif
