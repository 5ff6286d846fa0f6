/*
 * The internal header of derecho_async._native, the hot loops of derecho_async in C (CPython C
 * API, no other dependency). One extension module is built from one C file per concern:
 *
 *   words.c      load_u64, store_u64, fence, min_u64
 *   ordering.c   frontier, turns_needed
 *   slotring.c   scan_slots, write_messages, deliver_messages (the SST slot ring)
 *   shmring.c    ring_scan, ring_put (the shm transport's ring)
 *   plaincall.c  decode_plain_call, encode_plain_call (the usual call's msgpack)
 *   dispatch.c   dispatch_calls (the group's loop over delivered calls)
 *   bytescopy.c  bytes_copy
 *   logframe.c   frame_log_records, frame_log_runs (the durable log's batches)
 *   beacon.c     beacon_start, beacon_add, beacon_add_peer, beacon_udp, beacon_set_view,
 *                beacon_remove, beacon_touch, beacon_count, beacon_stop (the liveness
 *                thread), siphash24
 *   module.c     the method table, the module state and multi-phase init
 *
 * The pure-Python twin, derecho_async/_hotpath_pure/, has a module per file with the same
 * API, results and error messages; derecho_async/hotpath.py picks one (docs/DESIGN.md §8).
 *
 * Every offset, length and count that comes from shared memory or the network is checked
 * against the buffer it indexes before it is used: a hostile peer can make these functions
 * report an error, never read or write outside a buffer.
 *
 * Words are little-endian u64. An aligned word is loaded with acquire and stored with release
 * ordering (one instruction on x86-64 and aarch64); an unaligned one is copied bytewise between
 * fences.
 */
#ifndef DERECHO_ASYNC_NATIVE_H
#define DERECHO_ASYNC_NATIVE_H

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
#define MAX_TURN ((uint64_t)1 << 56)

/* The slot ring's records (slotring.c; module.c keeps KIND_MESSAGE as an int object). */
#define SLOT_HEADER 32          /* first_turn, kind | n_turns << 8, nbytes, msg_no */
#define KIND_MESSAGE 1
#define KIND_DESCRIPTOR 2
#define KIND_NULL 3
#define KIND_BATCH 4
#define BATCH_ENTRY 16          /* a batch entry's header: nbytes, msg_no (then the payload) */
#define MAX_NULL_TURNS ((uint64_t)1 << 40)

/* ------------------------------------------------------------------------ words in memory */

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

/* a plain little-endian write of a record field (published later by a release store) */
static inline void
put_u64(unsigned char *p, uint64_t v)
{
    v = LE64(v);
    memcpy(p, &v, 8);
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

/* ------------------------------------------------------------------------ across files */

/* Only PyInit__native (module.c) leaves the shared object. */
#pragma GCC visibility push(hidden)

/* an int argument in [0, 2**64); else ValueError naming it (words.c) */
int arg_u64(PyObject *obj, const char *name, uint64_t *out);

/* the module's functions, for module.c's method table (self is the module) */
PyObject *native_load_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_store_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_fence(PyObject *self, PyObject *unused);
PyObject *native_min_u64(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_frontier(PyObject *self, PyObject *held);
PyObject *native_turns_needed(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_scan_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_write_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_deliver_messages(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_ring_scan(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_ring_put(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_decode_plain_call(PyObject *self, PyObject *data);
PyObject *native_encode_plain_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_dispatch_calls(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_bytes_copy(PyObject *self, PyObject *obj);
PyObject *native_frame_log_records(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_frame_log_runs(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
void native_logframe_init(void);
PyObject *native_beacon_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_add_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_udp(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_set_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_siphash24(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs);
PyObject *native_beacon_touch(PyObject *self, PyObject *obj);
PyObject *native_beacon_count(PyObject *self, PyObject *obj);
PyObject *native_beacon_stop(PyObject *self, PyObject *obj);

/* plaincall.c's decoding steps, which dispatch.c runs without building what it does not use:
 * see plaincall.c for their contracts */
int plain_method_span(const unsigned char **pp, const unsigned char *end,
                      const unsigned char **m, Py_ssize_t *mlen);
PyObject *plain_call_args(const unsigned char *p, const unsigned char *end);
PyObject *method_str(const unsigned char *m, Py_ssize_t mlen);

/* A call stamped with its sender's clock (wire.stamp_call): the envelope is a fixarray of 4
 * whose last item is the time as a 9-byte uint64. Moves *end before the stamp and returns 1;
 * 0 (nothing moved) for any other bytes. */
static inline int
drop_stamp(const unsigned char *p, const unsigned char **end)
{
    if (*end - p > 4 + 9 && *p == 0x94 && (*end)[-9] == 0xcf) {
        *end -= 9;
        return 1;
    }
    return 0;
}

/* Whether a call carries its sender's clock at its end: a stamped call (fixarray of 4) or an
 * external client's tagged one (fixarray of 5, wire.client_call). */
static inline int
has_stamp(const unsigned char *p, const unsigned char *end)
{
    return end - p > 4 + 9 && (*p == 0x94 || *p == 0x95) && end[-9] == 0xcf;
}

/* The time a stamped call carries, as a signed 64-bit int (call only after drop_stamp said 1,
 * with the end it had before). */
static inline int64_t
stamp_time(const unsigned char *end)
{
    uint64_t v = 0;
    for (int i = 8; i > 0; i--)
        v = v << 8 | end[-i];
    return (int64_t)v;
}

#pragma GCC visibility pop

#endif /* DERECHO_ASYNC_NATIVE_H */
