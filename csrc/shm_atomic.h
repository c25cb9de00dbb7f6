/* Shared declarations of the bullet._shmatomic extension.
 *
 * A SharedRegion pins a writable Python buffer (an mmap of a POSIX shared-memory segment) for as
 * long as it lives, so the raw pointer handed to C11 atomics can never dangle: the mmap refuses to
 * close while the region holds its buffer export. Everything that touches shared memory goes through
 * a region, with bounds and alignment checked once per call. */
#ifndef BULLET_SHM_ATOMIC_H
#define BULLET_SHM_ATOMIC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
} SharedRegionObject;

extern PyTypeObject SharedRegion_Type;

/* Returns a pointer to `size` bytes at `offset` inside the region, or NULL with a Python exception
 * set when the region was released, the range is out of bounds, or `offset` is not a multiple of
 * `align`. */
unsigned char *region_at(SharedRegionObject *region, Py_ssize_t offset, Py_ssize_t size,
                         Py_ssize_t align);

/* Bytes reserved for one process-shared robust mutex; a compile-time check in shm_atomic_mutex.c
 * keeps pthread_mutex_t (40 bytes on x86-64 glibc, 48 on aarch64) inside it. */
#define ROBUST_MUTEX_RESERVED 64

int shm_atomic_add_mutex_type(PyObject *module);

/* SharedRegion methods on 64-bit words (shm_atomic_words.c), METH_FASTCALL. */
PyObject *region_load_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *region_store_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *region_fetch_add_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *region_fetch_or_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *region_fetch_and_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *region_compare_exchange_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs);

#endif
