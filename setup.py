"""Build hook for the one C extension; all other metadata lives in pyproject.toml.

`bullet._shmatomic` (csrc/shm_atomic*.c) provides C11 atomics, seqlocks and robust process-shared
mutexes over POSIX shared memory. It needs only a C11 compiler with <stdatomic.h> and pthreads
(plain gcc or clang on Linux x86-64/aarch64; no CUDA); `pip install -e .` compiles it."""

from setuptools import Extension, setup

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
        )
    ]
)
