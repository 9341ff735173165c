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
#include <sched.h>
#include <time.h>
#include <unistd.h>

static int get_u64(PyObject *o, uint64_t *out) {
    unsigned long long v = PyLong_AsUnsignedLongLongMask(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* The argument checks of every METH_FASTCALL function: a call with other than `want` arguments is a
 * TypeError that shows the signature; then the first n arguments are read as unsigned 64-bit
 * integers into out[0..n) (the rest, buffers and floats, are the caller's). */
static int nargs_is(Py_ssize_t nargs, Py_ssize_t want, const char *signature) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", signature, want, nargs);
    return -1;
}

static int args_u64(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, const char *signature, Py_ssize_t n,
                    uint64_t *out) {
    if (nargs_is(nargs, want, signature)) return -1;
    for (Py_ssize_t i = 0; i < n; i++)
        if (get_u64(args[i], &out[i])) return -1;
    return 0;
}

/* cas64(addr, expected, desired) -> previous value (success iff == expected) */
static PyObject *cas64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[3];  /* addr, expected, desired */
    if (args_u64(args, nargs, 3, "cas64(addr, expected, desired)", 3, a)) return NULL;
    uint64_t prev = a[1];
    __atomic_compare_exchange_n((uint64_t *)(uintptr_t)a[0], &prev, a[2], 0,
                                __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(prev);
}

/* faaN(addr, delta) -> previous value; loadN(addr) -> value (acquire). 64-bit for the ring's
 * words, 32-bit for the doorbell word futexes sleep on: the same code at two widths. */
#define FAA_AND_LOAD(BITS, T, TO_PY)                                                              \
    static PyObject *faa##BITS(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {         \
        uint64_t a[2]; /* addr, delta */                                                          \
        if (args_u64(args, nargs, 2, "faa" #BITS "(addr, delta)", 2, a)) return NULL;             \
        return TO_PY(__atomic_fetch_add((T *)(uintptr_t)a[0], (T)a[1], __ATOMIC_ACQ_REL));        \
    }                                                                                             \
    static PyObject *load##BITS(PyObject *self, PyObject *arg) {                                  \
        uint64_t addr;                                                                            \
        if (get_u64(arg, &addr)) return NULL;                                                     \
        return TO_PY(__atomic_load_n((T *)(uintptr_t)addr, __ATOMIC_ACQUIRE));                    \
    }
FAA_AND_LOAD(64, uint64_t, PyLong_FromUnsignedLongLong)
FAA_AND_LOAD(32, uint32_t, PyLong_FromUnsignedLong)

static PyObject *store64(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[2];  /* addr, value */
    if (args_u64(args, nargs, 2, "store64(addr, value)", 2, a)) return NULL;
    __atomic_store_n((uint64_t *)(uintptr_t)a[0], a[1], __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* futex_wait(addr, expected32, timeout_s) -> True if woken or value changed, False on timeout.
 * Releases the GIL while it sleeps. Shared (not PRIVATE) futex: works across processes. */
static PyObject *futex_wait(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[2];  /* addr, expected */
    if (args_u64(args, nargs, 3, "futex_wait(addr, expected, timeout_s)", 2, a)) return NULL;
    double timeout = PyFloat_AsDouble(args[2]);
    if (timeout == -1.0 && PyErr_Occurred()) return NULL;
    struct timespec ts;
    ts.tv_sec = (time_t)timeout;
    ts.tv_nsec = (long)((timeout - (double)ts.tv_sec) * 1e9);
    long rc;
    int err;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)a[0], FUTEX_WAIT, (uint32_t)a[1], &ts, NULL, 0);
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == -1 && err == ETIMEDOUT) Py_RETURN_FALSE;
    if (rc == -1 && err != EAGAIN && err != EINTR) { errno = err; return PyErr_SetFromErrno(PyExc_OSError); }
    Py_RETURN_TRUE;
}

static PyObject *futex_wake(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[2];  /* addr, n */
    if (args_u64(args, nargs, 2, "futex_wake(addr, n)", 2, a)) return NULL;
    long rc = syscall(SYS_futex, (uint32_t *)(uintptr_t)a[0], FUTEX_WAKE, (int)a[1], NULL, NULL, 0);
    if (rc == -1) return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

/* copy(dst_addr, src_addr, n): plain memcpy with the GIL released (large payloads). */
static PyObject *copy(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[3];
    if (args_u64(args, nargs, 3, "copy(dst, src, n)", 3, a)) return NULL;
    void *dst = (void *)(uintptr_t)a[0];
    const void *src = (const void *)(uintptr_t)a[1];
    size_t n = (size_t)a[2];
    if (n >= (1u << 16)) {
        Py_BEGIN_ALLOW_THREADS
        memcpy(dst, src, n);
        Py_END_ALLOW_THREADS
    } else {
        memcpy(dst, src, n);
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
#include <immintrin.h>
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
#define S_W2 16
#define ST_FREE 0ULL
#define ST_RESERVED 1ULL
#define ST_COMMITTED 2ULL
#define ST_ABANDONED 3ULL
#define ST_ABANDON_ACKED 4ULL
#define RECORD_MAGIC 0x3152504FU
#define FLAG_SKIP 1
#define FLAG_HEADER_ONLY 2     /* the checksum covers the header only (rings created with verify_payload=False) */
#define KNOWN_FLAGS (FLAG_SKIP | FLAG_HEADER_ONLY)
#define HEADER_COVERED 40
#define NOGIL_MIN (1u << 16)   /* release the GIL while copying or hashing at least this much */
#define FUSE_MIN 1024          /* below this, hash a stack copy of header + payload in one call */

/* Payloads of at least this many bytes are written with non-temporal stores: a copy that large
 * evicts the caches anyway, and streaming stores skip the read-for-ownership of every line. Below
 * it, ordinary stores leave the record in the shared cache, where the consumer reads it next. */
static uint64_t stream_min = 1u << 20;

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

/* ---- one pass over the payload: xxh3-64 of (header[0:40] || payload), copying as it hashes ----
 * The same function as XXH3_64bits() on the concatenation (the tests check it against the xxhash
 * package), written out so that each 64-byte stripe is copied right after it is hashed, while it
 * is in L1: memory sees one read and one write per byte, as for memcpy. Mode 0 hashes only (the
 * consumer's verification), 1 copies with ordinary stores, 2 with non-temporal stores. */
static inline __attribute__((always_inline)) void copy64(char *d, const char *s, int mode) {
    __m256i a = _mm256_loadu_si256((const __m256i *)s), b = _mm256_loadu_si256((const __m256i *)(s + 32));
    if (mode == 2) {
        _mm256_stream_si256((__m256i *)d, a); _mm256_stream_si256((__m256i *)(d + 32), b);
    } else {
        _mm256_storeu_si256((__m256i *)d, a); _mm256_storeu_si256((__m256i *)(d + 32), b);
    }
}

static inline __attribute__((always_inline)) uint64_t
hash_copy_long(char *dst, const char *src, size_t len, const void *hdr, int mode) {
    const uint8_t *secret = XXH3_kSecret;
    const size_t secret_size = sizeof(XXH3_kSecret);
    const size_t per_block = (secret_size - XXH_STRIPE_LEN) / XXH_SECRET_CONSUME_RATE;
    const size_t block_len = XXH_STRIPE_LEN * per_block;
    const size_t total = HEADER_COVERED + len;  /* > 240, and len >= 64: XXH3's long-input path */
    XXH_ALIGN(XXH_ACC_ALIGN) xxh_u64 acc[XXH_ACC_NB] = XXH3_INIT_ACC;
    uint8_t first[XXH_STRIPE_LEN];  /* the one stripe that straddles header and payload */
    memcpy(first, hdr, HEADER_COVERED);
    memcpy(first + HEADER_COVERED, src, XXH_STRIPE_LEN - HEADER_COVERED);
    const size_t nb_blocks = (total - 1) / block_len;
    size_t v = 0;  /* offset in the virtual input header || payload */
    /* after the stripe at v (> 0) is hashed, payload bytes [v - 64, v) are in L1: copy them */
#define STRIPE(off) ((off) == 0 ? first : (const uint8_t *)src + (off) - HEADER_COVERED)
#define COPY_AFTER(off) do { if (mode && (off)) copy64(dst + (off) - XXH_STRIPE_LEN, src + (off) - XXH_STRIPE_LEN, mode); } while (0)
    for (size_t n = 0; n < nb_blocks; n++) {
        for (size_t s = 0; s < per_block; s++, v += XXH_STRIPE_LEN) {
            __builtin_prefetch(src + v + 512);
            XXH3_accumulate_512(acc, STRIPE(v), secret + s * XXH_SECRET_CONSUME_RATE);
            COPY_AFTER(v);
        }
        XXH3_scrambleAcc(acc, secret + secret_size - XXH_STRIPE_LEN);
    }
    const size_t nb_stripes = ((total - 1) - block_len * nb_blocks) / XXH_STRIPE_LEN;
    for (size_t s = 0; s < nb_stripes; s++, v += XXH_STRIPE_LEN) {
        XXH3_accumulate_512(acc, STRIPE(v), secret + s * XXH_SECRET_CONSUME_RATE);
        COPY_AFTER(v);
    }
#undef STRIPE
#undef COPY_AFTER
    if (mode) {
        size_t done = v ? v - XXH_STRIPE_LEN : 0;
        if (mode == 2) _mm_sfence();  /* streamed lines are globally visible before the commit CAS */
        memcpy(dst + done, src + done, len - done);
    }
    XXH3_accumulate_512(acc, (const uint8_t *)src + len - XXH_STRIPE_LEN,
                        secret + secret_size - XXH_STRIPE_LEN - XXH_SECRET_LASTACC_START);
    return XXH3_mergeAccs(acc, secret + XXH_SECRET_MERGEACCS_START, (xxh_u64)total * XXH_PRIME64_1);
}

static __attribute__((noinline)) uint64_t hash_only(const char *src, size_t len, const void *hdr) {
    return hash_copy_long(NULL, src, len, hdr, 0);
}
static __attribute__((noinline)) uint64_t hash_copy_cached(char *dst, const char *src, size_t len, const void *hdr) {
    return hash_copy_long(dst, src, len, hdr, 1);
}
static __attribute__((noinline)) uint64_t hash_copy_stream(char *dst, const char *src, size_t len, const void *hdr) {
    return hash_copy_long(dst, src, len, hdr, 2);
}

static void copy_stream(char *dst, const char *src, size_t len) {
    size_t i = 0;
    for (; i + 64 <= len; i += 64) copy64(dst + i, src + i, 2);
    _mm_sfence();
    memcpy(dst + i, src + i, len - i);
}

/* Copy len payload bytes to dst (unless dst is NULL) and return the record's checksum:
 * xxh3-64 over the 40 covered header bytes and, when `payload`, the payload. `stream`: 1 forces
 * non-temporal stores, 0 decides by size. Call without the GIL for large lengths. */
static uint64_t record_checksum(char *dst, const char *src, size_t len, const void *hdr, int payload, int stream) {
    int nt = dst != NULL && ((uintptr_t)dst & 31) == 0 && (stream || len >= stream_min);
    if (!payload) {
        if (dst) {
            if (nt) copy_stream(dst, src, len);
            else memcpy(dst, src, len);
        }
        return XXH3_64bits(hdr, HEADER_COVERED);
    }
    if (len < FUSE_MIN) {
        uint8_t tmp[HEADER_COVERED + FUSE_MIN];
        memcpy(tmp, hdr, HEADER_COVERED);
        memcpy(tmp + HEADER_COVERED, src, len);
        if (dst) memcpy(dst, src, len);
        return XXH3_64bits(tmp, HEADER_COVERED + len);
    }
    if (dst == NULL) return hash_only(src, len, hdr);
    return nt ? hash_copy_stream(dst, src, len, hdr) : hash_copy_cached(dst, src, len, hdr);
}

/* record_checksum(header40, payload, out=None, stream=False) -> int: the checksum the ring writes,
 * copying payload into `out` on the way (for the tests: it must equal xxh3_64(header40 + payload)). */
static PyObject *py_record_checksum(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "record_checksum(header40, payload, out=None, stream=False, payload_covered=True)");
        return NULL;
    }
    Py_buffer hdr, src, out = {0};
    int have_out = nargs > 2 && args[2] != Py_None;
    int stream = nargs > 3 ? PyObject_IsTrue(args[3]) : 0;
    int covered = nargs > 4 ? PyObject_IsTrue(args[4]) : 1;
    if (stream < 0 || covered < 0) return NULL;
    if (PyObject_GetBuffer(args[0], &hdr, PyBUF_SIMPLE) < 0) return NULL;
    if (hdr.len != HEADER_COVERED) {
        PyBuffer_Release(&hdr);
        PyErr_SetString(PyExc_ValueError, "the header must be 40 bytes");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &src, PyBUF_SIMPLE) < 0) { PyBuffer_Release(&hdr); return NULL; }
    if (have_out && PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&hdr); PyBuffer_Release(&src);
        return NULL;
    }
    if (have_out && out.len < src.len) {
        PyBuffer_Release(&hdr); PyBuffer_Release(&src); PyBuffer_Release(&out);
        PyErr_SetString(PyExc_ValueError, "out is smaller than the payload");
        return NULL;
    }
    uint64_t h;
    Py_BEGIN_ALLOW_THREADS
    h = record_checksum(have_out ? (char *)out.buf : NULL, (const char *)src.buf, (size_t)src.len, hdr.buf, covered, stream);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&hdr); PyBuffer_Release(&src);
    if (have_out) PyBuffer_Release(&out);
    return PyLong_FromUnsignedLongLong(h);
}

