/*
 * frame_log_records: the durable log's records framed as one batch, in the format of
 * derecho_async/durability/records.py, with the checksums and copies done with the GIL released,
 * so the log's writer thread does not hold up the event loop (docs/DESIGN.md §4.6).
 * Twin: derecho_async/_hotpath_pure/logframe.py (the same checks, in the same order, with the
 * same messages).
 *
 * A record: a 3-tuple (version, time_ns, body): version a 2-tuple of ints in 0..2**63-1,
 * strictly above the one before it (``after`` for the first), time_ns a 64-bit int, body bytes of
 * at most max_record_bytes. Framed: a 48-byte little-endian header (magic "DLR1", crc32, length,
 * kind 1, batch, view, seq, time_ns), then the body; the crc32 (zlib's) covers header bytes 8..48
 * and the body.
 */
#include "native.h"

#define LOG_HEADER 48
#define LOG_KIND_CALL 1u
#define LOG_MAX_U63 ((uint64_t)0x7fffffffffffffffULL)

static uint32_t crc_table[8][256];

void
native_logframe_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = crc_table[0][i];
        for (int t = 1; t < 8; t++) {
            c = crc_table[0][c & 0xffu] ^ (c >> 8);
            crc_table[t][i] = c;
        }
    }
}

/* zlib's crc32(data, crc): the same polynomial, initial value and final xor */
static uint32_t
crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    crc = ~crc;
#if !(defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__)
    while (n >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        uint32_t lo = (uint32_t)w ^ crc, hi = (uint32_t)(w >> 32);
        crc = crc_table[7][lo & 0xffu] ^ crc_table[6][(lo >> 8) & 0xffu] ^
              crc_table[5][(lo >> 16) & 0xffu] ^ crc_table[4][lo >> 24] ^
              crc_table[3][hi & 0xffu] ^ crc_table[2][(hi >> 8) & 0xffu] ^
              crc_table[1][(hi >> 16) & 0xffu] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
#endif
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xffu] ^ (crc >> 8);
    return ~crc;
}

static void
put32(unsigned char *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

static void
put64(unsigned char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (unsigned char)(v >> (8 * i));
}

typedef struct {
    uint64_t view, seq;
    int64_t time_ns;
    PyObject *body; /* a new reference while the GIL is released */
} frame_rec;

/* A version (a 2-tuple of ints in 0..2**63-1) into *view, *seq; 0, or -1 with ValueError. */
static int
get_version(PyObject *version, uint64_t *view, uint64_t *seq)
{
    if (PyTuple_CheckExact(version) && PyTuple_GET_SIZE(version) == 2 &&
        PyLong_CheckExact(PyTuple_GET_ITEM(version, 0)) &&
        PyLong_CheckExact(PyTuple_GET_ITEM(version, 1))) {
        int o1 = 0, o2 = 0;
        long long v = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(version, 0), &o1);
        long long s = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(version, 1), &o2);
        if (!o1 && !o2 && v >= 0 && s >= 0) {
            *view = (uint64_t)v;
            *seq = (uint64_t)s;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "a version is a pair of ints in 0..2**63-1, got %R", version);
    return -1;
}

/* A time_ns (a 64-bit int) into *out; 0, or -1 with ValueError. */
static int
get_time(PyObject *t, int64_t *out)
{
    int overflow = 0;
    long long v = PyLong_CheckExact(t) ? PyLong_AsLongLongAndOverflow(t, &overflow) : 0;
    if (!PyLong_CheckExact(t) || overflow) {
        PyErr_Format(PyExc_ValueError, "time_ns must be a 64-bit int, got %R", t);
        return -1;
    }
    *out = (int64_t)v;
    return 0;
}

/* What both functions take after their first argument: batch, after, max_record_bytes. */
typedef struct {
    uint64_t batch;
    long long limit;
    int have_prev;
    uint64_t pview, pseq; /* the last version framed (``after`` at first) */
} frame_state;

