/* A mixture-of-experts SwiGLU expert in bfloat16 on AMX tiles (csrc/cpu_amx.c), for the experts of
 * csrc/cpu_gemv.c. Built where the compiler knows the AMX targets (setup.py defines BULLET_NO_AMX
 * otherwise); run only where `amx_ready()` says the CPU has the tiles and the kernel granted them. */
#ifndef BULLET_CPU_AMX_H
#define BULLET_CPU_AMX_H

#include <stddef.h>
#include <stdint.h>

/* Whether this build has the tile code, the CPU has AMX-BF16 and AVX-512, and the OS let this process use
 * the tile registers (Linux asks a process to request them once: arch_prctl ARCH_REQ_XCOMP_PERM).
 * The first call decides; later calls return the same answer. */
int amx_ready(void);

/* Whether an expert of hidden size H and width I fits the tiles: both whole multiples of 32 elements. */
int amx_shapes_fit(int H, int I);

/* Bytes of scratch one thread needs for experts of at most `rows` rows (64-byte aligned by the caller). */
size_t amx_scratch_bytes(int rows, int H, int I);

/* Each thread that runs `amx_expert` calls begin first (the tile configuration is per thread) and end
 * after its last expert (releasing the tile state). */
void amx_thread_begin(void);
void amx_thread_end(void);

/* One expert over its m rows: picks[i] is (token * k + pick); the token's row of x [T, H] goes in, and
 * the expert's output for it (float32) times weights[picks[i]] is added to the token's row of acc [T, H].
 * gate_up [2I, H] (gate rows, then up rows) and down [H, I] are the expert's bfloat16 matrices, read as
 * they lie. */
void amx_expert(const uint16_t *x, int k, const int32_t *picks, int m, const uint16_t *gate_up, const uint16_t *down,
                int H, int I, const float *weights, float *acc, void *scratch);

#endif