/* set_stream_min(bytes) -> previous: the size from which payloads are written with non-temporal stores */
static PyObject *set_stream_min(PyObject *self, PyObject *arg) {
    uint64_t v, prev = stream_min;
    if (get_u64(arg, &v)) return NULL;
    stream_min = v;
    return PyLong_FromUnsignedLongLong(prev);
}

typedef struct { char *base; uint64_t b_off, s_off, p_off, slots, buf; } geom_t;

static int parse_geom(PyObject *const *args, geom_t *g) {
    uint64_t base;
    if (get_u64(args[0], &base) || get_u64(args[1], &g->b_off) || get_u64(args[2], &g->s_off) ||
        get_u64(args[3], &g->p_off) || get_u64(args[4], &g->slots) || get_u64(args[5], &g->buf)) return -1;
    g->base = (char *)(uintptr_t)base;
    return 0;
}

/* ---- producer: steps 1-7 of docs/ring-protocol.md for one message ---- */
enum { SENT = 0, FULL = 1, FENCED = 2 };

/* Called with the GIL held; releases it around large copies. */
static int send_one(const geom_t *g, uint64_t producer, uint64_t epoch, uint64_t seq, uint64_t flags,
                    const char *src, uint64_t len, uint64_t *slot_out, uint64_t *units_out, uint64_t *retries) {
    char *b = g->base;
    uint64_t need = (UNIT + len + UNIT - 1) / UNIT;
    uint64_t tail, ts, tb, units, start, slot, phys;
    for (;;) {                                                        /* [P1] + [P2] */
        tail = ld(b, C_TAIL);
        uint64_t head = ld(b, C_HEAD);
        ts = tail >> 40; tb = tail & BYTE_MASK;
        uint64_t hs = head >> 40, hb = head & BYTE_MASK;
        uint64_t p = tb % g->buf;
        units = (p + need * UNIT <= g->buf) ? need : need + (g->buf - p) / UNIT;
        uint64_t used = (tb - hb) & BYTE_MASK;
        if (((ts - hs) & SLOT_MASK) >= g->slots || used + units * UNIT > g->buf) return FULL;
        uint64_t nt = (((ts + 1) & SLOT_MASK) << 40) | ((tb + units * UNIT) & BYTE_MASK);
        if (cas(b, C_TAIL, tail, nt) == tail) break;
        (*retries)++;
    }
    slot = ts; start = tb;
    uint64_t so = g->s_off + (slot % g->slots) * SLOT_ENTRY;
    uint64_t w1 = ld(b, so + 8);
    for (;;) {                                                        /* [P3] */
        if (slot_diff(w1 >> 40, slot) > 0) return FENCED;  /* zombie from an older lap */
        uint64_t prev = cas(b, so + 8, w1, ((slot & SLOT_MASK) << 40) | (start & BYTE_MASK));
        if (prev == w1) break;
        w1 = prev;
    }
    uint64_t freew = w0(slot, ST_FREE, 0, 0), claimed = w0(slot, ST_RESERVED, producer, units);
    if (cas(b, so, freew, claimed) != freew) return FENCED;           /* [P4] */
    {                                                                 /* [P5] */
        uint64_t p = start % g->buf;
        phys = (p + units * UNIT > g->buf) ? 0 : p;
        record_t *rec = (record_t *)(b + g->b_off + phys);
        rec->magic = RECORD_MAGIC; rec->producer = (uint16_t)producer; rec->flags = (uint16_t)flags;
        rec->epoch = (uint32_t)epoch; rec->hv = 1; rec->seq = seq; rec->length = len; rec->slot = slot & SLOT_MASK;
        rec->checksum = 0;
        char *dst = b + g->b_off + phys + UNIT;
        int payload = !(flags & FLAG_HEADER_ONLY);
        uint64_t h;
        if (len >= NOGIL_MIN) {
            Py_BEGIN_ALLOW_THREADS
            h = record_checksum(dst, src, len, rec, payload, 0);
            Py_END_ALLOW_THREADS
        } else {
            h = record_checksum(dst, src, len, rec, payload, 0);
        }
        rec->checksum = h;
    }
    if (cas(b, so, claimed, w0(slot, ST_COMMITTED, producer, units)) != claimed) {   /* [P6] */
        uint64_t stolen = w0(slot, ST_ABANDONED, producer, units);
        cas(b, so, stolen, w0(slot, ST_ABANDON_ACKED, producer, units));
        return FENCED;
    }
    if (ld(b, C_CONSUMER_WAITING)) {                                  /* [P7] */
        __atomic_fetch_add((uint32_t *)(b + C_DOORBELL), 1, __ATOMIC_ACQ_REL);
        syscall(SYS_futex, (uint32_t *)(b + C_DOORBELL), FUTEX_WAKE, 1 << 30, NULL, NULL, 0);
    }
    *slot_out = slot;
    *units_out = units;
    return SENT;
}

