/*
 * The SST slot ring (docs/DESIGN.md §4.1, §4.2): each sender's ring of window slots in its row,
 * one record per slot (a message, a batch of messages, a descriptor or a null of some turns).
 * scan_slots validates and copies out a peer's new records, write_messages writes this member's
 * queued inline messages into records, and deliver_messages runs the delivery loop over the
 * scanned records in seq order. Twin: derecho_async/_hotpath_pure/slotring.py.
 */
#include "native.h"

/* ------------------------------------------------------------------------ slot scan */

/* The message records of a batch record (entries of consecutive turns from ``turn``) appended
 * to ``records``: 0 with *error NULL when valid, 0 with *error set (nothing appended) when not,
 * -1 on a Python error. Checked whole before anything is made, as the pure twin does. */
static int
batch_entries(PyObject *records, const unsigned char *slot, uint64_t slot_bytes, uint64_t turn,
              uint64_t n_turns, uint64_t nbytes, uint64_t max_payload, PyObject **error)
{
    if (n_turns < 2 || n_turns > (slot_bytes - SLOT_HEADER) / BATCH_ENTRY ||
        nbytes > slot_bytes - SLOT_HEADER || nbytes % WORD) {
        *error = PyUnicode_FromFormat("bad batch record (%llu messages, %llu B)",
                                      (unsigned long long)n_turns, (unsigned long long)nbytes);
        return *error == NULL ? -1 : 0;
    }
    const unsigned char *body = slot + SLOT_HEADER;
    uint64_t pos = 0;
    for (uint64_t i = 0; i < n_turns; i++) {
        if (pos + BATCH_ENTRY > nbytes) {
            *error = PyUnicode_FromFormat("batch entry %llu lies past the record's %llu B",
                                          (unsigned long long)i, (unsigned long long)nbytes);
            return *error == NULL ? -1 : 0;
        }
        uint64_t size = get_u64(body + pos);
        if (size > max_payload || size > nbytes - pos - BATCH_ENTRY) {
            *error = PyUnicode_FromFormat("batch entry %llu of %llu B does not fit",
                                          (unsigned long long)i, (unsigned long long)size);
            return *error == NULL ? -1 : 0;
        }
        pos += BATCH_ENTRY + (size + WORD - 1) / WORD * WORD;
    }
    if (pos != nbytes) {
        *error = PyUnicode_FromFormat("batch record of %llu B holds %llu B of entries",
                                      (unsigned long long)nbytes, (unsigned long long)pos);
        return *error == NULL ? -1 : 0;
    }
    pos = 0;
    for (uint64_t i = 0; i < n_turns; i++) {
        uint64_t size = get_u64(body + pos);
        uint64_t msg_no = get_u64(body + pos + 8);
        PyObject *payload = PyBytes_FromStringAndSize((const char *)body + pos + BATCH_ENTRY,
                                                      (Py_ssize_t)size);
        if (payload == NULL)
            return -1;
        PyObject *rec = Py_BuildValue("(KKKKKN)", (unsigned long long)(turn + i),
                                      (unsigned long long)KIND_MESSAGE, 1ULL,
                                      (unsigned long long)size, (unsigned long long)msg_no,
                                      payload);
        if (rec == NULL)
            return -1;
        int rc = PyList_Append(records, rec);
        Py_DECREF(rec);
        if (rc < 0)
            return -1;
        pos += BATCH_ENTRY + (size + WORD - 1) / WORD * WORD;
    }
    return 0;
}

/* scan_slots(buf, base, window, slot_bytes, lo, hi, turn, max_payload)
 *   -> (records, turn, slots, error) */
/* A slot ring of window slots of slot_bytes at base lies in len bytes; else ValueError, 0. */
static int
ring_fits(uint64_t len, uint64_t base, uint64_t window, uint64_t slot_bytes)
{
    if (window < 1 || slot_bytes < SLOT_HEADER || slot_bytes % WORD || base % WORD ||
        window > len / slot_bytes || base > len - window * slot_bytes) {
        PyErr_SetString(PyExc_ValueError, "slot ring does not fit the buffer");
        return 0;
    }
    return 1;
}

