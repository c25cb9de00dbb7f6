/* Atomic operations on aligned 64-bit words of a SharedRegion (heartbeats, flag words, counters,
 * claim tables). Acquire loads, release stores and acq_rel read-modify-writes: a value observed
 * through these carries everything its writer did before it. Lock-free on x86-64 and aarch64
 * (asserted in shm_atomic.c), so valid between processes. */
#include "shm_atomic.h"

#include <stdatomic.h>

static _Atomic uint64_t *word_arg(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs,
                                  Py_ssize_t want, const char *name) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", name, want);
        return NULL;
    }
    Py_ssize_t offset = PyLong_AsSsize_t(args[0]);
    if (offset == -1 && PyErr_Occurred()) return NULL;
    return (_Atomic uint64_t *)region_at(self, offset, 8, 8);
}

/* Values are u64; Python callers may also pass negative ints (taken modulo 2**64), so that
 * fetch_add_u64(off, -1) decrements. */
static int u64_arg(PyObject *obj, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

PyObject *region_load_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) {
    _Atomic uint64_t *w = word_arg(self, args, nargs, 1, "load_u64(offset)");
    if (!w) return NULL;
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(w, memory_order_acquire));
}

PyObject *region_store_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t v;
    _Atomic uint64_t *w = word_arg(self, args, nargs, 2, "store_u64(offset, value)");
    if (!w || u64_arg(args[1], &v) < 0) return NULL;
    atomic_store_explicit(w, v, memory_order_release);
    Py_RETURN_NONE;
}

#define FETCH_OP(pyname, c_op)                                                                       \
    PyObject *region_##pyname(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) { \
        uint64_t v;                                                                                  \
        _Atomic uint64_t *w = word_arg(self, args, nargs, 2, #pyname "(offset, value)");             \
        if (!w || u64_arg(args[1], &v) < 0) return NULL;                                             \
        return PyLong_FromUnsignedLongLong(c_op(w, v, memory_order_acq_rel));                        \
    }
FETCH_OP(fetch_add_u64, atomic_fetch_add_explicit)
FETCH_OP(fetch_or_u64, atomic_fetch_or_explicit)
FETCH_OP(fetch_and_u64, atomic_fetch_and_explicit)

PyObject *region_compare_exchange_u64(SharedRegionObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t expected, desired;
    _Atomic uint64_t *w = word_arg(self, args, nargs, 3, "compare_exchange_u64(offset, expected, desired)");
    if (!w || u64_arg(args[1], &expected) < 0 || u64_arg(args[2], &desired) < 0) return NULL;
    int ok = atomic_compare_exchange_strong_explicit(w, &expected, desired, memory_order_acq_rel,
                                                     memory_order_acquire);
    return Py_BuildValue("(OK)", ok ? Py_True : Py_False, (unsigned long long)expected);
}