/* ring_send(base, b_off, s_off, p_off, slots, buf, producer, epoch, seq, flags, data)
 *   -> (status, slot, units, cas_retries); status 0 committed, 1 full, 2 fenced (retry). */
static PyObject *ring_send(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t producer, epoch, seq, flags;
    if (nargs_is(nargs, 11, "ring_send")) return NULL;
    if (parse_geom(args, &g) || get_u64(args[6], &producer) || get_u64(args[7], &epoch) ||
        get_u64(args[8], &seq) || get_u64(args[9], &flags)) return NULL;
    Py_buffer data;
    if (PyObject_GetBuffer(args[10], &data, PyBUF_SIMPLE) < 0) return NULL;
    uint64_t slot = 0, units = 0, retries = 0;
    int status = send_one(&g, producer, epoch, seq, flags, (const char *)data.buf, (uint64_t)data.len, &slot, &units,
                          &retries);
    PyBuffer_Release(&data);
    return Py_BuildValue("(iKKK)", status, (unsigned long long)slot, (unsigned long long)units,
                         (unsigned long long)retries);
}

/* ring_send_many(base, b_off, s_off, p_off, slots, buf, producer, epoch, first_seq, flags, messages, start)
 *   -> (status, sent, slots, cas_retries): sends messages[start:] in order, message i with sequence
 *   number first_seq + i - start, until one does not commit; `sent` committed, their slots listed;
 *   status as for ring_send, of the message after the last sent one (0 when all were sent). */