PyObject *
native_scan_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "scan_slots(buf, base, window, slot_bytes, lo, hi, turn, max_payload) "
                        "takes 8 arguments");
        return NULL;
    }
    uint64_t base, window, slot_bytes, lo, hi, turn, max_payload;
    if (arg_u64(args[1], "base", &base) < 0 || arg_u64(args[2], "window", &window) < 0 ||
        arg_u64(args[3], "slot_bytes", &slot_bytes) < 0 || arg_u64(args[4], "lo", &lo) < 0 ||
        arg_u64(args[5], "hi", &hi) < 0 || arg_u64(args[6], "turn", &turn) < 0 ||
        arg_u64(args[7], "max_payload", &max_payload) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *records = NULL, *error = NULL, *result = NULL;
    uint64_t len = (uint64_t)view.len;
    if (!ring_fits(len, base, window, slot_bytes))
        goto done;
    if (hi < lo || hi - lo > window) {
        PyErr_SetString(PyExc_ValueError, "records to scan must be 0..window");
        goto done;
    }
    if (turn > MAX_TURN) {
        PyErr_SetString(PyExc_ValueError, "turn must lie in [0, 2**56]");
        goto done;
    }
    records = PyList_New(0);
    if (records == NULL)
        goto done;
    const unsigned char *buf = (const unsigned char *)view.buf;
    uint64_t rec_no;
    for (rec_no = lo; rec_no < hi; rec_no++) {
        const unsigned char *slot = buf + base + (rec_no % window) * slot_bytes;
        uint64_t first = get_u64(slot);
        uint64_t kind_turns = get_u64(slot + 8);
        uint64_t nbytes = get_u64(slot + 16);
        uint64_t msg_no = get_u64(slot + 24);
        uint64_t kind = kind_turns & 0xFF;
        uint64_t n_turns = kind_turns >> 8;
        PyObject *payload = NULL;
        if (first != turn) {
            error = PyUnicode_FromFormat("record %llu starts at turn %llu, expected %llu",
                                         (unsigned long long)rec_no, (unsigned long long)first,
                                         (unsigned long long)turn);
            break;
        }
        if (kind == KIND_MESSAGE) {
            if (n_turns != 1 || nbytes > max_payload || nbytes > slot_bytes - SLOT_HEADER) {
                error = PyUnicode_FromFormat("bad message record (%llu turns, %llu B)",
                                             (unsigned long long)n_turns,
                                             (unsigned long long)nbytes);
                break;
            }
            payload = PyBytes_FromStringAndSize((const char *)slot + SLOT_HEADER,
                                                (Py_ssize_t)nbytes);
            if (payload == NULL)
                goto fail;
        }
        else if (kind == KIND_DESCRIPTOR) {
            if (n_turns != 1) {
                error = PyUnicode_FromString("descriptor record must cover one turn");
                break;
            }
        }
        else if (kind == KIND_NULL) {
            if (n_turns < 1 || n_turns > MAX_NULL_TURNS) {
                error = PyUnicode_FromFormat("null record of %llu turns",
                                             (unsigned long long)n_turns);
                break;
            }
        }
        else if (kind == KIND_BATCH) {
            if (n_turns > MAX_TURN - turn) {
                error = PyUnicode_FromString("turn count passed 2**56");
                break;
            }
            if (batch_entries(records, slot, slot_bytes, turn, n_turns, nbytes, max_payload,
                              &error) < 0)
                goto fail;
            if (error != NULL)
                break;
            turn += n_turns;
            continue;
        }
        else {
            error = PyUnicode_FromFormat("unknown record kind %llu", (unsigned long long)kind);
            break;
        }
        if (n_turns > MAX_TURN - turn) {
            Py_XDECREF(payload);
            error = PyUnicode_FromString("turn count passed 2**56");
            break;
        }
        PyObject *rec = Py_BuildValue("(KKKKKN)", (unsigned long long)first,
                                      (unsigned long long)kind, (unsigned long long)n_turns,
                                      (unsigned long long)nbytes, (unsigned long long)msg_no,
                                      payload ? payload : Py_NewRef(Py_None));
        if (rec == NULL)
            goto fail;
        int rc = PyList_Append(records, rec);
        Py_DECREF(rec);
        if (rc < 0)
            goto fail;
        turn += n_turns;
    }
    if (error == NULL && PyErr_Occurred())
        goto fail;
    if (error == NULL)
        error = Py_NewRef(Py_None);
    result = Py_BuildValue("(NKKN)", records, (unsigned long long)turn,
                           (unsigned long long)(rec_no - lo), error);
    records = error = NULL;
    goto done;
fail:
    Py_XDECREF(records);
    Py_XDECREF(error);
    records = error = NULL;
done:
    PyBuffer_Release(&view);
    return result;
}

