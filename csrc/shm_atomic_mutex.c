/* RobustMutex: a pthread mutex living in shared memory, shared by processes, that survives the death
 * of its holder.
 *
 * Attributes: PTHREAD_PROCESS_SHARED (both workers lock the same object through their own mappings),
 * PTHREAD_MUTEX_ROBUST (when the holder dies the kernel walks its robust list and the next locker gets
 * EOWNERDEAD instead of blocking forever), PTHREAD_MUTEX_ERRORCHECK (relocking from the holding thread
 * or unlocking from a non-holder is an error, not a deadlock or silent corruption).
 *
 * On EOWNERDEAD we call pthread_mutex_consistent at once and report `recovered=True` to the caller,
 * whose duty is to repair the protected data before relying on it. If the repairer itself dies, the
 * next locker gets EOWNERDEAD again and repeats the (idempotent) repair, so ENOTRECOVERABLE cannot
 * arise through this API.
 *
 * Blocking waits release the GIL and wake every 50 ms to run Python signal handlers, so a worker
 * waiting on the lock still honours SIGINT/SIGTERM (and the shared-memory cleanup they trigger). */
#include "shm_atomic.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <time.h>

_Static_assert(sizeof(pthread_mutex_t) <= ROBUST_MUTEX_RESERVED, "pthread_mutex_t outgrew its reserved slot");

typedef struct {
    PyObject_HEAD
    SharedRegionObject *region; /* strong reference: keeps the buffer (and so the pointer) alive */
    Py_ssize_t offset;
} RobustMutexObject;

static pthread_mutex_t *mutex_ptr(RobustMutexObject *self) {
    return (pthread_mutex_t *)region_at(self->region, self->offset, ROBUST_MUTEX_RESERVED, 8);
}

static PyObject *raise_errno(int rc, const char *what) {
    errno = rc;
    return PyErr_Format(PyExc_OSError, "%s: %s", what, strerror(rc));
}

/* robust_mutex_init(region, offset): the creator of the segment runs this once, before any other
 * process can lock. */
static PyObject *robust_mutex_init(PyObject *module, PyObject *args) {
    SharedRegionObject *region;
    Py_ssize_t offset;
    if (!PyArg_ParseTuple(args, "O!n:robust_mutex_init", &SharedRegion_Type, &region, &offset)) return NULL;
    pthread_mutex_t *m = (pthread_mutex_t *)region_at(region, offset, ROBUST_MUTEX_RESERVED, 8);
    if (!m) return NULL;
    pthread_mutexattr_t attr;
    int rc = pthread_mutexattr_init(&attr);
    if (!rc) rc = pthread_mutexattr_setpshared(&attr, PTHREAD_PROCESS_SHARED);
    if (!rc) rc = pthread_mutexattr_setrobust(&attr, PTHREAD_MUTEX_ROBUST);
    if (!rc) rc = pthread_mutexattr_settype(&attr, PTHREAD_MUTEX_ERRORCHECK);
    if (!rc) {
        memset(m, 0, ROBUST_MUTEX_RESERVED);
        rc = pthread_mutex_init(m, &attr);
    }
    pthread_mutexattr_destroy(&attr);
    if (rc) return raise_errno(rc, "pthread_mutex_init");
    Py_RETURN_NONE;
}

static int mutex_init(RobustMutexObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"region", "offset", NULL};
    SharedRegionObject *region;
    Py_ssize_t offset;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!n:RobustMutex", kwlist, &SharedRegion_Type, &region, &offset))
        return -1;
    if (!region_at(region, offset, ROBUST_MUTEX_RESERVED, 8)) return -1;
    Py_INCREF(region);
    Py_XSETREF(self->region, region);
    self->offset = offset;
    return 0;
}

