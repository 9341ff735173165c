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


/* ------------------------------------------------------------------------------------------
 * Fast paths of the ring protocol for a region mapped in this process (shm, or the owner of a
 * tcp/verbs region). They do exactly what engine/transport/ring/ does step by step (see
 * docs/ring-protocol.md), in one call, because the Python version costs ~10 us per message.
 * The Python version stays the reference: remote regions and fault-injection tests use it,
 * and tests run both against each other. Layout constants mirror engine/transport/layout.py.
 * ------------------------------------------------------------------------------------------ */
#if defined(__has_include)
#if __has_include(<xxhash.h>) && defined(__x86_64__)
/* xxh3 picks its SIMD width at compile time; compile it and the fast paths for AVX2 and
 * use them only where the CPU has AVX2 (module init checks), else the Python path runs. */
#define ONEPIECE_FAST 1
#pragma GCC push_options
#pragma GCC target("avx2")
#define XXH_INLINE_ALL
#define XXH_VECTOR XXH_AVX2
#include <xxhash.h>
#endif
#endif

#ifdef ONEPIECE_FAST
#define UNIT 64ULL
#define SLOT_MASK ((1ULL << 24) - 1)
#define BYTE_MASK ((1ULL << 40) - 1)
#define C_TAIL 128
#define C_HEAD 192
#define C_CURSOR 256
#define C_DOORBELL 320
#define C_CONSUMER_WAITING 384
#define P_OWNER 0
#define P_DELIVERED 32
#define PRODUCER_ENTRY 64
#define SLOT_ENTRY 64
#define ST_FREE 0ULL
#define ST_RESERVED 1ULL
#define ST_COMMITTED 2ULL
#define ST_ABANDONED 3ULL
#define ST_ABANDON_ACKED 4ULL
#define RECORD_MAGIC 0x3152504FU
#define FLAG_SKIP 1
#define HEADER_COVERED 40
#ifndef CHUNK
#define CHUNK (128u << 10)
#endif

#pragma pack(push, 1)
typedef struct {
    uint32_t magic; uint16_t producer; uint16_t flags; uint32_t epoch; uint32_t hv;
    uint64_t seq; uint64_t length; uint64_t slot; uint64_t checksum;
} record_t;
#pragma pack(pop)