static PyObject *ring_send_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t producer, epoch, seq, flags, start;
    if (nargs_is(nargs, 12, "ring_send_many")) return NULL;
    if (parse_geom(args, &g) || get_u64(args[6], &producer) || get_u64(args[7], &epoch) ||
        get_u64(args[8], &seq) || get_u64(args[9], &flags) || get_u64(args[11], &start)) return NULL;
    PyObject *seqobj = PySequence_Fast(args[10], "messages must be a sequence of buffers");
    if (!seqobj) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seqobj);
    PyObject **items = PySequence_Fast_ITEMS(seqobj);
    PyObject *slots = PyList_New(0);
    if (!slots) { Py_DECREF(seqobj); return NULL; }
    uint64_t retries = 0;
    int status = SENT;
    for (Py_ssize_t i = (Py_ssize_t)start; i < n; i++) {
        Py_buffer data;
        if (PyObject_GetBuffer(items[i], &data, PyBUF_SIMPLE) < 0) goto error;
        uint64_t slot = 0, units = 0;
        status = send_one(&g, producer, epoch, seq, flags, (const char *)data.buf, (uint64_t)data.len, &slot, &units,
                          &retries);
        PyBuffer_Release(&data);
        if (status != SENT) break;
        seq++;
        PyObject *s = PyLong_FromUnsignedLongLong(slot);
        if (!s || PyList_Append(slots, s) < 0) { Py_XDECREF(s); goto error; }
        Py_DECREF(s);
    }
    Py_DECREF(seqobj);
    return Py_BuildValue("(inNK)", status, PyList_GET_SIZE(slots), slots, (unsigned long long)retries);
