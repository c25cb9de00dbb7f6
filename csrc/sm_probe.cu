/* Isolation probe kernels: how many SMs does a stream really get, and what else limits it?
 *
 * spin   every block holds its SM for a fixed wall time (%globaltimer, not clock cycles, so the
 *        SM clock does not change it) and requests so much dynamic shared memory that no second
 *        block fits beside it: a launch of B blocks on a share of S SMs takes ceil(B / S) spins,
 *        so blocks per second x spin time = the SMs the stream got. Neither clocks, power nor
 *        memory bandwidth move that number; only SMs taken by someone else do.
 * fma    register-only fused multiply-adds: follows the SM clock (power and thermal limits).
 * copy   a streaming device-to-device copy: follows HBM bandwidth.
 *
 * Launchers take the caller's stream (a green-context stream, a libsmctrl-masked stream) and
 * device buffers allocated by the caller. Every launcher returns a cudaError_t (0 = ok). The graph
 * functions capture spin launches into a CUDA graph on a given stream and replay it, to see
 * whether a stream's SM mask holds for graph replays.
 *
 * Build: nvcc -shared -Xcompiler -fPIC -O2 -gencode arch=compute_XY,code=sm_XY sm_probe.cu */
#include <cuda_runtime.h>

#define SM_PROBE_ABI_VERSION 2
#define FMA_CHAINS 8

static __device__ __forceinline__ unsigned long long global_ns(void) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

static __device__ __forceinline__ unsigned current_smid(void) {
    unsigned id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

/* Only the size of this allocation matters: it keeps a second block off the SM. */
extern __shared__ unsigned char sm_probe_hold[];

/* `smids`/`starts` (optional): each block's SM and start time, so the caller can check that no two
 * blocks ever shared an SM (the probe's premise). */
static __global__ void spin_kernel(unsigned long long spin_ns, unsigned *smids, unsigned long long *starts) {
    if (threadIdx.x != 0) return;
    sm_probe_hold[0] = 1;
    unsigned long long start = global_ns();
    while (global_ns() - start < spin_ns) {
    }
    if (smids) smids[blockIdx.x] = current_smid();
    if (starts) starts[blockIdx.x] = start;
}

static __global__ void fma_kernel(int iters, float *sink) {
    float x[FMA_CHAINS];
    const float b = 0.999999f, c = 1e-7f;
#pragma unroll
    for (int k = 0; k < FMA_CHAINS; k++) x[k] = threadIdx.x * 1e-6f + k;
    for (int i = 0; i < iters; i++) {
#pragma unroll
        for (int k = 0; k < FMA_CHAINS; k++) x[k] = fmaf(x[k], b, c);
    }
    float s = 0.f;
#pragma unroll
    for (int k = 0; k < FMA_CHAINS; k++) s += x[k];
    if (s == -1.f) sink[0] = s; /* never true; keeps the loop from being optimised away */
}

static __global__ void copy_kernel(const float4 *__restrict__ src, float4 *__restrict__ dst, size_t n) {
    size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) dst[i] = src[i];
}

static int spin_shared_bytes = 0;

extern "C" int sm_probe_abi_version(void) { return SM_PROBE_ABI_VERSION; }

/* Size the spin kernel's shared-memory request for `device` (the most one block may opt into:
 * more than half of an SM's shared memory, so one block per SM) and allow it. Writes the bytes. */
extern "C" int sm_probe_init(int device, int *shared_bytes) {
    int optin = 0, per_sm = 0;
    cudaError_t err = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err == cudaSuccess)
        err = cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device);
    if (err != cudaSuccess) return (int)err;
    if (2 * optin <= per_sm) return (int)cudaErrorNotSupported; /* two blocks would fit: no count */
    err = cudaFuncSetAttribute(spin_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    if (err == cudaSuccess)
        err = cudaFuncSetAttribute(spin_kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
    if (err != cudaSuccess) return (int)err;
    spin_shared_bytes = optin;
    if (shared_bytes) *shared_bytes = optin;
    return 0;
}

/* `smids`, `starts`: NULL, or `blocks` slots on the device (each block's SM id, start in ns). */
extern "C" int sm_probe_spin(void *stream, unsigned blocks, unsigned long long spin_ns, unsigned *smids,
                             unsigned long long *starts) {
    if (blocks == 0 || spin_shared_bytes == 0) return (int)cudaErrorInvalidValue;
    spin_kernel<<<blocks, 32, spin_shared_bytes, (cudaStream_t)stream>>>(spin_ns, smids, starts);
    return (int)cudaGetLastError();
}

extern "C" int sm_probe_fma(void *stream, unsigned blocks, unsigned threads, int iters, float *sink) {
    if (blocks == 0 || threads == 0) return (int)cudaErrorInvalidValue;
    fma_kernel<<<blocks, threads, 0, (cudaStream_t)stream>>>(iters, sink);
    return (int)cudaGetLastError();
}

/* Copies `bytes` (a multiple of 16, both pointers 16-byte aligned) from `src` to `dst`. */
extern "C" int sm_probe_copy(void *stream, unsigned blocks, const void *src, void *dst, size_t bytes) {
    if (blocks == 0 || bytes % 16) return (int)cudaErrorInvalidValue;
    copy_kernel<<<blocks, 256, 0, (cudaStream_t)stream>>>((const float4 *)src, (float4 *)dst, bytes / 16);
    return (int)cudaGetLastError();
}

extern "C" int sm_probe_sync(void *stream) { return (int)cudaStreamSynchronize((cudaStream_t)stream); }

/* Capture `launches` spin launches on `stream` into a graph; *exec_out receives the executable. */
extern "C" int sm_probe_graph_capture(void *stream, unsigned blocks, unsigned long long spin_ns, unsigned *smids,
                                      unsigned long long *starts, int launches, void **exec_out) {
    cudaStream_t s = (cudaStream_t)stream;
    cudaGraph_t graph = 0;
    cudaGraphExec_t exec = 0;
    cudaError_t err = cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
    if (err != cudaSuccess) return (int)err;
    int launch_err = 0;
    for (int i = 0; i < launches && !launch_err; i++) launch_err = sm_probe_spin(stream, blocks, spin_ns, smids, starts);
    err = cudaStreamEndCapture(s, &graph);
    if (launch_err) {
        if (graph) cudaGraphDestroy(graph);
        return launch_err;
    }
    if (err != cudaSuccess) return (int)err;
    err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    if (err != cudaSuccess) return (int)err;
    *exec_out = (void *)exec;
    return 0;
}

extern "C" int sm_probe_graph_launch(void *exec, void *stream) {
    return (int)cudaGraphLaunch((cudaGraphExec_t)exec, (cudaStream_t)stream);
}

extern "C" int sm_probe_graph_destroy(void *exec) { return (int)cudaGraphExecDestroy((cudaGraphExec_t)exec); }
