/* An experiment, not part of the package (bench/compiled.py --kind express): the N=2
 * express pair allreduce in C (rabit2.io.express,
 * rabit2.core.express), off with RABIT2_FASTPATH=0.  Pure mechanics, same wire bytes:
 *
 *   exchange(fd, parts|None, inbox, got, prefix, frames, checked, spin_ns, stop_again)
 *       -> (sent, got, status)
 *     writev(parts) once (as express_wire.write), then nonblocking reads into
 *     inbox[got:len(inbox)], checking every peer header as soon as it is whole (the call's
 *     24-byte prefix, its own CRC32C, its (offset, length)); once all is in, the payload
 *     CRC32Cs (checked links).  Spins up to spin_ns on EAGAIN (sched_yield between
 *     tries), then returns so that Python falls back to its epoll wait.
 *
 *   reduce(inbox, frames, mine, out, dtype_code, op_code, lower) -> bool
 *     out = op(mine, theirs) in rank order, frame by frame, written to mine in the same pass;
 *     False (nothing done) for a dtype/op left to numpy.
 *
 *   pack(kind, ckind, dtype, op, root, version, seqno, total, offset, length, inc, crc|None)
 *     -> bytes (framing.pack_header, 48 bytes)
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <nmmintrin.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define HEADER_SIZE 48
#define PREFIX_SIZE 24
#define MAX_FRAMES 64
#define MAX_PARTS 128

enum { ST_DONE = 0, ST_AGAIN_FIRST, ST_SPUN, ST_EOF, ST_ERROR, ST_BAD_HEADER,
       ST_BAD_PAYLOAD, ST_SHORT_WRITE };

static PyObject *crc_fn;  /* crc32c.crc32c: 3-way interleaved, for payloads */

__attribute__((target("sse4.2"))) static uint32_t crc32c_small(const uint8_t *p, size_t n) {
    uint64_t c = 0xffffffffu;
    while (n >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = _mm_crc32_u64(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (n--) c32 = _mm_crc32_u8(c32, *p++);
    return ~c32;
}

/* payload CRC: the crc32c package's (fast, interleaved) for large, ours for small */
static int payload_crc(const uint8_t *p, Py_ssize_t n, uint32_t *out) {
    if (n <= 2048 || crc_fn == NULL) {
        *out = crc32c_small(p, (size_t)n);
        return 0;
    }
    PyObject *mv = PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
    if (mv == NULL) return -1;
    PyObject *r = PyObject_CallOneArg(crc_fn, mv);
    Py_DECREF(mv);
    if (r == NULL) return -1;
    *out = (uint32_t)PyLong_AsUnsignedLong(r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

typedef struct {
    Py_ssize_t n;
    uint64_t off[MAX_FRAMES];
    uint32_t len[MAX_FRAMES];
    Py_ssize_t start[MAX_FRAMES]; /* where each header starts in the inbox */
} Frames;

static int parse_frames(PyObject *seq, Frames *f) {
    PyObject *fast = PySequence_Fast(seq, "frames must be a sequence");
    if (fast == NULL) return -1;
    f->n = PySequence_Fast_GET_SIZE(fast);
    if (f->n < 1 || f->n > MAX_FRAMES) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "bad frame count");
        return -1;
    }
    for (Py_ssize_t i = 0; i < f->n; i++) {
        unsigned long long off;
        unsigned long len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "Kk", &off, &len)) {
            Py_DECREF(fast);
            return -1;
        }
        f->off[i] = off;
        f->len[i] = (uint32_t)len;
        f->start[i] = f->n == 1 ? 0 : (Py_ssize_t)off + i * HEADER_SIZE;
    }
    Py_DECREF(fast);
    return 0;
}

/* check_frames: the header at inbox[s:] is this call's DATA frame i */
static int header_ok(const uint8_t *h, const uint8_t *prefix, const Frames *f, Py_ssize_t i,
                     uint32_t *pcrc) {
    uint64_t off;
    uint32_t len, hcrc;
    if (memcmp(h, prefix, PREFIX_SIZE) != 0) return 0;
    memcpy(&off, h + 24, 8);
    memcpy(&len, h + 32, 4);
    memcpy(pcrc, h + 40, 4);
    memcpy(&hcrc, h + 44, 4);
    if (crc32c_small(h, HEADER_SIZE - 4) != hcrc) return 0;
    return off == f->off[i] && len == f->len[i];
}