static void mutex_dealloc(RobustMutexObject *self) {
    Py_XDECREF(self->region);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void deadline_after(struct timespec *ts, double seconds) {
    clock_gettime(CLOCK_REALTIME, ts); /* pthread_mutex_timedlock measures against CLOCK_REALTIME */
    long long ns = ts->tv_nsec + (long long)(seconds * 1e9);
    ts->tv_sec += ns / 1000000000LL;
    ts->tv_nsec = ns % 1000000000LL;
}

static double monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* acquire(timeout=None) -> bool: True when the previous holder died while holding the lock. */
static PyObject *mutex_acquire(RobustMutexObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"timeout", NULL};
    PyObject *timeout_obj = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:acquire", kwlist, &timeout_obj)) return NULL;
    double timeout = -1.0;
    if (timeout_obj != Py_None) {
        timeout = PyFloat_AsDouble(timeout_obj);
        if (timeout == -1.0 && PyErr_Occurred()) return NULL;
        if (timeout < 0) return PyErr_Format(PyExc_ValueError, "timeout must be non-negative or None");
    }
    pthread_mutex_t *m = mutex_ptr(self);
    if (!m) return NULL;

    int rc = pthread_mutex_trylock(m); /* uncontended: no GIL round trip */
    double give_up = timeout >= 0 ? monotonic_s() + timeout : 0.0;
    while (rc == EBUSY) {
        double slice = 0.05;
        if (timeout >= 0) {
            double left = give_up - monotonic_s();
            if (left <= 0) break;
            if (left < slice) slice = left;
        }
        struct timespec until;
        deadline_after(&until, slice);
        Py_BEGIN_ALLOW_THREADS
        rc = pthread_mutex_timedlock(m, &until);
        Py_END_ALLOW_THREADS
        if (rc == ETIMEDOUT) {
            rc = EBUSY;
            if (PyErr_CheckSignals() < 0) return NULL;
        }
    }
    switch (rc) {
    case 0:
        Py_RETURN_FALSE;
    case EOWNERDEAD:
        rc = pthread_mutex_consistent(m);
        if (rc) return raise_errno(rc, "pthread_mutex_consistent");
        Py_RETURN_TRUE;
    case EBUSY:
        return PyErr_Format(PyExc_TimeoutError, "robust mutex not acquired within %lld ms", (long long)(timeout * 1e3));
    case EDEADLK:
        return PyErr_Format(PyExc_RuntimeError, "robust mutex is already held by this thread");
    case ENOTRECOVERABLE:
        return PyErr_Format(PyExc_RuntimeError, "robust mutex is not recoverable (a holder died and the "
                                                "next one released it without marking it consistent)");
    default:
        return raise_errno(rc, "pthread_mutex_lock");
    }
}

static PyObject *mutex_release(RobustMutexObject *self, PyObject *unused) {
    pthread_mutex_t *m = mutex_ptr(self);
    if (!m) return NULL;
    int rc = pthread_mutex_unlock(m);
    if (rc == EPERM) return PyErr_Format(PyExc_RuntimeError, "robust mutex released by a thread that does not hold it");
    if (rc) return raise_errno(rc, "pthread_mutex_unlock");
    Py_RETURN_NONE;
}

static PyObject *mutex_enter(RobustMutexObject *self, PyObject *unused) {
    PyObject *noargs = PyTuple_New(0);
    if (!noargs) return NULL;
    PyObject *r = mutex_acquire(self, noargs, NULL);
    Py_DECREF(noargs);
    return r;
}

static PyObject *mutex_exit(RobustMutexObject *self, PyObject *args) {
    PyObject *r = mutex_release(self, NULL);
    if (!r) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyMethodDef mutex_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))mutex_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(timeout=None) -> bool: lock; True if the previous holder died holding it (repair the data)."},
    {"release", (PyCFunction)mutex_release, METH_NOARGS, "Unlock (only the holding thread may)."},
    {"__enter__", (PyCFunction)mutex_enter, METH_NOARGS, "acquire(); returns the recovered flag."},
    {"__exit__", (PyCFunction)mutex_exit, METH_VARARGS, "release()."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RobustMutex_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bullet._shmatomic.RobustMutex",
    .tp_basicsize = sizeof(RobustMutexObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "RobustMutex(region, offset): a process-shared robust mutex initialized by robust_mutex_init.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mutex_init,
    .tp_dealloc = (destructor)mutex_dealloc,
    .tp_methods = mutex_methods,
};

static PyMethodDef module_functions[] = {
    {"robust_mutex_init", robust_mutex_init, METH_VARARGS,
     "robust_mutex_init(region, offset): initialize a process-shared robust mutex in place."},
    {NULL, NULL, 0, NULL},
};

int shm_atomic_add_mutex_type(PyObject *module) {
    if (PyType_Ready(&RobustMutex_Type) < 0) return -1;
    Py_INCREF(&RobustMutex_Type);
    if (PyModule_AddObject(module, "RobustMutex", (PyObject *)&RobustMutex_Type) < 0) return -1;
    if (PyModule_AddIntConstant(module, "ROBUST_MUTEX_SIZE", ROBUST_MUTEX_RESERVED) < 0) return -1;
    return PyModule_AddFunctions(module, module_functions);
}