error:
    Py_DECREF(seqobj);
    Py_DECREF(slots);
    return NULL;
}

/* ---- consumer: the common case at the cursor ---- */
enum { TAKEN = 0, EMPTY = 1, NOT_COMMITTED = 2, CORRUPT = 3, STALE = 4, DUPLICATE = 5, OUT_OF_ORDER = 6 };

typedef struct { uint64_t producer, epoch, seq, flags, off, length, units; } take_t;

/* Examine slot c whose span starts at logical byte cb. TAKEN updates DELIVERED[p] (not CURSOR);
 * CORRUPT..OUT_OF_ORDER set t->units (the caller skips the slot). Releases the GIL for large
 * payloads (call with it held). */
static int take_one(const geom_t *g, uint64_t c, uint64_t cb, int header_only_ok, take_t *t) {
    char *b = g->base;
    if ((ld(b, C_TAIL) >> 40) == (c & SLOT_MASK)) return EMPTY;
    uint64_t so = g->s_off + (c % g->slots) * SLOT_ENTRY;
    uint64_t w = ld(b, so);
    uint64_t wslot = w >> 40, state = (w >> 36) & 0xF, producer = (w >> 24) & 0xFFF, units = w & 0xFFFFFF;
    if (wslot != (c & SLOT_MASK) || state != ST_COMMITTED) return NOT_COMMITTED;
    t->units = units;
    uint64_t p = cb % g->buf;
    uint64_t phys = (p + units * UNIT > g->buf) ? 0 : p;
    uint64_t span = units * UNIT;
    record_t *rec = (record_t *)(b + g->b_off + phys);
    if (span < UNIT || phys + span > g->buf || rec->magic != RECORD_MAGIC || rec->hv != 1 ||
        rec->length > span - UNIT || (rec->flags & ~KNOWN_FLAGS) || rec->producer != producer ||
        rec->slot != (c & SLOT_MASK) || ((rec->flags & FLAG_HEADER_ONLY) && !header_only_ok))
        return CORRUPT;
    uint64_t len = rec->length, h;
    int payload = !(rec->flags & FLAG_HEADER_ONLY);
    if (payload && len >= NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        h = record_checksum(NULL, (char *)rec + UNIT, len, rec, 1, 0);
        Py_END_ALLOW_THREADS
    } else {
        h = record_checksum(NULL, (char *)rec + UNIT, len, rec, payload, 0);
    }
    if (h != rec->checksum) return CORRUPT;
    uint64_t po = g->p_off + producer * PRODUCER_ENTRY;
    uint64_t owner_epoch = (ld(b, po + P_OWNER) >> 8) & 0xFFFFFF;
    uint64_t epoch = rec->epoch, seq = rec->seq;
    if (epoch != owner_epoch) return STALE;
    uint64_t dw = ld(b, po + P_DELIVERED);
    uint64_t nxt = ((dw >> 40) == epoch) ? (dw & BYTE_MASK) : 0;
    if (seq != nxt) return seq < nxt ? DUPLICATE : OUT_OF_ORDER;
    st(b, po + P_DELIVERED, ((epoch & 0xFFFFFF) << 40) | ((seq + 1) & BYTE_MASK));
    t->producer = producer; t->epoch = epoch; t->seq = seq; t->flags = rec->flags;
    t->off = g->b_off + phys + UNIT; t->length = len;
    return TAKEN;
}