static PyObject *exchange(PyObject *self, PyObject *args) {
    int fd, checked, stop_again;
    PyObject *parts, *frames_obj;
    Py_buffer inbox, prefix;
    Py_ssize_t got;
    unsigned long long spin_ns;
    if (!PyArg_ParseTuple(args, "iOw*ny*OpKp", &fd, &parts, &inbox, &got, &prefix,
                          &frames_obj, &checked, &spin_ns, &stop_again))
        return NULL;
    Frames f;
    Py_buffer pb[MAX_PARTS];
    struct iovec iov[MAX_PARTS];
    Py_ssize_t nparts = 0, total = 0, sent = 0;
    PyObject *fast = NULL, *result = NULL;
    int status = ST_DONE;
    uint32_t pcrc[MAX_FRAMES];
    if (prefix.len != PREFIX_SIZE) {
        PyErr_SetString(PyExc_ValueError, "prefix must be 24 bytes");
        goto out;
    }
    if (parse_frames(frames_obj, &f) < 0) goto out;
    if (parts != Py_None) {
        fast = PySequence_Fast(parts, "parts must be a sequence");
        if (fast == NULL) goto out;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
        if (n > MAX_PARTS) {
            PyErr_SetString(PyExc_ValueError, "too many parts");
            goto out;
        }
        for (; nparts < n; nparts++) {
            if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(fast, nparts), &pb[nparts],
                                   PyBUF_SIMPLE) < 0)
                goto out;
            iov[nparts].iov_base = pb[nparts].buf;
            iov[nparts].iov_len = (size_t)pb[nparts].len;
            total += pb[nparts].len;
        }
    }
    const Py_ssize_t want = inbox.len;
    uint8_t *in = inbox.buf;
    const uint8_t *pre = prefix.buf;
    Py_ssize_t nextcheck = 0; /* the next header to check */
    uint64_t spin_start = 0;
    Py_BEGIN_ALLOW_THREADS
    if (nparts) {
        ssize_t w = writev(fd, iov, (int)nparts);
        sent = w >= 0 ? w : (errno == EAGAIN || errno == EWOULDBLOCK) ? 0 : -1;
    }
    if (sent < total) {
        status = ST_SHORT_WRITE;
    } else {
        for (;;) {
            while (nextcheck < f.n && f.start[nextcheck] + HEADER_SIZE <= got) {
                if (!header_ok(in + f.start[nextcheck], pre, &f, nextcheck, &pcrc[nextcheck]))
                    break;
                nextcheck++;
            }
            if (nextcheck < f.n && f.start[nextcheck] + HEADER_SIZE <= got) {
                status = ST_BAD_HEADER;
                break;
            }
            if (got >= want) {
                status = ST_DONE;
                break;
            }
            ssize_t r = read(fd, in + got, (size_t)(want - got));
            if (r > 0) {
                got += r;
                continue;
            }
            if (r == 0) {
                status = ST_EOF;
                break;
            }
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                if (stop_again) {
                    status = ST_AGAIN_FIRST;
                    break;
                }
                uint64_t t = now_ns();
                if (!spin_start) spin_start = t;
                if (t - spin_start >= spin_ns) {
                    status = ST_SPUN;
                    break;
                }
                sched_yield();
                continue;
            }
            status = errno == EINTR ? ST_SPUN : ST_ERROR; /* (EINTR: Python runs handlers) */
            break;
        }
    }
    Py_END_ALLOW_THREADS
    if (status == ST_DONE && checked) {
        for (Py_ssize_t i = 0; i < f.n; i++) {
            uint32_t c;
            if (payload_crc(in + f.start[i] + HEADER_SIZE, f.len[i], &c) < 0) goto out;
            if (c != pcrc[i]) {
                status = ST_BAD_PAYLOAD;
                break;
            }
        }
    }
    result = Py_BuildValue("nni", sent, got, status);
out:
    for (Py_ssize_t i = 0; i < nparts; i++) PyBuffer_Release(&pb[i]);
    Py_XDECREF(fast);
    PyBuffer_Release(&inbox);
    PyBuffer_Release(&prefix);
    return result;
}

/* ---------------------------------------------------------------------------- reduce */