/* ----------------------------------------------------------------- write_messages */
/* write_messages(buf, base, window, slot_bytes, rec_no, turn, queue, free, limit, pending, own,
 * inflight, n, k) -> (records, messages, turn): the inverse of scan_slots, for the inline
 * messages at the head of the deque queue (see the pure twin for the whole contract). Each
 * record takes the next inline message and those after it that fit the same slot (a batch
 * record; a lone one is a message record). Stops after free records or limit messages, at an
 * empty queue or a large message. */

typedef struct {
    PyObject *out;      /* the Outgoing (a new reference) */
    PyObject *nbytes;   /* its fields (new references) */
    PyObject *msg_no;
    PyObject *payload;
    uint64_t size, no;
} inline_msg;

static void
inline_clear(inline_msg *m)
{
    Py_CLEAR(m->out);
    Py_CLEAR(m->nbytes);
    Py_CLEAR(m->msg_no);
    Py_CLEAR(m->payload);
}

/* The queue's head as an inline message to write at turn: 1 (m filled), 0 (empty queue or a
 * large message), -1 (error: it cannot be written). */
static int
peek_inline(native_state *st, PyObject *queue, uint64_t room, uint64_t turn, inline_msg *m)
{
    *m = (inline_msg){0};
    Py_ssize_t qlen = PyObject_Length(queue);
    if (qlen <= 0)
        return qlen < 0 ? -1 : 0;
    m->out = PySequence_GetItem(queue, 0);
    if (m->out == NULL)
        return -1;
    PyObject *large = PyObject_GetAttr(m->out, st->str_large);
    if (large == NULL)
        goto fail;
    int is_large = PyObject_IsTrue(large);
    Py_DECREF(large);
    if (is_large != 0) {
        Py_CLEAR(m->out);
        return is_large < 0 ? -1 : 0;
    }
    m->nbytes = PyObject_GetAttr(m->out, st->str_nbytes);
    if (m->nbytes == NULL)
        goto fail;
    m->msg_no = PyObject_GetAttr(m->out, st->str_msg_no);
    if (m->msg_no == NULL)
        goto fail;
    m->payload = PyObject_GetAttr(m->out, st->str_payload);
    if (m->payload == NULL)
        goto fail;
    if (!PyBytes_CheckExact(m->payload) || !PyLong_CheckExact(m->nbytes) ||
        !PyLong_CheckExact(m->msg_no)) {
        PyErr_SetString(PyExc_TypeError,
                        "write_messages: an inline message needs int nbytes and msg_no and a "
                        "bytes payload");
        goto fail;
    }
    Py_ssize_t plen = PyBytes_GET_SIZE(m->payload);
    long long size = PyLong_AsLongLong(m->nbytes);
    if (size == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            goto fail;
        PyErr_Clear();
        size = -1;  /* refused below */
    }
    unsigned long long no = PyLong_AsUnsignedLongLong(m->msg_no);
    int no_bad = 0;
    if (no == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            goto fail;
        PyErr_Clear();
        no_bad = 1;
    }
    if (size != (long long)plen || (uint64_t)plen > room || no_bad) {
        PyErr_Format(PyExc_ValueError,
                     "write_messages: an inline message of %zd B (nbytes %S) does not fit a "
                     "slot", plen, m->nbytes);
        goto fail;
    }
    if (turn >= MAX_TURN) {
        PyErr_SetString(PyExc_ValueError, "write_messages: turn count passed 2**56");
        goto fail;
    }
    m->size = (uint64_t)plen;
    m->no = (uint64_t)no;
    return 1;
fail:
    inline_clear(m);
    return -1;
}

/* After a failed peek: 1 if the error is an Exception and was cleared (the message stays
 * queued, and the call ends with what it wrote), 0 if it must propagate. */
static int
stop_at_bad_message(void)
{
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return 0;
    PyErr_Clear();
    return 1;
}

static inline uint64_t
padded(uint64_t n)
{
    return (n + WORD - 1) / WORD * WORD;
}