/* ring_take(base, b_off, s_off, p_off, slots, buf, cursor, cursor_bytes[, header_only_ok[, at_cursor]])
 *   -> (status, producer, epoch, seq, flags, payload_offset, length, units)
 * status: 0 delivered (DELIVERED and CURSOR updated), 1 empty, 2 not committed (Python decides:
 * wait, look ahead or steal), 3 corrupt, 4 stale epoch, 5 duplicate, 6 out of order. For 3-6 the
 * caller skips the slot. Only the common case lives here. With at_cursor 0 (look-ahead: a slot
 * past the cursor, whose span start the caller read from its W1) CURSOR is left alone. */
static PyObject *ring_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t c, cb, hok = 0, at_cursor = 1;
    if (nargs < 8 || nargs > 10) { PyErr_SetString(PyExc_TypeError, "ring_take takes 8 to 10 arguments"); return NULL; }
    if (parse_geom(args, &g) || get_u64(args[6], &c) || get_u64(args[7], &cb) ||
        (nargs >= 9 && get_u64(args[8], &hok)) || (nargs == 10 && get_u64(args[9], &at_cursor))) return NULL;
    take_t t = {0};
    int status = take_one(&g, c, cb, (int)hok, &t);
    if (status == TAKEN) {
        if (at_cursor) st(g.base, C_CURSOR, (c + 1) & SLOT_MASK);
        return Py_BuildValue("(iiiKiKKK)", 0, (int)t.producer, (int)t.epoch, (unsigned long long)t.seq, (int)t.flags,
                             (unsigned long long)t.off, (unsigned long long)t.length, (unsigned long long)t.units);
    }
    return Py_BuildValue("(iiiKiKKK)", status, 0, 0, 0ULL, 0, 0ULL, 0ULL, (unsigned long long)t.units);
}

/* ring_spin(base, s_off, slots, cursor, max_ns, yield_ns) -> bool
 * The consumer's short wait before it sleeps on the doorbell: returns True as soon as the slot at
 * the cursor is committed or TAIL moves, False after max_ns. Polls with PAUSE (a reaction within a
 * fraction of a microsecond) and yields the core every yield_ns, so that a producer sharing this
 * core (more busy processes than cores) runs at once instead of after the whole spin. Without the
 * GIL. */
static PyObject *ring_spin(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t a[6];
    if (args_u64(args, nargs, 6, "ring_spin(base, s_off, slots, cursor, max_ns, yield_ns)", 6, a)) return NULL;
    uint64_t base = a[0], s_off = a[1], slots = a[2], c = a[3], max_ns = a[4], yield_ns = a[5];
    char *b = (char *)(uintptr_t)base;
    uint64_t so = s_off + (c % slots) * SLOT_ENTRY, committed = (c & SLOT_MASK) << 40 | ST_COMMITTED << 36;
    uint64_t tail0 = ld(b, C_TAIL);
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t start = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec, next_yield = start + yield_ns;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            if ((ld(b, so) & ~((1ULL << 36) - 1)) == committed || ld(b, C_TAIL) != tail0) { ready = 1; break; }
            _mm_pause();
        }
        if (ready) break;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
        if (now - start >= max_ns) break;
        if (now >= next_yield) {
            sched_yield();
            next_yield = now + yield_ns;
        }
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ready);
}

/* One slot of a run taken by ring_take_many (32 bytes; engine/transport/ring/consumer.py reads
 * it with struct format RUN_ENTRY). */
enum { RUN_DELIVERED = 0, RUN_SKIP_RECORD = 1, RUN_DROPPED = 2 };
#pragma pack(push, 1)
typedef struct {
    uint8_t kind;      /* RUN_*: delivered (a view), a skip record (acknowledged, no view), dropped */
    uint8_t why;       /* the take status of a dropped slot (3-6) */
    uint16_t producer;
    uint32_t epoch;
    uint64_t seq;
    uint32_t units;
    uint32_t view;     /* index into the run's views (RUN_DELIVERED) */
    uint64_t reserved;
} run_entry_t;
#pragma pack(pop)

