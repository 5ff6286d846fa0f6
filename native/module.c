/*
 * The module derecho_async._native (docs/DESIGN.md §8): its method table (the functions of
 * the other files), the module state of native.h (interned names and small ints, one per
 * module object) and multi-phase initialisation. The pure twin's module is
 * derecho_async/_hotpath_pure/__init__.py.
 */
#include "native.h"

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
    {"frame_log_records", (PyCFunction)(void (*)(void))native_frame_log_records, METH_FASTCALL,
     "frame_log_records(records, batch, after, max_record_bytes) -> bytes: the durable log's "
     "records framed as one batch, checksummed and copied with the GIL released."},
    {"frame_log_runs", (PyCFunction)(void (*)(void))native_frame_log_runs, METH_FASTCALL,
     "frame_log_runs(runs, batch, after, max_record_bytes, prefix) -> bytes | None: runs of "
     "delivered calls framed as one batch of log records (None: a payload is not bytes)."},
    {"beacon_start", (PyCFunction)(void (*)(void))native_beacon_start, METH_FASTCALL,
     "beacon_start(period_s, hold_s) -> beacon: start a liveness thread that, every period_s, "
     "stores a growing count into its target words while the loop touched it within hold_s "
     "(0: always)."},
    {"beacon_add", (PyCFunction)(void (*)(void))native_beacon_add, METH_FASTCALL,
     "beacon_add(beacon, key, (buf, offset)): count into the u64 at offset of the writable "
     "buf too (pinned until removed), replacing the target of the same key."},
    {"beacon_add_peer", (PyCFunction)(void (*)(void))native_beacon_add_peer, METH_FASTCALL,
     "beacon_add_peer(beacon, key, host, port): send each count to the UDP address (a numeric "
     "IPv4 or IPv6 host) too, replacing the target of the same key."},
    {"beacon_udp", (PyCFunction)(void (*)(void))native_beacon_udp, METH_FASTCALL,
     "beacon_udp(beacon, fd, sender, epoch, key): send the peers' datagrams on the UDP socket "
     "fd: magic, 0, sender, epoch, view, count (u64 each after the u32s) and their SipHash-2-4 "
     "under the 16-byte key."},
    {"beacon_set_view", (PyCFunction)(void (*)(void))native_beacon_set_view, METH_FASTCALL,
     "beacon_set_view(beacon, view): the view id the datagrams carry from now on."},
    {"siphash24", (PyCFunction)(void (*)(void))native_siphash24, METH_FASTCALL,
     "siphash24(key, data) -> int: SipHash-2-4 of data under the 16-byte key."},
    {"beacon_remove", (PyCFunction)(void (*)(void))native_beacon_remove, METH_FASTCALL,
     "beacon_remove(beacon, key) -> bool: stop counting into key's word and unpin its buffer."},
    {"beacon_touch", native_beacon_touch, METH_O,
     "beacon_touch(beacon): the loop runs (the hold limit counts from now)."},
    {"beacon_count", native_beacon_count, METH_O,
     "beacon_count(beacon) -> int: the count last stored."},
    {"beacon_stop", native_beacon_stop, METH_O,
     "beacon_stop(beacon): end the thread and unpin every buffer (idempotent)."},
    {NULL, NULL, 0, NULL},
};

/* Fills the state of a new module object (multi-phase init: Py_mod_exec). On failure the
 * module is dropped, and m_clear/m_free release whatever was made. */
static int
native_exec(PyObject *module)
{
    native_state *st = get_state(module);
    native_logframe_init();
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