static int
append_new(native_state *st, PyObject *seq, PyObject *item)  /* steals item */
{
    if (item == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodOneArg(seq, st->str_append, item);
    Py_DECREF(item);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static int
pop_head(native_state *st, PyObject *queue)
{
    PyObject *o = PyObject_CallMethodNoArgs(queue, st->str_popleft);
    if (o == NULL)
        return -1;
    Py_DECREF(o);
    return 0;
}

PyObject *
native_write_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError,
                        "write_messages(buf, base, window, slot_bytes, rec_no, turn, queue, "
                        "free, limit, pending, own, inflight, n, k) takes 14 arguments");
        return NULL;
    }
    native_state *st = get_state(self);
    uint64_t base, window, slot_bytes, rec_no, turn, free, limit, n, k;
    if (arg_u64(args[1], "base", &base) < 0 || arg_u64(args[2], "window", &window) < 0 ||
        arg_u64(args[3], "slot_bytes", &slot_bytes) < 0 ||
        arg_u64(args[4], "rec_no", &rec_no) < 0 || arg_u64(args[5], "turn", &turn) < 0 ||
        arg_u64(args[7], "free", &free) < 0 || arg_u64(args[8], "limit", &limit) < 0 ||
        arg_u64(args[12], "n", &n) < 0 || arg_u64(args[13], "k", &k) < 0)
        return NULL;
    PyObject *queue = args[6], *pending = args[9], *own = args[10], *inflight = args[11];
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL;
    inline_msg local[16];
    inline_msg *group = local;
    Py_ssize_t cap = 16, g = 0;
    uint64_t len = (uint64_t)view.len;
    if (view.readonly) {
        PyErr_SetString(PyExc_TypeError, "write_messages: buf must be writable");
        goto done;
    }
    if (!ring_fits(len, base, window, slot_bytes))
        goto done;
    if (n < 1 || n > 256 || k >= n || free > window || turn > MAX_TURN) {
        PyErr_SetString(PyExc_ValueError,
                        "write_messages: n must lie in 1..256, k below n, free at most window "
                        "and turn at most 2**56");
        goto done;
    }
    uint64_t room = slot_bytes - SLOT_HEADER;
    unsigned char *buf = (unsigned char *)view.buf;
    uint64_t records = 0, written = 0;
    while (records < free && written < limit) {
        int got = peek_inline(st, queue, room, turn, &group[0]);
        if (got < 0) {
            if (records > 0 && stop_at_bad_message())
                break;  /* returned: the next call raises it, with nothing written */
            goto done;
        }
        if (got == 0)
            break;
        g = 1;
        if (pop_head(st, queue) < 0)
            goto done;
        uint64_t need0 = BATCH_ENTRY + padded(group[0].size);
        uint64_t left = need0 <= room ? room - need0 : 0;  /* 0: nothing more fits */
        while (written + (uint64_t)g < limit) {
            inline_msg nxt;
            got = peek_inline(st, queue, room, turn + (uint64_t)g, &nxt);
            if (got < 0) {
                if (stop_at_bad_message())
                    break;  /* left queued: the next record stops at it */
                goto done;
            }
            if (got == 0)
                break;
            if (BATCH_ENTRY + padded(nxt.size) > left) {
                inline_clear(&nxt);
                break;
            }
            if (pop_head(st, queue) < 0) {
                inline_clear(&nxt);
                goto done;
            }
            if (g == cap) {
                inline_msg *bigger = PyMem_Malloc((size_t)cap * 2 * sizeof(inline_msg));
                if (bigger == NULL) {
                    inline_clear(&nxt);
                    PyErr_NoMemory();
                    goto done;
                }
                memcpy(bigger, group, (size_t)cap * sizeof(inline_msg));
                if (group != local)
                    PyMem_Free(group);
                group = bigger;
                cap *= 2;
            }
            left -= BATCH_ENTRY + padded(nxt.size);
            group[g++] = nxt;
        }
        unsigned char *slot = buf + base + (rec_no % window) * slot_bytes;
        uint64_t first = turn;
        unsigned char *pos = slot + SLOT_HEADER;
        for (Py_ssize_t i = 0; i < g; i++) {
            inline_msg *m = &group[i];
            if (g > 1) {
                put_u64(pos, m->size);
                put_u64(pos + 8, m->no);
                memcpy(pos + BATCH_ENTRY, PyBytes_AS_STRING(m->payload), (size_t)m->size);
                pos += BATCH_ENTRY + padded(m->size);
            }
            else {
                put_u64(slot, first);
                put_u64(slot + 8, KIND_MESSAGE | (1u << 8));
                put_u64(slot + 16, m->size);
                put_u64(slot + 24, m->no);
                memcpy(pos, PyBytes_AS_STRING(m->payload), (size_t)m->size);
            }
            PyObject *t = PyLong_FromUnsignedLongLong(turn);
            PyObject *rec = t ? PyTuple_Pack(6, t, st->small_kind_message, st->small_one, m->nbytes,
                                             m->msg_no, m->payload) : NULL;
            Py_XDECREF(t);
            if (append_new(st, pending, rec) < 0)
                goto done;
            /* turn < 2**56 and n <= 256: the seq fits a u64 */
            PyObject *seq = PyLong_FromUnsignedLongLong(turn * n + k);
            PyObject *entry = seq ? PyTuple_Pack(2, seq, m->out) : NULL;
            Py_XDECREF(seq);
            if (append_new(st, own, entry) < 0)
                goto done;
            turn++;
        }
        if (g > 1) {
            put_u64(slot, first);
            put_u64(slot + 8, KIND_BATCH | ((uint64_t)g << 8));
            put_u64(slot + 16, (uint64_t)(pos - slot - SLOT_HEADER));
            put_u64(slot + 24, 0);
        }
        if (append_new(st, inflight, PyLong_FromUnsignedLongLong((turn - 1) * n + k)) < 0)
            goto done;
        rec_no++;
        records++;
        written += (uint64_t)g;
        for (Py_ssize_t i = 0; i < g; i++)
            inline_clear(&group[i]);
        g = 0;
    }
    result = Py_BuildValue("(KKK)", (unsigned long long)records, (unsigned long long)written,
                           (unsigned long long)turn);
