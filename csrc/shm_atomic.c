/* bullet._shmatomic: C11 atomics on POSIX shared memory for Bullet's control plane.
 *
 * SharedRegion(buffer) wraps a writable buffer (an mmap) and offers:
 *   - a single-writer seqlock per block: the block is an 8-byte sequence word followed by the
 *     payload. The writer makes the sequence odd, copies, then makes it even; a reader copies the
 *     payload between two loads of the sequence and retries until both loads agree on an even value.
 *   - 64-bit atomic load/store/fetch-add/fetch-or/fetch-and/compare-exchange on aligned words
 *     (heartbeats, flag words, counters).
 * RobustMutex (shm_atomic_mutex.c) is a process-shared robust pthread mutex in the same memory.
 *
 * Memory ordering follows Boehm, "Can seqlocks get along with programming language memory models?"
 * (MSPC 2012): payload words are copied with relaxed atomic accesses so that concurrent copying is
 * not a data race; the writer puts a release fence after making the sequence odd and publishes the
 * even value with a release store; the reader loads the sequence with acquire, copies, issues an
 * acquire fence and reloads the sequence. If the reader saw any word of a write in progress, the
 * fences synchronize and the second load must see that write's odd (or a later) value, so it retries.
 * On x86 the fences compile to nothing (TSO); on Arm they become dmb/ldar/stlr, which is what makes
 * the protocol correct there. Atomics on 64-bit words are lock-free on both targets (checked below),
 * hence address-free and valid across processes that map the memory at different addresses. */
#include "shm_atomic.h"

#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free to be used across processes");
_Static_assert(sizeof(_Atomic uint64_t) == 8, "an atomic u64 must have the layout of a plain u64");

static PyObject *SeqlockTimeout;

/* ---- region ------------------------------------------------------------------------------- */

unsigned char *region_at(SharedRegionObject *region, Py_ssize_t offset, Py_ssize_t size, Py_ssize_t align) {
    if (!region->has_view) {
        PyErr_SetString(PyExc_ValueError, "shared region was released");
        return NULL;
    }
    if (offset < 0 || size < 0 || offset > region->view.len - size) {
        PyErr_Format(PyExc_IndexError, "range [%zd, %zd) outside the %zd-byte region", offset, offset + size,
                     region->view.len);
        return NULL;
    }
    unsigned char *p = (unsigned char *)region->view.buf + offset;
    if (align > 1 && ((uintptr_t)p % (uintptr_t)align) != 0) {
        PyErr_Format(PyExc_ValueError, "offset %zd is not %zd-byte aligned", offset, align);
        return NULL;
    }
    return p;
}

