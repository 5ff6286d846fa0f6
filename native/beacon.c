/*
 * The liveness beacon (docs/DESIGN.md §4.4): a small POSIX thread, not a Python thread, that
 * every period stores a growing count into words of shared memory that peers read (the shm
 * transport's rings, W_PALIVE) and sends it in a datagram to peers over UDP (the tcp
 * transport: beacon_udp, beacon_add_peer), with the sender's view (beacon_set_view: a peer
 * counts a beacon only from a member of its own view), each datagram signed with SipHash-2-4 under a key
 * this process made (siphash24 computes it for the receiver). It never takes the GIL, so a handler that holds the event loop
 * (or the GIL) does not stop it; a process that dies or is stopped (SIGSTOP) stops it with the
 * rest of the process. The loop touches the beacon at every tick; once the loop has not touched
 * it for hold_s, the beacon stops counting, so a loop held for good is suspected all the same.
 *
 * Handles are capsules: beacon_start makes one; beacon_add pins a writable buffer (the Py_buffer
 * is held until the target is removed or the beacon stops, so its mmap cannot close under the
 * thread); the thread reads the target list under the beacon's mutex, and the functions that
 * change it take the mutex while holding the GIL (the thread never waits for the GIL, so this
 * cannot deadlock). A forked child has no thread: its copy of a beacon acts as a stopped one.
 * Twin: derecho_async/_hotpath_pure/beacon.py.
 */
#include "native.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define CAPSULE_NAME "derecho_async.beacon"

/* A target: a word of a pinned buffer (word != NULL) or a peer's UDP address. */
typedef struct {
    long long key;
    Py_buffer view;
    unsigned char *word;
    struct sockaddr_storage addr;
    socklen_t addrlen;
} beacon_target;

/* The datagram: magic, zero, sender, epoch, view, count, then SipHash-2-4 of those 40 bytes. */
#define DGRAM_MAGIC 0x31624144u     /* "DAb1" little-endian */
#define DGRAM_SIGNED 40
#define DGRAM_BYTES 48

typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t wake;
    pthread_t thread;
    int running;                /* the thread was started and not joined yet */
    pid_t owner;                /* the process that started it (a fork's child has no thread) */
    int stop;                   /* under lock: the thread ends at its next wake-up */
    uint64_t period_ns;
    uint64_t hold_ns;           /* 0: count whatever the loop does */
    uint64_t touched_ns;        /* atomic: CLOCK_MONOTONIC of the loop's last touch */
    uint64_t count;             /* under lock: the count last stored */
    beacon_target *targets;     /* under lock */
    Py_ssize_t n, cap;
    int fd;                     /* under lock: the UDP socket, -1 for none */
    uint64_t sender, epoch;     /* under lock: the datagram's identity */
    uint64_t view;              /* under lock: the sender's view (beacon_set_view) */
    uint64_t k0, k1;            /* under lock: the SipHash key */
} beacon;

/* ---------------------------------------------------------------------------- SipHash-2-4 */

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                              \
    do {                                                                                      \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                             \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                                \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                                \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                             \
    } while (0)

static uint64_t
siphash24(uint64_t k0, uint64_t k1, const unsigned char *p, size_t len)
{
    uint64_t v0 = k0 ^ 0x736f6d6570736575ULL, v1 = k1 ^ 0x646f72616e646f6dULL;
    uint64_t v2 = k0 ^ 0x6c7967656e657261ULL, v3 = k1 ^ 0x7465646279746573ULL;
    size_t whole = len & ~(size_t)7;
    for (size_t i = 0; i < whole; i += 8) {
        uint64_t m = get_u64(p + i);
        v3 ^= m;
        SIPROUND;
        SIPROUND;
        v0 ^= m;
    }
    uint64_t last = (uint64_t)len << 56;
    for (size_t i = 0; i < (len & 7); i++)
        last |= (uint64_t)p[whole + i] << (8 * i);
    v3 ^= last;
    SIPROUND;
    SIPROUND;
    v0 ^= last;
    v2 ^= 0xff;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    SIPROUND;
    return v0 ^ v1 ^ v2 ^ v3;
}

