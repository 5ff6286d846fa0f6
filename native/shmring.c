/*
 * The shm transport's ring (docs/DESIGN.md §5.2): a byte ring of records, each a 32-byte header
 * (u32 type, u32 flags, u64 a, u64 b, u64 length) and a payload padded to 8, addressed by
 * stream position modulo its size. ring_scan validates and copies out the records a peer
 * published; ring_put writes one. Twin: derecho_async/_hotpath_pure/shmring.py.
 */
#include "native.h"

#define RING_HEADER 32          /* u32 type, u32 flags, u64 a, u64 b, u64 length */
#define R_PUSH 1
#define R_MSG 2
#define U63 ((uint64_t)1 << 63)

static void
ring_copy(unsigned char *dst, const unsigned char *data, uint64_t cap, uint64_t pos, uint64_t n)
{
    uint64_t i = pos % cap;
    uint64_t first = n < cap - i ? n : cap - i;
    memcpy(dst, data + i, (size_t)first);
    if (n > first)
        memcpy(dst + first, data, (size_t)(n - first));
}

/* ring_scan(data, tail, head, budget) -> (records, tail, error) */
PyObject *
native_ring_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "ring_scan(data, tail, head, budget) takes 4 arguments");
        return NULL;
    }
    uint64_t tail, head, budget;
    if (arg_u64(args[1], "tail", &tail) < 0 || arg_u64(args[2], "head", &head) < 0 ||
        arg_u64(args[3], "budget", &budget) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *records = NULL, *error = NULL, *result = NULL;
    uint64_t cap = (uint64_t)view.len;
    if (cap == 0 || cap % WORD || head < tail || head - tail > cap || tail % WORD ||
        head % WORD) {
        PyErr_SetString(PyExc_ValueError, "published range does not fit the ring");
        goto done;
    }
    records = PyList_New(0);
    if (records == NULL)
        goto done;
    const unsigned char *data = (const unsigned char *)view.buf;
    uint64_t count = 0;
    while (tail != head && count < budget) {
        uint64_t avail = head - tail;
        if (avail < RING_HEADER) {
            error = PyUnicode_FromFormat("%llu bytes left, less than a record header",
                                         (unsigned long long)avail);
            break;
        }
        unsigned char hdr[RING_HEADER];
        ring_copy(hdr, data, cap, tail, RING_HEADER);
        uint32_t typ = get_u32(hdr);
        uint32_t flags = get_u32(hdr + 4);
        uint64_t a = get_u64(hdr + 8);
        uint64_t b = get_u64(hdr + 16);
        uint64_t length = get_u64(hdr + 24);
        if (flags) {
            error = PyUnicode_FromFormat("record flags 0x%x are not zero", (unsigned int)flags);
            break;
        }
        if (length > avail - RING_HEADER ||
            ((length + 7) & ~(uint64_t)7) > avail - RING_HEADER) {
            error = PyUnicode_FromFormat("record of %llu bytes overruns published data",
                                         (unsigned long long)length);
            break;
        }
        uint64_t size = RING_HEADER + ((length + 7) & ~(uint64_t)7);
        if (typ == R_PUSH) {
            if (a >= U63 || b >= U63) {
                error = PyUnicode_FromFormat("push view %llu / offset %llu out of range",
                                             (unsigned long long)a, (unsigned long long)b);
                break;
            }
        }
        else if (typ != R_MSG) {
            error = PyUnicode_FromFormat("unknown record type %u", (unsigned int)typ);
            break;
        }
        PyObject *payload = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)length);
        if (payload == NULL)
            goto fail;
        if (length)
            ring_copy((unsigned char *)PyBytes_AS_STRING(payload), data, cap,
                      tail + RING_HEADER, length);
        PyObject *rec = Py_BuildValue("(IKKN)", (unsigned int)typ, (unsigned long long)a,
                                      (unsigned long long)b, payload);
        if (rec == NULL)
            goto fail;
        int rc = PyList_Append(records, rec);
        Py_DECREF(rec);
        if (rc < 0)
            goto fail;
        tail += size;
        count++;
    }
    if (error == NULL && PyErr_Occurred())
        goto fail;
    if (error == NULL)
        error = Py_NewRef(Py_None);
    result = Py_BuildValue("(NKN)", records, (unsigned long long)tail, error);
    records = error = NULL;
    goto done;
fail:
    Py_XDECREF(records);
    Py_XDECREF(error);
done:
    PyBuffer_Release(&view);
    return result;
}

static void
ring_put_bytes(unsigned char *data, uint64_t cap, uint64_t pos, const unsigned char *src,
               uint64_t n)
{
    uint64_t i = pos % cap;
    uint64_t first = n < cap - i ? n : cap - i;
    memcpy(data + i, src, (size_t)first);
    if (n > first)
        memcpy(data, src + first, (size_t)(n - first));
}

/* ring_put(data, pos, typ, a, b, payload) -> size: write one record at stream position pos */
PyObject *
native_ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError,
                        "ring_put(data, pos, typ, a, b, payload) takes 6 arguments");
        return NULL;
    }
    uint64_t pos, typ, a, b;
    if (arg_u64(args[1], "pos", &pos) < 0 || arg_u64(args[2], "typ", &typ) < 0 ||
        arg_u64(args[3], "a", &a) < 0 || arg_u64(args[4], "b", &b) < 0)
        return NULL;
    if (typ > 0xFFFFFFFFu) {
        PyErr_SetString(PyExc_ValueError, "typ must be an int in [0, 2**32)");
        return NULL;
    }
    Py_buffer view, payload;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "buffer is not writable");
        }
        return NULL;
    }
    if (PyObject_GetBuffer(args[5], &payload, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&view);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t cap = (uint64_t)view.len;
    uint64_t length = (uint64_t)payload.len;
    uint64_t size = RING_HEADER + ((length + 7) & ~(uint64_t)7);
    if (cap == 0 || cap % WORD || pos % WORD) {
        PyErr_SetString(PyExc_ValueError, "ring size and position must be whole words");
    }
    else if (size > cap) {
        PyErr_Format(PyExc_ValueError, "a record of %llu bytes does not fit a ring of %llu",
                     (unsigned long long)size, (unsigned long long)cap);
    }
    else if (pos > UINT64_MAX - size) {
        PyErr_SetString(PyExc_ValueError, "the record would pass stream position 2**64");
    }
    else {
        unsigned char hdr[RING_HEADER];
        uint32_t t32 = (uint32_t)typ, zero = 0;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        t32 = __builtin_bswap32(t32);
#endif
        memcpy(hdr, &t32, 4);
        memcpy(hdr + 4, &zero, 4);
        put_u64(hdr + 8, a);
        put_u64(hdr + 16, b);
        put_u64(hdr + 24, length);
        unsigned char *data = (unsigned char *)view.buf;
        ring_put_bytes(data, cap, pos, hdr, RING_HEADER);
        if (length)
            ring_put_bytes(data, cap, pos + RING_HEADER, (const unsigned char *)payload.buf,
                           length);
        result = PyLong_FromUnsignedLongLong(size);
    }
    PyBuffer_Release(&payload);
    PyBuffer_Release(&view);
    return result;
}
