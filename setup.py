"""Build hook for the C extensions; all other metadata lives in pyproject.toml.

`bullet._shmatomic` (csrc/shm_atomic*.c) provides C11 atomics, seqlocks and robust process-shared
mutexes over POSIX shared memory. It needs only a C11 compiler with <stdatomic.h> and pthreads
(plain gcc or clang on Linux x86-64/aarch64; no CUDA); `pip install -e .` compiles it.

`engines._cpu_attention` (csrc/cpu_attention.c) is the CPU decode-attention kernel that reads the paged
KV pool in place (AVX-512 / AVX2 / portable C, chosen at run time by what the CPU reports). It links
OpenMP by soname, which inside a torch process resolves to torch's own runtime; where the compiler has
no OpenMP it builds single-threaded. A vector implementation whose target flags the compiler does not
know is left out of the build; `BULLET_CPU_ATTENTION_ISA=avx2` (or `generic`) leaves out the wider
ones on purpose, to run the narrower code on a wider CPU.

`engines._cpu_gemv` (csrc/cpu_gemv.c) multiplies a decode step's few rows by weights read once: its
bfloat16 projections and its mixture-of-experts SwiGLU experts; it is built as the attention kernel is
(the same ISA choices, the shared helpers of csrc/cpu_vec.h). Its AMX part (csrc/cpu_amx.c: a prefill's
bfloat16 experts on the tiles) is left out where the compiler does not know the AMX targets (gcc >= 11
and clang >= 12 do) or the build is told to stay below AVX-512; the CPU is asked at run time."""

import os
import subprocess
import sys
import tempfile

from setuptools import Extension, setup


def _compiles(code: str, *flags: str) -> bool:
    """Whether the C compiler builds and links `code` with `flags`."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write(code)
        try:
            return subprocess.run([cc, *flags, src, "-o", os.path.join(d, "t")], capture_output=True).returncode == 0
        except OSError:
            return False


# gcc links -fopenmp; Apple clang does not
OPENMP = (["-fopenmp"] if sys.platform.startswith("linux") and _compiles(
    "#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n", "-fopenmp") else [])


def _target_compiles(target: str, body: str) -> bool:
    return _compiles(f"#include <immintrin.h>\n__attribute__((target(\"{target}\"))) int f(void) {{ {body} }}\n"
                     "int main(void) { __builtin_cpu_init(); return __builtin_cpu_supports(\"avx2\") ? 0 : f(); }\n")


def _isa_macros() -> list[tuple[str, None]]:
    """BULLET_NO_AVX512 / BULLET_NO_AVX2 / BULLET_NO_AMX where the compiler lacks a target (or the build is
    told to)."""
    want = os.environ.get("BULLET_CPU_ATTENTION_ISA", "auto").lower()
    if want not in ("auto", "avx512", "avx2", "generic"):
        raise SystemExit(f"BULLET_CPU_ATTENTION_ISA must be auto, avx512, avx2 or generic, got {want!r}")
    avx2 = want != "generic" and _target_compiles(
        "avx2,fma,f16c", "__m256 x = _mm256_cvtph_ps(_mm_setzero_si128()); return (int)_mm256_cvtss_f32(x);")
    avx512 = avx2 and want in ("auto", "avx512") and _target_compiles(
        "avx512f,avx512bw,avx512vl,avx2,fma,f16c", "return (int)_mm512_reduce_add_ps(_mm512_setzero_ps());")
    amx = avx512 and _target_compiles(
        "amx-tile,amx-bf16,avx512f", "_tile_zero(0); _tile_release(); return 0;")
    return [(name, None) for name, have in (("BULLET_NO_AVX2", avx2), ("BULLET_NO_AVX512", avx512),
                                            ("BULLET_NO_AMX", amx)) if not have]


# The CPU kernels (csrc/cpu_attention.c, csrc/cpu_gemv.c): the vector code carries its own target
# attributes, so each module itself stays baseline x86-64
CPU_KERNEL_BUILD = dict(
    depends=["csrc/cpu_vec.h"],
    define_macros=_isa_macros(),
    extra_compile_args=["-std=gnu11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                        "-Wno-missing-field-initializers", *OPENMP],
    extra_link_args=OPENMP,
)


setup(
    ext_modules=[
        Extension(
            "bullet._shmatomic",
            sources=["csrc/shm_atomic.c", "csrc/shm_atomic_words.c", "csrc/shm_atomic_mutex.c"],
            depends=["csrc/shm_atomic.h"],
            # gnu11: C11 atomics plus the POSIX/GNU declarations Python.h and pthread robust mutexes use.
            extra_compile_args=["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", "-Wno-cast-function-type", "-pthread"],
            extra_link_args=["-pthread"],
        ),
        Extension("engines._cpu_attention", sources=["csrc/cpu_attention.c"], **CPU_KERNEL_BUILD),
        Extension("engines._cpu_gemv", sources=["csrc/cpu_gemv.c", "csrc/cpu_amx.c"],
                  **{**CPU_KERNEL_BUILD, "depends": ["csrc/cpu_vec.h", "csrc/cpu_amx.h"]}),
    ]
)
