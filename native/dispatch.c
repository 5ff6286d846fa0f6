/*
 * dispatch_calls, the group's loop over a run of delivered calls (docs/DESIGN.md §7.3, §8.3):
 * it runs the usual ordered calls on idle runners, completes this member's one-way calls and
 * batches the replies that need no more than a nil, and hands every other outcome to the
 * caller's finish. The shapes it reads are those hotpath.py documents (a Delivered 7-tuple,
 * a hosted 4-tuple). Twin: derecho_async/_hotpath_pure/dispatch.py.
 */
#include "native.h"

/* dispatch_calls(events, start, me, hosted, casts, outbox, nil, finish) -> int: run the usual
 * ordered calls of a run of Delivered events from events[start] on, in order, as the group's
 * general path would (the pure twin states the whole contract). It stops at the first event it
 * does not take, before any effect of that event, and returns its index (len(events) when it
 * took them all): the caller runs that one its general way and calls again after it. */

/* The exception being raised, as a value with its traceback (what `except BaseException as
 * exc` binds): whatever a handler raises, cancellation and SystemExit included, is that call's
 * outcome, never a loop cut short. */
static PyObject *
caught_exception(void)
{
    if (!PyErr_ExceptionMatches(PyExc_BaseException))
        return NULL;
#if PY_VERSION_HEX >= 0x030C0000
    return PyErr_GetRaisedException();
#else
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
#endif
}

