/*
 * Words of shared memory (docs/DESIGN.md §4.1, §8): load_u64 and store_u64 with acquire and
 * release ordering (load_word and store_word in native.h), a full fence, and min_u64, the
 * stability scan over the words of a table's rows. Twin: derecho_async/_hotpath_pure/words.py.
 */
#include "native.h"

/* ------------------------------------------------------------------------------ arguments */

/* offset argument: an int in [0, len - 8] */
static int
word_offset(PyObject *obj, Py_ssize_t len, Py_ssize_t *out)
{
    Py_ssize_t off = PyLong_AsSsize_t(obj);
    if (off == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_IndexError, "word offset out of range");
        }
        return -1;
    }
    if (off < 0 || len < WORD || off > len - WORD) {
        PyErr_Format(PyExc_IndexError, "word at offset %zd is outside a buffer of %zd bytes",
                     off, len);
        return -1;
    }
    *out = off;
    return 0;
}

/* declared in native.h: every file parses its u64 arguments with it */
int
arg_u64(PyObject *obj, const char *name, uint64_t *out)
{
    unsigned long long v = PyLong_AsUnsignedLongLong(obj);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError) ||
            PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "%s must be an int in [0, 2**64)", name);
        }
        return -1;
    }
    *out = v;
    return 0;
}

/* ------------------------------------------------------------------------------ words */

PyObject *
native_load_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "load_u64(buf, offset) takes 2 arguments");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t off;
    PyObject *result = NULL;
    if (word_offset(args[1], view.len, &off) == 0)
        result = PyLong_FromUnsignedLongLong(load_word((const unsigned char *)view.buf + off));
    PyBuffer_Release(&view);
    return result;
}

PyObject *
native_store_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "store_u64(buf, offset, value) takes 3 arguments");
        return NULL;
    }
    if (!PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "value must be an int");
        return NULL;
    }
    unsigned long long value = PyLong_AsUnsignedLongLong(args[2]);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_SetString(PyExc_OverflowError, "value outside [0, 2**64)");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        if (PyErr_ExceptionMatches(PyExc_BufferError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "buffer is not writable");
        }
        return NULL;
    }
    Py_ssize_t off;
    int rc = word_offset(args[1], view.len, &off);
    if (rc == 0)
        store_word((unsigned char *)view.buf + off, (uint64_t)value);
    PyBuffer_Release(&view);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *
native_fence(PyObject *self, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

PyObject *
native_min_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "min_u64(buf, offsets, start) takes 3 arguments");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[1], "offsets must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject *result = NULL;
    uint64_t best;
    if (arg_u64(args[2], "start", &best) < 0)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t off;
        if (word_offset(items[i], view.len, &off) < 0)
            goto done;
        uint64_t v = load_word((const unsigned char *)view.buf + off);
        if (v < best)
            best = v;
    }
    result = PyLong_FromUnsignedLongLong(best);
done:
    PyBuffer_Release(&view);
    Py_DECREF(seq);
    return result;
}