static int
frame_start(PyObject *const *args, frame_state *st)
{
    unsigned long long batch = PyLong_AsUnsignedLongLong(args[1]);
    if (batch == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    st->batch = (uint64_t)batch;
    st->limit = PyLong_AsLongLong(args[3]);
    if (st->limit == -1 && PyErr_Occurred())
        return -1;
    st->have_prev = args[2] != Py_None;
    st->pview = st->pseq = 0;
    return st->have_prev ? get_version(args[2], &st->pview, &st->pseq) : 0;
}

/* Whether (view, seq) follows the last version framed. */
static int
follows(const frame_state *st, uint64_t view, uint64_t seq)
{
    return !st->have_prev || view > st->pview || (view == st->pview && seq > st->pseq);
}

/* The framed batch of recs[0..n) (``total`` bytes), each body behind ``prefix``: headers,
 * copies and crc32s with the GIL released. */
static PyObject *
frame_emit(const frame_rec *recs, Py_ssize_t n, size_t total, uint64_t batch,
           const unsigned char *pre, size_t plen)
{
    if (total > (size_t)PY_SSIZE_T_MAX)
        return PyErr_NoMemory();
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
    if (out == NULL)
        return NULL;
    unsigned char *dst = (unsigned char *)PyBytes_AS_STRING(out);
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t len = plen + (size_t)PyBytes_GET_SIZE(recs[i].body);
        memcpy(dst, "DLR1", 4);
        put32(dst + 8, (uint32_t)len);
        put32(dst + 12, LOG_KIND_CALL);
        put64(dst + 16, batch);
        put64(dst + 24, recs[i].view);
        put64(dst + 32, recs[i].seq);
        put64(dst + 40, (uint64_t)recs[i].time_ns);
        if (plen)
            memcpy(dst + LOG_HEADER, pre, plen);
        memcpy(dst + LOG_HEADER + plen, PyBytes_AS_STRING(recs[i].body), len - plen);
        put32(dst + 4, crc32_update(crc32_update(0, dst + 8, LOG_HEADER - 8), dst + LOG_HEADER,
                                    len));
        dst += LOG_HEADER + len;
    }
    Py_END_ALLOW_THREADS
    return out;
}

static void
frame_release(frame_rec *recs, Py_ssize_t taken)
{
    for (Py_ssize_t i = 0; i < taken; i++)
        Py_DECREF(recs[i].body);
    PyMem_Free(recs);
}

PyObject *
native_frame_log_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "frame_log_records(records, batch, after, max_record_bytes)");
        return NULL;
    }
    PyObject *records = args[0];
    if (!PyList_CheckExact(records)) {
        PyErr_SetString(PyExc_TypeError, "frame_log_records: records must be a list");
        return NULL;
    }
    frame_state st;
    if (frame_start(args, &st) < 0)
        return NULL;
    PyObject *prev = args[2];
    Py_ssize_t n = PyList_GET_SIZE(records);
    frame_rec *recs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(frame_rec));
    if (recs == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    Py_ssize_t taken = 0;
    size_t total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *rec = PyList_GET_ITEM(records, i);
        if (!PyTuple_Check(rec) || PyTuple_GET_SIZE(rec) != 3) {
            PyErr_SetString(PyExc_TypeError, "a log record is a (version, time_ns, body) tuple");
            goto done;
        }
        PyObject *version = PyTuple_GET_ITEM(rec, 0);
        frame_rec *r = &recs[i];
        if (get_version(version, &r->view, &r->seq) < 0)
            goto done;
        if (!follows(&st, r->view, r->seq)) {
            PyErr_Format(PyExc_ValueError, "version %R does not follow %R", version, prev);
            goto done;
        }
        if (get_time(PyTuple_GET_ITEM(rec, 1), &r->time_ns) < 0)
            goto done;
        PyObject *body = PyTuple_GET_ITEM(rec, 2);
        if (!PyBytes_CheckExact(body)) {
            PyObject *name = PyType_GetName(Py_TYPE(body));
            if (name != NULL) {
                PyErr_Format(PyExc_TypeError, "a record's body is bytes, got %U", name);
                Py_DECREF(name);
            }
            goto done;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(body);
        if (len > st.limit) {
            PyErr_Format(PyExc_ValueError, "a record of %zd bytes is over the limit of %lld", len,
                         st.limit);
            goto done;
        }
        r->body = Py_NewRef(body);
        taken = i + 1;
        total += LOG_HEADER + (size_t)len;
        st.have_prev = 1;
        st.pview = r->view;
        st.pseq = r->seq;
        prev = version;
    }
    out = frame_emit(recs, taken, total, st.batch, NULL, 0);
done:
    frame_release(recs, taken);
    return out;
}