static inline uint64_t ld(char *b, uint64_t off) { return __atomic_load_n((uint64_t *)(b + off), __ATOMIC_ACQUIRE); }
static inline void st(char *b, uint64_t off, uint64_t v) { __atomic_store_n((uint64_t *)(b + off), v, __ATOMIC_RELEASE); }
static inline uint64_t cas(char *b, uint64_t off, uint64_t expected, uint64_t desired) {
    uint64_t prev = expected;
    __atomic_compare_exchange_n((uint64_t *)(b + off), &prev, desired, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return prev;
}
static inline uint64_t w0(uint64_t slot, uint64_t state, uint64_t producer, uint64_t units) {
    return ((slot & SLOT_MASK) << 40) | (state << 36) | ((producer & 0xFFF) << 24) | (units & 0xFFFFFF);
}
static inline int64_t slot_diff(uint64_t a, uint64_t b) {
    uint64_t d = (a - b) & SLOT_MASK;
    return d >= (1ULL << 23) ? (int64_t)d - (int64_t)(1ULL << 24) : (int64_t)d;
}

typedef struct { char *base; uint64_t b_off, s_off, p_off, slots, buf; } geom_t;

static int parse_geom(PyObject *const *args, geom_t *g) {
    uint64_t base;
    if (get_u64(args[0], &base) || get_u64(args[1], &g->b_off) || get_u64(args[2], &g->s_off) ||
        get_u64(args[3], &g->p_off) || get_u64(args[4], &g->slots) || get_u64(args[5], &g->buf)) return -1;
    g->base = (char *)(uintptr_t)base;
    return 0;
}

/* ring_send(base, b_off, s_off, p_off, slots, buf, producer, epoch, seq, flags, data)
 *   -> (status, slot, units, cas_retries); status 0 committed, 1 full, 2 fenced (retry). */
static PyObject *ring_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t producer, epoch, seq, flags;
    if (nargs != 11) { PyErr_SetString(PyExc_TypeError, "ring_send takes 11 arguments"); return NULL; }
    if (parse_geom(args, &g) || get_u64(args[6], &producer) || get_u64(args[7], &epoch) ||
        get_u64(args[8], &seq) || get_u64(args[9], &flags)) return NULL;
    Py_buffer data;
    if (PyObject_GetBuffer(args[10], &data, PyBUF_SIMPLE) < 0) return NULL;
    char *b = g.base;
    uint64_t len = (uint64_t)data.len;
    uint64_t need = (UNIT + len + UNIT - 1) / UNIT;
    uint64_t retries = 0, tail, ts, tb, units, start, slot, phys;
    for (;;) {
        tail = ld(b, C_TAIL);
        uint64_t head = ld(b, C_HEAD);
        ts = tail >> 40; tb = tail & BYTE_MASK;
        uint64_t hs = head >> 40, hb = head & BYTE_MASK;
        uint64_t p = tb % g.buf;
        units = (p + need * UNIT <= g.buf) ? need : need + (g.buf - p) / UNIT;
        uint64_t used = (tb - hb) & BYTE_MASK;
        if (((ts - hs) & SLOT_MASK) >= g.slots || used + units * UNIT > g.buf) {
            PyBuffer_Release(&data);
            return Py_BuildValue("(iKKK)", 1, 0ULL, 0ULL, (unsigned long long)retries);
        }
        uint64_t nt = (((ts + 1) & SLOT_MASK) << 40) | ((tb + units * UNIT) & BYTE_MASK);
        if (cas(b, C_TAIL, tail, nt) == tail) break;
        retries++;
    }
    slot = ts; start = tb;
    uint64_t so = g.s_off + (slot % g.slots) * SLOT_ENTRY;
    uint64_t w1 = ld(b, so + 8);
    for (;;) {
        if (slot_diff(w1 >> 40, slot) > 0) goto fenced;  /* zombie from an older lap */
        uint64_t prev = cas(b, so + 8, w1, ((slot & SLOT_MASK) << 40) | (start & BYTE_MASK));
        if (prev == w1) break;
        w1 = prev;
    }
    uint64_t freew = w0(slot, ST_FREE, 0, 0), claimed = w0(slot, ST_RESERVED, producer, units);
    if (cas(b, so, freew, claimed) != freew) goto fenced;
    {
        uint64_t p = start % g.buf;
        phys = (p + units * UNIT > g.buf) ? 0 : p;
        record_t *rec = (record_t *)(b + g.b_off + phys);
        rec->magic = RECORD_MAGIC; rec->producer = (uint16_t)producer; rec->flags = (uint16_t)flags;
        rec->epoch = (uint32_t)epoch; rec->hv = 1; rec->seq = seq; rec->length = len; rec->slot = slot & SLOT_MASK;
        rec->checksum = 0;
        char *dst = b + g.b_off + phys + UNIT;
        XXH3_state_t state;
        XXH3_64bits_reset(&state);
        XXH3_64bits_update(&state, rec, HEADER_COVERED);
        const char *src = (const char *)data.buf;
        if (len >= (1u << 16)) {
            Py_BEGIN_ALLOW_THREADS
            for (uint64_t a = 0; a < len; a += CHUNK) {  /* hash, then copy while still in cache */
                uint64_t n = len - a < CHUNK ? len - a : CHUNK;
                XXH3_64bits_update(&state, src + a, n);
                memcpy(dst + a, src + a, n);
            }
            Py_END_ALLOW_THREADS
        } else {
            memcpy(dst, src, len);
            XXH3_64bits_update(&state, src, len);
        }
        rec->checksum = XXH3_64bits_digest(&state);
    }
    PyBuffer_Release(&data);
    if (cas(b, so, claimed, w0(slot, ST_COMMITTED, producer, units)) != claimed) {
        uint64_t stolen = w0(slot, ST_ABANDONED, producer, units);
        cas(b, so, stolen, w0(slot, ST_ABANDON_ACKED, producer, units));
        return Py_BuildValue("(iKKK)", 2, (unsigned long long)slot, (unsigned long long)units,
                             (unsigned long long)retries);
    }
    if (ld(b, C_CONSUMER_WAITING)) {
        __atomic_fetch_add((uint32_t *)(b + C_DOORBELL), 1, __ATOMIC_ACQ_REL);
        syscall(SYS_futex, (uint32_t *)(b + C_DOORBELL), FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    }
    return Py_BuildValue("(iKKK)", 0, (unsigned long long)slot, (unsigned long long)units,
                         (unsigned long long)retries);
fenced:
    PyBuffer_Release(&data);
    return Py_BuildValue("(iKKK)", 2, 0ULL, 0ULL, (unsigned long long)retries);
}

/* ring_take(base, b_off, s_off, p_off, slots, buf, cursor, cursor_bytes)
 *   -> (status, producer, epoch, seq, flags, payload_offset, length, units)
 * status: 0 delivered (DELIVERED and CURSOR updated), 1 empty, 2 not committed (Python decides:
 * wait, look ahead or steal), 3 corrupt, 4 stale epoch, 5 duplicate, 6 out of order. For 3-6 the
 * caller skips the slot. Only the common case lives here. */
static PyObject *ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t c, cb;
    if (nargs != 8) { PyErr_SetString(PyExc_TypeError, "ring_take takes 8 arguments"); return NULL; }
    if (parse_geom(args, &g) || get_u64(args[6], &c) || get_u64(args[7], &cb)) return NULL;
    char *b = g.base;
    if ((ld(b, C_TAIL) >> 40) == c) return Py_BuildValue("(iiiKiKKK)", 1, 0, 0, 0ULL, 0, 0ULL, 0ULL, 0ULL);
    uint64_t so = g.s_off + (c % g.slots) * SLOT_ENTRY;
    uint64_t w = ld(b, so);
    uint64_t wslot = w >> 40, state = (w >> 36) & 0xF, producer = (w >> 24) & 0xFFF, units = w & 0xFFFFFF;
    if (wslot != (c & SLOT_MASK) || state != ST_COMMITTED)
        return Py_BuildValue("(iiiKiKKK)", 2, 0, 0, 0ULL, 0, 0ULL, 0ULL, 0ULL);
    uint64_t p = cb % g.buf;
    uint64_t phys = (p + units * UNIT > g.buf) ? 0 : p;
    uint64_t span = units * UNIT;
    record_t *rec = (record_t *)(b + g.b_off + phys);
    int status = 0;
    if (span < UNIT || phys + span > g.buf || rec->magic != RECORD_MAGIC || rec->hv != 1 ||
        rec->length > span - UNIT || (rec->flags & ~FLAG_SKIP) || rec->producer != producer ||
        rec->slot != (c & SLOT_MASK)) {
        status = 3;
    } else {
        XXH3_state_t st3;
        XXH3_64bits_reset(&st3);
        XXH3_64bits_update(&st3, rec, HEADER_COVERED);
        uint64_t len = rec->length;
        if (len >= (1u << 16)) {
            Py_BEGIN_ALLOW_THREADS
            XXH3_64bits_update(&st3, (char *)rec + UNIT, len);
            Py_END_ALLOW_THREADS
        } else {
            XXH3_64bits_update(&st3, (char *)rec + UNIT, len);
        }
        if (XXH3_64bits_digest(&st3) != rec->checksum) status = 3;
    }
    if (status == 3) return Py_BuildValue("(iiiKiKKK)", 3, 0, 0, 0ULL, 0, 0ULL, 0ULL, (unsigned long long)units);
    uint64_t po = g.p_off + producer * PRODUCER_ENTRY;
    uint64_t owner_epoch = (ld(b, po + P_OWNER) >> 8) & 0xFFFFFF;
    uint64_t epoch = rec->epoch, seq = rec->seq;
    if (epoch != owner_epoch) return Py_BuildValue("(iiiKiKKK)", 4, 0, 0, 0ULL, 0, 0ULL, 0ULL, (unsigned long long)units);
    uint64_t dw = ld(b, po + P_DELIVERED);
    uint64_t nxt = ((dw >> 40) == epoch) ? (dw & BYTE_MASK) : 0;
    if (seq != nxt)
        return Py_BuildValue("(iiiKiKKK)", seq < nxt ? 5 : 6, 0, 0, 0ULL, 0, 0ULL, 0ULL, (unsigned long long)units);
    st(b, po + P_DELIVERED, ((epoch & 0xFFFFFF) << 40) | ((seq + 1) & BYTE_MASK));
    st(b, C_CURSOR, (c + 1) & SLOT_MASK);
    return Py_BuildValue("(iiiKiKKK)", 0, (int)producer, (int)epoch, (unsigned long long)seq, (int)rec->flags,
                         (unsigned long long)(g.b_off + phys + UNIT), (unsigned long long)rec->length,
                         (unsigned long long)units);
}
#pragma GCC pop_options
#endif /* ONEPIECE_FAST */

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
#ifdef ONEPIECE_FAST
    {"ring_send", (PyCFunction)(void (*)(void))ring_send, METH_FASTCALL, "the producer's steps 1-7 for a local region"},
    {"ring_take", (PyCFunction)(void (*)(void))ring_take, METH_FASTCALL, "the consumer's common case for a local region"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_atomics", "Native atomics for shared memory.", -1, methods};

PyMODINIT_FUNC PyInit__atomics(void) {
#ifdef ONEPIECE_FAST
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2")) {
        /* hide the AVX2 fast paths: engine.transport.ring falls back to its Python steps */
        for (PyMethodDef *m = methods; m->ml_name; m++)
            if (strncmp(m->ml_name, "ring_", 5) == 0) { m->ml_name = "_unsupported_cpu"; }
    }
#endif
    return PyModule_Create(&module);
}
