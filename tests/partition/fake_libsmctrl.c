/* A stand-in for libsmctrl.so with the same exported symbols and C signatures, so the tests drive
 * Bullet's real ctypes path (including the unsigned __int128 argument) and read back exactly what
 * arrived. Build with -DNO_EXT to mimic an old libsmctrl without the 128-bit call. */
#include <stdint.h>

static uint32_t tpcs = 54;
static int calls;
static int last_kind; /* 1 stream, 2 stream_ext, 3 global */
static void *last_stream;
static uint64_t last_low, last_high;
static int last_device = -1; /* the device the last TPC-count query named */

int libsmctrl_get_tpc_info_cuda(uint32_t *num_tpcs, int cuda_dev) {
    last_device = cuda_dev;
    if (cuda_dev != 0) return 19; /* ENODEV */
    *num_tpcs = tpcs;
    return 0;
}

void libsmctrl_set_stream_mask(void *stream, uint64_t mask) {
    calls++, last_kind = 1, last_stream = stream, last_low = mask, last_high = 0;
}

#ifndef NO_EXT
void libsmctrl_set_stream_mask_ext(void *stream, unsigned __int128 mask) {
    calls++, last_kind = 2, last_stream = stream;
    last_low = (uint64_t)mask, last_high = (uint64_t)(mask >> 64);
}
#endif

void libsmctrl_set_global_mask(uint64_t mask) {
    calls++, last_kind = 3, last_stream = 0, last_low = mask, last_high = 0;
}

/* test-only accessors */
void fake_set_tpcs(uint32_t n) { tpcs = n; }
int fake_calls(void) { return calls; }
int fake_last_device(void) { return last_device; }
void fake_last(int *kind, void **stream, uint64_t *low, uint64_t *high) {
    *kind = last_kind, *stream = last_stream, *low = last_low, *high = last_high;
}
