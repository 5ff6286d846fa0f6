/*
 * bytes_copy: a new bytes object of a buffer's bytes, copied with the GIL released when it is
 * large, so a worker thread may copy a large received message while the event loop goes on
 * (docs/DESIGN.md §8.1). Twin: derecho_async/_hotpath_pure/bytescopy.py.
 */
#include "native.h"

/* Copies of at least this many bytes run with the GIL released. */
#define BYTES_COPY_NOGIL ((Py_ssize_t)1 << 16)

PyObject *
native_bytes_copy(PyObject *self, PyObject *obj)
{
    Py_buffer view;
    if (!PyObject_CheckBuffer(obj)) {
        PyErr_Format(PyExc_TypeError, "bytes_copy: a bytes-like object is required, not '%.200s'",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    if (PyObject_GetBuffer(obj, &view, PyBUF_FULL_RO) < 0)
        return NULL;
    PyObject *out = PyBytes_FromStringAndSize(NULL, view.len);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(out);
    if (PyBuffer_IsContiguous(&view, 'C')) {
        /* The held Py_buffer keeps the source alive and unresized while the GIL is released;
           the page faults of the fresh destination happen here too, off the GIL. */
        if (view.len >= BYTES_COPY_NOGIL) {
            Py_BEGIN_ALLOW_THREADS
            memcpy(dst, view.buf, (size_t)view.len);
            Py_END_ALLOW_THREADS
        }
        else if (view.len > 0) {
            memcpy(dst, view.buf, (size_t)view.len);
        }
    }
    else if (PyBuffer_ToContiguous(dst, &view, view.len, 'C') < 0) {
        Py_DECREF(out);
        PyBuffer_Release(&view);
        return NULL;
    }
    PyBuffer_Release(&view);
    return out;
}
