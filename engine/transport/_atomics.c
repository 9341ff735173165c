/*
 * Native one-sided primitives for the shared-memory backend.
 *
 * Python's own tools cost 1-26 us per compare-and-swap (ctypes, the PyPI
 * `atomics` package); these cost one C call. Every function takes a raw
 * address (the region's base + offset, computed once by the caller), so no
 * buffer-protocol work happens per call. Addresses must be 8-byte aligned for
 * the 64-bit operations and 4-byte aligned for the futex word; the Python
 * wrapper (engine/transport/shm.py) checks bounds and alignment.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int get_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* cas64(addr, expected, desired) -> previous value (success iff == expected) */
static PyObject *cas64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, expected, desired;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "cas64(addr, expected, desired)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &expected) || get_u64(args[2], &desired)) return NULL;
    uint64_t prev = expected;
    __atomic_compare_exchange_n((uint64_t *)(uintptr_t)addr, &prev, desired, 0,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(prev);
}

/* faa64(addr, delta) -> previous value */
static PyObject *faa64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, delta;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "faa64(addr, delta)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &delta)) return NULL;
    uint64_t prev = __atomic_fetch_add((uint64_t *)(uintptr_t)addr, delta, __ATOMIC_ACQ_REL);
    return PyLong_FromUnsignedLongLong(prev);
}

static PyObject *load64(PyObject *self, PyObject *arg) {
    uint64_t addr;
    if (get_u64(arg, &addr)) return NULL;
    return PyLong_FromUnsignedLongLong(__atomic_load_n((uint64_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE));
}

static PyObject *store64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, value;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "store64(addr, value)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &value)) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)addr, value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* futex_wait(addr, expected32, timeout_s) -> True if woken or value changed, False on timeout.
 * Releases the GIL while it sleeps. Shared (not PRIVATE) futex: works across processes. */
static PyObject *futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, expected;
    double timeout;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "futex_wait(addr, expected, timeout_s)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &expected)) return NULL;
    timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)addr, FUTEX_WAIT, (uint32_t)expected, &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == -1 && err == ETIMEDOUT) Py_RETURN_FALSE;
    if (rc == -1 && err != EAGAIN && err != EINTR) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_TRUE;
}

static PyObject *futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, n;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "futex_wake(addr, n)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &n)) return NULL;
    long rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)addr, FUTEX_WAKE, (int)n, NULL, NULL, 0);
    if (rc == -1) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

/* faa32(addr, delta) -> previous value: the doorbell word futexes sleep on is 32-bit. */
static PyObject *faa32(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t addr, delta;
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "faa32(addr, delta)"); return NULL; }
    if (get_u64(args[0], &addr) || get_u64(args[1], &delta)) return NULL;
    uint32_t prev = __atomic_fetch_add((uint32_t *)(uintptr_t)addr, (uint32_t)delta, __ATOMIC_ACQ_REL);
    return PyLong_FromUnsignedLong(prev);
}

static PyObject *load32(PyObject *self, PyObject *arg) {
    uint64_t addr;
    if (get_u64(arg, &addr)) return NULL;
    return PyLong_FromUnsignedLong(__atomic_load_n((uint32_t *)(uintptr_t)addr, __ATOMIC_ACQUIRE));
}

/* copy(dst_addr, src_addr, n): plain memcpy with the GIL released (large payloads). */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t dst, src, n;
    if (nargs != 3) { PyErr_SetString(PyExc_TypeError, "copy(dst, src, n)"); return NULL; }
    if (get_u64(args[0], &dst) || get_u64(args[1], &src) || get_u64(args[2], &n)) return NULL;
    if (n >= (1u << 16)) {
        Py_BEGIN_ALLOW_THREADS
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy((void *)(uintptr_t)dst, (const void *)(uintptr_t)src, (size_t)n);
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"cas64", (PyCFunction)(void (*)(void))cas64, METH_FASTCALL, "cas64(addr, expected, desired) -> previous"},
    {"faa64", (PyCFunction)(void (*)(void))faa64, METH_FASTCALL, "faa64(addr, delta) -> previous"},
    {"faa32", (PyCFunction)(void (*)(void))faa32, METH_FASTCALL, "faa32(addr, delta) -> previous"},
    {"load64", load64, METH_O, "load64(addr) -> value (acquire)"},
    {"load32", load32, METH_O, "load32(addr) -> value (acquire)"},
    {"store64", (PyCFunction)(void (*)(void))store64, METH_FASTCALL, "store64(addr, value) (release)"},
    {"futex_wait", (PyCFunction)(void (*)(void))futex_wait, METH_FASTCALL, "futex_wait(addr, expected32, timeout_s) -> bool"},
    {"futex_wake", (PyCFunction)(void (*)(void))futex_wake, METH_FASTCALL, "futex_wake(addr, n) -> woken"},
    {"copy", (PyCFunction)(void (*)(void))copy, METH_FASTCALL, "copy(dst, src, n)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomics", "Native atomics for shared memory.", -1, methods};

PyMODINIT_FUNC PyInit__atomics(void) { return PyModule_Create(&module); }
