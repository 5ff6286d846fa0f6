/*
 * The ordering maths over per-sender turn counts (docs/DESIGN.md §4.2): frontier, the lowest
 * seq not yet held (seq = turn * n + sender index), and turns_needed, the turns an idle sender
 * covers with a null. Twin: derecho_async/_hotpath_pure/ordering.py.
 */
#include "native.h"

/* held/seen values as u64; a value that does not fit raises OverflowError */
static int
u64_items(PyObject *arg, const char *what, PyObject **seq_out, uint64_t **vals_out,
          Py_ssize_t *n_out)
{
    PyObject *seq = PySequence_Fast(arg, what);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    uint64_t *vals = PyMem_Malloc(sizeof(uint64_t) * (size_t)(n ? n : 1));
    if (vals == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_Check(items[i])) {
            PyErr_Format(PyExc_TypeError, "%s", what);
            goto fail;
        }
        unsigned long long v = PyLong_AsUnsignedLongLong(items[i]);
        if (v == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            PyErr_SetString(PyExc_OverflowError, "turn counts must lie in [0, 2**56]");
            goto fail;
        }
        if (v > MAX_TURN) {
            PyErr_SetString(PyExc_OverflowError, "turn counts must lie in [0, 2**56]");
            goto fail;
        }
        vals[i] = v;
    }
    *seq_out = seq;
    *vals_out = vals;
    *n_out = n;
    return 0;
fail:
    PyMem_Free(vals);
    Py_DECREF(seq);
    return -1;
}

PyObject *
native_frontier(PyObject *self, PyObject *held)
{
    PyObject *seq;
    uint64_t *vals;
    Py_ssize_t n;
    if (u64_items(held, "held must be a sequence of ints", &seq, &vals, &n) < 0)
        return NULL;
    PyObject *result = NULL;
    if (n == 0) {
        PyErr_SetString(PyExc_ValueError, "frontier of no senders");
    }
    else if (n > 64) {
        PyErr_SetString(PyExc_ValueError, "at most 64 senders");
    }
    else {
        /* held <= 2**56 and n <= 64: h * n + k < 2**63, no overflow */
        uint64_t best = UINT64_MAX;
        for (Py_ssize_t k = 0; k < n; k++) {
            uint64_t s = vals[k] * (uint64_t)n + (uint64_t)k;
            if (s < best)
                best = s;
        }
        result = PyLong_FromUnsignedLongLong(best);
    }
    PyMem_Free(vals);
    Py_DECREF(seq);
    return result;
}

PyObject *
native_turns_needed(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "turns_needed(my_index, seen) takes 2 arguments");
        return NULL;
    }
    Py_ssize_t me = PyLong_AsSsize_t(args[0]);
    if (me == -1 && PyErr_Occurred())
        return NULL;
    PyObject *seq;
    uint64_t *vals;
    Py_ssize_t n;
    if (u64_items(args[1], "seen must be a sequence of ints", &seq, &vals, &n) < 0)
        return NULL;
    uint64_t need = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        /* the most turns seen from another sender: idle, I cover their latest round whole */
        if (j != me && vals[j] > need)
            need = vals[j];
    }
    PyMem_Free(vals);
    Py_DECREF(seq);
    return PyLong_FromUnsignedLongLong(need);
}
