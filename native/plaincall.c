/*
 * The usual ordered call, msgpack [method, [args...], {}] with scalar args, in one pass each
 * way (docs/DESIGN.md §7.2, §8): decode_plain_call and encode_plain_call, and the decoding
 * steps dispatch.c shares (declared in native.h). Anything else gives None and the general
 * (msgpack) codec takes it. Twin: derecho_async/_hotpath_pure/plaincall.py.
 */
#include "native.h"

#define PLAIN_BYTES_MAX ((Py_ssize_t)1 << 20) /* codec.LARGE_BYTES */

/* ------------------------------------------------------------ decode_plain_call */

/* The usual ordered call, [method, [args...], {}], whose args are all nil, bool, int, float,
 * str or bin, is decoded here in one pass; anything else (another shape, a nested or ext value,
 * non-canonical envelope bytes, truncated or trailing bytes, invalid UTF-8) gives None, and the
 * general (msgpack) decoder takes it and says what is wrong. Every length is checked against
 * the bytes left before it is used. */

static inline uint64_t
be_uint(const unsigned char *p, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++)
        v = v << 8 | p[i];
    return v;
}

/* One scalar at *pp, as a new reference, *pp moved past it. NULL with no exception set: not a
 * scalar of a plain call (or cut short); NULL with an exception: out of memory. */
static PyObject *
plain_scalar(const unsigned char **pp, const unsigned char *end)
{
    const unsigned char *p = *pp;
    PyObject *v;
    uint64_t n;
    int w;
    if (p >= end)
        return NULL;
    unsigned char c = *p++;
    if (c <= 0x7f) {
        v = PyLong_FromLong((long)c);
        goto done;
    }
    if (c >= 0xe0) {
        v = PyLong_FromLong((long)(int8_t)c);
        goto done;
    }
    if ((c & 0xe0) == 0xa0) {
        n = c & 0x1f;
        goto str;
    }
    switch (c) {
    case 0xc0:
        Py_INCREF(Py_None);
        v = Py_None;
        goto done;
    case 0xc2:
        Py_INCREF(Py_False);
        v = Py_False;
        goto done;
    case 0xc3:
        Py_INCREF(Py_True);
        v = Py_True;
        goto done;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        w = 1 << (c - 0xcc);
        if (end - p < w)
            return NULL;
        v = PyLong_FromUnsignedLongLong(be_uint(p, w));
        p += w;
        goto done;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        w = 1 << (c - 0xd0);
        if (end - p < w)
            return NULL;
        int shift = 64 - 8 * w;
        int64_t s = (int64_t)(be_uint(p, w) << shift) >> shift;
        v = PyLong_FromLongLong(s);
        p += w;
        goto done;
    }
    case 0xca: {
        if (end - p < 4)
            return NULL;
        uint32_t u = (uint32_t)be_uint(p, 4);
        float f;
        memcpy(&f, &u, 4);
        v = PyFloat_FromDouble((double)f);
        p += 4;
        goto done;
    }
    case 0xcb: {
        if (end - p < 8)
            return NULL;
        uint64_t u = be_uint(p, 8);
        double d;
        memcpy(&d, &u, 8);
        v = PyFloat_FromDouble(d);
        p += 8;
        goto done;
    }
    case 0xd9: case 0xda: case 0xdb:
        w = 1 << (c - 0xd9);
        if (end - p < w)
            return NULL;
        n = be_uint(p, w);
        p += w;
        goto str;
    case 0xc4: case 0xc5: case 0xc6:
        w = 1 << (c - 0xc4);
        if (end - p < w)
            return NULL;
        n = be_uint(p, w);
        p += w;
        if ((uint64_t)(end - p) < n)
            return NULL;
        v = PyBytes_FromStringAndSize((const char *)p, (Py_ssize_t)n);
        p += n;
        goto done;
    default:
        return NULL;
    }
str:
    if ((uint64_t)(end - p) < n)
        return NULL;
    v = PyUnicode_DecodeUTF8((const char *)p, (Py_ssize_t)n, "strict");
    if (v == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
            PyErr_Clear();
        return NULL;
    }
    p += n;