static uint64_t
mono_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void *
beacon_main(void *arg)
{
    beacon *b = (beacon *)arg;
    pthread_mutex_lock(&b->lock);
    uint64_t due = mono_ns();
    while (!b->stop) {
        uint64_t now = mono_ns();
        uint64_t touched = __atomic_load_n(&b->touched_ns, __ATOMIC_ACQUIRE);
        if (b->hold_ns == 0 || now - touched <= b->hold_ns) {
            b->count++;
            unsigned char dgram[DGRAM_BYTES];
            if (b->fd >= 0) {
                put_u64(dgram, (uint64_t)DGRAM_MAGIC);
                put_u64(dgram + 8, b->sender);
                put_u64(dgram + 16, b->epoch);
                put_u64(dgram + 24, b->view);
                put_u64(dgram + 32, b->count);
                put_u64(dgram + 40, siphash24(b->k0, b->k1, dgram, DGRAM_SIGNED));
            }
            for (Py_ssize_t i = 0; i < b->n; i++) {
                beacon_target *t = &b->targets[i];
                if (t->word != NULL)
                    store_word(t->word, b->count);
                else if (b->fd >= 0)    /* a full buffer or an unreachable peer: next time */
                    (void)sendto(b->fd, dgram, DGRAM_BYTES, MSG_DONTWAIT,
                                 (struct sockaddr *)&t->addr, t->addrlen);
            }
        }
        due += b->period_ns;
        if (due < now)          /* descheduled for more than a period: start again from now */
            due = now + b->period_ns;
        struct timespec ts = {(time_t)(due / 1000000000u), (long)(due % 1000000000u)};
        while (!b->stop && pthread_cond_timedwait(&b->wake, &b->lock, &ts) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&b->lock);
    return NULL;
}

/* Ends the thread (if running) and releases every pinned buffer; the GIL is held. */
static void
beacon_halt(beacon *b)
{
    if (b->owner != getpid()) {
        /* A forked child: the thread is the parent's, and the mutex may have been taken at
         * the fork. Forget both; the pinned buffers are the child's copies. */
        b->running = 0;
        for (Py_ssize_t i = 0; i < b->n; i++)
            if (b->targets[i].word != NULL)
                PyBuffer_Release(&b->targets[i].view);
        b->n = 0;
        return;
    }
    if (b->running) {
        pthread_mutex_lock(&b->lock);
        b->stop = 1;
        pthread_cond_signal(&b->wake);
        pthread_mutex_unlock(&b->lock);
        Py_BEGIN_ALLOW_THREADS
        pthread_join(b->thread, NULL);
        Py_END_ALLOW_THREADS
        b->running = 0;
    }
    for (Py_ssize_t i = 0; i < b->n; i++)
        if (b->targets[i].word != NULL)
            PyBuffer_Release(&b->targets[i].view);
    b->n = 0;
}

static void
beacon_capsule_free(PyObject *capsule)
{
    beacon *b = (beacon *)PyCapsule_GetPointer(capsule, CAPSULE_NAME);
    if (b == NULL)
        return;
    beacon_halt(b);
    if (b->owner == getpid()) {  /* (a forked child's copies may be held: leave them be) */
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
    }
    PyMem_RawFree(b->targets);
    PyMem_RawFree(b);
}

static beacon *
get_beacon(PyObject *obj)
{
    if (!PyCapsule_IsValid(obj, CAPSULE_NAME)) {
        PyErr_SetString(PyExc_TypeError, "expected a beacon from beacon_start");
        return NULL;
    }
    beacon *b = (beacon *)PyCapsule_GetPointer(obj, CAPSULE_NAME);
    if (b != NULL && b->owner != getpid() && b->running) {
        /* a forked child: stop it (without the parent's thread) and refuse the call */
        beacon_halt(b);
    }
    return b;
}

/* seconds argument: a finite number in [lo, 3600] (lo_text: lo as the pure twin's %g writes it) */
static int
arg_seconds(PyObject *obj, const char *name, double lo, const char *lo_text, uint64_t *out)
{
    double s = PyFloat_AsDouble(obj);
    if (s == -1.0 && PyErr_Occurred())
        return -1;
    if (!(s >= lo && s <= 3600.0)) {
        PyErr_Format(PyExc_ValueError, "%s must be a number of seconds in [%s, 3600]", name,
                     lo_text);
        return -1;
    }
    *out = (uint64_t)(s * 1e9);
    return 0;
}

PyObject *
native_beacon_start(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "beacon_start(period_s, hold_s) takes 2 arguments");
        return NULL;
    }
    uint64_t period_ns, hold_ns;
    if (arg_seconds(args[0], "period_s", 0.001, "0.001", &period_ns) < 0 ||
        arg_seconds(args[1], "hold_s", 0.0, "0", &hold_ns) < 0)
        return NULL;
    beacon *b = (beacon *)PyMem_RawCalloc(1, sizeof(beacon));
    if (b == NULL)
        return PyErr_NoMemory();
    b->period_ns = period_ns;
    b->hold_ns = hold_ns;
    b->touched_ns = mono_ns();
    b->fd = -1;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&b->wake, &attr);
    pthread_condattr_destroy(&attr);
    pthread_mutex_init(&b->lock, NULL);
    PyObject *capsule = PyCapsule_New(b, CAPSULE_NAME, beacon_capsule_free);
    if (capsule == NULL) {
        pthread_cond_destroy(&b->wake);
        pthread_mutex_destroy(&b->lock);
        PyMem_RawFree(b);
        return NULL;
    }
    int err = pthread_create(&b->thread, NULL, beacon_main, b);
    if (err != 0) {
        Py_DECREF(capsule);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    b->running = 1;
    b->owner = getpid();
    return capsule;
}

