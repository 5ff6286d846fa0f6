/*
 * derecho_async._native: the hot loops of derecho_async in C (CPython C API, no other
 * dependency). Its pure-Python twin is derecho_async/_hotpath_pure.py; both have the same API,
 * the same results and the same error messages, and derecho_async/hotpath.py picks one.
 *
 * Every offset, length and count that comes from shared memory or the network is checked
 * against the buffer it indexes before it is used: a hostile peer can make these functions
 * report an error, never read or write outside a buffer.
 *
 * Words are little-endian u64. An aligned word is loaded with acquire and stored with release
 * ordering (one instruction on x86-64 and aarch64); an unaligned one is copied bytewise between
 * fences.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LE64(x) __builtin_bswap64(x)
#else
#define LE64(x) (x)
#endif

#define WORD 8
#define SLOT_HEADER 32          /* first_turn, kind | n_turns << 8, nbytes, msg_no */
#define KIND_MESSAGE 1
#define KIND_DESCRIPTOR 2
#define KIND_NULL 3
#define KIND_BATCH 4
#define BATCH_ENTRY 16          /* a batch entry's header: nbytes, msg_no (then the payload) */
#define MAX_NULL_TURNS ((uint64_t)1 << 40)
#define MAX_TURN ((uint64_t)1 << 56)
#define RING_HEADER 32          /* u32 type, u32 flags, u64 a, u64 b, u64 length */
#define R_PUSH 1
#define R_MSG 2
#define U63 ((uint64_t)1 << 63)
#define PLAIN_BYTES_MAX ((Py_ssize_t)1 << 20) /* codec.LARGE_BYTES */

static inline uint64_t
load_word(const unsigned char *p)
{
    uint64_t v;
    if (((uintptr_t)p & 7) == 0) {
        v = __atomic_load_n((const uint64_t *)p, __ATOMIC_ACQUIRE);
    }
    else {
        memcpy(&v, p, 8);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
    }
    return LE64(v);
}

static inline void
store_word(unsigned char *p, uint64_t v)
{
    v = LE64(v);
    if (((uintptr_t)p & 7) == 0) {
        __atomic_store_n((uint64_t *)p, v, __ATOMIC_RELEASE);
    }
    else {
        __atomic_thread_fence(__ATOMIC_RELEASE);
        memcpy(p, &v, 8);
    }
}

/* plain (unordered) little-endian reads of record fields, after an acquire of the counter */
static inline uint64_t
get_u64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return LE64(v);
}

static inline uint32_t
get_u32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

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

static int
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

/* ------------------------------------------------------------------------ module state */

/* What the loops call or read by name on Python objects, interned once, and the small ints
 * write_messages puts in every record it queues. Each module object holds its own (the state
 * PyModule_GetState gives; self is the module for every function here): no mutable statics. */
typedef struct {
    PyObject *str_popleft;
    PyObject *str_append;
    PyObject *str_msg_no;
    PyObject *str_payload;
    PyObject *str_nbytes;
    PyObject *str_large;
    PyObject *str_idle;
    PyObject *str_done;
    PyObject *str_set_result;
    PyObject *small_kind_message;   /* KIND_MESSAGE */
    PyObject *small_one;            /* 1 */
} native_state;

static inline native_state *
get_state(PyObject *module)
{
    return (native_state *)PyModule_GetState(module);
}

/* ------------------------------------------------------------------------------ words */

static PyObject *
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

static PyObject *
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