/* ring_take_many(base, b_off, s_off, p_off, slots, buf, cursor, cursor_bytes, max_n, header_only_ok, ro)
 *   -> (n, stop, cursor_bytes, entries, views, counts)
 * Takes up to max_n consecutive slots from the cursor, each as ring_take would: delivered records
 * become read-only views (slices of `ro`, the region's read-only view), corrupt, stale, duplicate
 * and out-of-order ones are dropped in place; stops at the first empty (stop 1) or uncommitted
 * (stop 2) slot, or after max_n (stop 0). Publishes CURSOR once, past the n slots, and returns
 * the logical byte where the next slot starts. `entries` holds n run_entry_t;
 * counts = (delivered, skip records, corrupt, stale, duplicates, out of order). */
static PyObject *ring_take_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    geom_t g;
    uint64_t c, cb, max_n, hok;
    if (nargs_is(nargs, 11, "ring_take_many")) return NULL;
    if (parse_geom(args, &g) || get_u64(args[6], &c) || get_u64(args[7], &cb) || get_u64(args[8], &max_n) ||
        get_u64(args[9], &hok)) return NULL;
    PyObject *ro = args[10];
    if (max_n > (1u << 20)) max_n = 1u << 20;
    PyObject *views = PyList_New(0);
    if (!views) return NULL;
    run_entry_t small[64];
    run_entry_t *ent = max_n <= 64 ? small : PyMem_Malloc(max_n * sizeof(run_entry_t));
    if (!ent) { Py_DECREF(views); return PyErr_NoMemory(); }
    uint64_t counts[7] = {0};
    uint64_t n = 0;
    int stop = 0;
    for (; n < max_n; n++) {
        take_t t = {0};
        int status = take_one(&g, c, cb, (int)hok, &t);
        if (status == EMPTY || status == NOT_COMMITTED) { stop = status; break; }
        run_entry_t *e = &ent[n];
        memset(e, 0, sizeof *e);
        e->units = (uint32_t)t.units;
        if (status == TAKEN) {
            e->producer = (uint16_t)t.producer; e->epoch = (uint32_t)t.epoch; e->seq = t.seq;
            if (t.flags & FLAG_SKIP) {
                e->kind = RUN_SKIP_RECORD;
                counts[1]++;
            } else {
                e->kind = RUN_DELIVERED;
                e->view = (uint32_t)PyList_GET_SIZE(views);
                PyObject *lo = PyLong_FromUnsignedLongLong(t.off);
                PyObject *hi = PyLong_FromUnsignedLongLong(t.off + t.length);
                PyObject *sl = lo && hi ? PySlice_New(lo, hi, NULL) : NULL;
                Py_XDECREF(lo); Py_XDECREF(hi);
                PyObject *v = sl ? PyObject_GetItem(ro, sl) : NULL;
                Py_XDECREF(sl);
                if (!v || PyList_Append(views, v) < 0) {
                    /* the record is taken (DELIVERED moved): publish the cursor past it regardless, so
                     * the producer's go-back-N resends it; the error propagates */
                    Py_XDECREF(v);
                    st(g.base, C_CURSOR, (c + 1) & SLOT_MASK);
                    if (ent != small) PyMem_Free(ent);
                    Py_DECREF(views);
                    return NULL;
                }
                Py_DECREF(v);
                counts[0]++;
            }
        } else {
            e->kind = RUN_DROPPED;
            e->why = (uint8_t)status;
            counts[status - 1]++;
        }
        c = (c + 1) & SLOT_MASK;
        cb = (cb + t.units * UNIT) & BYTE_MASK;
    }
    if (n) st(g.base, C_CURSOR, c);
    PyObject *entries = PyBytes_FromStringAndSize((const char *)ent, (Py_ssize_t)(n * sizeof(run_entry_t)));
    if (ent != small) PyMem_Free(ent);
    if (!entries) { Py_DECREF(views); return NULL; }
    return Py_BuildValue("(KiKNN(KKKKKK))", (unsigned long long)n, stop, (unsigned long long)cb, entries, views,
                         (unsigned long long)counts[0], (unsigned long long)counts[1], (unsigned long long)counts[2],
                         (unsigned long long)counts[3], (unsigned long long)counts[4], (unsigned long long)counts[5]);
}

/* The arguments of ring_run_mark and ring_run_free: (base, s_off, slots, entries, first_slot, i0, i1),
 * entries the run_entry_t array ring_take_many returned, held as a buffer until run_release. */
typedef struct {
    char *base;
    uint64_t s_off, slots, first, i0, i1;
    Py_buffer eb;
    const run_entry_t *ent;
} run_args_t;

static int parse_run(PyObject *const *args, Py_ssize_t nargs, const char *name, run_args_t *r) {
    uint64_t a[3], b[3];
    if (args_u64(args, nargs, 7, name, 3, a)) return -1;
    if (get_u64(args[4], &b[0]) || get_u64(args[5], &b[1]) || get_u64(args[6], &b[2])) return -1;
    r->base = (char *)(uintptr_t)a[0]; r->s_off = a[1]; r->slots = a[2];
    r->first = b[0]; r->i0 = b[1]; r->i1 = b[2];
    if (PyObject_GetBuffer(args[3], &r->eb, PyBUF_SIMPLE) < 0) return -1;
    if (r->i0 > r->i1 || r->i1 * sizeof(run_entry_t) > (uint64_t)r->eb.len) {
        PyBuffer_Release(&r->eb);
        PyErr_SetString(PyExc_ValueError, "run range out of bounds");
        return -1;
    }
    r->ent = (const run_entry_t *)r->eb.buf;
    return 0;
}