/* Puts t in b's list, replacing the target of the same key (whose buffer is then released);
 * -1 with an exception (t's buffer released) if the list cannot grow. The GIL is held. */
static int
put_target(beacon *b, beacon_target *t)
{
    if (b->n == b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 8;
        beacon_target *more = (beacon_target *)PyMem_RawMalloc((size_t)cap * sizeof(*more));
        if (more == NULL) {
            if (t->word != NULL)
                PyBuffer_Release(&t->view);
            PyErr_NoMemory();
            return -1;
        }
        pthread_mutex_lock(&b->lock);
        if (b->n)
            memcpy(more, b->targets, (size_t)b->n * sizeof(*more));
        beacon_target *old = b->targets;
        b->targets = more;
        b->cap = cap;
        pthread_mutex_unlock(&b->lock);
        PyMem_RawFree(old);
    }
    beacon_target replaced;
    int had = 0;
    pthread_mutex_lock(&b->lock);
    if (t->word != NULL)
        store_word(t->word, b->count);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->targets[i].key == t->key) {
            replaced = b->targets[i];
            b->targets[i] = *t;
            had = 1;
            break;
        }
    }
    if (!had)
        b->targets[b->n++] = *t;
    pthread_mutex_unlock(&b->lock);
    if (had && replaced.word != NULL)
        PyBuffer_Release(&replaced.view);
    return 0;
}

static int
arg_key(PyObject *obj, long long *key)
{
    *key = PyLong_AsLongLong(obj);
    return *key == -1 && PyErr_Occurred() ? -1 : 0;
}