done:
    if (v != NULL)
        *pp = p;
    return v;
}

/* The method of a plain call at *pp (a msgpack str header and its bytes): 1 with *m and *mlen
 * set to its bytes (not checked as UTF-8) and *pp moved past them; 0 if it is not a str or is
 * cut short. */
int
plain_method_span(const unsigned char **pp, const unsigned char *end, const unsigned char **m,
                  Py_ssize_t *mlen)
{
    const unsigned char *p = *pp;
    if (p >= end)
        return 0;
    unsigned char c = *p++;
    uint64_t n;
    if ((c & 0xe0) == 0xa0) {
        n = c & 0x1f;
    }
    else if (c == 0xd9 || c == 0xda || c == 0xdb) {
        int w = 1 << (c - 0xd9);
        if (end - p < w)
            return 0;
        n = be_uint(p, w);
        p += w;
    }
    else {
        return 0;
    }
    if ((uint64_t)(end - p) < n)
        return 0;
    *m = p;
    *mlen = (Py_ssize_t)n;
    *pp = p + n;
    return 1;
}

/* The rest of a plain call after its method: the args array of scalars, then an empty fixmap
 * and nothing after it. A new tuple; None (a new reference) when it is not that; NULL with an
 * exception: out of memory. */
PyObject *
plain_call_args(const unsigned char *p, const unsigned char *end)
{
    if (p >= end)
        Py_RETURN_NONE;
    unsigned char c = *p++;
    uint64_t n;
    if ((c & 0xf0) == 0x90) {
        n = c & 0x0f;
    }
    else if (c == 0xdc || c == 0xdd) {
        int w = c == 0xdc ? 2 : 4;
        if (end - p < w)
            Py_RETURN_NONE;
        n = be_uint(p, w);
        p += w;
    }
    else {
        Py_RETURN_NONE;
    }
    if (n > (uint64_t)(end - p))  /* every item takes at least one byte */
        Py_RETURN_NONE;
    PyObject *args = PyTuple_New((Py_ssize_t)n);
    if (args == NULL)
        return NULL;
    for (uint64_t i = 0; i < n; i++) {
        PyObject *v = plain_scalar(&p, end);
        if (v == NULL) {
            Py_DECREF(args);
            if (PyErr_Occurred())
                return NULL;
            Py_RETURN_NONE;
        }
        PyTuple_SET_ITEM(args, (Py_ssize_t)i, v);
    }
    if (end - p != 1 || *p != 0x80) {  /* an empty fixmap, and nothing after it */
        Py_DECREF(args);
        Py_RETURN_NONE;
    }
    return args;
}

/* A method's bytes as a str: a new reference; NULL with no exception when they are not valid
 * UTF-8; NULL with an exception: out of memory. */