/* finish(ev, one_way, ok, value): the caller's path for the uncommon outcomes. */
static int
call_finish(PyObject *finish, PyObject *ev, int one_way, int ok, PyObject *value)
{
    PyObject *r = PyObject_CallFunctionObjArgs(finish, ev, one_way ? Py_True : Py_False,
                                               ok ? Py_True : Py_False, value, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The own one-way call's future: popped from casts and given (view_id, seq) unless done. */
static int
complete_cast(native_state *st, PyObject *casts, PyObject *msg_no, PyObject *cast,
              PyObject *ev)
{
    Py_INCREF(cast);
    int rc = -1;
    PyObject *done = NULL, *version = NULL, *r = NULL;
    if (PyDict_DelItem(casts, msg_no) < 0)
        goto out;
    done = PyObject_CallMethodNoArgs(cast, st->str_done);
    if (done == NULL)
        goto out;
    int is_done = PyObject_IsTrue(done);
    if (is_done < 0)
        goto out;
    if (!is_done) {
        version = PyTuple_Pack(2, PyTuple_GET_ITEM(ev, 2), PyTuple_GET_ITEM(ev, 3));
        if (version == NULL)
            goto out;
        r = PyObject_CallMethodOneArg(cast, st->str_set_result, version);
        if (r == NULL)
            goto out;
    }
    rc = 0;
out:
    Py_XDECREF(r);
    Py_XDECREF(version);
    Py_XDECREF(done);
    Py_DECREF(cast);
    return rc;
}

/* outbox[sender] += [msg_no, True, nil] */
static int
batch_reply(PyObject *outbox, PyObject *sender, PyObject *msg_no, PyObject *nil)
{
    PyObject *out = PyDict_GetItemWithError(outbox, sender);
    if (out == NULL) {
        if (PyErr_Occurred())
            return -1;
        out = PyList_New(0);
        if (out == NULL)
            return -1;
        int rc = PyDict_SetItem(outbox, sender, out);
        Py_DECREF(out);  /* the dict holds it */
        if (rc < 0)
            return -1;
    }
    if (!PyList_Check(out)) {
        PyErr_SetString(PyExc_TypeError, "dispatch_calls: an outbox entry is not a list");
        return -1;
    }
    if (PyList_Append(out, msg_no) < 0 || PyList_Append(out, Py_True) < 0 ||
        PyList_Append(out, nil) < 0)
        return -1;
    return 0;
}

PyObject *
native_dispatch_calls(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "dispatch_calls(events, start, me, hosted, casts, outbox, nil, finish) "
                        "takes 8 arguments");
        return NULL;
    }
    native_state *st = get_state(self);
    PyObject *events = args[0], *hosted = args[3], *casts = args[4], *outbox = args[5];
    PyObject *nil = args[6], *finish = args[7];
    if (!PyList_Check(events) || !PyDict_Check(hosted) || !PyDict_Check(casts) ||
        (outbox != Py_None && !PyDict_Check(outbox))) {
        PyErr_SetString(PyExc_TypeError,
                        "dispatch_calls: events must be a list, hosted and casts dicts, "
                        "outbox a dict or None");
        return NULL;
    }
    if (!PyLong_Check(args[1]) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "dispatch_calls: start and me must be ints");
        return NULL;
    }
    int over_start, over_me;
    long long first = PyLong_AsLongLongAndOverflow(args[1], &over_start);
    long long me = PyLong_AsLongLongAndOverflow(args[2], &over_me);
    if (PyErr_Occurred())
        return NULL;
    if (over_start || over_me) {
        PyErr_SetString(PyExc_OverflowError, "dispatch_calls: start or me is not an int64");
        return NULL;
    }
    if (first < 0) {
        PyErr_SetString(PyExc_ValueError, "dispatch_calls: start must be at least 0");
        return NULL;
    }
    Py_ssize_t i = first > PY_SSIZE_T_MAX ? PY_SSIZE_T_MAX : (Py_ssize_t)first;
    /* The last method name decoded and its bytes: the next call of the same method (the
     * usual run) reuses the str instead of decoding it again. */
    PyObject *last_method = NULL;
    unsigned char last_bytes[64];
    Py_ssize_t last_len = -1;
    PyObject *idle_runner = NULL;  /* the runner last found idle, until a finish call */
    for (; i < PyList_GET_SIZE(events); i++) {
        PyObject *ev = PyList_GET_ITEM(events, i);
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 7)
            break;
        PyObject *subgroup = PyTuple_GET_ITEM(ev, 0), *sender = PyTuple_GET_ITEM(ev, 4);
        PyObject *msg_no = PyTuple_GET_ITEM(ev, 5), *payload = PyTuple_GET_ITEM(ev, 6);
        if (!PyLong_CheckExact(sender) || !PyUnicode_CheckExact(subgroup))
            break;
        int overflow;
        long long s = PyLong_AsLongLongAndOverflow(sender, &overflow);
        if (s == -1 && PyErr_Occurred())
            goto error;
        if (overflow)
            break;
        int own = s == me;
        PyObject *entry = PyDict_GetItemWithError(hosted, subgroup);
        if (entry == NULL) {
            if (PyErr_Occurred())
                goto error;
            if (own)
                break;
            continue;  /* a subgroup this member does not host */
        }
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 4 ||
            !PyDict_Check(PyTuple_GET_ITEM(entry, 3)))
            break;
        PyObject *runner = PyTuple_GET_ITEM(entry, 1), *methods = PyTuple_GET_ITEM(entry, 3);
        PyObject *cast = NULL;
        if (own) {  /* a one-way call of mine: its future completes here */
            cast = PyDict_GetItemWithError(casts, msg_no);
            if (cast == NULL && PyErr_Occurred())
                goto error;
        }
        if (!PyBytes_CheckExact(payload))
            break;
        /* decode_plain_call's pass, without building what is not used */
        const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(payload);
        const unsigned char *end = p + PyBytes_GET_SIZE(payload), *m;
        Py_ssize_t mlen;
        if (end - p < 4 || (*p != 0x93 && !drop_stamp(p, &end)) ||
            (p++, !plain_method_span(&p, end, &m, &mlen)))
            break;
        if (last_method == NULL || mlen != last_len || memcmp(m, last_bytes, (size_t)mlen)) {
            PyObject *method = method_str(m, mlen);
            if (method == NULL) {
                if (PyErr_Occurred())
                    goto error;
                break;
            }
            Py_XSETREF(last_method, method);
            last_len = mlen <= (Py_ssize_t)sizeof(last_bytes) ? mlen : -1;
            if (last_len >= 0)
                memcpy(last_bytes, m, (size_t)mlen);
        }
        PyObject *call_args = plain_call_args(p, end);
        if (call_args == NULL)
            goto error;
        if (call_args == Py_None) {
            Py_DECREF(call_args);
            break;
        }
        PyObject *fe = PyDict_GetItemWithError(methods, last_method);
        if (fe == NULL || !PyTuple_Check(fe) || PyTuple_GET_SIZE(fe) != 2 ||
            (PyTuple_GET_ITEM(fe, 1) != Py_True && PyTuple_GET_ITEM(fe, 1) != Py_False)) {
            Py_DECREF(call_args);
            if (PyErr_Occurred())
                goto error;
            break;
        }
        int one_way = PyTuple_GET_ITEM(fe, 1) == Py_True;
        /* mine: a one-way call with its future, or a call awaiting replies without one;
         * another's call awaiting replies: only while replies may be batched */
        if (own ? one_way != (cast != NULL) : !one_way && outbox == Py_None) {
            Py_DECREF(call_args);
            break;
        }
        PyObject *fn = PyTuple_GET_ITEM(fe, 0);
        Py_INCREF(fn);
        if (runner != idle_runner) {  /* asked once until a finish (nothing else changes it) */
            PyObject *idle = PyObject_CallMethodNoArgs(runner, st->str_idle);
            if (idle == NULL || idle != Py_True) {
                Py_XDECREF(idle);
                Py_DECREF(fn);
                Py_DECREF(call_args);
                if (PyErr_Occurred())
                    goto error;
                break;  /* a busy runner queues the call: the general path */
            }
            Py_DECREF(idle);
            Py_INCREF(runner);
            Py_XSETREF(idle_runner, runner);
            if (cast != NULL) {  /* found again: idle() ran Python code, keep no stale pointer */
                cast = PyDict_GetItemWithError(casts, msg_no);
                if (cast == NULL) {
                    Py_DECREF(fn);
                    Py_DECREF(call_args);
                    if (PyErr_Occurred())
                        goto error;
                    break;
                }
            }
        }
        /* Taken: from here on its effects happen, in the general path's order. */
        Py_INCREF(ev);
        Py_INCREF(sender);
        Py_INCREF(msg_no);
        PyObject *result = NULL;
        int rc = -1;
        if (cast != NULL && complete_cast(st, casts, msg_no, cast, ev) < 0)
            goto failed;
        result = PyObject_Vectorcall(fn, PySequence_Fast_ITEMS(call_args),
                                     (size_t)PyTuple_GET_SIZE(call_args), NULL);
        if (result == NULL) {
            PyObject *exc = caught_exception();
            if (exc == NULL)
                goto failed;
            Py_CLEAR(idle_runner);  /* finish may step a coroutine: ask the runner again */
            rc = call_finish(finish, ev, one_way, 0, exc);
            Py_DECREF(exc);
        }
        else if (one_way && !PyCoro_CheckExact(result))
            rc = 0;
        else if (!one_way && result == Py_None && !own)
            rc = batch_reply(outbox, sender, msg_no, nil);
        else {
            Py_CLEAR(idle_runner);
            rc = call_finish(finish, ev, one_way, 1, result);
        }
    failed:
        Py_XDECREF(result);
        Py_DECREF(msg_no);
        Py_DECREF(sender);
        Py_DECREF(ev);
        Py_DECREF(fn);
        Py_DECREF(call_args);
        if (rc < 0)
            goto error;
    }
    Py_XDECREF(last_method);
    Py_XDECREF(idle_runner);
    return PyLong_FromSsize_t(i);
error:
    Py_XDECREF(last_method);
    Py_XDECREF(idle_runner);
    return NULL;
}