/* frame_log_runs: as frame_log_records, for runs of delivered calls as the driver reports them:
 * runs is a list of (events, time_ns), each event a tuple whose items 2 and 3 are its view and
 * seq and item 6 its payload; each record's body is ``prefix`` followed by the payload, its
 * time the run's, or the sender's clock of a stamped call (has_stamp). None (nothing framed)
 * when a payload is not bytes: the caller frames those its own way. */
PyObject *
native_frame_log_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "frame_log_runs(runs, batch, after, max_record_bytes, prefix)");
        return NULL;
    }
    PyObject *runs = args[0], *prefix = args[4];
    if (!PyList_CheckExact(runs) || !PyBytes_CheckExact(prefix)) {
        PyErr_SetString(PyExc_TypeError, "frame_log_runs: runs must be a list, prefix bytes");
        return NULL;
    }
    frame_state st;
    if (frame_start(args, &st) < 0)
        return NULL;
    size_t plen = (size_t)PyBytes_GET_SIZE(prefix);
    Py_ssize_t nruns = PyList_GET_SIZE(runs), n = 0;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        PyObject *run = PyList_GET_ITEM(runs, r);
        if (!PyTuple_Check(run) || PyTuple_GET_SIZE(run) != 2 ||
            !PyList_CheckExact(PyTuple_GET_ITEM(run, 0))) {
            PyErr_SetString(PyExc_TypeError, "a run is an (events, time_ns) tuple");
            return NULL;
        }
        n += PyList_GET_SIZE(PyTuple_GET_ITEM(run, 0));
    }
    frame_rec *recs = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(frame_rec));
    if (recs == NULL)
        return PyErr_NoMemory();
    PyObject *out = NULL;
    Py_ssize_t taken = 0;
    size_t total = 0;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        PyObject *run = PyList_GET_ITEM(runs, r);
        PyObject *events = PyTuple_GET_ITEM(run, 0);
        int64_t time_ns;
        if (get_time(PyTuple_GET_ITEM(run, 1), &time_ns) < 0)
            goto done;
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(events); i++) {
            PyObject *ev = PyList_GET_ITEM(events, i);
            if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) < 7) {
                PyErr_SetString(PyExc_TypeError, "a delivered event is a tuple of 7 items");
                goto done;
            }
            PyObject *payload = PyTuple_GET_ITEM(ev, 6);
            if (!PyBytes_CheckExact(payload)) {
                out = Py_NewRef(Py_None); /* framed by the caller, as records */
                goto done;
            }
            PyObject *version = PyTuple_Pack(2, PyTuple_GET_ITEM(ev, 2), PyTuple_GET_ITEM(ev, 3));
            if (version == NULL)
                goto done;
            frame_rec *rec = &recs[taken];
            int bad = get_version(version, &rec->view, &rec->seq) < 0;
            if (!bad && !follows(&st, rec->view, rec->seq)) {
                PyErr_Format(PyExc_ValueError, "version %R does not follow (%llu, %llu)", version,
                             (unsigned long long)st.pview, (unsigned long long)st.pseq);
                bad = 1;
            }
            Py_DECREF(version);
            if (bad)
                goto done;
            size_t len = plen + (size_t)PyBytes_GET_SIZE(payload);
            if ((long long)len > st.limit) {
                PyErr_Format(PyExc_ValueError, "a record of %zu bytes is over the limit of %lld",
                             len, st.limit);
                goto done;
            }
            const unsigned char *pb = (const unsigned char *)PyBytes_AS_STRING(payload);
            const unsigned char *pe = pb + PyBytes_GET_SIZE(payload);
            /* a call stamped with its sender's clock is logged at that time */
            rec->time_ns = has_stamp(pb, pe) ? stamp_time(pe) : time_ns;
            rec->body = Py_NewRef(payload);
            taken++;
            total += LOG_HEADER + len;
            st.have_prev = 1;
            st.pview = rec->view;
            st.pseq = rec->seq;
        }
    }
    out = frame_emit(recs, taken, total, st.batch,
                     (const unsigned char *)PyBytes_AS_STRING(prefix), plen);
done:
    frame_release(recs, taken);
    return out;
}