PyObject *
method_str(const unsigned char *m, Py_ssize_t mlen)
{
    PyObject *v = PyUnicode_DecodeUTF8((const char *)m, mlen, "strict");
    if (v == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();
    return v;
}

/* decode_plain_call(data) -> (method, args, kwargs) | None */
PyObject *
native_decode_plain_call(PyObject *self, PyObject *data)
{
    if (!PyBytes_CheckExact(data))
        Py_RETURN_NONE;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    const unsigned char *end = p + PyBytes_GET_SIZE(data);
    const unsigned char *m;
    Py_ssize_t mlen;
    if (end - p < 4 || (*p != 0x93 && !drop_stamp(p, &end)))  /* fixarray of 3 (or stamped) */
        Py_RETURN_NONE;
    p++;
    if (!plain_method_span(&p, end, &m, &mlen))
        Py_RETURN_NONE;
    PyObject *method = method_str(m, mlen);
    if (method == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NONE;
    }
    PyObject *args = plain_call_args(p, end);
    if (args == NULL || args == Py_None) {
        Py_DECREF(method);
        return args;
    }
    PyObject *kwargs = PyDict_New();
    PyObject *result = kwargs == NULL ? NULL : PyTuple_Pack(3, method, args, kwargs);
    Py_DECREF(method);
    Py_DECREF(args);
    Py_XDECREF(kwargs);
    return result;
}

/* ------------------------------------------------------------- encode_plain_call */

/* encode_plain_call(method, args) -> bytes | None: msgpack [method, [args...], {}] exactly as
 * msgpack.Packer(use_bin_type=True) writes it, for a str method and a tuple of args that are all
 * None, bool, int (-2**63 .. 2**64-1), float, str or bytes of at most PLAIN_BYTES_MAX (exact
 * types); None for anything else (a subclass, another type, an int out of range, a str that is
 * not valid UTF-8, longer bytes), which the general encoder then takes (and reports). */

static inline unsigned char *
put_be(unsigned char *p, uint64_t v, int n)
{
    for (int i = n - 1; i >= 0; i--) {
        p[i] = (unsigned char)(v & 0xff);
        v >>= 8;
    }
    return p + n;
}

/* a str (kind 0) or bin (kind 1) length header for n bytes */
static unsigned char *
put_len(unsigned char *p, int kind, Py_ssize_t n)
{
    if (kind == 0 && n < 32) {
        *p++ = (unsigned char)(0xa0 | n);
        return p;
    }
    unsigned char base = kind == 0 ? 0xd9 : 0xc4;
    if (n < 0x100) {
        *p++ = base;
        return put_be(p, (uint64_t)n, 1);
    }
    if (n < 0x10000) {
        *p++ = base + 1;
        return put_be(p, (uint64_t)n, 2);
    }
    *p++ = base + 2;
    return put_be(p, (uint64_t)n, 4);
}

/* An int argument, classified: 0 signed (*s), 1 unsigned above 2**63 - 1 (*u), -1 not
 * encodable here (out of range; the error is cleared). */
static int
int_arg(PyObject *o, long long *s, unsigned long long *u)
{
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (v == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    if (overflow == 0) {
        *s = v;
        return 0;
    }
    if (overflow < 0)
        return -1;
    unsigned long long w = PyLong_AsUnsignedLongLong(o);
    if (w == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    *u = w;
    return 1;
}

static unsigned char *
put_int(unsigned char *p, long long v)
{
    if (v >= 0) {
        if (v < 0x80) {
            *p++ = (unsigned char)v;
            return p;
        }
        if (v < 0x100) {
            *p++ = 0xcc;
            return put_be(p, (uint64_t)v, 1);
        }
        if (v < 0x10000) {
            *p++ = 0xcd;
            return put_be(p, (uint64_t)v, 2);
        }
        if (v <= 0xffffffffLL) {
            *p++ = 0xce;
            return put_be(p, (uint64_t)v, 4);
        }
        *p++ = 0xcf;
        return put_be(p, (uint64_t)v, 8);
    }
    if (v >= -32) {
        *p++ = (unsigned char)(int8_t)v;
        return p;
    }
    if (v >= -128) {
        *p++ = 0xd0;
        return put_be(p, (uint64_t)v, 1);
    }
    if (v >= -32768) {
        *p++ = 0xd1;
        return put_be(p, (uint64_t)v, 2);
    }
    if (v >= -2147483648LL) {
        *p++ = 0xd2;
        return put_be(p, (uint64_t)v, 4);
    }
    *p++ = 0xd3;
    return put_be(p, (uint64_t)v, 8);
}

static unsigned char *
put_array_len(unsigned char *p, Py_ssize_t n)
{
    if (n < 16) {
        *p++ = (unsigned char)(0x90 | n);
        return p;
    }
    if (n < 0x10000) {
        *p++ = 0xdc;
        return put_be(p, (uint64_t)n, 2);
    }
    *p++ = 0xdd;
    return put_be(p, (uint64_t)n, 4);
}

PyObject *
native_encode_plain_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "encode_plain_call(method, args) takes 2 arguments");
        return NULL;
    }
    PyObject *method = args[0], *items = args[1];
    if (!PyUnicode_CheckExact(method) || !PyTuple_CheckExact(items))
        Py_RETURN_NONE;
    Py_ssize_t n = PyTuple_GET_SIZE(items);
    Py_ssize_t mlen;
    const char *m = PyUnicode_AsUTF8AndSize(method, &mlen);
    if (m == NULL) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    if (mlen > 0xffffffffLL || n > 0xffffffffLL)
        Py_RETURN_NONE;
    /* first pass: check every arg and add up the size (each header written to scratch by
     * the writer the second pass uses, so the two passes cannot disagree on a header) */
    unsigned char tmp[9];
    Py_ssize_t size = 1 + (put_len(tmp, 0, mlen) - tmp) + mlen + (put_array_len(tmp, n) - tmp) + 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(items, i);
        if (a == Py_None || a == Py_True || a == Py_False) {
            size += 1;
        }
        else if (PyLong_CheckExact(a)) {
            long long s;
            unsigned long long u;
            int k = int_arg(a, &s, &u);
            if (k < 0)
                Py_RETURN_NONE;
            size += k == 1 ? 9 : put_int(tmp, s) - tmp;
        }
        else if (PyFloat_CheckExact(a)) {
            size += 9;
        }
        else if (PyUnicode_CheckExact(a)) {
            Py_ssize_t len;
            if (PyUnicode_AsUTF8AndSize(a, &len) == NULL) {
                PyErr_Clear();
                Py_RETURN_NONE;
            }
            if (len > 0xffffffffLL)
                Py_RETURN_NONE;
            size += (put_len(tmp, 0, len) - tmp) + len;
        }
        else if (PyBytes_CheckExact(a)) {
            Py_ssize_t len = PyBytes_GET_SIZE(a);
            if (len > PLAIN_BYTES_MAX)  /* it may travel out of band: the codec decides */
                Py_RETURN_NONE;
            size += (put_len(tmp, 1, len) - tmp) + len;
        }
        else {
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, size);
    if (out == NULL)
        return NULL;
    unsigned char *p = (unsigned char *)PyBytes_AS_STRING(out);
    *p++ = 0x93;
    p = put_len(p, 0, mlen);
    memcpy(p, m, (size_t)mlen);
    p += mlen;
    p = put_array_len(p, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *a = PyTuple_GET_ITEM(items, i);
        if (a == Py_None) {
            *p++ = 0xc0;
        }
        else if (a == Py_True) {
            *p++ = 0xc3;
        }
        else if (a == Py_False) {
            *p++ = 0xc2;
        }
        else if (PyLong_CheckExact(a)) {
            long long s = 0;
            unsigned long long u = 0;
            if (int_arg(a, &s, &u) == 1) {
                *p++ = 0xcf;
                p = put_be(p, (uint64_t)u, 8);
            }
            else {
                p = put_int(p, s);
            }
        }
        else if (PyFloat_CheckExact(a)) {
            double d = PyFloat_AS_DOUBLE(a);
            uint64_t bits;
            memcpy(&bits, &d, 8);
            *p++ = 0xcb;
            p = put_be(p, bits, 8);
        }
        else if (PyUnicode_CheckExact(a)) {
            Py_ssize_t len;
            const char *sbuf = PyUnicode_AsUTF8AndSize(a, &len);  /* cached by the first pass */
            p = put_len(p, 0, len);
            memcpy(p, sbuf, (size_t)len);
            p += len;
        }
        else {
            Py_ssize_t len = PyBytes_GET_SIZE(a);
            p = put_len(p, 1, len);
            memcpy(p, PyBytes_AS_STRING(a), (size_t)len);
            p += len;
        }
    }
    *p++ = 0x80;
    if (p != (unsigned char *)PyBytes_AS_STRING(out) + size) {  /* the two passes disagree */
        Py_DECREF(out);
        PyErr_SetString(PyExc_SystemError, "encode_plain_call: size mismatch");
        return NULL;
    }
    return out;
}