static int region_init(SharedRegionObject *self, PyObject *args, PyObject *kwds) {
    PyObject *obj;
    static char *kwlist[] = {"buffer", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O:SharedRegion", kwlist, &obj)) return -1;
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    if (PyObject_GetBuffer(obj, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return -1;
    self->has_view = 1;
    return 0;
}

static void region_dealloc(SharedRegionObject *self) {
    if (self->has_view) PyBuffer_Release(&self->view);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *region_release(SharedRegionObject *self, PyObject *unused) {
    if (self->has_view) {
        PyBuffer_Release(&self->view);
        self->has_view = 0;
    }
    Py_RETURN_NONE;
}

static PyObject *region_size(SharedRegionObject *self, void *closure) {
    return PyLong_FromSsize_t(self->has_view ? self->view.len : 0);
}

/* ---- seqlock -------------------------------------------------------------------------------- */

static void copy_to_shared(unsigned char *dst, const unsigned char *src, size_t n) {
    _Atomic uint64_t *words = (_Atomic uint64_t *)dst; /* dst is 8-byte aligned (checked by caller) */
    size_t nwords = n / 8, i;
    for (i = 0; i < nwords; i++) {
        uint64_t v;
        memcpy(&v, src + 8 * i, 8);
        atomic_store_explicit(&words[i], v, memory_order_relaxed);
    }
    for (i = nwords * 8; i < n; i++)
        atomic_store_explicit((_Atomic unsigned char *)(dst + i), src[i], memory_order_relaxed);
}

static void copy_from_shared(unsigned char *dst, const unsigned char *src, size_t n) {
    const _Atomic uint64_t *words = (const _Atomic uint64_t *)src;
    size_t nwords = n / 8, i;
    for (i = 0; i < nwords; i++) {
        uint64_t v = atomic_load_explicit(&words[i], memory_order_relaxed);
        memcpy(dst + 8 * i, &v, 8);
    }
    for (i = nwords * 8; i < n; i++)
        dst[i] = atomic_load_explicit((const _Atomic unsigned char *)(src + i), memory_order_relaxed);
}

static void seqlock_write_raw(_Atomic uint64_t *seq, const unsigned char *data, size_t n) {
    /* `| 1` rather than `+ 1`: a writer that died mid-write left the sequence odd; its successor
     * keeps it odd while writing and the final store makes it even again. */
    uint64_t odd = atomic_load_explicit(seq, memory_order_relaxed) | 1u;
    atomic_store_explicit(seq, odd, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    copy_to_shared((unsigned char *)(seq + 1), data, n);
    atomic_store_explicit(seq, odd + 1, memory_order_release);
}

/* One read attempt: 1 if `dst` holds a consistent snapshot. */
static int seqlock_try_read(const _Atomic uint64_t *seq, unsigned char *dst, size_t n) {
    uint64_t before = atomic_load_explicit(seq, memory_order_acquire);
    if (before & 1u) return 0;
    copy_from_shared(dst, (const unsigned char *)(seq + 1), n);
    atomic_thread_fence(memory_order_acquire);
    return atomic_load_explicit(seq, memory_order_relaxed) == before;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static PyObject *region_seqlock_write(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "seqlock_write(offset, data) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    Py_buffer data;
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) return NULL;
    unsigned char *block = region_at(self, offset, 8 + data.len, 8);
    if (block) seqlock_write_raw((_Atomic uint64_t *)block, data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    if (!block) return NULL;
    Py_RETURN_NONE;
}

/* Copies `size` payload bytes of the block at `offset`. The first attempt runs with the GIL held
 * (it almost always succeeds and a GIL round trip would cost more than the copy); only when a write
 * is in progress do we let go of the GIL, spin briefly, then yield the CPU — on two cores the writer
 * may be descheduled mid-write. A writer that died mid-write would keep the block odd forever, so
 * waiting is bounded by `timeout` seconds and then raises SeqlockTimeout. */
static PyObject *region_seqlock_read(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "seqlock_read(offset, size, timeout=1.0) takes 2 or 3 arguments");
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t size = PyLong_AsSsize_t(args[1]);
    if (size == -1 && PyErr_Occurred()) return NULL;
    double timeout = 1.0;
    if (nargs == 3) {
        timeout = PyFloat_AsDouble(args[2]);
        if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    }
    if (size < 0) return PyErr_Format(PyExc_ValueError, "size must be non-negative");
    unsigned char *block = region_at(self, offset, 8 + size, 8);
    if (!block) return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (!out) return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    const _Atomic uint64_t *seq = (const _Atomic uint64_t *)block;
    if (seqlock_try_read(seq, dst, (size_t)size)) return out;

    int ok = 0;
    int64_t deadline = monotonic_ns() + (int64_t)(timeout * 1e9);
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        for (int attempt = 0; attempt < 4096 && !ok; attempt++) {
            ok = seqlock_try_read(seq, dst, (size_t)size);
            if (!ok) {
                if (attempt < 64) cpu_relax();
                else sched_yield();
            }
        }
        Py_END_ALLOW_THREADS
        if (ok) return out;
        if (PyErr_CheckSignals() < 0 || monotonic_ns() > deadline) break;
    }
    Py_DECREF(out);
    if (!PyErr_Occurred())
        PyErr_Format(SeqlockTimeout, "block at offset %zd stayed mid-write for %lld ms (writer dead or stalled?)",
                     offset, (long long)(timeout * 1e3));
    return NULL;
}

/* ---- in-C timing loop: the cost of the synchronization itself, without the interpreter -------- */

static PyObject *region_seqlock_bench(SharedRegionObject *self, PyObject *args) {
    Py_ssize_t offset, size, iterations;
    if (!PyArg_ParseTuple(args, "nnn:seqlock_bench", &offset, &size, &iterations)) return NULL;
    if (iterations <= 0 || size < 0) return PyErr_Format(PyExc_ValueError, "iterations must be positive, size non-negative");
    unsigned char *block = region_at(self, offset, 8 + size, 8);
    if (!block) return NULL;
    unsigned char *scratch = PyMem_Malloc(size > 0 ? size : 1);
    if (!scratch) return PyErr_NoMemory();
    _Atomic uint64_t *seq = (_Atomic uint64_t *)block;
    copy_from_shared(scratch, block + 8, (size_t)size); /* rewrite what is there: no visible change */
    int64_t t0 = monotonic_ns();
    for (Py_ssize_t i = 0; i < iterations; i++) seqlock_write_raw(seq, scratch, (size_t)size);
    int64_t t1 = monotonic_ns();
    Py_ssize_t retries = 0;
    for (Py_ssize_t i = 0; i < iterations; i++)
        while (!seqlock_try_read(seq, scratch, (size_t)size)) retries++;
    int64_t t2 = monotonic_ns();
    PyMem_Free(scratch);
    return Py_BuildValue("(ddn)", (double)(t1 - t0) / iterations, (double)(t2 - t1) / iterations, retries);
}

static PyMethodDef region_methods[] = {
    {"release", (PyCFunction)region_release, METH_NOARGS, "Release the buffer (lets the mmap close)."},
    {"seqlock_write", (PyCFunction)(void (*)(void))region_seqlock_write, METH_FASTCALL,
     "seqlock_write(offset, data): publish data as the payload of the block at offset (single writer)."},
    {"seqlock_read", (PyCFunction)(void (*)(void))region_seqlock_read, METH_FASTCALL,
     "seqlock_read(offset, size, timeout=1.0) -> bytes: a consistent copy of the block's payload."},
    {"load_u64", (PyCFunction)(void (*)(void))region_load_u64, METH_FASTCALL, "Atomic acquire load."},
    {"store_u64", (PyCFunction)(void (*)(void))region_store_u64, METH_FASTCALL, "Atomic release store."},
    {"fetch_add_u64", (PyCFunction)(void (*)(void))region_fetch_add_u64, METH_FASTCALL,
     "Atomic add (mod 2**64); returns the previous value."},
    {"fetch_or_u64", (PyCFunction)(void (*)(void))region_fetch_or_u64, METH_FASTCALL,
     "Atomic or; returns the previous value."},
    {"fetch_and_u64", (PyCFunction)(void (*)(void))region_fetch_and_u64, METH_FASTCALL,
     "Atomic and; returns the previous value."},
    {"compare_exchange_u64", (PyCFunction)(void (*)(void))region_compare_exchange_u64, METH_FASTCALL,
     "compare_exchange_u64(offset, expected, desired) -> (swapped, observed)."},
    {"seqlock_bench", (PyCFunction)region_seqlock_bench, METH_VARARGS,
     "seqlock_bench(offset, size, iterations) -> (write_ns, read_ns, read_retries), timed inside C."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef region_getset[] = {
    {"size", (getter)region_size, NULL, "Length of the region in bytes (0 once released).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject SharedRegion_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bullet._shmatomic.SharedRegion",
    .tp_basicsize = sizeof(SharedRegionObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SharedRegion(buffer): C11 atomics and seqlocks over a writable shared buffer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)region_init,
    .tp_dealloc = (destructor)region_dealloc,
    .tp_methods = region_methods,
    .tp_getset = region_getset,
};

static struct PyModuleDef shmatomic_module = {
    PyModuleDef_HEAD_INIT, "bullet._shmatomic",
    "C11 atomics, seqlocks and robust process-shared mutexes over POSIX shared memory.", -1, NULL,
};

PyMODINIT_FUNC PyInit__shmatomic(void) {
    if (PyType_Ready(&SharedRegion_Type) < 0) return NULL;
    PyObject *m = PyModule_Create(&shmatomic_module);
    if (!m) return NULL;
    SeqlockTimeout = PyErr_NewExceptionWithDoc("bullet._shmatomic.SeqlockTimeout",
                                               "A seqlocked block stayed mid-write past the read timeout.",
                                               PyExc_TimeoutError, NULL);
    Py_INCREF(&SharedRegion_Type);
    if (!SeqlockTimeout || PyModule_AddObject(m, "SeqlockTimeout", SeqlockTimeout) < 0 ||
        PyModule_AddObject(m, "SharedRegion", (PyObject *)&SharedRegion_Type) < 0 ||
        PyModule_AddIntConstant(m, "SEQLOCK_HEADER", 8) < 0 ||
        shm_atomic_add_mutex_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