/* z = x op y, and the same into m (the caller's buffer, which x or y is): one pass */
#define LOOP(T, EXPR)                                                                    \
    do {                                                                                 \
        const T *x = (const T *)a;                                                       \
        const T *y = (const T *)b;                                                       \
        T *z = (T *)o;                                                                   \
        T *w = (T *)m;                                                                   \
        for (size_t k = 0; k < n; k++) {                                                 \
            T v = (EXPR);                                                                \
            z[k] = v;                                                                    \
            w[k] = v;                                                                    \
        }                                                                                \
    } while (0)
/* signed integers: wrap like numpy (unsigned arithmetic, no UB) */
#define ILOOP(T, U, OP) LOOP(T, (T)((U)x[k] OP (U)y[k]))

#define INT_OPS(T, U)                                                                    \
    switch (op) {                                                                        \
    case 0: LOOP(T, x[k] > y[k] ? x[k] : y[k]); return 1;                                \
    case 1: LOOP(T, x[k] < y[k] ? x[k] : y[k]); return 1;                                \
    case 2: ILOOP(T, U, +); return 1;                                                    \
    case 3: ILOOP(T, U, |); return 1;                                                    \
    case 4: ILOOP(T, U, *); return 1;                                                    \
    case 5: ILOOP(T, U, &); return 1;                                                    \
    case 6: ILOOP(T, U, ^); return 1;                                                    \
    default: return 0;                                                                   \
    }

/* element size of a wire dtype code (0: left to numpy) */
static int itemsize(int code) {
    switch (code) {
    case 0: case 1: return 1;
    case 10: case 11: return 2;
    case 2: case 3: case 6: return 4;
    case 4: case 5: case 7: return 8;
    default: return 0;
    }
}

/* z = x op y; 1 if done, 0 if this dtype/op is left to numpy (max/min of floats: NaN
 * rules; float16) */
static int reduce_block(int code, int op, const void *a, const void *b, void *o, void *m,
                        size_t n) {
    switch (code) {
    case 0: INT_OPS(int8_t, uint8_t)
    case 1: INT_OPS(uint8_t, uint8_t)
    case 10: INT_OPS(int16_t, uint16_t)
    case 11: INT_OPS(uint16_t, uint16_t)
    case 2: INT_OPS(int32_t, uint32_t)
    case 3: INT_OPS(uint32_t, uint32_t)
    case 4: INT_OPS(int64_t, uint64_t)
    case 5: INT_OPS(uint64_t, uint64_t)
    case 6:
        if (op == 2) { LOOP(float, x[k] + y[k]); return 1; }
        if (op == 4) { LOOP(float, x[k] * y[k]); return 1; }
        return 0;
    case 7:
        if (op == 2) { LOOP(double, x[k] + y[k]); return 1; }
        if (op == 4) { LOOP(double, x[k] * y[k]); return 1; }
        return 0;
    default:
        return 0;
    }
}

static int supported(int code, int op) {
    if (itemsize(code) == 0 || op < 0 || op > 6) return 0;
    if (code == 6 || code == 7) return op == 2 || op == 4;
    return 1;
}

static PyObject *reduce(PyObject *self, PyObject *args) {
    Py_buffer inbox, mine, out;
    PyObject *frames_obj;
    int code, op, lower;
    if (!PyArg_ParseTuple(args, "y*Ow*w*iip", &inbox, &frames_obj, &mine, &out, &code, &op,
                          &lower))
        return NULL;
    PyObject *result = NULL;
    Frames f;
    if (parse_frames(frames_obj, &f) < 0) goto done;
    if (!supported(code, op)) {
        result = Py_NewRef(Py_False);
        goto done;
    }
    size_t size = (size_t)itemsize(code);
    Py_ssize_t nbytes = 0;
    for (Py_ssize_t i = 0; i < f.n; i++) {
        if (f.start[i] + HEADER_SIZE + (Py_ssize_t)f.len[i] > inbox.len
            || (Py_ssize_t)(f.off[i] + f.len[i]) > mine.len
            || (Py_ssize_t)(f.off[i] + f.len[i]) > out.len || f.len[i] % size) {
            PyErr_SetString(PyExc_ValueError, "frames do not fit the buffers");
            goto done;
        }
        nbytes += f.len[i];
    }
    const uint8_t *in = inbox.buf;
    uint8_t *m = mine.buf, *o = out.buf;
    int big = nbytes >= (1 << 16);
    PyThreadState *ts = big ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < f.n; i++) {
        const uint8_t *theirs = in + f.start[i] + HEADER_SIZE;
        uint8_t *mi = m + f.off[i], *oi = o + f.off[i];
        size_t n = f.len[i] / size;
        if (lower) reduce_block(code, op, mi, theirs, oi, mi, n);  /* (out and mine at once) */
        else reduce_block(code, op, theirs, mi, oi, mi, n);
    }
    if (big) PyEval_RestoreThread(ts);
    result = Py_NewRef(Py_True);