static PyObject *
native_fence(PyObject *self, PyObject *unused)
{
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *
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

/* ------------------------------------------------------------------------ ordering maths */

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

static PyObject *
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

static PyObject *
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

static PyObject *
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

/* ------------------------------------------------------------------------ ring scan */

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
static PyObject *
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

static inline void
put_u64(unsigned char *p, uint64_t v)
{
    v = LE64(v);
    memcpy(p, &v, 8);
}

/* ring_put(data, pos, typ, a, b, payload) -> size: write one record at stream position pos */
static PyObject *
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
static int
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
static PyObject *
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
static PyObject *
method_str(const unsigned char *m, Py_ssize_t mlen)
{
    PyObject *v = PyUnicode_DecodeUTF8((const char *)m, mlen, "strict");
    if (v == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();
    return v;
}

/* decode_plain_call(data) -> (method, args, kwargs) | None */
static PyObject *
native_decode_plain_call(PyObject *self, PyObject *data)
{
    if (!PyBytes_CheckExact(data))
        Py_RETURN_NONE;
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(data);
    const unsigned char *end = p + PyBytes_GET_SIZE(data);
    const unsigned char *m;
    Py_ssize_t mlen;
    if (end - p < 4 || *p != 0x93)  /* fixarray of 3 */
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

static PyObject *
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

static PyObject *
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

static PyObject *
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

/* ---------------------------------------------------------------- dispatch_calls */

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

static PyObject *
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
        if (end - p < 4 || *p != 0x93 || (p++, !plain_method_span(&p, end, &m, &mlen)))
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

/* ------------------------------------------------------------------------ bytes_copy */

/* Copies of at least this many bytes run with the GIL released. */
#define BYTES_COPY_NOGIL ((Py_ssize_t)1 << 16)

static PyObject *
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

/* ------------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"load_u64", (PyCFunction)(void (*)(void))native_load_u64, METH_FASTCALL,
     "load_u64(buf, offset) -> int: the little-endian u64 at offset, loaded with acquire."},
    {"store_u64", (PyCFunction)(void (*)(void))native_store_u64, METH_FASTCALL,
     "store_u64(buf, offset, value): store a u64 at offset with release ordering."},
    {"fence", native_fence, METH_NOARGS, "fence(): a full (sequentially consistent) fence."},
    {"min_u64", (PyCFunction)(void (*)(void))native_min_u64, METH_FASTCALL,
     "min_u64(buf, offsets, start) -> int: min of start and the words at offsets."},
    {"frontier", native_frontier, METH_O,
     "frontier(held) -> int: lowest seq not held, min over k of held[k] * n + k."},
    {"turns_needed", (PyCFunction)(void (*)(void))native_turns_needed, METH_FASTCALL,
     "turns_needed(my_index, seen) -> int: turns an idle sender covers."},
    {"scan_slots", (PyCFunction)(void (*)(void))native_scan_slots, METH_FASTCALL,
     "scan_slots(buf, base, window, slot_bytes, lo, hi, turn, max_payload) -> "
     "(records, turn, slots, error): copy out and validate slot records lo..hi-1."},
    {"ring_scan", (PyCFunction)(void (*)(void))native_ring_scan, METH_FASTCALL,
     "ring_scan(data, tail, head, budget) -> (records, tail, error): parse and validate "
     "up to budget shm ring records between tail and head."},
    {"ring_put", (PyCFunction)(void (*)(void))native_ring_put, METH_FASTCALL,
     "ring_put(data, pos, typ, a, b, payload) -> size: write one shm ring record (header "
     "and payload) at stream position pos."},
    {"decode_plain_call", native_decode_plain_call, METH_O,
     "decode_plain_call(data) -> (method, args, kwargs) | None: the call [method, [args...], "
     "{}] whose args are all nil, bool, int, float, str or bytes; None for anything else."},
    {"encode_plain_call", (PyCFunction)(void (*)(void))native_encode_plain_call, METH_FASTCALL,
     "encode_plain_call(method, args) -> bytes | None: msgpack [method, [args...], {}] for a "
     "str method and args that are all None, bool, int, float, str or bytes; None otherwise."},
    {"deliver_messages", (PyCFunction)(void (*)(void))native_deliver_messages, METH_FASTCALL,
     "deliver_messages(pending, sender_ids, own, events, event_type, head, my_index, d, limit) "
     "-> int: deliver inline message records in seq order from d; the d it stopped at."},
    {"write_messages", (PyCFunction)(void (*)(void))native_write_messages, METH_FASTCALL,
     "write_messages(buf, base, window, slot_bytes, rec_no, turn, queue, free, limit, pending, "
     "own, inflight, n, k) -> (records, messages, turn): write the inline messages at the head "
     "of queue into slot records."},
    {"dispatch_calls", (PyCFunction)(void (*)(void))native_dispatch_calls, METH_FASTCALL,
     "dispatch_calls(events, start, me, hosted, casts, outbox, nil, finish) -> int: run the "
     "usual ordered calls of a run of deliveries from start; the index it stopped at."},
    {"bytes_copy", native_bytes_copy, METH_O,
     "bytes_copy(buffer) -> bytes: a new bytes object holding the buffer's bytes (C order), "
     "copied with the GIL released when it is large."},
    {NULL, NULL, 0, NULL},
};

/* Fills the state of a new module object (multi-phase init: Py_mod_exec). On failure the
 * module is dropped, and m_clear/m_free release whatever was made. */
static int
native_exec(PyObject *module)
{
    native_state *st = get_state(module);
    if ((st->str_popleft = PyUnicode_InternFromString("popleft")) == NULL ||
        (st->str_append = PyUnicode_InternFromString("append")) == NULL ||
        (st->str_msg_no = PyUnicode_InternFromString("msg_no")) == NULL ||
        (st->str_payload = PyUnicode_InternFromString("payload")) == NULL ||
        (st->str_nbytes = PyUnicode_InternFromString("nbytes")) == NULL ||
        (st->str_large = PyUnicode_InternFromString("large")) == NULL ||
        (st->str_idle = PyUnicode_InternFromString("idle")) == NULL ||
        (st->str_done = PyUnicode_InternFromString("done")) == NULL ||
        (st->str_set_result = PyUnicode_InternFromString("set_result")) == NULL ||
        (st->small_kind_message = PyLong_FromLong(KIND_MESSAGE)) == NULL ||
        (st->small_one = PyLong_FromLong(1)) == NULL)
        return -1;
    return PyModule_AddStringConstant(module, "IMPLEMENTATION", "native");
}

static int
native_traverse(PyObject *module, visitproc visit, void *arg)
{
    native_state *st = get_state(module);
    Py_VISIT(st->str_popleft);
    Py_VISIT(st->str_append);
    Py_VISIT(st->str_msg_no);
    Py_VISIT(st->str_payload);
    Py_VISIT(st->str_nbytes);
    Py_VISIT(st->str_large);
    Py_VISIT(st->str_idle);
    Py_VISIT(st->str_done);
    Py_VISIT(st->str_set_result);
    Py_VISIT(st->small_kind_message);
    Py_VISIT(st->small_one);
    return 0;
}

static int
native_clear(PyObject *module)
{
    native_state *st = get_state(module);
    Py_CLEAR(st->str_popleft);
    Py_CLEAR(st->str_append);
    Py_CLEAR(st->str_msg_no);
    Py_CLEAR(st->str_payload);
    Py_CLEAR(st->str_nbytes);
    Py_CLEAR(st->str_large);
    Py_CLEAR(st->str_idle);
    Py_CLEAR(st->str_done);
    Py_CLEAR(st->str_set_result);
    Py_CLEAR(st->small_kind_message);
    Py_CLEAR(st->small_one);
    return 0;
}

static void
native_free(void *module)
{
    native_clear((PyObject *)module);
}

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, native_exec},
#ifdef Py_mod_multiple_interpreters
    /* every object the module holds is in its state: one per interpreter */
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "derecho_async._native",
    .m_doc = "Hot loops of derecho_async in C; see derecho_async/hotpath.py.",
    .m_size = sizeof(native_state),
    .m_methods = native_methods,
    .m_slots = native_slots,
    .m_traverse = native_traverse,
    .m_clear = native_clear,
    .m_free = native_free,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