done:
    for (Py_ssize_t i = 0; i < g; i++)
        inline_clear(&group[i]);
    if (group != local)
        PyMem_Free(group);
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------- deliver_messages */

/* deliver_messages(pending, sender_ids, own, events, event_type, head, my_index, d, limit) -> d
 *
 * The delivery loop of ShardState.deliver_until for its usual records: while d < limit, the
 * record at the head of pending[d % n] (n = len(pending)) is an inline message as scan_slots
 * made it (a 6-tuple whose first turn is not below d // n): pop it, append
 * event_type(*head, d, sender_ids[k], msg_no, payload) to events (a tuple subclass, built as
 * tuple.__new__ would), drop own's head when it is (d, ...) and k == my_index, and go on with
 * d + 1; or it is a null as scan_slots made it (a 6-tuple of kind KIND_NULL, n_turns from 1,
 * whose turns reach d // n): nothing is delivered, it is popped at its last turn, and d + 1
 * goes on. Stops at anything else (an empty deque, another record type, a turn out of step)
 * and returns the d it stopped at: the caller handles that record. */

static int
as_ll(PyObject *o, long long *out)
{
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *out = v;
    return 0;
}

PyObject *
native_deliver_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError,
                        "deliver_messages(pending, sender_ids, own, events, event_type, head, "
                        "my_index, d, limit) takes 9 arguments");
        return NULL;
    }
    native_state *st = get_state(self);
    PyObject *pending = args[0], *sender_ids = args[1], *own = args[2], *events = args[3];
    PyObject *event_type = args[4], *head = args[5];
    long long my_index, d, limit;
    if (as_ll(args[6], &my_index) < 0 || as_ll(args[7], &d) < 0 || as_ll(args[8], &limit) < 0)
        return NULL;
    if (!PyList_CheckExact(pending) || !PyList_CheckExact(events) ||
        !PyTuple_CheckExact(head) || PyTuple_GET_SIZE(head) != 3 || !PyType_Check(event_type) ||
        !PyType_IsSubtype((PyTypeObject *)event_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "deliver_messages: pending and events must be lists, head a 3-tuple "
                        "and event_type a tuple subclass");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(pending);
    if (n == 0 || d < 0) {
        PyErr_SetString(PyExc_ValueError, "deliver_messages: no senders, or d < 0");
        return NULL;
    }
    PyTypeObject *etype = (PyTypeObject *)event_type;
    while (d < limit) {
        long long turn = d / n;
        Py_ssize_t k = (Py_ssize_t)(d % n);
        PyObject *pend = PyList_GET_ITEM(pending, k);
        Py_ssize_t len = PyObject_Length(pend);
        if (len < 0)
            return NULL;
        if (len == 0)
            break;
        PyObject *rec = PySequence_GetItem(pend, 0);
        if (rec == NULL)
            return NULL;
        if (!PyTuple_CheckExact(rec) || PyTuple_GET_SIZE(rec) != 6) {
            Py_DECREF(rec);
            break;
        }
        long long first;
        if (as_ll(PyTuple_GET_ITEM(rec, 0), &first) < 0) {
            Py_DECREF(rec);
            return NULL;
        }
        PyObject *kind = PyTuple_GET_ITEM(rec, 1), *turns = PyTuple_GET_ITEM(rec, 2);
        int over = 0;
        if (PyLong_CheckExact(kind) && PyLong_AsLongAndOverflow(kind, &over) == KIND_NULL &&
            !over) {
            /* a null of n_turns turns from first: this seq is empty; drop it at its last turn */
            long long n_turns = PyLong_CheckExact(turns)
                ? PyLong_AsLongLongAndOverflow(turns, &over) : (over = 1, 0);
            Py_DECREF(rec);
            if (over || n_turns < 1 || n_turns >= (long long)MAX_TURN || first < 0 ||
                first >= (long long)MAX_TURN)
                break;
            long long end = first + n_turns;
            if (turn >= end)
                break;
            if (turn == end - 1) {
                PyObject *popped = PyObject_CallMethodNoArgs(pend, st->str_popleft);
                if (popped == NULL)
                    return NULL;
                Py_DECREF(popped);
            }
            d++;
            continue;
        }
        if (turn > first) {  /* turn >= first + 1, without overflow */
            Py_DECREF(rec);
            break;
        }
        PyObject *sender = PySequence_GetItem(sender_ids, k);
        if (sender == NULL) {
            Py_DECREF(rec);
            return NULL;
        }
        PyObject *ev = etype->tp_alloc(etype, 7);
        PyObject *seq = ev == NULL ? NULL : PyLong_FromLongLong(d);
        if (seq == NULL) {
            Py_XDECREF(ev);
            Py_DECREF(sender);
            Py_DECREF(rec);
            return NULL;
        }
        for (int i = 0; i < 3; i++) {
            PyObject *h = PyTuple_GET_ITEM(head, i);
            Py_INCREF(h);
            PyTuple_SET_ITEM(ev, i, h);
        }
        PyTuple_SET_ITEM(ev, 3, seq);
        PyTuple_SET_ITEM(ev, 4, sender);  /* the reference GetItem gave */
        PyObject *msg_no = PyTuple_GET_ITEM(rec, 4), *payload = PyTuple_GET_ITEM(rec, 5);
        Py_INCREF(msg_no);
        Py_INCREF(payload);
        PyTuple_SET_ITEM(ev, 5, msg_no);
        PyTuple_SET_ITEM(ev, 6, payload);
        Py_DECREF(rec);
        PyObject *popped = PyObject_CallMethodNoArgs(pend, st->str_popleft);
        if (popped == NULL) {
            Py_DECREF(ev);
            return NULL;
        }
        Py_DECREF(popped);
        int appended = PyList_Append(events, ev);
        Py_DECREF(ev);
        if (appended < 0)
            return NULL;
        if (k == my_index) {
            Py_ssize_t olen = PyObject_Length(own);
            if (olen < 0)
                return NULL;
            if (olen > 0) {
                PyObject *top = PySequence_GetItem(own, 0);
                if (top == NULL)
                    return NULL;
                PyObject *s0 = PySequence_GetItem(top, 0);
                Py_DECREF(top);
                if (s0 == NULL)
                    return NULL;
                long long seq0;
                int bad = as_ll(s0, &seq0);
                Py_DECREF(s0);
                if (bad < 0)
                    return NULL;
                if (seq0 == d) {
                    PyObject *o = PyObject_CallMethodNoArgs(own, st->str_popleft);
                    if (o == NULL)
                        return NULL;
                    Py_DECREF(o);
                }
            }
        }
        d++;
    }
    return PyLong_FromLongLong(d);
}