done:
    PyBuffer_Release(&inbox);
    PyBuffer_Release(&mine);
    PyBuffer_Release(&out);
    return result;
}

/* ---------------------------------------------------------------------------- pack */

static PyObject *pack(PyObject *self, PyObject *args) {
    unsigned int kind, ckind, dtype, opc, root;
    unsigned long version, seqno, length, inc;
    unsigned long long total, offset;
    PyObject *crc_obj;
    if (!PyArg_ParseTuple(args, "IIIIIkkKKkkO", &kind, &ckind, &dtype, &opc, &root, &version,
                          &seqno, &total, &offset, &length, &inc, &crc_obj))
        return NULL;
    uint32_t pcrc = 0;
    if (crc_obj != Py_None) {
        kind |= 0x80;
        pcrc = (uint32_t)PyLong_AsUnsignedLong(crc_obj);
        if (PyErr_Occurred()) return NULL;
    }
    uint8_t h[HEADER_SIZE];
    uint16_t magic = 0x3252, r16 = (uint16_t)root;
    uint32_t v = (uint32_t)version, s = (uint32_t)seqno, l = (uint32_t)length,
             i = (uint32_t)inc;
    memcpy(h, &magic, 2);
    h[2] = (uint8_t)kind;
    h[3] = (uint8_t)ckind;
    h[4] = (uint8_t)dtype;
    h[5] = (uint8_t)opc;
    memcpy(h + 6, &r16, 2);
    memcpy(h + 8, &v, 4);
    memcpy(h + 12, &s, 4);
    memcpy(h + 16, &total, 8);
    memcpy(h + 24, &offset, 8);
    memcpy(h + 32, &l, 4);
    memcpy(h + 36, &i, 4);
    memcpy(h + 40, &pcrc, 4);
    uint32_t c = crc32c_small(h, HEADER_SIZE - 4);
    memcpy(h + 44, &c, 4);
    return PyBytes_FromStringAndSize((const char *)h, HEADER_SIZE);
}

/* crc(data) -> int: the payload CRC32C exchange uses (tests) */
static PyObject *crc(PyObject *self, PyObject *arg) {
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_SIMPLE) < 0) return NULL;
    uint32_t c;
    int rc = payload_crc(b.buf, b.len, &c);
    PyBuffer_Release(&b);
    return rc < 0 ? NULL : PyLong_FromUnsignedLong(c);
}

static PyMethodDef methods[] = {
    {"exchange", exchange, METH_VARARGS, "write the frames, read the peer's (see module)"},
    {"reduce", reduce, METH_VARARGS, "out = op(mine, theirs) in rank order; mine[:] = out"},
    {"pack", pack, METH_VARARGS, "framing.pack_header in C"},
    {"crc", crc, METH_O, "CRC32C"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_fastpath", NULL, -1, methods};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    PyObject *pkg = PyImport_ImportModule("crc32c");
    if (pkg != NULL) {
        crc_fn = PyObject_GetAttrString(pkg, "crc32c");
        Py_DECREF(pkg);
    }
    PyErr_Clear();
    PyModule_AddIntConstant(m, "DONE", ST_DONE);
    PyModule_AddIntConstant(m, "AGAIN_FIRST", ST_AGAIN_FIRST);
    PyModule_AddIntConstant(m, "SPUN", ST_SPUN);
    PyModule_AddIntConstant(m, "EOF", ST_EOF);
    PyModule_AddIntConstant(m, "ERROR", ST_ERROR);
    PyModule_AddIntConstant(m, "BAD_HEADER", ST_BAD_HEADER);
    PyModule_AddIntConstant(m, "BAD_PAYLOAD", ST_BAD_PAYLOAD);
    PyModule_AddIntConstant(m, "SHORT_WRITE", ST_SHORT_WRITE);
    return m;
}