PyObject *
native_beacon_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "beacon_add(beacon, key, (buf, offset)) takes 3 "
                                         "arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    beacon_target t;
    memset(&t, 0, sizeof(t));
    if (b == NULL || arg_key(args[1], &t.key) < 0)
        return NULL;
    PyObject *buf, *offobj;
    if (!PyArg_ParseTuple(args[2], "OO:beacon_add", &buf, &offobj))
        return NULL;
    if (!b->running) {
        PyErr_SetString(PyExc_ValueError, "the beacon is stopped");
        return NULL;
    }
    if (PyObject_GetBuffer(buf, &t.view, PyBUF_WRITABLE) < 0)
        return NULL;
    Py_ssize_t off = PyLong_AsSsize_t(offobj);
    if (off == -1 && PyErr_Occurred()) {
        PyBuffer_Release(&t.view);
        return NULL;
    }
    if (off < 0 || t.view.len < WORD || off > t.view.len - WORD) {
        PyErr_Format(PyExc_IndexError, "word at offset %zd is outside a buffer of %zd bytes",
                     off, t.view.len);
        PyBuffer_Release(&t.view);
        return NULL;
    }
    t.word = (unsigned char *)t.view.buf + off;
    if (put_target(b, &t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *
native_beacon_add_peer(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "beacon_add_peer(beacon, key, host, port) takes 4 "
                                         "arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    beacon_target t;
    memset(&t, 0, sizeof(t));
    if (b == NULL || arg_key(args[1], &t.key) < 0)
        return NULL;
    if (!PyUnicode_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "host must be a str (a numeric IPv4 or IPv6 address)");
        return NULL;
    }
    const char *host = PyUnicode_AsUTF8(args[2]);
    if (host == NULL)
        return NULL;
    long port = PyLong_AsLong(args[3]);
    if (port == -1 && PyErr_Occurred())
        return NULL;
    if (port < 1 || port > 65535) {
        PyErr_SetString(PyExc_ValueError, "port must be an int from 1 to 65535");
        return NULL;
    }
    struct sockaddr_in *v4 = (struct sockaddr_in *)&t.addr;
    struct sockaddr_in6 *v6 = (struct sockaddr_in6 *)&t.addr;
    if (inet_pton(AF_INET, host, &v4->sin_addr) == 1) {
        v4->sin_family = AF_INET;
        v4->sin_port = htons((uint16_t)port);
        t.addrlen = sizeof(*v4);
    }
    else if (inet_pton(AF_INET6, host, &v6->sin6_addr) == 1) {
        v6->sin6_family = AF_INET6;
        v6->sin6_port = htons((uint16_t)port);
        t.addrlen = sizeof(*v6);
    }
    else {
        PyErr_Format(PyExc_ValueError, "host %R is not a numeric IPv4 or IPv6 address", args[2]);
        return NULL;
    }
    if (!b->running) {
        PyErr_SetString(PyExc_ValueError, "the beacon is stopped");
        return NULL;
    }
    if (put_target(b, &t) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyObject *
native_beacon_udp(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "beacon_udp(beacon, fd, sender, epoch, key) takes 5 "
                                         "arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    if (b == NULL)
        return NULL;
    int fd = PyObject_AsFileDescriptor(args[1]);
    uint64_t sender, epoch;
    if (fd < 0 || arg_u64(args[2], "sender", &sender) < 0 ||
        arg_u64(args[3], "epoch", &epoch) < 0)
        return NULL;
    Py_buffer key;
    if (PyObject_GetBuffer(args[4], &key, PyBUF_SIMPLE) < 0)
        return NULL;
    if (key.len != 16) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "key must be 16 bytes");
        return NULL;
    }
    if (!b->running) {  /* stopped, or a forked child's copy */
        PyBuffer_Release(&key);
        Py_RETURN_NONE;
    }
    pthread_mutex_lock(&b->lock);
    b->fd = fd;
    b->sender = sender;
    b->epoch = epoch;
    b->k0 = get_u64((const unsigned char *)key.buf);
    b->k1 = get_u64((const unsigned char *)key.buf + 8);
    pthread_mutex_unlock(&b->lock);
    PyBuffer_Release(&key);
    Py_RETURN_NONE;
}

PyObject *
native_beacon_set_view(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "beacon_set_view(beacon, view) takes 2 arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    uint64_t view;
    if (b == NULL || arg_u64(args[1], "view", &view) < 0)
        return NULL;
    if (!b->running)  /* stopped, or a forked child's copy */
        Py_RETURN_NONE;
    pthread_mutex_lock(&b->lock);
    b->view = view;
    pthread_mutex_unlock(&b->lock);
    Py_RETURN_NONE;
}

PyObject *
native_siphash24(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "siphash24(key, data) takes 2 arguments");
        return NULL;
    }
    Py_buffer key, data;
    if (PyObject_GetBuffer(args[0], &key, PyBUF_SIMPLE) < 0)
        return NULL;
    if (key.len != 16) {
        PyBuffer_Release(&key);
        PyErr_SetString(PyExc_ValueError, "key must be 16 bytes");
        return NULL;
    }
    if (PyObject_GetBuffer(args[1], &data, PyBUF_SIMPLE) < 0) {
        PyBuffer_Release(&key);
        return NULL;
    }
    uint64_t h = siphash24(get_u64((const unsigned char *)key.buf),
                           get_u64((const unsigned char *)key.buf + 8),
                           (const unsigned char *)data.buf, (size_t)data.len);
    PyBuffer_Release(&data);
    PyBuffer_Release(&key);
    return PyLong_FromUnsignedLongLong(h);
}

PyObject *
native_beacon_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "beacon_remove(beacon, key) takes 2 arguments");
        return NULL;
    }
    beacon *b = get_beacon(args[0]);
    long long key;
    if (b == NULL || arg_key(args[1], &key) < 0)
        return NULL;
    beacon_target gone;
    int found = 0;
    if (!b->running)  /* stopped (nothing left to remove), or a forked child's copy */
        Py_RETURN_FALSE;
    pthread_mutex_lock(&b->lock);
    for (Py_ssize_t i = 0; i < b->n; i++) {
        if (b->targets[i].key == key) {
            gone = b->targets[i];
            b->targets[i] = b->targets[--b->n];
            found = 1;
            break;
        }
    }
    pthread_mutex_unlock(&b->lock);
    if (!found)
        Py_RETURN_FALSE;
    if (gone.word != NULL)
        PyBuffer_Release(&gone.view);
    Py_RETURN_TRUE;
}

PyObject *
native_beacon_touch(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    __atomic_store_n(&b->touched_ns, mono_ns(), __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

PyObject *
native_beacon_count(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    uint64_t count = b->count;
    if (b->running) {
        pthread_mutex_lock(&b->lock);
        count = b->count;
        pthread_mutex_unlock(&b->lock);
    }
    return PyLong_FromUnsignedLongLong(count);
}

PyObject *
native_beacon_stop(PyObject *self, PyObject *obj)
{
    beacon *b = get_beacon(obj);
    if (b == NULL)
        return NULL;
    beacon_halt(b);
    b->fd = -1;
    Py_RETURN_NONE;
}
