/* SM-id probe for `bullet doctor`: which SMs did a kernel launched on a given stream really run on?
 *
 * Every block records the SM it ran on (the %smid special register), then spins for a while so
 * that later blocks cannot all pile onto the first free SM: with several blocks per SM the observed
 * set converges to the SMs the stream is allowed to use. The launcher takes the stream and a device
 * buffer from the caller (torch), so the same launch can be captured into a CUDA graph.
 *
 * Build: nvcc -shared -Xcompiler -fPIC -O2 -gencode arch=compute_XY,code=sm_XY gpu_smid_probe.cu */
#include <cuda_runtime.h>

#define GPU_SMID_PROBE_ABI_VERSION 1

static __device__ __forceinline__ unsigned current_smid(void) {
    unsigned id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

static __global__ void record_smid(unsigned *smids, long long spin_cycles) {
    if (threadIdx.x == 0) smids[blockIdx.x] = current_smid();
    long long start = clock64();
    while (clock64() - start < spin_cycles) {
    }
}

extern "C" int gpu_smid_probe_abi_version(void) { return GPU_SMID_PROBE_ABI_VERSION; }

/* Returns a cudaError_t (0 = launched). `smids` must hold `blocks` unsigned ints on the device. */
extern "C" int gpu_smid_probe_launch(void *stream, unsigned blocks, long long spin_cycles,
                                     unsigned *smids) {
    if (blocks == 0 || smids == 0) return (int)cudaErrorInvalidValue;
    record_smid<<<blocks, 32, 0, (cudaStream_t)stream>>>(smids, spin_cycles);
    return (int)cudaGetLastError();
}