/* ring_run_mark(base, s_off, slots, entries, first_slot, i0, i1): the release marks (W2) of the
 * delivered slots i0 <= i < i1 of a run (crash recovery skips what they mark). */
static PyObject *ring_run_mark(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    run_args_t r;
    if (parse_run(args, nargs, "ring_run_mark", &r)) return NULL;
    for (uint64_t i = r.i0; i < r.i1; i++) {
        if (r.ent[i].kind != RUN_DELIVERED) continue;
        uint64_t s = (r.first + i) & SLOT_MASK;
        st(r.base, r.s_off + (s % r.slots) * SLOT_ENTRY + S_W2, (s << 40) | 1);
    }
    PyBuffer_Release(&r.eb);
    Py_RETURN_NONE;
}

/* ring_run_free(base, s_off, slots, entries, first_slot, i0, i1) -> (bytes, acks)
 * The HEAD advance over slots i0 <= i < i1 of a run: each W0 is reset to (slot + S, FREE) for the
 * next lap; returns the bytes they span and, per producer, the (producer, epoch, next seq) that
 * ACKED[producer] becomes (the caller publishes ACKED, then HEAD). */
static PyObject *ring_run_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    run_args_t r;
    if (parse_run(args, nargs, "ring_run_free", &r)) return NULL;
    const run_entry_t *ent = r.ent;
    uint64_t bytes = 0;
    int np = 0;
    struct { uint16_t p; uint32_t epoch; uint64_t next; } acks[16];
    PyObject *extra = NULL;  /* more than 16 producers in one range: a dict */
    for (uint64_t i = r.i0; i < r.i1; i++) {
        uint64_t s = (r.first + i) & SLOT_MASK;
        st(r.base, r.s_off + (s % r.slots) * SLOT_ENTRY, w0(s + r.slots, ST_FREE, 0, 0));
        bytes += (uint64_t)ent[i].units * UNIT;
        if (ent[i].kind == RUN_DROPPED) continue;
        int k = 0;
        while (k < np && acks[k].p != ent[i].producer) k++;
        if (k == np) {
            if (np == 16) {
                if (!extra && !(extra = PyDict_New())) { PyBuffer_Release(&r.eb); return NULL; }
                PyObject *key = PyLong_FromLong(ent[i].producer);
                PyObject *val = Py_BuildValue("(kK)", (unsigned long)ent[i].epoch, (unsigned long long)(ent[i].seq + 1));
                int rc = key && val ? PyDict_SetItem(extra, key, val) : -1;
                Py_XDECREF(key); Py_XDECREF(val);
                if (rc < 0) { Py_DECREF(extra); PyBuffer_Release(&r.eb); return NULL; }
                continue;
            }
            np++;
        }
        acks[k].p = ent[i].producer; acks[k].epoch = ent[i].epoch; acks[k].next = ent[i].seq + 1;
    }
    PyBuffer_Release(&r.eb);
    PyObject *out = extra ? extra : PyDict_New();
    if (!out) return NULL;
    for (int k = 0; k < np; k++) {
        PyObject *key = PyLong_FromLong(acks[k].p);
        PyObject *val = Py_BuildValue("(kK)", (unsigned long)acks[k].epoch, (unsigned long long)acks[k].next);
        int rc = key && val ? PyDict_SetItem(out, key, val) : -1;
        Py_XDECREF(key); Py_XDECREF(val);
        if (rc < 0) { Py_DECREF(out); return NULL; }
    }
    return Py_BuildValue("(KN)", (unsigned long long)bytes, out);
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
    {"ring_send_many", (PyCFunction)(void (*)(void))ring_send_many, METH_FASTCALL, "ring_send for each of a sequence of messages"},
    {"ring_take_many", (PyCFunction)(void (*)(void))ring_take_many, METH_FASTCALL, "ring_take for a run of slots at the cursor"},
    {"ring_run_mark", (PyCFunction)(void (*)(void))ring_run_mark, METH_FASTCALL, "release marks (W2) of a run's delivered slots"},
    {"ring_run_free", (PyCFunction)(void (*)(void))ring_run_free, METH_FASTCALL, "the HEAD advance over part of a run"},
    {"ring_spin", (PyCFunction)(void (*)(void))ring_spin, METH_FASTCALL, "the consumer's short wait for its next record"},
    {"ring_record_checksum", (PyCFunction)(void (*)(void))py_record_checksum, METH_FASTCALL, "the ring's fused copy and checksum (tests)"},
    {"ring_set_stream_min", set_stream_min, METH_O, "payload size from which copies use non-temporal stores"},
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
