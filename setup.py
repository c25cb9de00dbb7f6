"""Build hook for the C extensions; all other metadata lives in pyproject.toml.

`bullet._shmatomic` (csrc/shm_atomic*.c) provides C11 atomics, seqlocks and robust process-shared
mutexes over POSIX shared memory. It needs only a C11 compiler with <stdatomic.h> and pthreads
(plain gcc or clang on Linux x86-64/aarch64; no CUDA); `pip install -e .` compiles it.

`engines._cpu_attention` (csrc/cpu_attention.c) is the CPU decode-attention kernel that reads the paged
KV pool in place (AVX-512 / AVX2 / portable C, chosen at run time). It links OpenMP by soname, which
inside a torch process resolves to torch's own runtime; where the compiler has no OpenMP it builds
single-threaded (the engine then keeps the torch path, see engines/model/cpu_attention.py)."""

import os
import subprocess
import sys
import tempfile

from setuptools import Extension, setup


def _has_openmp() -> bool:
    """Whether the C compiler links -fopenmp (gcc does; Apple clang does not)."""
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "t.c")
        with open(src, "w") as f:
            f.write("#include <omp.h>\nint main(void) { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
        try:
            return subprocess.run([cc, "-fopenmp", src, "-o", os.path.join(d, "t")], capture_output=True).returncode == 0
        except OSError:
            return False


OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") and _has_openmp() else []

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
        Extension(
            "engines._cpu_attention",
            sources=["csrc/cpu_attention.c"],
            # the vector code carries its own target attributes: the module itself stays baseline x86-64
            extra_compile_args=["-std=gnu11", "-O3", "-Wall", "-Wextra", "-Wno-unused-parameter",
                                "-Wno-missing-field-initializers", *OPENMP],
            extra_link_args=OPENMP,
        ),
    ]
)
